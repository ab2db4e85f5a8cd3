"""The routes beside the dialects' own generation routes: stored responses (retrieve, delete, cancel,
input items) and Anthropic's count_tokens. Each is its tenant's: another tenant's response is a 404."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from aiohttp import web

from corral.admission import Authenticator
from corral.dialects import Messages, Responses, anthropic_error
from corral.dialects.chat import json_response
from corral.gateway.pipeline import Pipeline
from corral.protocol import APIError, InvalidRequest

__all__ = ["AgentViews"]

logger = logging.getLogger(__name__)


class AgentViews:
    def __init__(self, auth: Authenticator, pipeline: Pipeline, responses: Responses | None) -> None:
        self._auth = auth
        self._pipeline = pipeline  # (bodies are read by it: its bounds, a large one's key checked first)
        self._responses = responses
        self._messages = Messages()

    def add_routes(self, app: web.Application) -> None:
        if self._responses is not None and self._pipeline.responses is not None:
            app.router.add_post("/v1/responses", self._pipeline.responses)
            app.router.add_get("/v1/responses/{id}", self.retrieve)
            app.router.add_delete("/v1/responses/{id}", self.delete)
            app.router.add_post("/v1/responses/{id}/cancel", self.cancel)
            app.router.add_get("/v1/responses/{id}/input_items", self.input_items)
        app.router.add_post("/v1/messages", self._pipeline.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)

    async def _stored(
        self, request: web.Request, action: Callable[..., Awaitable[dict[str, Any]]], *args: Any
    ) -> web.Response:
        """`action(stored responses, the requester's tenant, the route's id, *args)`, answered, as a request
        under the key's limits (a stored conversation of megabytes is most of a second of a core to read)."""
        principal = await self._auth.authenticate(request.headers.get("Authorization"))
        work = partial(action, self._responses, principal.tenant, request.match_info["id"], *args)
        return json_response(await self._pipeline.metered(principal, work))

    async def retrieve(self, request: web.Request) -> web.Response:
        return await self._stored(request, Responses.retrieve)

    async def delete(self, request: web.Request) -> web.Response:
        return await self._stored(request, Responses.delete)

    async def cancel(self, request: web.Request) -> web.Response:
        return await self._stored(request, Responses.cancel)

    async def input_items(self, request: web.Request) -> web.Response:
        order = request.query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidRequest("order must be asc or desc.", param="order")
        try:
            limit = int(request.query.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise InvalidRequest("limit must be an integer from 1 to 100.", param="limit")
        after, before = request.query.get("after"), request.query.get("before")
        return await self._stored(request, Responses.input_items, order, limit, after, before)

    async def count_tokens(self, request: web.Request) -> web.Response:
        """Anthropic's count_tokens: the prompt's tokens as admission counts them (the model's tokenizer
        where the spec names one, else the gateway's estimate)."""
        try:
            principal = await self._auth.authenticate(self._messages.credentials(request))
            raw = await self._pipeline.read(request, principal)  # (a large one checked before parsing)
            # (a large body refused by its parse is one of the key's requests, as on /v1/messages)
            chat = await self._pipeline.spent_if_refused(principal, raw, request, self._count_request(raw))
            tokens = await self._pipeline.count_prompt(chat, principal)  # (a long prompt: in a thread)
        except APIError as exc:
            return anthropic_error(exc)
        except Exception:  # in Anthropic's shape too
            logger.exception("unhandled error on count_tokens")
            return anthropic_error(APIError("The gateway hit an internal error; it has been logged."))
        return json_response({"input_tokens": tokens})

    async def _count_request(self, raw: bytes) -> bytes:
        return self._messages.count_request(raw)
