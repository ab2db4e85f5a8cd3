"""The data plane's request pipeline, composed in one place:

    authenticate → parse → authorize model → admit (budget, rate limits) → cache → queue → route+relay
    → settle (and keep the answer in the cache)

Each stage is a small function over the RequestContext (parsing is intake.py's); errors are raised as
protocol errors and become OpenAI-shaped responses at the app's one boundary. Whatever happens after
admission, `settle` runs: the reservation is corrected to real usage, and a usage record and metrics are
written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TypeVar

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
from corral.cache import ExactCache
from corral.dialects import DialectStream, Messages, Responses
from corral.dialects.chat import Exchange
from corral.gateway.above import above, check_above, release, reserve_above
from corral.gateway.accounting import APIS, Accounting, reserved_usage
from corral.gateway.bodies import read_body
from corral.gateway.cached import CacheStage
from corral.gateway.clients import REQUEST_ID, trace_context
from corral.gateway.context import RequestContext
from corral.gateway.embeddings import EmbeddingShaper, asks_base64, in_base64
from corral.gateway.fanout import Fanout, in_flight
from corral.gateway.intake import Intake
from corral.gateway.isolation import TenantIsolation
from corral.gateway.metrics import GatewayMetrics
from corral.gateway.refusals import unexpected
from corral.gateway.relay import Relay
from corral.gateway.usage import UsageRecorder
from corral.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    NoCapacity,
    UpstreamError,
)
from corral.routing import Router

__all__ = ["Pipeline", "unexpected"]

logger = logging.getLogger(__name__)

_LIMITS_RETRY_S = 2.0  # Retry-After when the shared limit store is down and the gateway fails closed
_CLIENT_GONE = 499  # recorded for a client that went away before its answer ended (nginx's code)
# Ended with the engine's work and no count of it: the client left, or the engine worked past read_timeout
# (a long answer not streamed). Charged at the reservation: neither is a way around a limit or a budget.
_WORKED_UNCOUNTED = frozenset({_CLIENT_GONE, 504})
_CHAT = "/v1/chat/completions"  # where every dialect's requests go upstream

_Parse = Callable[[web.Request, Principal], Awaitable[RequestContext]]
_Answer = Callable[[RequestContext, Principal, web.Request], Awaitable[web.StreamResponse]]
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_T = TypeVar("_T")
_CHECKED_BEFORE_PARSING = 256 * 1024  # a body this large: its key's limits first (`read`)
# its long prompt counted, its key's check passed at its counting turn: a refusal after is one of its requests
_COUNTED = web.RequestKey("long_prompt_counted", bool)
# its key's check passed before its stored conversation was read: a refusal after is one of its requests
_READ_HISTORY = web.RequestKey("stored_conversation_read", bool)
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
        self._budget = budget
        self._limits = limits
        self._cached = (
            CacheStage(cache, metrics, router.replicas, relay.adapters) if cache is not None else None
        )
        self._queue = queue
        self._router = router
        self._replicas = router.replicas
        self._relay = relay
        self._adapters = relay.adapters  # LoRA adapters: model ids served by their base's replicas
        self._fanout = Fanout(relay.forward, relay.replica_header)
        self._metrics = metrics
        self._record = Accounting(metrics, usage).record  # a finished request's usage row and metrics
        self._isolation = isolation
        self._max_body = max_body_bytes
        self._body_timeout = body_timeout
        self._embeddings = EmbeddingShaper()
        self._intake = Intake(router, relay.adapters, sizing, failover_modes)
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

    def close(self) -> None:
        """The gateway is stopping: no more prompts are counted or answers shaped (those under way end)."""
        self._intake.close()
        self._embeddings.close()

    async def _handle(self, request: web.Request, parse: _Parse, answer: _Answer) -> web.StreamResponse:
        principal = await self._auth.authenticate(request.headers.get("Authorization"))
        ctx = await parse(request, principal)
        return await self._serve(ctx, principal, request, answer)

    async def _dialect(self, request: web.Request, dialect: Dialect) -> web.StreamResponse:
        """A request in another client API: opened into a chat-completions request (a Responses turn's
        conversation resolved from the store), served by the same stages, told back in its dialect. Its
        errors are in the dialect's shape."""
        try:
            principal = await self._auth.authenticate(dialect.credentials(request))
            raw = await self.read(request, principal)
            opened = self._opened(dialect, raw, principal, request)
            ctx = await self.spent_if_refused(principal, raw, request, opened)
            response = await self._serve(ctx, principal, request, self._answer)
            if not isinstance(response, DialectStream):
                assert ctx.exchange is not None  # (set by `_exchange_context`)
                response = await ctx.exchange.whole(response)
            return response
        except APIError as exc:
            return dialect.error_response(exc)
        except Exception as exc:  # in the dialect's shape too (the app's boundary would answer in OpenAI's)
            return dialect.error_response(unexpected(request, exc, self._metrics.store_unanswered))

    async def _opened(
        self, dialect: Dialect, raw: bytes, principal: Principal, request: web.Request
    ) -> RequestContext:
        exchange = await dialect.open(
            raw, principal.tenant, principal.key_id, partial(self._before_history, principal, request)
        )
        return await self._exchange_context(exchange, request.headers.get("x-session-id"), principal, request)

    async def spent_if_refused(
        self, principal: Principal, raw: bytes, request: web.Request, parsing: Awaitable[_T]
    ) -> _T:
        """`parsing`'s result (a context; count_tokens' chat request); a large body it refuses (400, 404), a
        long prompt it refuses once counted (400: past the model's context), or a Responses turn it refuses
        once its stored conversation was read (400 on its own input, 413: megabytes parsed for a request of
        a hundred bytes), is one of the key's requests all the same: its parse (its count) took the event
        loop (a counting thread) as long as a valid one's, and a key's RPM bounds how often (a body that
        fails validation never reached `admit`, which counts requests)."""
        try:
            return await parsing
        except APIError:
            if len(raw) > _CHECKED_BEFORE_PARSING or _worked_on(request):
                await self._spend_request(principal)
            raise

    async def _spend_request(self, principal: Principal) -> None:
        """One of the key's requests spent, no tokens (against its RPM and those of the keys above it;
        nothing where one has no room)."""
        limiter = self._limits.limiter
        for limited in (principal, *above(principal)):
            with contextlib.suppress(APIError, LimiterUnavailable):
                held = await limiter.reserve(limited, 0)
                if held is not None:
                    await limiter.settle(held, 0)

    async def _exchange_context(
        self,
        exchange: Exchange,
        session: str | None,
        principal: Principal,
        request: web.Request | None = None,
    ) -> RequestContext:
        """A dialect's request as the stages see it: its chat-completions body, told back by `exchange`."""
        checked = None if request is None else partial(self._within_limits, principal, request, exchange)
        ctx = await self._intake.generation(
            exchange.chat_body, _CHAT, ChatCompletionRequest, session, principal.tenant, checked
        )
        ctx.exchange = exchange
        exchange.prompt_tokens = ctx.route.prompt_tokens
        return ctx

    async def _serve(
        self, ctx: RequestContext, principal: Principal, request: web.Request, answer: _Answer
    ) -> web.StreamResponse:
        ctx.request_id = request.get(REQUEST_ID)
        ctx.trace = trace_context(request)
        self._isolation.apply(ctx, principal.tenant)
        try:
            principal.check_model(ctx.model)  # (an adapter's tenants: intake.py)
        except APIError as exc:
            self._metrics.of(ctx.model).rejected(exc.code or "forbidden")
            self._record(ctx, principal, exc.status)
            raise
        reservation = await self.admit(ctx, principal, _worked_on(request))
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
            status = 200 if ctx.delivered else _CLIENT_GONE  # (after its whole stream: not gone)
            raise
        finally:
            await self.settle(ctx, principal, reservation, status)

    async def run_line(
        self, principal: Principal, path: str, raw: bytes, request_id: str | None = None
    ) -> tuple[int, bytes]:
        """A batch line through the same stages as a request (parse, authorize, queue at the principal's
        priority, route, relay, settle: usage recorded, under `request_id`: the line's in the output file),
        without rate limits or the cache; never streamed (a /v1/responses line is told back as a response
        object, and stored as its `store` says). (status, body): the answer, or the error a client would
        have got."""
        try:
            if path == "/v1/embeddings":
                ctx = await self._intake.embedding(raw, path, principal.tenant)
            elif path == "/v1/responses" and self._responses is not None:
                exchange = await self._responses.open(raw, principal.tenant, principal.key_id)
                ctx = await self._exchange_context(exchange, None, principal)
            else:
                kind = ChatCompletionRequest if path == "/v1/chat/completions" else CompletionRequest
                ctx = await self._intake.generation(raw, path, kind, None, principal.tenant)
            ctx.request_id = request_id
            principal.check_model(ctx.model)  # (an adapter's tenants: intake.py)
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

    async def _answer(
        self, ctx: RequestContext, principal: Principal, request: web.Request
    ) -> web.StreamResponse:
        """A generation: from the cache where it holds the answer, else from a replica (then kept)."""
        cached = self._cached
        lookup = ctx.lookup = None if cached is None else await cached.look_up(ctx, principal, request)
        if cached is None or lookup is None:
            return await self._generate(ctx, principal, request)
        response = await cached.replay(ctx, lookup, request) if lookup.hit else None
        if response is None:
            response = await self._generate(ctx, principal, request)
            cached.keep(ctx, lookup)
        return response

    async def _embed(
        self, ctx: RequestContext, principal: Principal, request: web.Request | None
    ) -> web.StreamResponse:
        """Embeddings: a replica's vectors (base64 where its engines send it), told the way the client asked
        (see embeddings.py), with every header the relay gave the answer (x-ratelimit-*, x-corral-*)."""
        body = ctx.body
        assert isinstance(body, EmbeddingRequest)
        matryoshka, shaper = ctx.features.matryoshka, self._embeddings
        base = ctx.route.model
        generation = self._replicas.generation.get(base, 0)  # (a redeployment may change the vectors' size)
        shaper.check(body, matryoshka, generation)
        if asks_base64(self._replicas.of(base)):
            ctx.upstream_body = in_base64(ctx.upstream_body)
        response = await self._generate(ctx, principal, request)
        if not isinstance(response, web.Response) or response.status != 200:
            return response
        answer = response.body
        if not isinstance(answer, bytes):
            return response
        estimate = ctx.route.prompt_tokens
        try:
            response.body, ctx.usage = await shaper.answer(answer, body, matryoshka, estimate, generation)
        except UpstreamError:  # (a 502) the engine worked on every input: charged the prompt's estimate
            ctx.usage = {"prompt_tokens": estimate, "total_tokens": estimate}
            raise
        response.content_type = "application/json"
        return response

    async def _generate(
        self, ctx: RequestContext, principal: Principal, request: web.Request | None
    ) -> web.StreamResponse:
        """Wait in the model's queue for a slot, then have a replica (or several: fan-out) answer."""
        metrics = self._metrics.of(ctx.model)
        base = ctx.route.model  # (an adapter's requests wait for its base's replicas)
        try:
            if ctx.fanout:  # (its parts spread over the replicas)
                wait, slots = await self._queue.enter(base, principal, in_flight(ctx), spread=True)
            else:
                wait, slots = await self._queue.enter(base, principal, ctx.route.sequences)
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
            self._queue.done(base, principal.tenant, slots)
        metrics.decided(self._router.policy_for(base).name)
        return response

    async def parse(
        self,
        request: web.Request,
        principal: Principal,
        kind: type[ChatCompletionRequest] | type[CompletionRequest],
    ) -> RequestContext:
        """Read and validate the body; check the model exists; prepare the upstream body and routing info."""
        raw = await self.read(request, principal)
        session = request.headers.get("x-session-id")
        checked = partial(self._within_limits, principal, request, None)
        generation = self._intake.generation(raw, request.path, kind, session, principal.tenant, checked)
        return await self.spent_if_refused(principal, raw, request, generation)

    async def _within_limits(
        self,
        principal: Principal,
        request: web.Request,
        exchange: Exchange | None,
        ctx: RequestContext,
        refused: APIError | None,
    ) -> None:
        """A long prompt's key checked before the prompt is counted (seconds of a tokenizer's time for a
        few MB; `ctx`: its context, the prompt not counted), when it comes and again at its tenant's
        counting turn (others may have taken the room meanwhile): a model it may not use (403), its spent
        monthly budget, its rate limits or those above it (its makers', its adapter's: 429) refuse it, as
        does `refused` (the intake's own refusal), recorded as `_serve` and `admit` record a refusal,
        without the gateway counting for nothing. Nothing is reserved: `admit` reserves once the prompt is
        counted, and a refusal after a check passed at the turn spends one of the key's requests
        (`_COUNTED`: a key cannot have its prompts counted for nothing as often as it likes). A limiter
        that does not answer is left to `admit`."""
        request[_COUNTED] = False
        try:
            if refused is not None:
                raise refused
            principal.check_model(ctx.model)
            await self._budget.check(principal)  # (in admit's order: the budget, then the limits)
            limiter = self._limits.limiter
            with contextlib.suppress(LimiterUnavailable):
                await limiter.check(principal, 1)
                higher = above(principal, ctx.route.adapter)
                if higher:
                    await check_above(limiter, principal, higher)
        except APIError as refusal:
            ctx.exchange, ctx.request_id = exchange, request.get(REQUEST_ID)
            self._metrics.of(ctx.model).rejected(refusal.code or "rate_limited")
            self._record(ctx, principal, refusal.status)
            raise
        request[_COUNTED] = True  # (counted next, where this was its turn's check)

    async def _before_history(self, principal: Principal, request: web.Request) -> None:
        """`_may_ask` before a Responses turn's stored conversation is read: once it lets the store be read,
        the turn is one of the key's requests even if it is refused after (`spent_if_refused`)."""
        await self._may_ask(principal)
        request[_READ_HISTORY] = True

    async def _may_ask(self, principal: Principal) -> None:
        """A key's spent budget or rate limits (or those above it) refuse its request before a stored
        conversation is read for it (megabytes parsed, for a request `admit` would refuse). Nothing is
        reserved: `admit` does."""
        await self._budget.check(principal)
        limiter = self._limits.limiter
        with contextlib.suppress(LimiterUnavailable):
            await limiter.check(principal, 1)
            if principal.parents:
                await check_above(limiter, principal, above(principal))

    async def parse_embeddings(self, request: web.Request, principal: Principal) -> RequestContext:
        """An embedding request: validated, for an embedding model, sized by its inputs' tokens."""
        raw = await self.read(request, principal)
        checked = partial(self._within_limits, principal, request, None)
        embedding = self._intake.embedding(raw, request.path, principal.tenant, checked)
        return await self.spent_if_refused(principal, raw, request, embedding)

    async def count_prompt(self, chat_body: bytes, principal: Principal) -> int:
        """What admission counts for a chat request's prompt (Anthropic's count_tokens), as a request
        under the key's limits (`metered`): a long prompt costs the gateway a second of a core to count."""
        return await self.metered(principal, partial(self._intake.count_prompt, chat_body, principal))

    async def metered(self, principal: Principal, work: Callable[[], Awaitable[_T]]) -> _T:
        """`work` done as a request under the key's limits and those above it (RPM, concurrency; no
        tokens): counting a prompt, reading a stored response (a conversation of megabytes is a second of a
        core to parse)."""
        limiter = self._limits.limiter
        higher: tuple[Reservation, ...] = ()
        try:
            reservation = await limiter.reserve(principal, 0)
            if principal.parents:
                higher = await reserve_above(limiter, principal, above(principal), 0, reservation)
        except LimiterUnavailable as exc:
            self._without_limits(principal, exc)
            reservation = None
        try:
            return await work()
        finally:
            if await release(limiter, (reservation, *higher)):
                raise asyncio.CancelledError

    async def read(self, request: web.Request, principal: Principal) -> bytes:
        """The request's body; a large one's key checked first (`_may_ask`) before it is parsed: parsing
        megabytes of small JSON values holds the event loop for most of a second, which a key over its
        limits must not be able to have the gateway do as often as it sends (any route's body: count_tokens'
        too)."""
        raw = await read_body(request, self._body_timeout, self._max_body)
        if len(raw) > _CHECKED_BEFORE_PARSING:
            try:
                await self._may_ask(principal)
            except APIError as exc:  # (counted by tenant and API: no model is named before the parse)
                self._metrics.tenant(principal.tenant).finished(exc.status, 0, 0)
                self._metrics.api_finished(APIS.get(request.path) or request.path.split("/")[2], exc.status)
                raise
        return raw

    async def admit(
        self, ctx: RequestContext, principal: Principal, counted: bool = False
    ) -> Reservation | None:
        """Reserve the request and its tokens (input estimate + max output) before any work starts.
        `counted`: its long prompt was counted (or its stored conversation read), so a refusal (too large
        for its TPM, over its TPM or its budget) is one of the key's requests all the same."""
        reservation = None
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
                higher = above(principal, ctx.route.adapter)
                if higher:  # (refused there: its own reservation released too)
                    ctx.above_reserved = await reserve_above(
                        limiter, principal, higher, ctx.route.tokens, reservation
                    )
                return reservation
            except LimiterUnavailable as exc:
                if not self._limits.fail_open:
                    self._budget.settle(principal, 0, ctx.budgeted)
                self._without_limits(principal, exc)
                return None
            except BaseException:  # refused, or the client gone (cancelled) meanwhile: nothing ran
                self._budget.settle(principal, 0, ctx.budgeted)
                raise
        except APIError as exc:
            if counted and reservation is None:  # (a reservation made, and settled, was one)
                await self._spend_request(principal)
            self._metrics.of(ctx.model).rejected(exc.code or "rate_limited")
            self._record(ctx, principal, exc.status)
            raise

    def _without_limits(self, principal: Principal, exc: LimiterUnavailable) -> None:
        """The limiter's store did not answer: serve without limits where the spec fails open, else 503."""
        self._metrics.limiter_errors.inc()
        if not self._limits.fail_open:
            raise NoCapacity(
                "Rate limits cannot be checked right now; try again shortly.",
                code="limits_unavailable",
                retry_after=_LIMITS_RETRY_S,
            ) from exc
        logger.warning("serving key %s without its rate limits: %s", principal.key_id, exc)

    async def settle(
        self,
        ctx: RequestContext,
        principal: Principal,
        reservation: Reservation | None,
        status: int,
    ) -> None:
        """Correct the reservation to real usage; record usage and metrics. A cache hit costs its tokens or
        only the request, as the model's `cache.charge` says. All of it happens even if the handler is
        cancelled meanwhile (a client that closes once its answer is whole): the cancellation is raised
        after the budget and the usage row."""
        reached_engine = ctx.replica is not None
        if ctx.usage is None and reached_engine and (status in _WORKED_UNCOUNTED or status < 400):
            # The engine worked and its usage never reached us (a stream cut before its usage chunk, an
            # answer past read_timeout, an engine that reported none or none that reads as counts:
            # protocol/usage.py): charged, and recorded, at its reservation (its prompt's estimate and
            # max_tokens).
            ctx.usage = reserved_usage(ctx)
        usage = ctx.usage or {}
        used = int(usage.get("total_tokens") or 0)
        lookup = ctx.lookup
        if ctx.cached and lookup is not None and lookup.policy.charge == "request":
            used, ctx.charged = 0, False
        cancelled = False
        for held in (reservation, *(ctx.above_reserved or ())):  # (the key's, and those above it)
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
            except asyncio.CancelledError:  # (its settlement was sent: the limiter queues it before waiting)
                cancelled = True
        self._budget.settle(principal, used, ctx.budgeted)
        self._record(ctx, principal, status)
        if cancelled:
            raise asyncio.CancelledError


def _worked_on(request: web.Request) -> bool:
    """The gateway did a large request's work before admitting it (counted its long prompt, read its stored
    conversation) after its key's check let it: a refusal from then on is one of the key's requests."""
    return bool(request.get(_COUNTED, False) or request.get(_READ_HISTORY, False))
