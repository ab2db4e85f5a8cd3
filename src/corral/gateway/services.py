"""The long-lived parts the gateway's stages use, built once from configuration and passed in."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from corral.admission import (
    Authenticator,
    BudgetTracker,
    FairQueue,
    Limiter,
    MemoryLimiter,
    RedisLimiter,
    TokenCounter,
)
from corral.cache import CacheStore, ExactCache, MemoryStore, RedisStore
from corral.config import (
    AuthSettings,
    BatchSettings,
    CacheSettings,
    ClusterSpec,
    LimitsSettings,
    ModelCacheSpec,
    QueueSettings,
    StoreSettings,
)
from corral.routing import ReplicaSet
from corral.store import BatchStore, KeyStore, UsageStore, open_database

if TYPE_CHECKING:
    from sqlalchemy import Engine

__all__ = ["GatewayServices", "ReplicaControl"]


class ReplicaControl(Protocol):
    """What the admin API may ask of the control plane (implemented by cluster.Reconciler; in a gateway
    worker, by a proxy that asks the reconciler in `corral up`'s process)."""

    async def drain(self, replica_id: str, grace_s: float) -> dict[str, object]: ...

    async def apply(self, wanted: ClusterSpec, grace_s: float) -> list[dict[str, object]]: ...

    async def drain_node(self, node: str, grace_s: float) -> dict[str, object]: ...

    async def rollout_action(self, model: str, action: str, grace_s: float = 60.0) -> dict[str, object]: ...


@dataclass
class GatewayServices:
    keys: KeyStore
    usage_store: UsageStore
    auth: Authenticator
    limiter: Limiter
    budget: BudgetTracker
    queue: FairQueue
    admin_key: str | None
    open_access: bool
    tokens_per_byte: float
    flush_interval: float
    limits_fail_open: bool = True
    max_pending_usage: int = 100_000
    token_counters: dict[str, TokenCounter] = field(default_factory=dict)
    failover_modes: dict[str, str] = field(default_factory=dict)  # model → mid_stream_failover
    control: ReplicaControl | None = None  # the supervisor, when it runs in this process
    cache: ExactCache | None = None  # answers repeated requests (models with cache.exact)
    limits: LimitsSettings | None = None  # what `limiter` was built from (a live apply compares)
    retired: list[Limiter] = field(default_factory=list)  # limiters replaced by a live apply
    batches: BatchStore | None = None  # files and batch jobs (batch.enabled)
    batch: BatchSettings = field(default_factory=BatchSettings)

    def reconfigure(self, queue: QueueSettings, limits: LimitsSettings) -> Limiter | None:
        """New queue bounds and rate-limit settings from a live `corral apply`. A changed limits section
        gets a new limiter (counts start afresh); requests admitted by the old one settle with it. Returns
        the old limiter, for the caller to close once those are done."""
        self.queue.configure(queue.max_queued, queue.timeout)
        self.tokens_per_byte = limits.tokens_per_char
        self.limits_fail_open = limits.on_redis_error == "open"
        if limits == self.limits:
            return None
        old, self.limiter, self.limits = self.limiter, _limiter(limits), limits
        self.retired.append(old)  # closed at shutdown: requests it admitted may still settle with it
        return old

    @classmethod
    def build(
        cls,
        replicas: ReplicaSet,
        database_url: str,
        auth: AuthSettings,
        store: StoreSettings,
        limits: LimitsSettings,
        queue: QueueSettings,
        admin_key: str | None,
        tokenizers: dict[str, Path] | None = None,
        failover_modes: dict[str, str] | None = None,
        cache: CacheSettings | None = None,
        cache_policies: dict[str, ModelCacheSpec] | None = None,
        cache_versions: dict[str, str] | None = None,
        batch: BatchSettings | None = None,
    ) -> GatewayServices:
        engine = open_database(store.url or database_url)
        keys, usage = KeyStore(engine), UsageStore(engine)
        limiter = _limiter(limits)
        batch = batch or BatchSettings()
        return cls(
            keys=keys,
            usage_store=usage,
            auth=Authenticator(keys, open_access=auth.open, ttl=auth.cache_ttl),
            limiter=limiter,
            budget=BudgetTracker(usage),
            queue=FairQueue(replicas, queue.max_queued, queue.timeout),
            admin_key=admin_key,
            open_access=auth.open,
            tokens_per_byte=limits.tokens_per_char,
            flush_interval=store.flush_interval,
            limits_fail_open=limits.on_redis_error == "open",
            max_pending_usage=store.max_pending,
            token_counters={model: TokenCounter(path) for model, path in (tokenizers or {}).items()},
            failover_modes=failover_modes or {},
            cache=_cache(cache or CacheSettings(), cache_policies or {}, cache_versions or {}),
            limits=limits,
            batches=_batches(engine, batch),
            batch=batch,
        )


def _batches(engine: Engine, settings: BatchSettings) -> BatchStore | None:
    if not settings.enabled:
        return None
    if settings.queue == "redis":
        from corral.store.batch_redis import RedisLines  # the redis client is imported only when used

        return BatchStore(engine, RedisLines(settings.redis_url))
    return BatchStore(engine)


def _limiter(limits: LimitsSettings) -> Limiter:
    if limits.backend == "redis":
        return RedisLimiter(limits.redis_url, limits.window_s, timeout=limits.redis_timeout)
    return MemoryLimiter(limits.window_s)


def _cache(
    settings: CacheSettings, policies: dict[str, ModelCacheSpec], versions: dict[str, str]
) -> ExactCache:
    store: CacheStore = (
        RedisStore(settings.redis_url, settings.redis_timeout)
        if settings.backend == "redis"
        else MemoryStore(settings.max_bytes)
    )
    return ExactCache(store, dict(policies), dict(versions), embed_timeout=settings.embedding_timeout)
