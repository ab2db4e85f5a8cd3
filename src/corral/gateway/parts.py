"""The gateway's long-lived parts, built once from the spec and handed to the app's assembly (app.py),
which gives each stage the parts it uses by name: no stage holds the container."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from corral.admission import (
    Authenticator,
    BudgetTracker,
    FairQueue,
    RateLimits,
    SharedBudgets,
    TokenCounter,
    TokenSizing,
)
from corral.batch import BatchStore
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
from corral.routing.adapters import AdapterCatalogue
from corral.store import (
    AuditLog,
    KeyStore,
    ResponseStore,
    Retention,
    SessionStore,
    StoreThreads,
    StoreTimeouts,
    UsageStore,
    open_database,
    server_secret,
)

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from corral.admission.oidc import OIDCVerifier

__all__ = ["AdminAccess", "GatewayParts", "ReplicaControl", "isolates"]


class ReplicaControl(Protocol):
    """What the admin API may ask of the control plane (implemented by cluster.Reconciler; in a gateway
    worker, by a proxy that asks the reconciler in `corral up`'s process)."""

    async def drain(self, replica_id: str, grace_s: float) -> dict[str, object]: ...

    async def apply(self, wanted: ClusterSpec, grace_s: float) -> list[dict[str, object]]: ...

    async def drain_node(self, node: str, grace_s: float) -> dict[str, object]: ...

    async def rollout_action(self, model: str, action: str, grace_s: float = 60.0) -> dict[str, object]: ...


@dataclass(frozen=True)
class AdminAccess:
    """Who may use the admin API: the holder of `admin_key`; without one, clients on this machine of a
    gateway that runs open (`open_access`)."""

    admin_key: str | None
    open_access: bool


@dataclass(frozen=True)
class GatewayParts:
    """What the gateway is built from. Immutable: a live `corral apply` changes settings inside the parts
    (`reconfigure`; a new model's entries in `failover_modes`, `sizing` and `cache`), never which parts."""

    keys: KeyStore
    usage_store: UsageStore
    auth: Authenticator
    limits: RateLimits
    budget: BudgetTracker
    queue: FairQueue
    sizing: TokenSizing
    access: AdminAccess
    flush_interval: float  # seconds between usage-record writes
    max_pending_usage: int = 100_000
    failover_modes: dict[str, str] = field(default_factory=dict)  # model → mid_stream_failover
    isolated: set[str] = field(default_factory=set)  # models whose prefix index keeps tenants apart
    # what the tenants' routing tags and cache salts are derived from: the admin key, else the store's own
    # secret (an empty one would let a tenant compute another's tag: gateway/isolation.py)
    isolation_secret: str = ""
    control: ReplicaControl | None = None  # the supervisor (or, in a worker, a proxy to it)
    cache: ExactCache | None = None  # answers repeated requests (models with cache.exact)
    batches: BatchStore | None = None  # files and batch jobs (batch.enabled)
    batch: BatchSettings = field(default_factory=BatchSettings)
    responses: ResponseStore | None = None  # stored responses (/v1/responses)
    adapters: AdapterCatalogue = field(default_factory=AdapterCatalogue)  # LoRA adapters (a live apply's)
    # in a gateway worker: the cluster's counts per replica, summed over the workers by the supervisor
    # (each worker's own replica set holds only its requests and its share of the slots)
    cluster_counts: Callable[[], Awaitable[dict[str, list[int]]]] | None = None
    audit: AuditLog | None = None  # every administrative action (store/audit.py)
    sessions: SessionStore | None = None  # console sign-ins through the identity provider (auth.oidc)
    retention: Retention | None = None  # old usage/audit rows, expired responses swept (store/retention.py)
    # the threads the requests' own store calls run on (key and session lookups, budgets, stored responses),
    # apart from asyncio's default executor where the admin reports and the sweeps run; closed at shutdown
    threads: StoreThreads = field(default_factory=StoreThreads.default_executor)

    def reconfigure(self, queue: QueueSettings, limits: LimitsSettings) -> None:
        """New queue bounds and rate-limit settings from a live `corral apply` (requests already waiting
        keep their place; a changed limits section gets a new limiter)."""
        self.queue.configure(queue.max_queued, queue.timeout)
        self.sizing.tokens_per_byte = limits.tokens_per_char
        before = self.limits.settings
        self.limits.reconfigure(limits)
        if _budgets_where(before) != _budgets_where(limits):  # (budgets count where the limits do)
            self.budget.share(_shared_budgets(limits))

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
        isolation: dict[str, str | None] | None = None,
        cache: CacheSettings | None = None,
        cache_policies: dict[str, ModelCacheSpec] | None = None,
        cache_versions: dict[str, str] | None = None,
        batch: BatchSettings | None = None,
    ) -> GatewayParts:
        engine = open_database(store.url or database_url, timeouts=StoreTimeouts())
        keys, usage = KeyStore(engine), UsageStore(engine)
        threads = StoreThreads()
        batch = batch or BatchSettings()
        counters = {model: TokenCounter(path) for model, path in (tokenizers or {}).items()}
        responses = ResponseStore(engine, store.response_ttl_days * 86400, store.response_tenant_max_bytes)
        return cls(
            keys=keys,
            usage_store=usage,
            auth=Authenticator(
                keys, open_access=auth.open, ttl=auth.cache_ttl, oidc=_oidc(auth), threads=threads
            ),
            limits=RateLimits(limits),
            budget=BudgetTracker(usage, shared=_shared_budgets(limits), keys=keys, threads=threads),
            queue=FairQueue(replicas, queue.max_queued, queue.timeout),
            sizing=TokenSizing(limits.tokens_per_char, counters),
            access=AdminAccess(admin_key, auth.open),
            flush_interval=store.flush_interval,
            max_pending_usage=store.max_pending,
            failover_modes=failover_modes or {},
            isolated={m for m, value in (isolation or {}).items() if isolates(value, auth.open)},
            isolation_secret=admin_key or server_secret(engine, "isolation"),
            cache=_cache(cache or CacheSettings(), cache_policies or {}, cache_versions or {}),
            batches=_batches(engine, batch),
            batch=batch,
            responses=responses,
            audit=AuditLog(engine),
            sessions=SessionStore(engine) if auth.oidc is not None else None,
            retention=Retention(engine, store.usage_retention_days, store.audit_retention_days, responses),
            threads=threads,
        )


