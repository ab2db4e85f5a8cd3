"""Continuing a stream cut mid-answer on other replicas: the relay's side of mid-stream failover (what was
sent, and the request that continues it, are failover.py's). Each continuation is a retry, routed on a
record of its own and judged by its replica's breaker as the relay judges a first attempt."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import aiohttp
from aiohttp import web

from corral.engines.client import EngineClient, EngineConnectionError, EngineResponse
from corral.gateway.adapters import (
    AdapterLoader,
    AdapterLoadFailed,
    AdapterRefused,
    Events,
    Renamed,
    body_for,
)
from corral.gateway.context import RequestContext
from corral.gateway.failover import SILENT, Continuation, Sent, Transcript, continuation_body
from corral.protocol import APIError, ChatCompletionRequest, NoCapacity
from corral.routing import Replica, Router, RouteRequest

__all__ = ["Continuer"]

logger = logging.getLogger(__name__)

_DONE_EVENT = b"data: [DONE]\n\n"
# what can go wrong asking another replica to continue a stream (tokenizing, then the POST)
_CONTINUE_FAILURES = (
    EngineConnectionError,
    AdapterLoadFailed,
    aiohttp.ClientError,
    TimeoutError,
    KeyError,
    ValueError,
    TypeError,
    OverflowError,  # (a token id read as Infinity)
    APIError,  # (its adapter removed by an apply meanwhile: ModelNotFound)
)


# copy events from an engine's stream to the client's (the relay's): the problem that ended it, or None
Pump = Callable[[EngineResponse, Events, web.StreamResponse, Transcript | None], Awaitable[str | None]]


class Continuer:
    """Continues cut streams (`fail_over`) through the relay's router, engines and adapter loader, copying
    with the relay's `pump` (`session`: aiohttp's client, for llama.cpp's tokenizer)."""

    def __init__(
        self,
        router: Router,
        engines: EngineClient,
        loader: AdapterLoader,
        session: aiohttp.ClientSession,
        timeout: aiohttp.ClientTimeout,
        retries: int,
        pump: Pump,
    ) -> None:
        self._router, self._engines, self.loader = router, engines, loader
        self._session, self._timeout, self._retries, self._pump = session, timeout, retries, pump

    async def fail_over(
        self,
        ctx: RequestContext,
        failed: Replica,
        problem: str,
        transcript: Transcript,
        response: web.StreamResponse,
    ) -> str | None:
        """Continue a cut stream on other replicas (see failover.py); the last problem if none could. Each
        continuation is a retry (it spends the retry budget) and its replica's breaker hears of it as
        `forward`'s do: a stream it cut counts as its tenant's when it served others meanwhile, a refusal
        (4xx) not at all."""
        tried = [failed]
        for _ in range(max(1, self._retries)):
            sent = transcript.summary()
            if sent.finished:  # the answer was whole; only its end was lost
                await response.write(_DONE_EVENT)
                return None
            if sent.thinking:  # cut in its reasoning, which no engine is asked to continue (failover.py)
                return problem
            if not self._router.retry_budget.try_spend():
                return f"{problem} (retry budget exhausted)"
            # each attempt routed on its own record: the cut replica's is still held (`forward` releases
            # it with its own adapter residence, prefix marks and slots)
            route = replace(
                ctx.route,
                held=1,
                prefill=0,
                inflight=None,
                use=0.0,
                residence=None,
                load_adapter=False,
                trial=False,
            )
            try:
                replica = self._router.acquire(route, exclude=tried)
            except NoCapacity:
                return problem
            logger.warning(
                "stream from %s cut (%s): continuing on %s after %d tokens",
                tried[-1].id,
                problem,
                replica.id,
                sent.tokens,
            )
            tried.append(replica)
            ended = _Ended(None, None, False)  # (cancelled: the client left, no word on the replica)
            try:
                ended = await self._continue(ctx, replica, route, sent, transcript, response, failed)
            finally:
                self._router.release(replica, route, ended.outcome, None, ended.answered)
            if ended.problem is None:
                return None
            problem = ended.problem
        return problem

    async def _continue(
        self,
        ctx: RequestContext,
        replica: Replica,
        route: RouteRequest,
        sent: Sent,
        transcript: Transcript,
        response: web.StreamResponse,
        first: Replica,
    ) -> _Ended:
        succeeded = replica.succeeded
        try:
            token_ids = await self._token_ids(replica, sent) if _by_tokens(ctx) else None
            body = continuation_body(ctx, sent, token_ids, first.features.prefill_echo)
            if route.adapter is not None or replica.adapters:
                await self.loader.ready(replica, route)
                body = body_for(replica, route, body)
            upstream = await self._engines.post(replica.url, ctx.path, body, replica.api_key, ctx.to_engine)
        except _CONTINUE_FAILURES as exc:  # (the log names the replica: the client is told none)
            logger.warning("request %s: continuing on %s failed: %r", ctx.request_id, replica.id, exc)
            failure = f"continuing on another replica failed ({type(exc).__name__})"
            # an adapter it refused, or one removed meanwhile, is no fault of the replica's; nor a timeout
            # while it served others (a long prompt)
            blameless = isinstance(exc, AdapterRefused | APIError) or (
                isinstance(exc, TimeoutError) and replica.succeeded != succeeded
            )
            return _Ended(failure, None if blameless else False, False)
        try:
            if upstream.status != 200:
                return _refused(upstream.status)
            continuation = Continuation(sent, ctx.client_wants_usage)
            events: Events = continuation
            if ctx.route.adapter is not None:  # as the first replica's events: the model the client asked
                events = Renamed(continuation, ctx.route.adapter)
            try:
                problem = await self._pump(upstream, events, response, transcript)
            finally:  # (its events charged with the first replica's where no usage comes)
                ctx.relayed += continuation.events
            if continuation.usage is not None:
                ctx.usage = continuation.usage
            if problem is None:
                return _Ended(None, True, False)
            # cut (not gone silent) while the replica served others: alive, so the request failed (its
            # tenant's, for the breaker), as in `forward`
            alive = replica.succeeded != succeeded and problem != SILENT
            return _Ended(problem, False, alive)
        finally:
            upstream.release()

    async def _token_ids(self, replica: Replica, sent: Sent) -> list[int] | None:
        """The token ids of the pieces sent, from the engine's own tokenizer, in one request: llama.cpp
        tokenizes each string of a `content` list on its own (only when a stream fails over)."""
        async with self._session.post(
            replica.url + "/tokenize", json={"content": list(sent.pieces)}, timeout=self._timeout
        ) as response:
            response.raise_for_status()
            ids = [int(t) for t in (await response.json())["tokens"]]
        # Tokenized one by one, pieces may gain a space prefix (SentencePiece models): use the ids only if
        # they read back as exactly the text sent.
        async with self._session.post(
            replica.url + "/detokenize", json={"tokens": ids}, timeout=self._timeout
        ) as response:
            response.raise_for_status()
            text = (await response.json())["content"]
        return ids if text == sent.text else None


@dataclass(frozen=True, slots=True)
class _Ended:
    """How a continuation ended: its problem (None: the stream is whole), and what its replica's breaker
    hears (`outcome` as `Router.release` takes it; `answered`: a failure perhaps the request's doing)."""

    problem: str | None
    outcome: bool | None
    answered: bool


def _refused(status: int) -> _Ended:
    """A continuation the engine did not take, as `forward` counts the same answer: a 4xx is the request's
    (429: full); a 502 or 503 the replica's; another 5xx the engine's answer to a request it read."""
    problem = f"continuing on another replica was refused with {status}"
    if status < 500:
        return _Ended(problem, None, False)
    return _Ended(problem, False, status not in (502, 503))


def _by_tokens(ctx: RequestContext) -> bool:
    return ctx.features.token_prompts and not isinstance(ctx.body, ChatCompletionRequest)
