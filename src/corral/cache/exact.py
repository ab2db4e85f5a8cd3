"""The exact response cache: which requests it may answer, under which key, and what it keeps.

The key is the tenant, the model and what serves it (a digest of its deployed spec: weights, engine,
arguments, so a rollout starts afresh), the endpoint and a canonical form of everything in the body that
shapes the answer: all fields but `stream`, `stream_options`, `user` and `metadata`, with object keys
sorted. So two tenants never share an entry, and two conversations that end in the same question but
differ before it never hit each other (the whole `messages` list is in the key). By default only deterministic
requests are cached (temperature 0, or a seed). `Cache-Control: no-cache` skips the lookup,
`no-store` the keeping. Only an answer that ended well is kept: status 200, a stream that ended with
`[DONE]` on its first replica (no error event, no mid-stream failover, the client still there), not
while the model is being rolled out (either revision may answer), and not when what serves the model
changed between the lookup and the answer (`versions`: a rollout, an adapter replaced; the key names the
revision the lookup saw, the answer may be the other's). Likewise a question's vector is kept only if
the embedding model's revision is still the lookup's. An answer larger than `max_entry_bytes` is not kept
(a stream stops being collected past it): one tenant's huge answer would otherwise be held, parsed and, on
every hit, decoded and replayed on the event loop every tenant shares. Under `charge: tokens` an answer
without usage (an engine that reported none) is not kept: its hits would cost nothing. The cache
never fails a request: an entry it cannot read or keep is a miss, logged.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from corral.cache.embedding import MAX_EMBEDDINGS, EmbeddingCalls
from corral.cache.entry import Collected, Entry, entry_from_stream, entry_from_whole
from corral.cache.guard import may_share_answer
from corral.cache.semantic import Embedder, Neighbour, SemanticIndex, ThresholdLearner, Vector
from corral.cache.store import CacheStore, entry_key, key_matches
from corral.config import ModelCacheSpec

__all__ = ["MAX_ENTRY_BYTES", "CacheLookup", "ExactCache"]

logger = logging.getLogger(__name__)

MAX_ENTRY_BYTES = 1024 * 1024  # `cache.max_entry_bytes`'s default: the most bytes of one answer kept
_NO_VECTOR = b'"vector":null'  # (in an encoded entry: quotes inside its strings are escaped, so only its own)

_NOT_SHAPING = frozenset({"stream", "stream_options", "user", "metadata"})


@dataclass(slots=True)
class CacheLookup:
    """One request's dealings with the cache: its key, whether it may read and keep, what it found."""

    key: str
    read: bool
    keep: bool
    policy: ModelCacheSpec
    model: str = ""
    version: str = ""  # the digest of what served the model at the lookup (`ExactCache.versions`)
    hit: Entry | None = None
    group: str | None = None  # semantic: the digest of everything but the last user turn
    vector: Vector | None = None  # semantic: the last user turn's embedding
    neighbour: Neighbour | None = None  # semantic: the entry that answered (a hit) or is checked
    check: Entry | None = None  # learned thresholds: the neighbour's answer, compared with the engine's
    question: str | None = None  # semantic: the last user turn's text
    vetoed: bool = False  # semantic: the lexical guard refused the nearest neighbour
    embedder_version: str = ""  # semantic: the embedding model's digest at the lookup
    embedding_failure: str | None = None  # semantic: why the question got no vector (EmbeddingCalls)

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
        embedder: Embedder | None = None,
        embed_timeout: float = 2.0,
        learner: ThresholdLearner | None = None,
        max_embeddings: int = MAX_EMBEDDINGS,
        clock: Callable[[], float] = time.monotonic,
        max_entry_bytes: int = MAX_ENTRY_BYTES,
    ) -> None:
        """`max_embeddings`: the embedding calls for questions made at once (EmbeddingCalls);
        `max_entry_bytes`: the most bytes of one answer kept (`cache.max_entry_bytes`)."""
        self.store = store
        self.max_entry_bytes = max_entry_bytes
        # a stored value larger than any entry this gateway keeps (its strings' quotes escaped at most
        # double it): another gateway's, kept before the bound, is a miss without being decoded
        self._max_value = 2 * max_entry_bytes + 64 * 1024
        self.policies = policies
        self.versions = versions if versions is not None else {}  # model → digest of its deployed spec
        self.embedder = embedder  # semantic lookups: set by the gateway, which can reach the embedders
        self.index = SemanticIndex()
        self.learner = learner or ThresholdLearner()
        self.checks = {"correct": 0, "wrong": 0}  # learned thresholds: explored neighbours, judged
        self._embedding = EmbeddingCalls(embed_timeout, max_embeddings, clock)
        self._writes: set[asyncio.Task[None]] = set()

    def enabled(self, model: str) -> bool:
        policy = self.policies.get(model)
        return policy is not None and (policy.exact or policy.semantic)

    async def lookup(
        self, tenant: str, model: str, path: str, raw: bytes, cache_control: str | None
    ) -> CacheLookup | None:
        """None when the model does not cache or the request may not be cached (sampled, say)."""
        policy = self.policies.get(model)
        if policy is None or not (policy.exact or policy.semantic):
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
        found = CacheLookup(
            key, "no-cache" not in directives, "no-store" not in directives, policy, model, version
        )
        if found.read:
            found.hit = await self._get(found.key)
        if policy.semantic and self.embedder is not None and path.endswith("/chat/completions"):
            turn = _last_user_turn(shaping)
            if turn is not None:
                text, rest = turn
                found.question = text
                # the context also names the embedding model and its revision: vectors of two models
                # (or of a rolled-out one) are never compared
                embedder = policy.embedding_model or ""
                found.embedder_version = self.versions.get(embedder, "")
                context = [tenant, model, version, path, rest, embedder, found.embedder_version]
                group = orjson.dumps(context, option=orjson.OPT_SORT_KEYS)
                found.group = hashlib.sha256(group).hexdigest()
                if found.hit is None:  # the vector is needed to find a neighbour, or to keep the answer
                    await self._semantic(found, tenant, text)
        return found

    async def _get(self, key: str) -> Entry | None:
        value = await self.store.get(key)
        if value is None:
            return None
        if len(value) > self._max_value:
            logger.warning(
                "response cache: entry %s of %d bytes, past max_entry_bytes: a miss", key, len(value)
            )
            return None
        try:
            return Entry.decode(value)
        except Exception as exc:  # another version's entry, or not ours: whatever it holds, a miss
            logger.warning(
                "response cache: unreadable entry %s (%s: %s): a miss", key, type(exc).__name__, exc
            )
            return None

    async def _semantic(self, found: CacheLookup, tenant: str, text: str) -> None:
        """Embed the last user turn; on an exact miss, answer from its nearest neighbour in the group when
        that is close enough (fixed threshold) or trusted (learned thresholds)."""
        policy = found.policy
        assert self.embedder is not None and policy.embedding_model is not None and found.group is not None
        calls = self._embedding
        found.vector, found.embedding_failure = await calls.vector(
            self.embedder, policy.embedding_model, text, tenant
        )
        if found.vector is None or found.hit is not None or not found.read:
            return
        try:
            await self._neighbour(found, text)
        except (ValueError, ArithmeticError, np.linalg.LinAlgError) as exc:  # never fail the request
            logger.warning("semantic cache: lookup failed (a miss): %s", exc)
            found.hit = found.check = found.neighbour = None

    async def _neighbour(self, found: CacheLookup, text: str) -> None:
        """The nearest cached question of the context: a hit, a check (learned thresholds) or nothing."""
        policy = found.policy
        assert found.group is not None and found.vector is not None
        neighbour = self.index.nearest(found.group, found.vector)
        if neighbour is None:
            return
        entry = await self._get(neighbour.key)
        if entry is None:
            if self.store.healthy:  # expired, evicted or purged (not a store that is down): forget it
                self.index.remove([neighbour.key])
                self.learner.forget([neighbour.key])
            return
        if policy.guard and (entry.question is None or not may_share_answer(entry.question, text)):
            found.vetoed = True  # a different question in words embeddings miss: the engine answers
            return
        found.neighbour = neighbour
        if policy.learn_thresholds:
            if self.learner.explore(
                neighbour.key, neighbour.similarity, policy.similarity, policy.target_false_hit_rate
            ):
                found.check = entry  # the engine answers; its answer tells whether this one was right
                return
        elif not neighbour.similarity >= policy.similarity:  # (NaN fails closed)
            return
        found.hit = entry

    async def rebuild(self) -> int:
        """Index the vectors of stored entries (a gateway starting beside a shared Redis cache). An entry
        without a vector (exact only), or larger than any this gateway keeps, is passed by without being
        decoded; the others are decoded one at a time, the event loop let go between them (a shared
        Redis holds every gateway's entries: decoding them all at once held the loop for most of a
        second); one that cannot be read is passed by, logged."""
        added = 0
        async for key, value in self.store.scan():
            await asyncio.sleep(0)
            if len(value) > self._max_value or value.find(_NO_VECTOR) >= 0:
                continue
            try:
                entry = Entry.decode(value)
                vector = decode_vector(entry.vector) if entry.vector is not None else None
            except Exception as exc:  # another version's entry, or not ours
                logger.debug("semantic cache: unreadable entry %s not indexed (%s)", key, exc)
                continue
            if entry.group is not None and vector is not None:
                await self.index.add(entry.group, key, vector)
                added += 1
        return added

    async def sweep(self) -> int:
        """Forget indexed vectors whose entries are gone (expired, evicted); how many went. One question to
        the store for all the index's keys (in Redis, pipelined 500 at a time)."""
        keys = self.index.keys()
        if not keys or not self.store.healthy:
            return 0
        present = await self.store.present(keys)
        gone = [key for key in keys if key not in present]
        if self.store.healthy:  # (a store that failed mid-way answered nothing reliable)
            self.index.remove(gone)
            self.learner.forget(gone)
            return len(gone)
        return 0

    async def purge(self, tenant: str | None, model: str | None) -> int:
        """Remove cached answers (and their vectors) of a tenant and/or model; StoreUnavailable if the
        store cannot."""
        removed = await self.store.purge(tenant, model)
        doomed = [key for key in self.index.keys() if key_matches(key, tenant, model)]
        self.index.remove(doomed)
        self.learner.forget(doomed)
        return removed

    def collector(self) -> Collected:
        """What a stream's events are collected in for `keep_stream` (up to `max_entry_bytes`)."""
        return Collected(self.max_entry_bytes)

    def keep_whole(self, lookup: CacheLookup, body: bytes, chat: bool) -> None:
        if lookup.keep and len(body) <= self.max_entry_bytes:  # (a larger one is not even parsed)
            self._keep(lookup, lambda: entry_from_whole(body, chat))

    def keep_stream(
        self, lookup: CacheLookup, written: list[bytes], chat: bool, usage: dict[str, Any] | None
    ) -> None:
        over = (
            written.over if isinstance(written, Collected) else sum(map(len, written)) > self.max_entry_bytes
        )
        if lookup.keep and not over:
            self._keep(lookup, lambda: entry_from_stream(written, chat, usage))

    def _keep(self, lookup: CacheLookup, make: Any) -> None:
        if self.versions.get(lookup.model, "") != lookup.version:
            return  # redeployed since the lookup: the answer may be the old revision's, the key the new one's
        try:
            entry = make()
            if entry is not None and _chargeable(entry, lookup.policy):
                # An answer that proved its neighbour right is kept for exact hits but not indexed: the
                # neighbour already answers this question, and its evidence stays in one place.
                confirmed = self._judge(lookup, entry)
                if (
                    lookup.vector is not None
                    and lookup.group is not None
                    and not confirmed
                    and self._same_embedder(lookup)
                ):
                    vector = encode_vector(lookup.vector)
                    entry = dataclasses.replace(
                        entry, group=lookup.group, vector=vector, question=lookup.question
                    )
                self._put(lookup, entry)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # an answer of an odd shape
            logger.warning("response cache: not keeping an answer (%s: %s)", type(exc).__name__, exc)

    def _same_embedder(self, lookup: CacheLookup) -> bool:
        """The embedding model's revision is the lookup's: its vector is of the revision its group names
        (one made while the embedding model was redeployed is not kept: the entry serves exact hits only)."""
        return self.versions.get(lookup.policy.embedding_model or "", "") == lookup.embedder_version

    def _judge(self, lookup: CacheLookup, fresh: Entry) -> bool:
        """Learned thresholds: the engine answered a request whose neighbour was not yet trusted; equal
        answers are evidence that the neighbour's answer fits this similarity, different ones against.
        True when the neighbour proved right."""
        if lookup.check is None or lookup.neighbour is None:
            return False
        mine, theirs = fresh.text(), lookup.check.text()
        if mine is None or theirs is None:
            return False
        correct = " ".join(mine.split()) == " ".join(theirs.split())
        self.checks["correct" if correct else "wrong"] += 1
        self.learner.observe(lookup.neighbour.key, lookup.neighbour.similarity, correct)
        return correct

    def _put(self, lookup: CacheLookup, entry: Entry) -> None:
        """Kept in the background: the answer is already on its way to the client."""

        async def put() -> None:
            value = entry.encode()
            if len(value) > self._max_value:  # (a long question beside it: it would never be read back)
                return
            kept = await self.store.put(lookup.key, value, lookup.policy.ttl_s)
            if kept and entry.group is not None and lookup.vector is not None:  # (refused: not indexed)
                await self.index.add(entry.group, lookup.key, lookup.vector)

        task = asyncio.create_task(put())
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def flush(self) -> None:
        """Wait for entries being kept (tests, shutdown)."""
        await asyncio.gather(*self._writes, return_exceptions=True)


def _chargeable(entry: Entry, policy: ModelCacheSpec) -> bool:
    """A hit on the entry can be charged as the policy says: under `charge: tokens` it needs its usage (an
    engine that reported none: the miss was charged its reservation, but the hits would be free)."""
    return entry.usage is not None or policy.charge != "tokens"


def _last_user_turn(shaping: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The last message's text when it is the user's, and everything else; None for other requests."""
    messages = shaping.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return None
    last = messages[-1]
    if last.get("role") != "user" or set(last) - {"role", "content"}:
        return None
    content = last.get("content")
    if isinstance(content, list):  # text parts only; an image makes it not comparable by text
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            return None
        content = "\n".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str) or not content.strip():
        return None
    return content, {**shaping, "messages": messages[:-1]}


def encode_vector(vector: Vector) -> str:
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()


def decode_vector(text: str) -> Vector:
    return np.frombuffer(base64.b64decode(text), dtype="<f4").astype(np.float32)


def _deterministic(data: dict[str, Any]) -> bool:
    temperature = data.get("temperature")
    return temperature == 0 or data.get("seed") is not None
