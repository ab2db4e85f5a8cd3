"""The data plane's request pipeline, composed in one place: parse → route → relay → settle.

Authentication, admission, caching and scheduling slot in between parse and relay (see ARCHITECTURE.md);
each stage is a small function over the RequestContext.
"""

from __future__ import annotations

import logging
import time

import orjson
from aiohttp import web

from corral.gateway.context import RequestContext
from corral.gateway.relay import Relay
from corral.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelNotFound,
    PayloadTooLarge,
    parse_body,
)
from corral.routing import Router, RouteRequest

__all__ = ["Pipeline"]

logger = logging.getLogger(__name__)

_DEFAULT_OUTPUT_ESTIMATE = 256  # tokens, when a request sets no max_tokens


class Pipeline:
    """Handles the generation endpoints; one instance per app, built in the app's assembly."""

    def __init__(self, router: Router, relay: Relay, max_body_bytes: int) -> None:
        self._router = router
        self._replicas = router.replicas
        self._relay = relay
        self._max_body = max_body_bytes

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, ChatCompletionRequest)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, CompletionRequest)

    async def _handle(
        self, request: web.Request, kind: type[ChatCompletionRequest] | type[CompletionRequest]
    ) -> web.StreamResponse:
        ctx = await self.parse(request, kind)
        response = await self._relay.forward(ctx, request)
        self.settle(ctx)
        return response

    async def parse(
        self, request: web.Request, kind: type[ChatCompletionRequest] | type[CompletionRequest]
    ) -> RequestContext:
        """Read and validate the body; check the model exists; prepare the upstream body."""
        if request.content_length is not None and request.content_length > self._max_body:
            raise _too_large(self._max_body)
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise _too_large(self._max_body) from exc
        body = parse_body(kind, raw)
        if not self._replicas.has_model(body.model):
            raise ModelNotFound(f"The model '{body.model}' does not exist on this server.", param="model")
        upstream = _with_usage(raw) if body.stream and not body.include_usage else raw
        route = RouteRequest(
            model=body.model,
            tokens=len(raw) // 4 + (body.max_tokens or _DEFAULT_OUTPUT_ESTIMATE),
            session=request.headers.get("x-session-id") or body.user,
        )
        if getattr(self._router.policy_for(body.model), "needs_prompt", False):
            route.prompt = prompt_text(body)
        return RequestContext(
            path=request.path, body=body, upstream_body=upstream, received_at=time.monotonic(), route=route
        )

    @staticmethod
    def settle(ctx: RequestContext) -> None:
        """Account for the finished request (usage recording and metrics arrive with admission)."""
        if ctx.usage is not None and logger.isEnabledFor(logging.DEBUG):
            logger.debug("request on %s used %s", ctx.replica.id if ctx.replica else "-", ctx.usage)


def prompt_text(body: ChatCompletionRequest | CompletionRequest) -> str:
    """The prompt as one string, for prefix-affinity routing."""
    if isinstance(body, ChatCompletionRequest):
        return "\n".join(f"{m.role}:{m.content}" for m in body.messages)
    return body.prompt if isinstance(body.prompt, str) else str(body.prompt)


def _with_usage(raw: bytes) -> bytes:
    """The body asking the engine for a usage chunk, which the relay strips again for the client."""
    data = orjson.loads(raw)
    options = data.get("stream_options") or {}
    data["stream_options"] = {**options, "include_usage": True}
    return orjson.dumps(data)


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"The request body is larger than the limit of {limit} bytes.")
