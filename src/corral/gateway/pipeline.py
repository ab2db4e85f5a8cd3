"""The data plane's request pipeline, composed in one place:

    authenticate → parse → authorize model → admit (budget, rate limits) → cache → queue → route+relay
    → settle (and keep the answer in the cache)

Each stage is a small function over the RequestContext; errors are raised as protocol errors and become
OpenAI-shaped responses at the app's one boundary. Whatever happens after admission, `settle` runs:
the reservation is corrected to real usage, and a usage record and metrics are written.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from functools import partial

import orjson
from aiohttp import web

from corral.admission import (
    Authenticator,
    BudgetTracker,
    FairQueue,
    LimiterUnavailable,
    Principal,
    RateLimits,
    Reservation,
    TokenSizing,
)
from corral.cache import CacheLookup, ExactCache
from corral.dialects import DialectStream, Messages, Responses
from corral.dialects.chat import Exchange
from corral.engines import EngineFeatures
from corral.gateway.bodies import read_body, with_member
from corral.gateway.context import RequestContext
from corral.gateway.embeddings import EmbeddingShaper, upstream_body
from corral.gateway.failover import can_fail_over
from corral.gateway.fanout import Fanout, check_features, needs_fanout
from corral.gateway.isolation import TenantIsolation
from corral.gateway.metrics import GatewayMetrics
from corral.gateway.relay import SSE_HEADERS, EventStream, Relay
from corral.gateway.toolcalls import ToolEmulation, names_tools
from corral.gateway.usage import UsageRecorder
from corral.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    GenerationRequest,
    InvalidRequest,
    ModelNotFound,
    NoCapacity,
    RateLimited,
    parse_body,
)
from corral.routing import Router, RouteRequest
from corral.routing.adapters import Adapter
from corral.store import UsageRecord

__all__ = ["Pipeline"]

logger = logging.getLogger(__name__)

_DEFAULT_OUTPUT_ESTIMATE = 256  # tokens, when a request sets no max_tokens
_LIMITS_RETRY_S = 2.0  # Retry-After when the shared limit store is down and the gateway fails closed
_CLIENT_GONE = 499  # recorded for a client that went away before its answer ended (nginx's code)
_CHAT = "/v1/chat/completions"  # where every dialect's requests go upstream
_APIS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/embeddings": "embeddings"}

_Parse = Callable[[web.Request], Awaitable[RequestContext]]
_Answer = Callable[[RequestContext, Principal, web.Request], Awaitable[web.StreamResponse]]
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Dialect = Responses | Messages


class Pipeline:
    """Handles the generation endpoints; one instance per app, built in the app's assembly with every part
    it uses, each named for its stage."""

    def __init__(
        self,
        *,
        auth: Authenticator,
        sizing: TokenSizing,
        budget: BudgetTracker,
        limits: RateLimits,
        cache: ExactCache | None,
        queue: FairQueue,
        router: Router,
        relay: Relay,
        usage: UsageRecorder,
        metrics: GatewayMetrics,
        failover_modes: dict[str, str],
        isolation: TenantIsolation,
        max_body_bytes: int,
        body_timeout: float = 30.0,
        responses: Responses | None = None,
    ) -> None:
        self._auth = auth
        self._sizing = sizing
        self._budget = budget
        self._limits = limits
        self._cache = cache
        self._queue = queue
        self._router = router
        self._replicas = router.replicas
        self._relay = relay
        self._adapters = relay.adapters  # LoRA adapters: model ids served by their base's replicas
        self._fanout = Fanout(relay.forward, relay.replica_header)
        self._usage = usage
        self._metrics = metrics
        self._failover_modes = failover_modes  # a live apply adds new models' modes
        self._isolation = isolation
        self._max_body = max_body_bytes
        self._body_timeout = body_timeout
        self._embeddings = EmbeddingShaper()
        # The route handlers, made once: the app calls them directly, with no wrapper between.
        self.chat_completions: _Handler = partial(
            self._handle, parse=partial(self.parse, kind=ChatCompletionRequest), answer=self._answer
        )
        self.completions: _Handler = partial(
            self._handle, parse=partial(self.parse, kind=CompletionRequest), answer=self._answer
        )
        self.embeddings: _Handler = partial(self._handle, parse=self.parse_embeddings, answer=self._embed)
        self.messages: _Handler = partial(self._dialect, dialect=Messages())
        self._responses = responses
        self.responses: _Handler | None = (
            partial(self._dialect, dialect=responses) if responses is not None else None
        )

    async def _handle(self, request: web.Request, parse: _Parse, answer: _Answer) -> web.StreamResponse:
        principal = await self._auth.authenticate(request.headers.get("Authorization"))
        ctx = await parse(request)
        return await self._serve(ctx, principal, request, answer)

    async def _dialect(self, request: web.Request, dialect: Dialect) -> web.StreamResponse:
        """A request in another client API: opened into a chat-completions request (a Responses turn's
        conversation resolved from the store), served by the same stages, told back in its dialect. Its
        errors are in the dialect's shape."""
        try:
            principal = await self._auth.authenticate(dialect.credentials(request))
            raw = await self._read(request)
            exchange = await dialect.open(raw, principal.tenant, principal.key_id)
            ctx = self._exchange_context(exchange, request.headers.get("x-session-id"))
            response = await self._serve(ctx, principal, request, self._answer)
            if not isinstance(response, DialectStream):
                response = await exchange.whole(response)
            return response
        except APIError as exc:
            return dialect.error_response(exc)
        except Exception:  # in the dialect's shape too (the app's boundary would answer in OpenAI's)
            logger.exception("unhandled error on %s %s", request.method, request.path)
            return dialect.error_response(APIError("The gateway hit an internal error; it has been logged."))

    def _exchange_context(self, exchange: Exchange, session: str | None) -> RequestContext:
        """A dialect's request as the stages see it: its chat-completions body, told back by `exchange`."""
        ctx = self._context(exchange.chat_body, _CHAT, ChatCompletionRequest, session)
        ctx.exchange = exchange
        exchange.prompt_tokens = ctx.route.prompt_tokens
        return ctx

    async def _serve(
        self, ctx: RequestContext, principal: Principal, request: web.Request, answer: _Answer
    ) -> web.StreamResponse:
        self._isolation.apply(ctx, principal.tenant)
        try:
            self._check_model(ctx, principal)
        except APIError as exc:
            self._metrics.of(ctx.model).rejected(exc.code or "forbidden")
            self._record(ctx, principal, exc.status)
            raise
        reservation = await self.admit(ctx, principal)
        if reservation is not None and reservation.headers:
            ctx.headers.update(reservation.headers)
        status = 500
        try:
            response = await answer(ctx, principal, request)
            status = _CLIENT_GONE if ctx.client_gone else response.status
            return response
        except APIError as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:  # the client disconnected (aiohttp cancels its handler)
            status = _CLIENT_GONE
            raise
        finally:
            await self.settle(ctx, principal, reservation, status)

    async def run_line(self, principal: Principal, path: str, raw: bytes) -> tuple[int, bytes]:
        """A batch line through the same stages as a request (parse, authorize, queue at the principal's
        priority, route, relay, settle: usage recorded), without rate limits or the cache; never streamed
        (a /v1/responses line is told back as a response object, and stored as its `store` says).
        (status, body): the answer, or the error a client would have got."""
        try:
            if path == "/v1/embeddings":
                ctx = self._embedding_context(raw, path)
            elif path == "/v1/responses" and self._responses is not None:
                exchange = await self._responses.open(raw, principal.tenant, principal.key_id)
                ctx = self._exchange_context(exchange, None)
            else:
                kind = ChatCompletionRequest if path == "/v1/chat/completions" else CompletionRequest
                ctx = self._context(raw, path, kind, None)
            self._check_model(ctx, principal)
            self._isolation.apply(ctx, principal.tenant)
            ctx.budgeted = await self._budget.reserve(
                principal,
                ctx.budget_tokens or ctx.route.tokens,
                ctx.route.prompt_tokens,
                ctx.budget_tokens is not None,
            )
        except APIError as exc:
            return exc.status, exc.to_json()
        status = 500
        try:
            if isinstance(ctx.body, EmbeddingRequest):
                response = await self._embed(ctx, principal, None)
            else:
                response = await self._generate(ctx, principal, None)
            status = response.status
            if ctx.exchange is not None:  # a Responses line: its answer is a response object
                response = await ctx.exchange.whole(response)
            body = response.body if isinstance(response, web.Response) else None
            return status, body if isinstance(body, bytes) else b"{}"
        except APIError as exc:
            status = exc.status
            return status, exc.to_json()
        finally:
            await self.settle(ctx, principal, None, status)

    @staticmethod
    def _check_model(ctx: RequestContext, principal: Principal) -> None:
        """The key may use the model id; an adapter kept for other tenants does not exist for it."""
        adapter = ctx.route.adapter
        if adapter is not None and not adapter.allows(principal.tenant):
            raise ModelNotFound(f"The model '{ctx.model}' does not exist on this server.", param="model")
        principal.check_model(ctx.model)

    async def _answer(
        self, ctx: RequestContext, principal: Principal, request: web.Request
    ) -> web.StreamResponse:
        """A generation: from the cache where it holds the answer, else from a replica (then kept)."""
        lookup = ctx.lookup = await self._look_up(ctx, principal, request)
        response = await self._replay(ctx, lookup, request) if lookup and lookup.hit else None
        if response is None:
            response = await self._generate(ctx, principal, request)
            if lookup is not None:
                self._keep(ctx, lookup)
        return response

    async def _embed(
        self, ctx: RequestContext, principal: Principal, request: web.Request | None
    ) -> web.StreamResponse:
        """Embeddings: a replica's float vectors, told the way the client asked (see embeddings.py)."""
        body = ctx.body
        assert isinstance(body, EmbeddingRequest)
        matryoshka = ctx.features.matryoshka
        self._embeddings.check(body, matryoshka)
        response = await self._generate(ctx, principal, request)
        answer = response.body if isinstance(response, web.Response) else None
        if response.status != 200 or not isinstance(answer, bytes):
            return response
        shaped, ctx.usage = self._embeddings.shape(answer, body, matryoshka)
        headers = {k: v for k, v in response.headers.items() if k.lower().startswith("x-corral-")}
        return web.Response(body=shaped, content_type="application/json", headers=headers)

    async def _generate(
        self, ctx: RequestContext, principal: Principal, request: web.Request | None
    ) -> web.StreamResponse:
        """Wait in the model's queue for a slot, then have a replica (or several: fan-out) answer."""
        metrics = self._metrics.of(ctx.model)
        base = ctx.route.model  # (an adapter's requests wait for its base's replicas)
        try:
            wait = await self._queue.enter(base, principal)
        except APIError as exc:
            metrics.rejected(exc.code or "queue")
            raise
        metrics.queue_wait.observe(wait)
        try:
            if ctx.fanout:
                response = await self._fanout.answer(ctx, request)
            else:
                response = await self._relay.forward(ctx, request)
        finally:
            self._queue.done(base, principal.tenant)
        metrics.decided(self._router.policy_for(base).name)
        return response

    async def _look_up(
        self, ctx: RequestContext, principal: Principal, request: web.Request
    ) -> CacheLookup | None:
        """The exact cache's view of the request: None where the model does not cache or the request may
        not be (sampled, several choices fanned out); a miss asks the relay to keep what it writes."""
        cache = self._cache
        if cache is None or not cache.enabled(ctx.model) or ctx.fanout:
            return None
        lookup = await cache.lookup(
            principal.tenant, ctx.model, ctx.path, ctx.upstream_body, request.headers.get("Cache-Control")
        )
        if lookup is None:
            return None
        ctx.headers["x-corral-cache"] = lookup.state
        if lookup.group is not None and lookup.vector is not None and lookup.read:
            result = "hit" if lookup.neighbour and lookup.hit else "explore" if lookup.check else "miss"
            result = "vetoed" if lookup.vetoed else result
            self._metrics.cache_semantic.labels(ctx.model, result).inc()
            if lookup.neighbour is not None:
                ctx.headers["x-corral-cache-similarity"] = f"{lookup.neighbour.similarity:.4f}"
        if lookup.hit is None and lookup.keep:
            ctx.written = []
        return lookup

    async def _replay(
        self, ctx: RequestContext, lookup: CacheLookup, request: web.Request
    ) -> web.StreamResponse | None:
        """Answer from the cache: a stored stream with its own chunking, or either kind made from the
        other; None when the entry cannot be told the way this request asks (then the engine answers)."""
        entry = lookup.hit
        assert entry is not None
        chat = isinstance(ctx.body, ChatCompletionRequest)
        if entry.chat != chat:
            return None
        data = entry.sse(ctx.client_wants_usage) if ctx.stream else entry.whole()
        if data is None:  # stored the other way and cannot be told this way: the engine answers
            lookup.hit = None
            ctx.headers["x-corral-cache"] = "miss"
            ctx.written = [] if lookup.keep else None
            return None
        headers = {**ctx.headers, "x-corral-cache": "hit"}
        ctx.usage, ctx.cached = entry.usage, True
        if ctx.stream:
            exchange, headers = ctx.exchange, {**SSE_HEADERS, **headers}
            response: web.StreamResponse = (
                exchange.stream_response(headers) if exchange is not None else EventStream(headers=headers)
            )
            try:
                await response.prepare(request)
                await response.write(data)
                await response.write_eof()
            except ConnectionResetError:
                ctx.client_gone = True
        else:
            response = web.Response(body=data, content_type="application/json", headers=headers)
        self._metrics.cache_tokens_saved.labels(ctx.model).inc(entry.tokens)
        return response

    def _keep(self, ctx: RequestContext, lookup: CacheLookup) -> None:
        """Keep an answer that ended well (never a truncated stream, an error, or a client that left)."""
        cache = self._cache
        if cache is None or ctx.written is None or ctx.client_gone or self._rolling_out(ctx.route.model):
            return
        chat = isinstance(ctx.body, ChatCompletionRequest)
        if ctx.stream and ctx.complete:
            cache.keep_stream(lookup, ctx.written, chat, ctx.usage)
        elif not ctx.stream and ctx.whole is not None:
            cache.keep_whole(lookup, ctx.whole, chat)

    async def parse(
        self, request: web.Request, kind: type[ChatCompletionRequest] | type[CompletionRequest]
    ) -> RequestContext:
        """Read and validate the body; check the model exists; prepare the upstream body and routing info."""
        raw = await self._read(request)
        return self._context(raw, request.path, kind, request.headers.get("x-session-id"))

    def _context(
        self,
        raw: bytes,
        path: str,
        kind: type[ChatCompletionRequest] | type[CompletionRequest],
        session: str | None,
    ) -> RequestContext:
        body = parse_body(kind, raw)
        adapter = self._adapters.get(body.model)
        base = adapter.base if adapter is not None else body.model
        features = self._features_of(base)
        if features.embeddings:
            raise InvalidRequest(
                f"The model '{body.model}' is an embedding model: it serves /v1/embeddings only.",
                param="model",
                code="model_not_supported",
            )
        check_features(body, features)
        emulation = None
        if not features.tools and isinstance(body, ChatCompletionRequest) and names_tools(body):
            try:  # tool calls its engine cannot make: asked for as JSON
                data = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:  # (pydantic took NaN or Infinity; JSON has neither)
                raise InvalidRequest(f"The body is not strict JSON: {exc}.") from exc
            emulation = ToolEmulation(data)
            raw = emulation.request(data)
        upstream = _with_usage(raw) if body.stream and not body.include_usage else raw
        asked = (
            body.max_completion_tokens if isinstance(body, ChatCompletionRequest) else None
        ) or body.max_tokens
        max_tokens = asked or _DEFAULT_OUTPUT_ESTIMATE
        counter = self._sizing.counters.get(base)
        prompt = prompt_text(body) if counter is not None else ""
        input_tokens = self._input_tokens(body, raw, prompt, base)
        self._check_context(body, base, asked, input_tokens if counter is not None else None)
        prompts = len(body.prompts) if isinstance(body, CompletionRequest) else 1
        route = RouteRequest(
            model=base,
            tokens=input_tokens + max_tokens * body.n * prompts,
            session=session or body.user,
            prompt_tokens=input_tokens * prompts,
            adapter=adapter,
        )
        if getattr(self._router.policy_for(base), "needs_prompt", False):
            route.prompt = prompt or prompt_text(body)
            if adapter is not None:  # engines share no KV blocks across adapters: neither does the index
                route.prompt = f"lora:{adapter.name}\n{route.prompt}"
        context = self._replicas.context_length(base)
        may_generate = max(0, context - input_tokens) if asked is None and context else None
        return RequestContext(
            path=path,
            body=body,
            upstream_body=upstream,
            received_at=time.monotonic(),
            route=route,
            budget_tokens=input_tokens + may_generate * body.n * prompts if may_generate else None,
            features=features,
            fanout=not body.stream and needs_fanout(body, features),
            failover=emulation is None
            and can_fail_over(body, self._failover_modes.get(base, "deterministic"), features.continuation),
            emulation=emulation,
        )

    def _input_tokens(self, body: GenerationRequest, raw: bytes, prompt: str, base: str) -> int:
        """The prompt's tokens: counted where the model names its tokenizer, else estimated by size."""
        counter = self._sizing.counters.get(base)
        if counter is not None:
            return counter.count(prompt or prompt_text(body))
        return int(len(raw) * self._sizing.tokens_per_byte)

    def count_prompt(self, chat_body: bytes, principal: Principal) -> int:
        """What admission counts for a chat request's prompt (Anthropic's count_tokens)."""
        body = parse_body(ChatCompletionRequest, chat_body)
        adapter = self._adapters.get(body.model)
        base = adapter.base if adapter is not None else body.model
        self._features_of(base)  # an unknown model is a 404
        if adapter is not None and not adapter.allows(principal.tenant):
            raise ModelNotFound(f"The model '{body.model}' does not exist on this server.", param="model")
        principal.check_model(body.model)
        return self._input_tokens(body, chat_body, "", base)

    async def parse_embeddings(self, request: web.Request) -> RequestContext:
        """An embedding request: validated, for an embedding model, sized by its inputs' tokens."""
        return self._embedding_context(await self._read(request), request.path)

    def _embedding_context(self, raw: bytes, path: str) -> RequestContext:
        body = parse_body(EmbeddingRequest, raw)
        features = self._features_of(body.model)
        if not features.embeddings:
            raise InvalidRequest(
                f"The model '{body.model}' does not make embeddings; ask one of the cluster's embedding "
                "models (task: embed).",
                param="model",
                code="model_not_supported",
            )
        counter = self._sizing.counters.get(body.model)
        tokens = sum(
            len(item)
            if isinstance(item, list)
            else counter.count(item)
            if counter is not None
            else max(1, int(len(item.encode()) * self._sizing.tokens_per_byte))
            for item in body.inputs
        )
        route = RouteRequest(model=body.model, tokens=tokens, session=body.user, prompt_tokens=tokens)
        return RequestContext(
            path=path,
            body=body,
            upstream_body=upstream_body(raw),
            received_at=time.monotonic(),
            route=route,
            features=features,
        )

    async def _read(self, request: web.Request) -> bytes:
        return await read_body(request, self._body_timeout, self._max_body)

    def _features_of(self, model: str) -> EngineFeatures:
        if not self._replicas.has_model(model):
            raise ModelNotFound(f"The model '{model}' does not exist on this server.", param="model")
        return self._replicas.features(model)

    def _check_context(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        base: str,
        max_tokens: int | None,
        input_tokens: int | None,
    ) -> None:
        """Refuse output (and, where a tokenizer counts it exactly, prompt + output) beyond the context the
        model's replicas hold per sequence: the engine would hold a slot until the read timeout."""
        context = self._replicas.context_length(base)
        if context is None:
            return
        param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
        if max_tokens is not None and max_tokens > context:
            raise InvalidRequest(
                f"{param} is too large: {max_tokens}. The model '{body.model}' holds at most {context} "
                "tokens per request (prompt and output together).",
                param=param,
                code="context_length_exceeded",
            )
        if input_tokens is not None and input_tokens + (max_tokens or 0) > context:
            raise InvalidRequest(
                f"This request needs {input_tokens + (max_tokens or 0)} tokens ({input_tokens} in the prompt"
                f"{f', {max_tokens} of output' if max_tokens else ''}), more than the {context} the model "
                f"'{body.model}' holds per request. Shorten the prompt or lower {param}.",
                param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                code="context_length_exceeded",
            )

    async def admit(self, ctx: RequestContext, principal: Principal) -> Reservation | None:
        """Reserve the request and its tokens (input estimate + max output) before any work starts."""
        try:
            ctx.budgeted = await self._budget.reserve(
                principal,
                ctx.budget_tokens or ctx.route.tokens,
                ctx.route.prompt_tokens,
                ctx.budget_tokens is not None,
            )
            limiter = ctx.limiter = self._limits.limiter  # settled by the same, even if replaced live
            try:
                reservation = await limiter.reserve(principal, ctx.route.tokens)
                adapter = ctx.route.adapter
                if adapter is not None and (adapter.rpm or adapter.tpm):
                    try:
                        ctx.adapter_reserved = await limiter.reserve(
                            _adapter_principal(adapter), ctx.route.tokens
                        )
                    except RateLimited as exc:
                        if reservation is not None:
                            await limiter.settle(reservation, 0)
                        raise RateLimited(
                            exc.message.replace("for this key", f"for the model '{adapter.name}'"),
                            code=exc.code,
                            retry_after=exc.retry_after,
                            headers=exc.extra_headers,
                        ) from None
                return reservation
            except APIError:
                self._budget.settle(principal, 0, ctx.budgeted)  # refused: nothing ran
                raise
            except LimiterUnavailable as exc:
                self._metrics.limiter_errors.inc()
                if self._limits.fail_open:
                    logger.warning("serving key %s without its rate limits: %s", principal.key_id, exc)
                    return None
                self._budget.settle(principal, 0, ctx.budgeted)
                raise NoCapacity(
                    "Rate limits cannot be checked right now; try again shortly.",
                    code="limits_unavailable",
                    retry_after=_LIMITS_RETRY_S,
                ) from exc
        except APIError as exc:
            self._metrics.of(ctx.model).rejected(exc.code or "rate_limited")
            self._record(ctx, principal, exc.status)
            raise

    def _rolling_out(self, model: str) -> bool:
        """A rollout of the model is under way: either revision may have answered (not kept)."""
        state = self._replicas.rollouts.get(model)
        return state is not None and state.get("phase") not in ("completed", "rolled_back")

    async def settle(
        self,
        ctx: RequestContext,
        principal: Principal,
        reservation: Reservation | None,
        status: int,
    ) -> None:
        """Correct the reservation to real usage; record usage and metrics. A cache hit costs its tokens or
        only the request, as the model's `cache.charge` says."""
        reached_engine = ctx.replica is not None
        if ctx.usage is None and reached_engine and status == _CLIENT_GONE:
            # The client left before the engine's usage reached us (a stream cut before its usage chunk):
            # it is charged, and recorded, at its reservation (its prompt's estimate and max_tokens).
            ctx.usage = _reserved_usage(ctx)
        usage = ctx.usage or {}
        used = int(usage.get("total_tokens") or 0)
        lookup = ctx.lookup
        if ctx.cached and lookup is not None and lookup.policy.charge == "request":
            used, ctx.charged = 0, False
        for held in (reservation, ctx.adapter_reserved):
            if held is None:
                continue
            # Tokens the engine reported; when it reported none but worked on the request, the
            # reservation stands: nothing is refunded for leaving early.
            kept = held.tokens if reached_engine and status < 500 else 0
            actual = used if used or ctx.cached else kept
            try:
                await (ctx.limiter or self._limits.limiter).settle(held, actual)
            except LimiterUnavailable as exc:  # a Redis hiccup must not turn a served answer into an error
                self._metrics.limiter_errors.inc()
                logger.warning("settling the rate-limit reservation of key %s failed: %s", held.key_id, exc)
        self._budget.settle(principal, used, ctx.budgeted)
        self._record(ctx, principal, status)

    def _record(self, ctx: RequestContext, principal: Principal, status: int) -> None:
        usage = ctx.usage or {}
        now = time.monotonic()
        latency = now - ctx.received_at
        ttft = ctx.first_byte_at - ctx.received_at if ctx.first_byte_at is not None else None
        input_tokens = int(usage.get("prompt_tokens") or 0)
        output_tokens = int(usage.get("completion_tokens") or 0)
        model = ctx.model
        m = self._metrics.of(model)
        m.finished(status, latency)
        state = ctx.headers.get("x-corral-cache")
        if state is not None:
            self._metrics.cache_lookups.labels(
                model, self._metrics.tenant_label(principal.tenant), state
            ).inc()
        if ctx.cached:  # no engine tokens; usage keeps what the hit was charged, under replica "cache"
            charged = ctx.charged
            input_tokens, output_tokens = (input_tokens, output_tokens) if charged else (0, 0)
            ttft = None  # a hit's sub-millisecond answer says nothing of the engines (SLO alerts)
        self._metrics.tenant(principal.tenant).finished(status, input_tokens, output_tokens)
        api = ctx.exchange.api if ctx.exchange is not None else _APIS.get(ctx.path, "chat")
        self._metrics.api_finished(api, status)
        if status < 400 and not ctx.cached:
            m.input_tokens.inc(input_tokens)
            m.output_tokens.inc(output_tokens)
        if ctx.held:
            m.prefill_holds.inc()
            m.prefill_hold_seconds.inc(ctx.held)
        if ttft is not None:
            m.ttft.observe(ttft)
            if output_tokens > 1:
                m.itl.observe((latency - ttft) / (output_tokens - 1))
        self._usage.record(
            UsageRecord(
                at=datetime.now(UTC),
                key_id=principal.key_id,
                tenant=principal.tenant,
                model=model,
                input_tokens=input_tokens,
                output_tokens=output_tokens,
                ttft_ms=round(ttft * 1000, 2) if ttft is not None else None,
                latency_ms=round(latency * 1000, 2),
                status=status,
                replica="cache" if ctx.cached else (ctx.replica.id if ctx.replica else None),
                api=api,
            )
        )