def isolates(prefix_isolation: str | None, open_access: bool) -> bool:
    """A model's `prefix_isolation` on this gateway: tenant (stated, or unset on a closed gateway)."""
    return prefix_isolation == "tenant" or (prefix_isolation is None and not open_access)


def _oidc(auth: AuthSettings) -> OIDCVerifier | None:
    """The identity provider's token checks, where the spec names one (admission/oidc.py)."""
    if auth.oidc is None:
        return None
    from corral.admission.oidc import OIDCVerifier  # (joserfc imported only when used)

    return OIDCVerifier(auth.oidc)


def _budgets_where(limits: LimitsSettings) -> tuple[object, ...]:
    return (limits.backend, limits.redis_url, limits.redis_timeout) if limits.backend == "redis" else ()


def _shared_budgets(limits: LimitsSettings) -> SharedBudgets | None:
    """Budgets across gateways where the rate limits are (Redis); None: each gateway its own."""
    if limits.backend != "redis":
        return None
    return SharedBudgets(limits.redis_url, timeout=limits.redis_timeout)


def _batches(engine: Engine, settings: BatchSettings) -> BatchStore | None:
    if not settings.enabled:
        return None
    if settings.queue == "redis":
        from corral.batch.queue_redis import RedisLines  # the redis client is imported only when used

        return BatchStore(engine, RedisLines(settings.redis_url), settings.file_expiry)
    return BatchStore(engine, file_expiry=settings.file_expiry)


def _cache(
    settings: CacheSettings, policies: dict[str, ModelCacheSpec], versions: dict[str, str]
) -> ExactCache:
    store: CacheStore = (
        RedisStore(
            settings.redis_url,
            settings.redis_timeout,
            tenant_max_bytes=settings.tenant_max_bytes or settings.max_bytes,
        )
        if settings.backend == "redis"
        else MemoryStore(settings.max_bytes, settings.tenant_max_bytes)
    )
    return ExactCache(
        store,
        dict(policies),
        dict(versions),
        embed_timeout=settings.embedding_timeout,
        max_entry_bytes=settings.max_entry_bytes,
    )
