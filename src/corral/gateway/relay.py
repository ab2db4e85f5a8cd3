"""Relay one generation request to a replica and its answer back, with retry before the first byte.

Failures before any byte reached the client (connect refused, connection dropped, a 502 from the engine,
an engine busy: 429/503) are retried on another replica. After the first byte a stream that may fail over
is continued on another replica (continuing.py); else, or when that fails too, the failure cannot be
hidden: the stream ends with an SSE error event and no `[DONE]`, so the client knows the answer is
truncated. A client that goes away closes the upstream connection, which makes the engine stop generating.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import aiohttp
import orjson
from aiohttp import web

from corral.engines.client import AnswerTooLarge, EngineClient, EngineConnectionError, EngineResponse
from corral.gateway.accounting import reserved_usage
from corral.gateway.adapters import (
    AdapterLoader,
    AdapterLoadFailed,
    AdapterRefused,
    Events,
    Renamed,
    body_for,
    unknown_adapter,
)
from corral.gateway.context import RequestContext
from corral.gateway.continuing import Continuer
from corral.gateway.failover import SILENT, StallWatch, Transcript
from corral.gateway.refusals import busy_wait, engine_error, failed_how, unanswered
from corral.gateway.sse import SSEFilter
from corral.protocol import (
    ChatCompletionRequest,
    NoCapacity,
    UpstreamError,
    UpstreamTimeout,
    error_body,
)
from corral.protocol.events import EventTooLarge
from corral.protocol.usage import usage_of_answer
from corral.routing import Replica, Router, RouteRequest
from corral.routing.adapters import AdapterCatalogue

__all__ = ["MAX_ANSWER_BYTES", "SSE_HEADERS", "EventStream", "Relay"]

logger = logging.getLogger(__name__)

_BUSY_STATUS = frozenset({429, 503})  # the engine is full or loading (TGI's 429, vLLM's 503 while it starts)
_SEP = b"\n\n"
# A whole (not streamed) answer's bytes at most: held in memory, it may be copied several times over (a cache,
# tool-call emulation). Generous for real answers (a 4,096-token answer with top-20 logprobs is ~6 MB); n up
# to 128 with logprobs can ask for gigabytes, which a stream relays and this refuses (a fan-out's parts share
# it). An embedding answer is bounded by its request instead (2,048 inputs; 160 MB as floats at 4,096
# dimensions): not counted.
MAX_ANSWER_BYTES = 64 * 1024 * 1024
# A refusal's or an error's body at most (what the gateway reads of it: a message to log, a code to find;
# a validation error may echo a part of the input): an engine that sends more is failing (502), never read
# whole into memory.
MAX_ERROR_BYTES = 1024 * 1024
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


class EventStream(web.StreamResponse):
    """An SSE response whose headers leave with its first event, in one write: the relay and the cache
    write that event right after `prepare`, so sending the headers alone first cost a send and a client
    wake-up per stream. (aiohttp's own whole responses do the same; where an aiohttp lacks the switch, the
    headers go out at once, as before. `write_eof` sends them if no event was written.)"""

    _send_headers_immediately = False


class _Retryable(Exception):
    """The replica failed before the client saw anything; another replica may serve the request."""


class _Busy(_Retryable):
    """The engine said it is busy (429: full, the replica's breaker does not hear of it; 503: loading, or
    broken: it does): another replica may take the request; when none does, the client is told to come
    back (503 with the longest Retry-After an engine asked, 1 to 60 s)."""

    def __init__(self, status: int, wait: float) -> None:
        super().__init__(f"answered {status}")
        self.full = status == 429
        self.wait = wait


class _Refused(_Retryable):
    """The replica refused to load the request's adapter (its files): another replica may load it; the
    replica is not at fault (one tenant's broken adapter must not open its base's breakers)."""


class _Reload(_Retryable):
    """The engine did not know the request's adapter (it restarted, or another gateway worker unloaded it):
    the replica loads it again, and may serve the request after all."""


@dataclass(frozen=True, slots=True)
class RelayTimeouts:
    connect: float
    read: float
    stall: float = 15.0  # silence after a stream's first byte that counts as a failed replica (failover)


class Relay:
    """Sends requests to engines over pooled keep-alive connections (`engines`; `session`, aiohttp's client,
    for the rare calls that are not the relay's own: tokenizing a failed-over stream's text)."""

    def __init__(
        self,
        engines: EngineClient,
        session: aiohttp.ClientSession,
        router: Router,
        retries: int,
        timeouts: RelayTimeouts,
        replica_header: bool = True,
        adapters: AdapterCatalogue | None = None,
    ) -> None:
        """`replica_header`: answers say which replica served them (x-corral-replica); `adapters`: the
        LoRA adapters served (their requests go to their bases' replicas, see adapters.py)."""
        self._engines = engines
        self.adapters = adapters or AdapterCatalogue()
        self.loader = AdapterLoader(engines, router, self.adapters)
        self.replica_header = replica_header
        self._session = session
        self._router = router
        self._retries = retries
        timeout = aiohttp.ClientTimeout(total=None, connect=timeouts.connect, sock_read=timeouts.read)
        self._stall = timeouts.stall
        self._continuer = Continuer(router, engines, self.loader, session, timeout, retries, self._pump)

    async def forward(self, ctx: RequestContext, request: web.Request | None) -> web.StreamResponse:
        """The replica's answer (`request`: the client's, for a stream; None for a batch line)."""
        tried: list[Replica] = []
        failure = "no attempt"
        busy = 0.0  # while every failure was a busy engine's: the longest wait one asked (-1: another failed)
        reloads = 1  # an engine that lost the request's adapter loads it again, once, before it is passed by
        refused = 0  # replicas that refused to load the request's adapter
        free = False  # the next attempt spends no retry budget: the last replica refused the adapter's load
        self._router.retry_budget.on_request()
        for attempt in range(self._retries + 1 + reloads):
            if attempt and not free and not self._router.retry_budget.try_spend():
                failure += " (retry budget exhausted)"
                break
            free = False
            try:
                replica = await self._acquire(ctx, tried)
            except NoCapacity:
                if not tried:
                    raise
                break  # every routable replica has failed this request
            ctx.replica = replica
            succeeded = replica.succeeded
            outcome: bool | None = None
            answered = False
            try:
                response = await self._attempt(replica, ctx, request)
                cut = ctx.replica_failed
                # (a 4xx is the request's refusal: no word on the replica, and no sign it is alive either, or
                # a tenant's cheap invalid requests would keep a replica that fails everyone in routing)
                outcome = None if 400 <= response.status < 500 else response.status < 500 and not cut
                # the engine's 5xx answer, or a stream the engine cut (not one gone silent: a hung engine's)
                # while the replica served others meanwhile (it is alive: the request, its tenant's, is what
                # failed): the breaker hears of it with the tenant
                alive = replica.succeeded != succeeded and not ctx.replica_silent
                answered = (response.status >= 500 and not cut) or (cut and alive)
                return response
            except _Reload as exc:
                outcome, failure = None, str(exc)
                if not reloads:
                    tried.append(replica)
                reloads = 0
            except _Refused as exc:
                # the adapter's trouble (its files), not the replica's: its breaker does not hear of it, and
                # trying the next replica spends no retry budget (one broken adapter would spend it all)
                outcome, failure, busy = None, str(exc), -1.0
                tried.append(replica)
                refused += 1
                free = True
            except _Busy as exc:  # full (429) is no failure of the replica's; loading or broken (503) is
                outcome, failure = None if exc.full else False, str(exc)
                tried.append(replica)
                busy = max(busy, exc.wait) if busy >= 0 else -1.0
                level = logging.DEBUG if exc.full else logging.WARNING
                logger.log(level, "request %s: replica %s %s", ctx.request_id, replica.id, exc)
            except _Retryable as exc:
                outcome, failure, busy = False, str(exc), -1.0
                tried.append(replica)
                # (the engine's address and error, in the cause: the operator's to read, not the client's)
                detail = exc.__cause__ or exc
                logger.warning(
                    "request %s: replica %s failed before its first byte: %s",
                    ctx.request_id,
                    replica.id,
                    detail,
                )
            except UpstreamTimeout as exc:
                # a replica that served others meanwhile is alive: the request was long (a huge prompt, a
                # long answer not streamed), which a tenant can do on purpose to take replicas away
                outcome = False if replica.succeeded == succeeded else None
                logger.warning("request %s: replica %s: %s", ctx.request_id, replica.id, exc.message)
                raise
            finally:  # (its usage: what the engine computed, for the prefix index)
                self._router.release(replica, ctx.route, outcome, ctx.usage if outcome else None, answered)
        raise unanswered(ctx, tried, failure, busy, refused)

    async def _acquire(self, ctx: RequestContext, tried: list[Replica]) -> Replica:
        """A replica for the request, counted as outstanding (NoCapacity: none). With prefill coalescing a
        request whose long prefix that replica is computing now waits for it (then finds it cached); one
        that may no longer serve when the wait ends (drained, removed, its breaker opened meanwhile) is
        released and passed by."""
        passed: list[Replica] = []
        while True:
            replica = self._router.acquire(ctx.route, exclude=[*tried, *passed] if passed else tried)
            shared = self._router.shared_prefill(replica, ctx.route)
            if shared is None:
                return replica
            serves = False
            try:
                ctx.held += await self._router.hold(shared)
                serves = self._router.may_serve(replica, ctx.route)
            finally:  # (cancelled while held, or passed by: released as a request that never went out)
                if not serves:
                    self._router.release(replica, ctx.route, None)
            if serves:
                return replica
            passed.append(replica)

    async def call(self, route: RouteRequest, path: str, body: bytes) -> bytes:
        """A request of the gateway's own (the semantic cache's embeddings): a replica's whole 200 answer,
        tried on another replica when one fails; UpstreamError when none answers."""
        tried: list[Replica] = []
        failure = "no attempt"
        for _ in range(self._retries + 1):
            try:
                replica = self._router.acquire(route, exclude=tried)
            except NoCapacity:
                break
            ok: bool | None = None  # cancelled (the caller's deadline): not the replica's fault
            succeeded = replica.succeeded
            try:
                upstream = await self._engines.post(replica.url, path, body, replica.api_key)
                try:
                    answer = await upstream.read(
                        MAX_ANSWER_BYTES if upstream.status == 200 else MAX_ERROR_BYTES
                    )
                except AnswerTooLarge:
                    if 400 <= upstream.status < 500 and upstream.status != 429:  # (the input's: no blame)
                        raise UpstreamError(f"{route.model} refused the input ({upstream.status})") from None
                    raise
                finally:
                    upstream.release()
                if upstream.status == 200:
                    ok = True
                    return answer
                status, error = engine_error(upstream.status, answer)
                failure = f"engine answered {upstream.status}"
                if upstream.status == 429:  # full (no blame), or its upstream's quota spent (its failure)
                    ok = None if answer.find(b'"insufficient_quota"') < 0 else False
                elif status < 500:  # the input's fault (a text too long): no retry, no blame
                    raise UpstreamError(f"{route.model} refused the input: {error.decode()[:200]}")
                else:
                    ok = False
            except (EngineConnectionError, TimeoutError, AnswerTooLarge) as exc:
                # (a timeout while the replica served others: a long input, not the replica's fault; an
                # answer past its bound: the engine's failure, another replica may answer)
                alive = isinstance(exc, TimeoutError) and replica.succeeded != succeeded
                ok, failure = None if alive else False, f"{type(exc).__name__}: {exc}"
            finally:
                self._router.release(replica, route, ok)
            tried.append(replica)
        raise UpstreamError(f"{route.model} did not answer: {failure}")

    async def _attempt(
        self, replica: Replica, ctx: RequestContext, request: web.Request | None
    ) -> web.StreamResponse:
        body = ctx.upstream_body
        route = ctx.route
        try:
            if route.adapter is not None or replica.adapters:
                await self.loader.ready(replica, route)
                body = body_for(replica, route, body)
            upstream = await self._engines.post(replica.url, ctx.path, body, replica.api_key, ctx.to_engine)
        except TimeoutError as exc:
            raise UpstreamTimeout("The model's replica did not answer in time.") from exc
        except AdapterRefused as exc:
            raise _Refused("refused to load the adapter") from exc
        except (EngineConnectionError, AdapterLoadFailed) as exc:
            raise _Retryable(failed_how(exc)) from exc
        try:
            if upstream.status in _BUSY_STATUS:
                if upstream.status == 429 and (await _refusal(upstream)).find(b'"insufficient_quota"') >= 0:
                    raise _Retryable("answered 429 insufficient_quota (its upstream's quota is spent)")
                raise _Busy(upstream.status, busy_wait(upstream.retry_after))
            if upstream.status == 502:
                raise _Retryable("answered 502")
            if upstream.status == 404 and route.adapter is not None:
                answer = await _refusal(upstream, cut=None)
                if unknown_adapter(route, upstream.status, answer):
                    self.loader.forget(replica, route)
                    raise _Reload("did not know the adapter")
                status, error = engine_error(upstream.status, answer, ctx.request_id)
                return web.Response(body=error, status=status, content_type="application/json")
            if not ctx.stream or upstream.status != 200 or request is None:
                return await self._whole(replica, ctx, upstream)
            return await self._stream(replica, ctx, upstream, request)
        finally:
            upstream.release()

    async def _whole(self, replica: Replica, ctx: RequestContext, upstream: EngineResponse) -> web.Response:
        limit = None if ctx.path == "/v1/embeddings" else MAX_ANSWER_BYTES // max(1, ctx.shares)
        if upstream.status != 200:
            return await self._error(replica, ctx, upstream)
        try:
            body = await upstream.read(limit)
        except AnswerTooLarge as exc:  # (the request's asking, not the replica's fault: not retried)
            logger.warning("request %s: replica %s: %s", ctx.request_id, replica.id, exc)
            ctx.usage = reserved_usage(ctx, whole=True)  # (the engine made it all: charged, not refunded)
            raise UpstreamError(
                f"The model's answer is larger than the {limit:,} bytes the gateway relays whole: ask for it "
                "streamed, or for less of it (n, max_tokens, logprobs).",
                code="answer_too_large",
            ) from exc
        except TimeoutError as exc:
            raise UpstreamTimeout("The model's replica did not finish its answer in time.") from exc
        except EngineConnectionError as exc:
            raise _Retryable(failed_how(exc)) from exc
        if ctx.route.adapter is not None:
            body = Renamed.rename(body, ctx.route.adapter)
        if ctx.path != "/v1/embeddings":  # (the embedding shaper reads its usage: llama.cpp writes it
            ctx.usage = usage_of_answer(body)  # before megabytes of vectors, which this would parse)
        if ctx.emulation is not None and ctx.emulation.active:  # the answer's JSON as tool calls
            body = ctx.emulation.whole(body)
        if replica.engine == "llamacpp" and _TIMINGS in body and not _asks_timings(ctx):
            body = _without_timings(body)
        if replica.features.prefill_echo and (prefill := _continued_prefill(ctx)):
            body = _without_prefill(body, prefill)
        if ctx.written is not None:  # the cache keeps it
            ctx.whole = body
        return self._answer(replica, ctx, 200, body, upstream.content_type)

    async def _error(self, replica: Replica, ctx: RequestContext, upstream: EngineResponse) -> web.Response:
        """An engine's answer other than 200, read up to MAX_ERROR_BYTES: a larger 5xx is the engine failing
        (another replica is tried); a larger 4xx is told by its status alone (the input's fault: a
        validation error may echo megabytes of it)."""
        status, content_type = upstream.status, upstream.content_type
        try:
            body = await upstream.read(MAX_ERROR_BYTES)
        except AnswerTooLarge as exc:
            if status >= 500 or status == 429:
                raise _Retryable(f"answered {status} with a body past {MAX_ERROR_BYTES:,} bytes") from exc
            logger.warning("request %s: replica %s: %s", ctx.request_id, replica.id, exc)
            refused = f"The model's replica refused the request ({status})."
            body = orjson.dumps({"error": {"message": refused}})
        except TimeoutError as exc:
            raise UpstreamTimeout("The model's replica did not finish its answer in time.") from exc
        except EngineConnectionError as exc:
            raise _Retryable(failed_how(exc)) from exc
        if status >= 400:
            status, body = engine_error(status, body, ctx.request_id)
            content_type = "application/json"
        return self._answer(replica, ctx, status, body, content_type)

    def _answer(
        self, replica: Replica, ctx: RequestContext, status: int, body: bytes, content_type: str | None
    ) -> web.Response:
        headers = {"x-corral-replica": replica.id} if self.replica_header else {}
        if ctx.headers:
            headers.update(ctx.headers)
        return web.Response(body=body, status=status, content_type=content_type, headers=headers)

    async def _stream(
        self, replica: Replica, ctx: RequestContext, upstream: EngineResponse, request: web.Request
    ) -> web.StreamResponse:
        sse = SSEFilter(keep_usage=ctx.client_wants_usage)
        emulation = ctx.emulation
        events: Events = emulation.stream(sse) if emulation is not None and emulation.active else sse
        if ctx.route.adapter is not None:  # the engine names the base, or the adapter's revision
            events = Renamed(events, ctx.route.adapter)
        first = b""
        try:
            while not first:  # hold the response until the first whole event: a failure here can retry
                data = await upstream.chunk()
                if not data:
                    raise _Retryable("ended its stream before its first event")
                first = events.feed(data)
        except TimeoutError as exc:
            raise UpstreamTimeout("The model's replica sent no first token in time.") from exc
        except EngineConnectionError as exc:
            raise _Retryable(failed_how(exc)) from exc
        except EventTooLarge as exc:  # (the request's answer, not the replica: not retried, not its fault)
            logger.warning("request %s: replica %s: %s", ctx.request_id, replica.id, exc)
            raise UpstreamError(f"The model's replica sent an event too large to relay: {exc}.") from exc
        finally:  # (left or failed before a first event: an emulated call's events so far, read here)
            if not first:
                ctx.relayed += sse.events

        self._router.prefilled(replica, ctx.route)  # the first token came: the prompt is in its cache
        served_by = {"x-corral-replica": replica.id} if self.replica_header else {}
        headers = {**SSE_HEADERS, **served_by, **ctx.headers}
        exchange = ctx.exchange
        response = exchange.stream_response(headers) if exchange is not None else EventStream(headers=headers)
        transcript = Transcript() if ctx.failover else None
        try:
            await response.prepare(request)
            await response.write(first)
            ctx.first_byte_at = time.monotonic()
            if transcript is not None:
                transcript.add(first)
            if ctx.written is not None:
                ctx.written.append(first)
            problem = await self._pump(upstream, events, response, transcript, ctx.written)
            ctx.complete = problem is None
            if problem is not None:
                ctx.replica_failed = True  # the breaker hears of it, whatever happens to the stream
                ctx.replica_silent = problem == SILENT
                ctx.written = None  # a stream continued elsewhere, or cut, is not kept
            if problem is not None and transcript is not None:
                upstream.close()  # let go of the failed replica before asking another one
                problem = await self._continuer.fail_over(ctx, replica, problem, transcript, response)
            if problem is not None:
                logger.warning("stream from replica %s cut: %s", replica.id, problem)
                message = f"The response was cut short: {problem}."
                await response.write(
                    b"data: " + error_body(message, "upstream_error", "stream_truncated") + _SEP
                )
            ctx.delivered = True
            await response.write_eof()
        except asyncio.CancelledError:  # the client left (aiohttp cancels the handler)
            ctx.delivered = ctx.delivered or events.done  # ... after its `[DONE]`: see below
            raise
        except ConnectionResetError:
            # A client that read its answer to the end may close before the engine ends its stream or the
            # closing chunk is written (the openai client does, once it has `[DONE]`): it got everything,
            # so it did not leave.
            ctx.delivered = ctx.delivered or events.done
            ctx.client_gone = not ctx.delivered
            if not ctx.delivered:
                logger.debug("client went away; closing the upstream stream from %s", replica.id)
        finally:  # (whatever ended the stream, the engine's usage so far is charged)
            if ctx.usage is None:
                ctx.usage = sse.usage
            ctx.relayed += sse.events
        return response

    async def _pump(
        self,
        upstream: EngineResponse,
        events: Events,
        response: web.StreamResponse,
        transcript: Transcript | None,
        written: list[bytes] | None = None,
    ) -> str | None:
        """Copy events until the upstream ends; the reason if it ended badly, else None. A stream that may
        fail over also fails when its replica goes silent for `stall_timeout` (one watchdog timer per
        stream, not one per chunk: a timer per chunk cost more than the rest of the chunk's relaying)."""
        if transcript is None:
            return await self._copy(upstream, events, response, None, written, None)
        watch = StallWatch(self._stall)
        try:
            return await self._copy(upstream, events, response, transcript, written, watch)
        except asyncio.CancelledError:
            if watch.expired and watch.task.uncancel() == 0:  # the watch's doing, and no one else's
                return SILENT
            raise
        finally:
            watch.stop()

    async def _copy(
        self,
        upstream: EngineResponse,
        events: Events,
        response: web.StreamResponse,
        transcript: Transcript | None,
        written: list[bytes] | None,
        watch: StallWatch | None,
    ) -> str | None:
        while True:
            try:
                data = await upstream.chunk()
            except TimeoutError:  # the read timeout (the stall watch cancels the copy from outside)
                return SILENT
            except EngineConnectionError as exc:
                return f"the replica failed mid-stream ({type(exc).__name__})"
            if not data:
                return None if events.done else "the replica closed the stream before it was complete"
            try:
                out = events.feed(data)
            except EventTooLarge as exc:
                return str(exc)
            if out:
                if watch is not None:
                    watch.waiting_since = None  # writing to the client: a slow client is no stall
                await response.write(out)
                if transcript is not None:
                    transcript.add(out)
                if written is not None:
                    written.append(out)
            if watch is not None and (out or watch.waiting_since is None):
                # waiting for the next event from now; bytes that end no event move nothing on (a replica
                # dribbling a byte at a time is as silent as one that sends none)
                watch.waiting_since = watch.loop.time()


async def _refusal(upstream: EngineResponse, cut: bytes | None = b"") -> bytes:
    """A refusal's body, read up to MAX_ERROR_BYTES: `cut` where it did not come whole (None: the
    engine's failure, retried); a larger one is the engine's failure (retried on another replica, else
    502), never read whole."""
    try:
        return await upstream.read(MAX_ERROR_BYTES)
    except AnswerTooLarge as exc:
        raise _Retryable(f"answered {upstream.status} with a body past {MAX_ERROR_BYTES:,} bytes") from exc
    except (TimeoutError, EngineConnectionError) as exc:
        if cut is None:
            raise _Retryable(f"answered {upstream.status}, then failed ({type(exc).__name__})") from exc
        return cut


_TIMINGS = b'"timings"'


def _asks_timings(ctx: RequestContext) -> bool:
    """The client asked llama.cpp for its timings (its own `timings_per_token`)."""
    extra = ctx.body.model_extra or {}
    return extra.get("timings_per_token") is True


def _without_timings(body: bytes) -> bytes:
    """A whole answer without llama.cpp's `timings` object (an engine extension OpenAI's API has not)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    if not isinstance(data, dict) or data.pop("timings", None) is None:
        return body
    return orjson.dumps(data)


def _continued_prefill(ctx: RequestContext) -> str:
    """The text of the chat's final assistant message where the request asks it continued
    (`continue_final_message`: the Messages dialect's prefill), else "". llama.cpp's whole answer begins
    with it (its stream, so asked, does not; vLLM's answer holds only what follows)."""
    body = ctx.body
    if not isinstance(body, ChatCompletionRequest) or body.messages[-1].role != "assistant":
        return ""
    if (body.model_extra or {}).get("continue_final_message") is not True:
        return ""
    content = body.messages[-1].content
    if isinstance(content, list):
        return "".join(str(part.get("text") or "") for part in content if isinstance(part, dict))
    return content or ""


def _without_prefill(body: bytes, prefill: str) -> bytes:
    """A whole chat answer whose messages begin with the continued `prefill`, without it (the answer is
    what follows it, as on every engine and in the stream)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    choices = data.get("choices") if isinstance(data, dict) else None
    for choice in choices if isinstance(choices, list) else ():
        message = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, str) and content.startswith(prefill):
            message["content"] = content[len(prefill) :]
    return orjson.dumps(data)
