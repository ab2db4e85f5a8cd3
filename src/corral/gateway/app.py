"""Gateway assembly: routes, the one error boundary, and the app's long-lived objects.

The app serves `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`, `/v1/responses` (and its stored
responses), `/v1/messages` (Anthropic's; see agents.py and dialects/), `/v1/models`, `/health`
(process up), `/ready` (every model has a ready replica), `/corral/status` (replicas with state and load),
`/metrics` (Prometheus) and the admin API under `/admin/` (keys, usage, routing state; see admin.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from aiohttp.typedefs import Middleware

from corral.admission import Authenticator, Principal
from corral.batch.runner import BatchRunner
from corral.cache import ExactCache
from corral.config import GatewaySettings
from corral.dialects import Responses
from corral.engines.client import EngineClient
from corral.gateway.admin import AdminViews, bearer_is
from corral.gateway.agents import AgentViews
from corral.gateway.batches import BatchViews
from corral.gateway.clients import REQUEST_ID, ClientAddresses, RequestIds
from corral.gateway.connections import ConnectionCaps
from corral.gateway.console import ConsoleViews
from corral.gateway.embedder import ReplicaEmbedder
from corral.gateway.isolation import TenantIsolation
from corral.gateway.metrics import GatewayMetrics
from corral.gateway.parts import GatewayParts
from corral.gateway.pipeline import Pipeline
from corral.gateway.refusals import unexpected
from corral.gateway.relay import Relay, RelayTimeouts
from corral.gateway.usage import UsageRecorder
from corral.protocol import (
    APIError,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotFound,
    NotFound,
    PayloadTooLarge,
    Unauthorized,
)
from corral.protocol.openapi import openapi_document
from corral.routing import Router
from corral.routing.adapters import Adapter, AdapterCatalogue
from corral.store import NewKey

__all__ = ["PIPELINE", "build_app"]

logger = logging.getLogger(__name__)

PIPELINE = web.AppKey("pipeline", Pipeline)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_app(
    settings: GatewaySettings,
    router: Router,
    parts: GatewayParts,
    worker: int | None = None,
    metrics_dir: Path | None = None,
    connections: ConnectionCaps | None = None,
) -> web.Application:
    """The gateway application over `router`'s replica set, made of `parts`; `worker` and `metrics_dir`
    when it is one of several worker processes (see cluster/workers.py); `connections`: the listener's
    caps, whose closings the metrics count. The one place that says which
    stage uses which part. Called in the event loop that will serve the app (its clients are made here)."""
    clients = ClientAddresses(settings.trusted_proxies)
    ids = RequestIds(clients)
    metrics = GatewayMetrics(
        router, parts.queue.depths, metrics_dir, parts.budget.spent, settings.metrics_tenant_labels
    )
    parts.auth.on_store_error = metrics.store_errors_keys.inc
    if connections is not None:
        connections.on_close = lambda reason: metrics.connections_closed.labels(reason).inc()
    admin = AdminViews(
        access=parts.access,
        keys=parts.keys,
        usage=parts.usage_store,
        router=router,
        queue_depths=parts.queue.depths,
        cache=parts.cache,
        control=parts.control,
        clients=clients,
        worker=worker,
        body_timeout=settings.body_timeout,
        max_body_bytes=settings.max_body_bytes,
        auth=parts.auth,
        audit=parts.audit,
        sessions=parts.sessions,
        threads=parts.threads,
    )
    app = web.Application(
        middlewares=[_error_boundary(ids, metrics.store_unanswered, admin.refused)],
        client_max_size=settings.max_body_bytes,
    )
    app.on_response_prepare.append(_tell_request_id)
    status = _StatusViews(
        router,
        parts.auth,
        admin,
        time.time(),
        worker,
        parts.adapters,
        parts.cluster_counts,
        open_access=parts.access.open_access,
    )
    engines = EngineClient(settings.connect_timeout, settings.read_timeout, settings.max_upstream_connections)
    session = aiohttp.ClientSession(  # the relay's rare calls that are not its own (tokenizing)
        connector=aiohttp.TCPConnector(
            limit=settings.max_upstream_connections, limit_per_host=0, keepalive_timeout=30
        ),
        auto_decompress=False,
    )
    timeouts = RelayTimeouts(
        connect=settings.connect_timeout, read=settings.read_timeout, stall=settings.stall_timeout
    )
    open_access = parts.access.open_access
    replica_header = settings.routing_headers if settings.routing_headers is not None else open_access
    relay = Relay(engines, session, router, settings.retries, timeouts, replica_header, parts.adapters)
    relay.loader.metrics = metrics
    usage = UsageRecorder(
        parts.usage_store,
        parts.flush_interval,
        parts.max_pending_usage,
        on_written=parts.budget.written,
        metrics=metrics.usage,
    )
    responses = None
    if parts.responses is not None:
        responses = Responses(parts.responses, settings.max_body_bytes, parts.threads)
    pipeline = app[PIPELINE] = Pipeline(
        auth=parts.auth,
        sizing=parts.sizing,
        budget=parts.budget,
        limits=parts.limits,
        cache=parts.cache,
        queue=parts.queue,
        router=router,
        relay=relay,
        usage=usage,
        metrics=metrics,
        failover_modes=parts.failover_modes,
        isolation=TenantIsolation.of(parts.isolated, parts.isolation_secret, open_access),
        max_body_bytes=settings.max_body_bytes,
        body_timeout=settings.body_timeout,
        responses=responses,
    )
    # The generation routes first: aiohttp tries resources in the order they were added. Their handlers
    # are the pipeline's own (no wrapper: every await layer costs each suspension of a request).
    app.router.add_post("/v1/chat/completions", pipeline.chat_completions)
    app.router.add_post("/v1/completions", pipeline.completions)
    app.router.add_post("/v1/embeddings", pipeline.embeddings)
    AgentViews(parts.auth, pipeline, responses).add_routes(app)
    app.router.add_get("/health", status.health)
    app.router.add_get("/ready", status.ready)
    app.router.add_get("/v1/models", status.models)
    app.router.add_get("/v1/models/{model:.+}", status.model)
    app.router.add_get("/corral/status", status.replica_status)
    scraper = _MetricsAccess(parts.access.open_access, settings.metrics_token, admin)

    async def service_discovery(request: web.Request) -> web.Response:
        if not scraper.token_given(request):  # (the scraper's token: Prometheus needs no admin key)
            await admin.check(request)
        return status.service_discovery()

    app.router.add_get("/corral/sd", service_discovery)

    async def metrics_view(request: web.Request) -> web.Response:
        await scraper.check(request)
        return web.Response(body=await metrics.scrape(), content_type="text/plain", charset="utf-8")

    app.router.add_get("/metrics", metrics_view)
    # a closed gateway's document names no models: anyone may read it, and /v1/models answers keys only
    served = router.replicas.models() if parts.access.open_access else None
    document = orjson.dumps(openapi_document(served, NewKey.model_json_schema()))

    async def openapi_view(request: web.Request) -> web.Response:
        return web.Response(body=document, content_type="application/json")

    app.router.add_get("/openapi.json", openapi_view)
    admin.add_routes(app)
    if parts.batches is not None:
        batch_views = BatchViews(
            parts.batches, parts.auth, parts.batch, settings.body_timeout, settings.max_body_bytes
        )
        batch_views.add_routes(app)
    ConsoleViews(metrics, admin).add_routes(app)
    _sign_in(parts, admin, app, clients)
    if settings.cors_origins:
        _allow_browsers(app, settings.cors_origins)

    runner = _batch_runner(parts, router, pipeline, worker)
    if runner is not None:  # a shutdown stops leasing lines at once (those running are handed back)
        app.on_shutdown.append(runner.stop_leasing)
        parts.queue.report_beside(runner.pressure)  # the autoscaler sizes for interactive demand only

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        rebuild = _semantic_cache(parts.cache, relay)
        parts.queue.start()
        batches = asyncio.create_task(runner.run(), name="batch-runner") if runner is not None else None
        retention = _retention(parts, worker)
        usage.start()
        metrics.start()
        try:
            yield
        finally:
            for task in (rebuild, batches, retention):
                if task is not None:
                    task.cancel()
                    try:
                        await task
                    except asyncio.CancelledError:
                        pass
                    except Exception:  # it had failed already: logged; shutdown goes on
                        logger.exception("background task %s had failed", task.get_name())
            await metrics.stop()
            await parts.queue.stop()
            pipeline.close()
            await usage.stop()
            engines.close()
            await session.close()
            await parts.limits.close()
            await parts.budget.close()
            parts.threads.close()  # (after every stage that calls the store on them has stopped)

    app.cleanup_ctx.append(lifecycle)
    return app


def _allow_browsers(app: web.Application, origins: list[str]) -> None:
    """Web pages of `origins` may call the client APIs (`/v1/`) from a browser: preflights answered, the
    answers' headers (x-request-id, rate limits, Retry-After) readable. Keys travel in a header, never in
    cookies, so no credentials are allowed; the admin API and the console stay same-origin only."""
    import aiohttp_cors

    options = aiohttp_cors.ResourceOptions(  # type: ignore[no-untyped-call]
        allow_credentials=False, expose_headers="*", allow_headers="*", max_age=600
    )
    cors = aiohttp_cors.setup(app, defaults=dict.fromkeys(origins, options))
    for route in list(app.router.routes()):
        resource = route.resource
        if route.method != "HEAD" and resource is not None and resource.canonical.startswith("/v1/"):
            cors.add(route)


def _batch_runner(
    parts: GatewayParts, router: Router, pipeline: Pipeline, worker: int | None
) -> BatchRunner | None:
    """Run batch lines here: every worker on its own share of the slots (a worker's router holds its share
    of each replica's), the first one also checking new batches and keeping the queue."""
    if parts.batches is None:
        return None
    return BatchRunner(
        parts.batches,
        pipeline,
        parts.keys,
        router.replicas,
        parts.queue.depths,
        parts.batch,
        parts.adapters,
        manages=worker in (None, 0),
        oidc=parts.auth.oidc,
    )


_RETENTION_S = 3600.0  # how often old usage and audit rows and expired responses are swept (and at start)


def _retention(parts: GatewayParts, worker: int | None) -> asyncio.Task[None] | None:
    """Sweep usage and audit rows past their retention and expired stored responses (one gateway process
    of a machine's workers)."""
    retention = parts.retention
    if retention is None or worker not in (None, 0):
        return None

    async def sweep() -> None:
        while True:
            try:
                usage, audit, responses = await asyncio.to_thread(retention.sweep)
                if usage or audit or responses:
                    logger.info(
                        "retention: deleted %d usage and %d audit records, %d expired responses",
                        usage,
                        audit,
                        responses,
                    )
            except Exception:  # a supervisor loop: logged, tried again next time
                logger.exception("retention: the sweep failed")
            await asyncio.sleep(_RETENTION_S)

    return asyncio.create_task(sweep(), name="retention")


_SWEEP_S = 60.0  # how often the semantic index forgets the vectors of expired or evicted entries


def _semantic_cache(cache: ExactCache | None, relay: Relay) -> asyncio.Task[None] | None:
    """Give the cache its embedder; where a model caches semantically, index the stored entries' vectors
    (a gateway starting beside a shared cache), then sweep out the vectors of entries gone since."""
    if cache is None:
        return None
    cache.embedder = ReplicaEmbedder(relay)

    async def upkeep() -> None:
        if any(p.semantic for p in cache.policies.values()):
            try:
                logger.info("semantic cache: %d stored vectors indexed", await cache.rebuild())
            except Exception:  # (the store's entries are another's to fix: the gateway serves, unindexed)
                logger.exception("semantic cache: indexing the stored vectors failed")
        while True:
            await asyncio.sleep(_SWEEP_S)
            try:
                await cache.sweep()
            except Exception:  # a supervisor loop: logged, and it goes on
                logger.exception("semantic cache: sweeping the index failed")

    return asyncio.create_task(upkeep(), name="semantic-cache-upkeep")


def _error_boundary(
    ids: RequestIds,
    store_unanswered: Callable[[], None],
    refused: Callable[[web.Request, int], Awaitable[None]] | None = None,
) -> Middleware:
    """The one place errors become OpenAI-shaped JSON responses; each request is given its id first.
    (No await layer of its own beyond the handler's: each one costs every suspension of a stream.)
    A NUL in the path or query (`%00`) is refused before any handler reads it: no name or id holds one,
    and PostgreSQL's text refuses it (a 500 where a store lookup met it). `refused` puts such a refusal on
    the audit trail where the route's own refusals go (admin.py)."""

    @web.middleware
    async def boundary(request: web.Request, handler: Handler) -> web.StreamResponse:
        ids.assign(request)
        if "%00" in request.raw_path:  # (path and query; a raw NUL cannot arrive in a request line)
            return await _refuse_nul(request, refused)
        try:
            return await handler(request)
        except Exception as exc:
            return _error_answer(request, exc, store_unanswered)

    return boundary


async def _refuse_nul(
    request: web.Request, refused: Callable[[web.Request, int], Awaitable[None]] | None
) -> web.Response:
    refusal = InvalidRequest("The request's path or query holds a NUL character (%00), which no name holds.")
    if refused is not None:
        await refused(request, refusal.status)
    return _error_response(refusal)


async def _tell_request_id(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["x-request-id"] = request.get(REQUEST_ID) or "-"


def _error_answer(request: web.Request, exc: Exception, store_unanswered: Callable[[], None]) -> web.Response:
    """The OpenAI-shaped answer to what a handler raised (called in its `except`)."""
    if isinstance(exc, APIError):
        return _error_response(exc)
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return _error_response(PayloadTooLarge("The request body is larger than the gateway accepts."))
    if isinstance(exc, web.HTTPNotFound):
        return _error_response(NotFound(f"Unknown path {request.path}."))
    if isinstance(exc, web.HTTPMethodNotAllowed):
        refusal = MethodNotAllowed(
            f"Method {exc.method} is not allowed on {request.path}.",
            headers={"Allow": ", ".join(sorted(exc.allowed_methods))},
        )
        return _error_response(refusal)
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc
        return _error_response(APIError(exc.reason or "HTTP error"), status=exc.status)
    return _error_response(unexpected(request, exc, store_unanswered))


def _error_response(exc: APIError, status: int | None = None) -> web.Response:
    return web.Response(
        body=exc.to_json(),
        status=status or exc.status,
        content_type="application/json",
        headers=exc.headers(),
    )


def _sign_in(parts: GatewayParts, admin: AdminViews, app: web.Application, clients: ClientAddresses) -> None:
    """The console's sign-in through the identity provider, where the spec names one (signin.py)."""
    verifier = parts.auth.oidc
    if verifier is None or parts.sessions is None:

        async def no_sign_in(request: web.Request) -> web.Response:
            return web.json_response({"signed_in": False, "oidc": False})

        app.router.add_get("/console/me", no_sign_in)
        return
    from corral.gateway.signin import SignInViews

    settings = verifier.settings
    held = (parts.access.admin_key or "", verifier.client_secret or "")
    if not any(held):  # (a public client without an admin key: the client id alone is public)
        held = (parts.sessions.signing_secret(), "")
    material = "\0".join((*held, settings.client_id))
    key = hashlib.sha256(b"corral sign-in\0" + material.encode()).digest()
    views = SignInViews(verifier, parts.sessions, key, admin.record, clients, parts.threads)
    views.add_routes(app)
    admin.access.https = views.secure  # (the admin API reads the session cookie under the name sign-in wrote)


_SHARED = ("outstanding", "pending_prefill_tokens", "served", "failures")  # a worker's counts, in order


class _MetricsAccess:
    """Who may read /metrics (it names every tenant, key and model): anyone on an open gateway; on a closed
    one the scraper's `gateway.metrics_token` or the admin key."""

    def __init__(self, open_access: bool, token: str | None, admin: AdminViews) -> None:
        self._open = open_access
        self._token = token.encode() if token else None
        self._admin = admin

    def token_given(self, request: web.Request) -> bool:
        return self._token is not None and bearer_is(request, self._token)

    async def check(self, request: web.Request) -> None:
        if self._open or self._admin.is_admin(request):
            return
        if self.token_given(request):
            return
        actor = await self._admin.access.actor(request)
        if actor is not None and actor.may("metrics:read"):
            return
        raise Unauthorized(
            "/metrics on a closed gateway needs 'Authorization: Bearer <gateway.metrics_token or admin key>'."
        )


class _StatusViews:
    """Read-only views of the replica set. On a closed gateway `/v1/models` needs an API key (and lists the
    models it may use) and `/corral/status` the admin key, or a tenant key, which sees its models' replicas
    without their addresses and processes."""

    # hidden from tenants: the replica's internals and, on a shared replica, what would tell the sizes of
    # other tenants' requests (prompt estimates and max_tokens in flight, prompts awaiting prefill) or how
    # much of their prompts is cached
    _INTERNAL = frozenset(
        {"url", "pid", "node", "gpus", "log_tail", "last_error"}
        | {"outstanding_tokens", "pending_prefill_tokens", "kv_cached_tokens", "kv_evicted_tokens_total"}
        | {"generated_tokens_total", "kv_capacity_tokens", "prefix_cache_hit_rate"}  # (others' output, hits)
    )

    def __init__(
        self,
        router: Router,
        auth: Authenticator,
        admin: AdminViews,
        started_at: float,
        worker: int | None = None,
        adapters: AdapterCatalogue | None = None,
        cluster_counts: Callable[[], Awaitable[dict[str, list[int]]]] | None = None,
        open_access: bool = True,
    ) -> None:
        self._replicas = router.replicas
        self._cluster_counts = cluster_counts
        self._placement = router.adapters
        self._adapters = adapters or AdapterCatalogue()
        self._auth = auth
        self._admin = admin
        self._started_at = started_at
        self._worker = {"worker": {"index": worker, "pid": os.getpid()}} if worker is not None else {}
        self._open = open_access  # (a closed gateway names its models only to those who may see them)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        replicas = self._replicas
        counts = {m: len(replicas.ready(m)) for m in replicas.models()}
        # a model scaled to zero holds its requests while a replica starts: it is ready to take them
        ok = bool(counts) and all(n or m in replicas.on_demand for m, n in counts.items())
        body: dict[str, object] = {"ready": ok}
        if self._open or await self._sees_replicas(request):
            body["models"] = counts  # (on a closed gateway, model names are for those who may see them)
        return web.json_response(body, status=200 if ok else 503)

    async def _sees_replicas(self, request: web.Request) -> bool:
        if "Authorization" not in request.headers:  # (a load balancer's probe: no key to look up)
            return False
        actor = await self._admin.access.actor(request)
        return actor is not None and actor.may("status:read")

    async def models(self, request: web.Request) -> web.Response:
        principal = await self._auth.authenticate(request.headers.get("Authorization"))
        created = int(self._started_at)
        data: list[dict[str, object]] = [
            {"id": m, "object": "model", "created": created, "owned_by": "corral"}
            for m in self._replicas.models()
            if not principal.models or m in principal.models
        ]
        data += [
            {"id": a.name, "object": "model", "created": created, "owned_by": "corral", "parent": a.base}
            for a in self._visible_adapters(principal)
        ]
        return web.json_response({"object": "list", "data": data})

    def _visible_adapters(self, principal: Principal) -> list[Adapter]:
        """The LoRA adapters a key may use: its tenant's (or everyone's) that its model list names."""
        return [
            a
            for a in self._adapters.all()
            if a.allows(principal.tenant) and (not principal.models or a.name in principal.models)
        ]

    async def model(self, request: web.Request) -> web.Response:
        """One model (OpenAI's retrieve); 404 for a model this key may not see."""
        principal = await self._auth.authenticate(request.headers.get("Authorization"))
        name = request.match_info["model"]
        entry: dict[str, object] = {
            "id": name,
            "object": "model",
            "created": int(self._started_at),
            "owned_by": "corral",
        }
        adapter = self._adapters.get(name)
        if adapter is not None and adapter in self._visible_adapters(principal):
            return web.json_response({**entry, "parent": adapter.base})
        if not self._replicas.has_model(name) or (principal.models and name not in principal.models):
            raise ModelNotFound(f"The model '{name}' does not exist on this server.", param="model")
        return web.json_response(entry)

    def service_discovery(self) -> web.Response:
        """Prometheus HTTP service discovery: each replica that exports engine metrics, with its model,
        replica id and engine as labels (the admin's or the scraper's only: it names the replicas'
        addresses)."""
        targets = [
            {
                "targets": [r.url.split("://", 1)[-1].split("/", 1)[0]],
                "labels": {
                    "model": r.model,
                    "replica": r.id,
                    "engine": r.engine,
                    "__metrics_path__": "/metrics",
                },
            }
            for r in self._replicas
            if r.url and r.engine != "external"
        ]
        return web.json_response(targets)

    async def replica_status(self, request: web.Request) -> web.Response:
        actor = await self._admin.access.actor(request)
        if actor is not None and actor.may("status:read"):
            models = self._replicas.models()
            replicas = [{**r.snapshot(), **self._placement.snapshot(r)} for r in self._replicas]
            changes = {"rollouts": self._replicas.rollouts, "events": list(self._replicas.events)}
        else:
            principal = await self._auth.authenticate(request.headers.get("Authorization"))
            models = [m for m in self._replicas.models() if not principal.models or m in principal.models]
            visible = {a.name for a in self._visible_adapters(principal)}
            replicas = [
                {k: v for k, v in r.snapshot().items() if k not in self._INTERNAL}
                | {"adapters": [a for a in self._placement.resident(r) if a in visible]}
                for m in models
                for r in self._replicas.of(m)
            ]
            changes = {}  # rollouts and changes name replicas and reasons: the admin's
        if self._cluster_counts is not None:
            await self._whole_cluster(replicas)
        return web.json_response({"models": models, "replicas": replicas, **changes, **self._worker})

    async def _whole_cluster(self, replicas: list[dict[str, Any]]) -> None:
        """A worker's rows with the cluster's counts (every worker's requests, the whole capacity), not its
        own share; its own if the pool does not answer in time."""
        assert self._cluster_counts is not None
        try:
            counts = await asyncio.wait_for(self._cluster_counts(), 2.0)
        except (TimeoutError, OSError, ValueError):
            return
        for row in replicas:
            found = counts.get(str(row["id"]))
            if found is not None:
                # only what the row shows: a tenant's view has no prompts awaiting prefill (_INTERNAL)
                shared = zip(_SHARED, found[:4], strict=True)
                row.update((k, v) for k, v in shared if k in row)
                row["capacity"] = found[4] or row["capacity"]
