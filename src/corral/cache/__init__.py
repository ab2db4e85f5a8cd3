"""Response caching: the exact cache (per tenant and model, memory or Redis) between admission and the
queue. The semantic cache and the embeddings it needs come next (issue #15)."""

from corral.cache.entry import Entry
from corral.cache.exact import CacheLookup, ExactCache
from corral.cache.store import CacheStore, MemoryStore, RedisStore, StoreUnavailable, entry_key

__all__ = [
    "CacheLookup",
    "CacheStore",
    "Entry",
    "ExactCache",
    "MemoryStore",
    "RedisStore",
    "StoreUnavailable",
    "entry_key",
]
