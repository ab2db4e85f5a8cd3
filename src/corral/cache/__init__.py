"""Response caching between admission and the queue: the exact cache (per tenant and model, memory or
Redis) and the semantic cache over it (semantic.py), which asks an `Embedder` for its vectors."""

from corral.cache.entry import Entry
from corral.cache.exact import CacheLookup, ExactCache
from corral.cache.semantic import Embedder, SemanticIndex, ThresholdLearner, Vector
from corral.cache.store import CacheStore, MemoryStore, RedisStore, StoreUnavailable, entry_key

__all__ = [
    "CacheLookup",
    "CacheStore",
    "Embedder",
    "Entry",
    "ExactCache",
    "MemoryStore",
    "RedisStore",
    "SemanticIndex",
    "StoreUnavailable",
    "ThresholdLearner",
    "Vector",
    "entry_key",
]
