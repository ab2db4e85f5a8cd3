"""Where cached answers live: an in-process LRU bounded in bytes, or Redis with TTLs (shared by gateways).
Either way each tenant holds at most `cache.tenant_max_bytes` of answers: past it, its own oldest go. When
the whole memory store is full, the tenant putting an answer gives up its own oldest, unless it holds less
than an equal share of the store (`max_bytes` over the tenants holding answers): then the tenant holding the
most gives up its oldest (a new tenant is not starved by one that filled the store, and no tenant below its
share loses answers to another's).

Keys are `<tenant>/<model>/<digest>` (tenant and model percent-quoted), so a purge by tenant or model
finds its entries in either store. A store that cannot answer (Redis down or slow) is a miss, never an
error: caching must not fail a request; after a failure Redis is skipped for a few seconds, so a
black-holed Redis costs one timeout, not one per request. Each failure is told to the store's `on_error`
with the operation that failed (the gateway counts them: `corral_cache_store_errors_total`).
"""

from __future__ import annotations

import logging
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Protocol

__all__ = ["CacheStore", "MemoryStore", "RedisStore", "StoreUnavailable", "entry_key", "key_matches"]

logger = logging.getLogger(__name__)

_SKIP_AFTER_FAILURE_S = 5.0

# Redis: store an entry and keep its tenant's books. KEYS entry, the tenant's entries by expiry (a sorted
# set), their sizes (a hash; the field '' holds the total). ARGV value, ttl ms, now ms, the tenant's cap.
# Entries whose TTL passed leave the books; past the cap, the tenant's entries that expire first (its
# oldest, for one TTL) are deleted, never another tenant's. Returns 1 if the entry put is still there (one
# with a shorter TTL than the tenant's others may be the first to go), else 0.
_PUT = """
local entry, order, sizes = KEYS[1], KEYS[2], KEYS[3]
local ttl, now, cap = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local function forget(k)
  local n = tonumber(redis.call('HGET', sizes, k) or '0')
  redis.call('HDEL', sizes, k)
  redis.call('ZREM', order, k)
  if n > 0 then redis.call('HINCRBY', sizes, '', -n) end
end
for _, k in ipairs(redis.call('ZRANGEBYSCORE', order, '-inf', now, 'LIMIT', 0, 100)) do forget(k) end
forget(entry)
redis.call('SET', entry, ARGV[1], 'PX', ttl)
redis.call('ZADD', order, now + ttl, entry)
redis.call('HSET', sizes, entry, #ARGV[1])
local total = redis.call('HINCRBY', sizes, '', #ARGV[1])
while total > cap do
  local oldest = redis.call('ZRANGE', order, 0, 0)[1]
  if not oldest then break end
  redis.call('DEL', oldest)
  forget(oldest)
  total = tonumber(redis.call('HGET', sizes, '') or '0')
end
local last = redis.call('ZRANGE', order, -1, -1, 'WITHSCORES')
if last[2] then
  local keep = math.max(1, math.ceil(tonumber(last[2]) - now))
  redis.call('PEXPIRE', order, keep)
  redis.call('PEXPIRE', sizes, keep)
end
return redis.call('EXISTS', entry)
"""

# Redis: delete entries and take them off their tenants' books. KEYS (entry, order, sizes) per entry.
_DROP = """
local removed = 0
for i = 1, #KEYS, 3 do
  removed = removed + redis.call('DEL', KEYS[i])
  local n = tonumber(redis.call('HGET', KEYS[i + 2], KEYS[i]) or '0')
  redis.call('HDEL', KEYS[i + 2], KEYS[i])
  redis.call('ZREM', KEYS[i + 1], KEYS[i])
  if n > 0 then redis.call('HINCRBY', KEYS[i + 2], '', -n) end
end
return removed
"""


class StoreUnavailable(RuntimeError):
    """The cache's store did not answer an admin call (a purge)."""


def entry_key(tenant: str, model: str, digest: str) -> str:
    return f"{_quote(tenant)}/{_quote(model)}/{digest}"


def _quote(part: str) -> str:
    return urllib.parse.quote(part, safe="")


class CacheStore(Protocol):
    on_error: Callable[[str], None]  # told the operation (get, put, scan, present, purge) that failed

    async def get(self, key: str) -> bytes | None: ...

    async def put(self, key: str, value: bytes, ttl_s: float) -> bool:
        """Keep an entry; whether it was kept (not past a tenant's share, the store answering)."""
        ...

    async def purge(self, tenant: str | None, model: str | None) -> int: ...

    def scan(self) -> AsyncIterator[tuple[str, bytes]]:
        """Every live entry (key, value): the semantic index is rebuilt from them."""
        ...

    async def present(self, keys: list[str]) -> set[str]:
        """Which of `keys` still have entries."""
        ...

    @property
    def healthy(self) -> bool:
        """The store answers (a None from `get` means absent, not unreachable)."""
        ...

    def stats(self) -> dict[str, object]: ...


