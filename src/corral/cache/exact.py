"""The exact response cache: which requests it may answer, under which key, and what it keeps.

The key is the tenant, the model and what serves it (a digest of its deployed spec: weights, engine,
arguments, so a rollout starts afresh), the endpoint and a canonical form of everything in the body that
shapes the answer: all fields but `stream`, `stream_options`, `user` and `metadata`, with object keys
sorted. So two tenants never share an entry, and two conversations that end in the same question but
differ before it never hit each other (the whole `messages` list is in the key). By default only deterministic
requests are cached (temperature 0, or a seed). `Cache-Control: no-cache` skips the lookup,
`no-store` the keeping. Only an answer that ended well is kept: status 200, a stream that ended with
`[DONE]` on its first replica (no error event, no mid-stream failover, the client still there), and not
while the model is being rolled out (either revision may answer). The cache never fails a request: an
entry it cannot read or keep is a miss, logged.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import orjson

from corral.cache.entry import Entry, entry_from_stream, entry_from_whole
from corral.cache.store import CacheStore, entry_key
from corral.config import ModelCacheSpec

__all__ = ["CacheLookup", "ExactCache"]

logger = logging.getLogger(__name__)

_NOT_SHAPING = frozenset({"stream", "stream_options", "user", "metadata"})


@dataclass(slots=True)
class CacheLookup:
    """One request's dealings with the cache: its key, whether it may read and keep, what it found."""

    key: str
    read: bool
    keep: bool
    policy: ModelCacheSpec
    hit: Entry | None = None

    @property
    def state(self) -> str:
        if self.hit is not None:
            return "hit"
        return "miss" if self.read else "bypass"


class ExactCache:
    """Exact-match answers per tenant and model, in a memory or Redis store."""

    def __init__(
        self,
        store: CacheStore,
        policies: dict[str, ModelCacheSpec],
        versions: dict[str, str] | None = None,
    ) -> None:
        self.store = store
        self.policies = policies
        self.versions = versions if versions is not None else {}  # model → digest of its deployed spec
        self._writes: set[asyncio.Task[None]] = set()

    def enabled(self, model: str) -> bool:
        policy = self.policies.get(model)
        return policy is not None and policy.exact

    async def lookup(
        self, tenant: str, model: str, path: str, raw: bytes, cache_control: str | None
    ) -> CacheLookup | None:
        """None when the model does not cache or the request may not be cached (sampled, say)."""
        policy = self.policies.get(model)
        if policy is None or not policy.exact:
            return None
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:  # NaN or a huge number pydantic took: not cached, the engine judges
            return None
        if policy.deterministic_only and not _deterministic(data):
            return None
        directives = {d.strip().lower() for d in (cache_control or "").split(",")}
        shaping = {k: v for k, v in data.items() if k not in _NOT_SHAPING}
        version = self.versions.get(model, "")
        canonical = orjson.dumps([version, path, shaping], option=orjson.OPT_SORT_KEYS)
        key = entry_key(tenant, model, hashlib.sha256(canonical).hexdigest())
        found = CacheLookup(key, "no-cache" not in directives, "no-store" not in directives, policy)
        if found.read:
            value = await self.store.get(found.key)
            try:
                found.hit = Entry.decode(value) if value is not None else None
            except (ValueError, KeyError, TypeError) as exc:  # another version's entry, or not ours
                logger.warning("response cache: unreadable entry %s (%s): a miss", found.key, exc)
        return found

    def keep_whole(self, lookup: CacheLookup, body: bytes, chat: bool) -> None:
        if lookup.keep:
            self._keep(lookup, lambda: entry_from_whole(body, chat))

    def keep_stream(
        self, lookup: CacheLookup, written: list[bytes], chat: bool, usage: dict[str, Any] | None
    ) -> None:
        if lookup.keep:
            self._keep(lookup, lambda: entry_from_stream(written, chat, usage))

    def _keep(self, lookup: CacheLookup, make: Any) -> None:
        try:
            entry = make()
            if entry is not None:
                self._put(lookup, entry)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # an answer of an odd shape
            logger.warning("response cache: not keeping an answer (%s: %s)", type(exc).__name__, exc)

    def _put(self, lookup: CacheLookup, entry: Entry) -> None:
        """Kept in the background: the answer is already on its way to the client."""
        task = asyncio.create_task(self.store.put(lookup.key, entry.encode(), lookup.policy.ttl_s))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def flush(self) -> None:
        """Wait for entries being kept (tests, shutdown)."""
        await asyncio.gather(*self._writes, return_exceptions=True)


def _deterministic(data: dict[str, Any]) -> bool:
    temperature = data.get("temperature")
    return temperature == 0 or data.get("seed") is not None