def _adapter_principal(adapter: Adapter) -> Principal:
    """The limits an adapter has over all keys, as the limiter keeps a key's (its own window)."""
    return Principal(key_id=f"adapter:{adapter.name}", tenant="", rpm=adapter.rpm, tpm=adapter.tpm)


def _reserved_usage(ctx: RequestContext) -> dict[str, int]:
    """The usage a request reserved at admission: its prompt's estimate and the most output it asked for."""
    prompt = ctx.route.prompt_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": ctx.route.tokens - prompt,
        "total_tokens": ctx.route.tokens,
    }


def prompt_text(body: ChatCompletionRequest | CompletionRequest) -> str:
    """The prompt as one string, for prefix-affinity routing and for counting: a chat's turns, their tool
    calls, and the tools it offers (the engine's template renders all of them into the prompt)."""
    if isinstance(body, ChatCompletionRequest):
        turns = "\n".join(
            f"{m.role}:{m.content}"
            + (
                _json_text(m.model_extra["tool_calls"])
                if m.model_extra and "tool_calls" in m.model_extra
                else ""
            )
            for m in body.messages
        )
        tools = (body.model_extra or {}).get("tools")
        return turns + _json_text(tools) if tools else turns
    return body.prompt if isinstance(body.prompt, str) else str(body.prompt)


def _json_text(value: object) -> str:
    try:
        return "\n" + orjson.dumps(value).decode()
    except TypeError:  # (nested past orjson's depth: counted by its text instead)
        return "\n" + str(value)


_ASK_USAGE = b',"stream_options":{"include_usage":true}'


def _with_usage(raw: bytes) -> bytes:
    """The body asking the engine for a usage chunk, which the relay strips again for the client (the
    member appended to the bytes as they are where the body names no `stream_options`)."""
    return with_member(raw, "stream_options", {"include_usage": True}, _ASK_USAGE, merge=True)