class MemoryStore:
    """An LRU of encoded entries, at most `max_bytes` of them and `tenant_max_bytes` of one tenant's, each
    gone after its TTL. When full, the tenant holding the most gives up its least recently used ones while
    it holds more than an equal share (`max_bytes` over the tenants holding entries); otherwise the tenant
    putting an entry gives up its own: a tenant filling the cache with answers no one asks again evicts its
    own, not other tenants', and a tenant coming to a full cache still gets its share. (A tenant still sees
    when the store as a whole is full, from its own evictions: a `tenant_max_bytes` of at most `max_bytes`
    over the tenants partitions the store instead.)"""

    def __init__(self, max_bytes: int, tenant_max_bytes: int | None = None) -> None:
        self._max = max_bytes
        self._tenant_max = min(max_bytes, tenant_max_bytes or max_bytes)
        self._entries: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._bytes = 0
        self._tenants: dict[str, OrderedDict[str, int]] = {}  # tenant → its keys (LRU order) → bytes
        self._held: dict[str, int] = {}  # tenant → bytes
        self.on_error: Callable[[str], None] = _unheard  # (memory does not fail)

    async def get(self, key: str) -> bytes | None:
        found = self._entries.get(key)
        if found is None:
            return None
        expires, value = found
        if expires < time.monotonic():
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        self._tenants[_owner(key)].move_to_end(key)
        return value

    async def put(self, key: str, value: bytes, ttl_s: float) -> bool:
        if len(value) > self._tenant_max:
            return False
        self._drop(key)
        owner = _owner(key)
        self._entries[key] = (time.monotonic() + ttl_s, value)
        self._tenants.setdefault(owner, OrderedDict())[key] = len(value)
        self._held[owner] = self._held.get(owner, 0) + len(value)
        self._bytes += len(value)
        while self._held[owner] > self._tenant_max:
            self._drop(next(iter(self._tenants[owner])))
        while self._bytes > self._max:
            largest = max(self._held, key=self._held.__getitem__)
            above_share = self._held[largest] * len(self._held) > self._max
            victim = largest if above_share or not self._held.get(owner) else owner
            self._drop(next(iter(self._tenants[victim])))
        return key in self._entries

    async def purge(self, tenant: str | None, model: str | None) -> int:
        doomed = [k for k in self._entries if key_matches(k, tenant, model)]
        for key in doomed:
            self._drop(key)
        return len(doomed)

    async def scan(self) -> AsyncIterator[tuple[str, bytes]]:
        now = time.monotonic()
        for key, (expires, value) in list(self._entries.items()):
            if expires >= now:
                yield key, value

    async def present(self, keys: list[str]) -> set[str]:
        now = time.monotonic()
        return {k for k in keys if (found := self._entries.get(k)) is not None and found[0] >= now}

    @property
    def healthy(self) -> bool:
        return True

    def stats(self) -> dict[str, object]:
        entries, used = len(self._entries), self._bytes
        return {"backend": "memory", "entries": entries, "bytes": used, "max_bytes": self._max}

    def _drop(self, key: str) -> None:
        found = self._entries.pop(key, None)
        if found is None:
            return
        owner = _owner(key)
        self._bytes -= len(found[1])
        keys = self._tenants[owner]
        del keys[key]
        self._held[owner] -= len(found[1])
        if not keys:
            del self._tenants[owner], self._held[owner]


def _unheard(operation: str) -> None:
    """An `on_error` nobody listens to."""


def _owner(key: str) -> str:
    return key.split("/", 1)[0]


class RedisStore:
    """Entries in Redis under `corral:cache:<key>`, each with its TTL; each tenant's books (its entries by
    expiry, their sizes) under `corral:cache-books:<tenant>:`, so a tenant past `tenant_max_bytes` loses
    its own oldest entries. Redis's `maxmemory` bounds the whole (its eviction does not know tenants)."""

    def __init__(
        self,
        url: str,
        timeout: float,
        prefix: str = "corral:cache:",
        tenant_max_bytes: int = 256 * 1024 * 1024,
    ) -> None:
        import redis.asyncio as aioredis
        from redis.exceptions import RedisError

        self._errors: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)
        self._redis = aioredis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self._prefix = prefix
        self._books = prefix.rstrip(":") + "-books:"
        self._tenant_max = tenant_max_bytes
        self._put = self._redis.register_script(_PUT)
        self._drop = self._redis.register_script(_DROP)
        self.on_error: Callable[[str], None] = _unheard
        self._failures = 0
        self._down_until = 0.0  # after a failure the store is skipped a while: no wait on every request

    async def get(self, key: str) -> bytes | None:
        if time.monotonic() < self._down_until:
            return None
        try:
            value = await self._redis.get(self._prefix + key)
        except self._errors as exc:
            self._failed("get", exc)
            return None
        return value.encode() if isinstance(value, str) else value

    def _keys(self, name: str) -> list[str]:
        """An entry's key and its tenant's books."""
        books = self._books + _owner(name)
        return [self._prefix + name, books + ":order", books + ":sizes"]

    async def put(self, key: str, value: bytes, ttl_s: float) -> bool:
        if time.monotonic() < self._down_until or len(value) > self._tenant_max:
            return False
        ttl_ms, now_ms = max(1, round(ttl_s * 1000)), round(time.time() * 1000)
        try:
            kept = await self._put(keys=self._keys(key), args=[value, ttl_ms, now_ms, self._tenant_max])
        except self._errors as exc:
            self._failed("put", exc)
            return False
        return bool(kept)  # (the tenant's cap may have taken the entry itself: its vector is not indexed)

    async def purge(self, tenant: str | None, model: str | None) -> int:
        """Remove matching entries; StoreUnavailable when Redis does not answer."""
        pattern = self._prefix + "/".join(
            [_quote(tenant) if tenant is not None else "*", _quote(model) if model is not None else "*", "*"]
        )
        removed = 0
        try:
            found: list[str] = []
            async for key in self._redis.scan_iter(match=pattern, count=500):
                found.append((key.decode() if isinstance(key, bytes) else key).removeprefix(self._prefix))
                if len(found) >= 500:
                    removed += await self._forget(found)
                    found = []
            removed += await self._forget(found)
        except self._errors as exc:
            self.on_error("purge")
            raise StoreUnavailable(f"the cache's Redis did not answer: {exc}") from exc
        return removed

    async def _forget(self, names: list[str]) -> int:
        if not names:
            return 0
        return int(await self._drop(keys=[k for name in names for k in self._keys(name)]))

    async def scan(self) -> AsyncIterator[tuple[str, bytes]]:
        """Entries in batches; a Redis that fails mid-way ends the scan (what was read is used)."""
        try:
            batch: list[bytes] = []
            async for key in self._redis.scan_iter(match=self._prefix + "*", count=500):
                batch.append(key)
                if len(batch) >= 500:
                    async for item in self._values(batch):
                        yield item
                    batch = []
            async for item in self._values(batch):
                yield item
        except self._errors as exc:
            self._failed("scan", exc)

    async def _values(self, keys: list[bytes]) -> AsyncIterator[tuple[str, bytes]]:
        if not keys:
            return
        for key, value in zip(keys, await self._redis.mget(keys), strict=True):
            if value is not None:
                name = key.decode() if isinstance(key, bytes) else str(key)
                yield name.removeprefix(self._prefix), value.encode() if isinstance(value, str) else value

    async def present(self, keys: list[str]) -> set[str]:
        found: set[str] = set()
        if not self.healthy:
            return found
        try:
            for start in range(0, len(keys), 500):
                batch = keys[start : start + 500]
                async with self._redis.pipeline(transaction=False) as pipe:
                    for key in batch:
                        pipe.exists(self._prefix + key)
                    answers = await pipe.execute()
                found.update(k for k, n in zip(batch, answers, strict=True) if n)
        except self._errors as exc:
            self._failed("present", exc)
        return found

    @property
    def healthy(self) -> bool:
        return time.monotonic() >= self._down_until

    def stats(self) -> dict[str, object]:
        return {"backend": "redis", "failures": self._failures, "tenant_max_bytes": self._tenant_max}

    def _failed(self, what: str, exc: BaseException) -> None:
        self._failures += 1
        self.on_error(what)
        self._down_until = time.monotonic() + _SKIP_AFTER_FAILURE_S
        logger.warning("response cache %s failed (served without the cache): %s", what, exc)


def key_matches(key: str, tenant: str | None, model: str | None) -> bool:
    """The entry key belongs to the tenant and model given (None: any)."""
    owner, name, _ = key.split("/", 2)
    return (tenant is None or owner == _quote(tenant)) and (model is None or name == _quote(model))
