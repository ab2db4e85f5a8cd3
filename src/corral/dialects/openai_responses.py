"""OpenAI's Responses API (`POST /v1/responses`) as a dialect over chat completions.

A request's `input` (a string, or items: messages, `function_call`s and their `function_call_output`s),
its `instructions`, function `tools`, `tool_choice`, `text.format` and `max_output_tokens` become one chat
completions request; the engine's answer (whole, or streamed) becomes a response object, or the event
sequence OpenAI streams (`response.created` … `response.output_text.delta` …
`response.function_call_arguments.delta` … `response.completed`, each with its `sequence_number`).

Conversation state is the gateway's: with `store` (the default) the response and the whole input that
made it are kept in the store (store/responses.py), tenant-scoped, until they expire; a request naming
`previous_response_id` is resolved from there into the full conversation before it is admitted and
routed, so the next turn may land on any replica or gateway. The stored response is written before its
last event (or its body) leaves, so a client may name it at once.
"""

from __future__ import annotations

import os
import re
import time
from typing import Annotated, Any, Literal, cast

import orjson
from aiohttp import web
from pydantic import Field, StrictBool

from corral.dialects.chat import (
    Answer,
    Checked,
    DialectStream,
    answer_of_completion,
    json_response,
    whole_json,
)
from corral.dialects.responses_input import (
    allowed_tools,
    chat_messages,
    chat_tool_choice,
    chat_tools,
    continues,
    input_items,
    response_format,
)
from corral.dialects.responses_stream import (
    ResponsesEncoder,
    call_item,
    message_item,
    reasoning_item,
    usage_of,
)
from corral.protocol import APIError, InvalidRequest, NotFound, PayloadTooLarge, parse_body
from corral.protocol.types import Body, encode
from corral.store import ResponseStore, StoredResponse, StoreThreads

__all__ = ["Responses", "ResponsesRequest", "check_line"]

# a response's id as this gateway makes them ("resp_" and 128 random bits in hex): another is none of its
# stored responses, answered so without a lookup (a NUL in one reached PostgreSQL: a 500)
_RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")
# Responses fields with no chat-completions counterpart: read here, never sent to the engine.
_OWN_FIELDS = {
    "input",
    "instructions",
    "previous_response_id",
    "store",
    "metadata",
    "text",
    "tools",
    "tool_choice",
    "max_output_tokens",
    "truncation",
    "include",
    "reasoning",
    "background",
    "conversation",
    "prompt",
    "service_tier",
    "max_tool_calls",
    "stream_options",
    "prompt_cache_key",
    "safety_identifier",
    "top_logprobs",
}


class ResponsesRequest(Body):
    model: Annotated[str, Field(min_length=1)]
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    stream: StrictBool = False
    store: StrictBool = True
    background: StrictBool = False
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: Annotated[int, Field(ge=1, lt=2**31)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict[str, Any] | None = None


class Responses:
    """The dialect: a request opened into an exchange; the stored responses' own routes' logic."""

    name = "responses"

    def __init__(
        self, store: ResponseStore, max_body_bytes: int = 4 * 1024 * 1024, threads: StoreThreads | None = None
    ) -> None:
        self._store = store
        self._max_body = max_body_bytes
        self._threads = threads or StoreThreads.default_executor()  # (the request path's own store threads)

    def credentials(self, request: web.Request) -> str | None:
        return request.headers.get("Authorization")

    def error_response(self, exc: APIError) -> web.Response:
        return web.Response(
            body=exc.to_json(), status=exc.status, content_type="application/json", headers=exc.headers()
        )

    async def open(
        self, raw: bytes, tenant: str, key_id: str | None, before_history: Checked | None = None
    ) -> ResponsesExchange:
        """The request opened into an exchange, its earlier turns read from the store (`before_history`
        first: a key that would be refused is refused before megabytes of conversation are parsed)."""
        body = parse_body(ResponsesRequest, raw)
        if body.background:
            raise InvalidRequest(
                "background responses are not served here: send background: false (the default).",
                param="background",
                code="unsupported_parameter",
            )
        if (body.model_extra or {}).get("conversation") is not None:
            raise InvalidRequest(
                "conversation objects are not served here; chain turns with previous_response_id.",
                param="conversation",
                code="unsupported_parameter",
            )
        history: list[dict[str, Any]] = []
        carried = 0  # the earlier turns' bytes, as stored
        if body.previous_response_id is not None:
            if not _RESPONSE_ID.fullmatch(body.previous_response_id):
                raise _previous_not_found(body.previous_response_id)
            if before_history is not None:
                await before_history()
            previous = await self._threads.call(self._store.get, tenant, body.previous_response_id)
            if previous is None:
                raise _previous_not_found(body.previous_response_id)
            output = previous.response.get("output") or []
            history = previous.input_items + [item for item in output if continues(item)]
            carried = previous.size
        token = os.urandom(16).hex()  # the response's id, and its input items' (one random draw a request)
        items = input_items(body.input, token)
        if body.store:  # (stored as sent: what JSON cannot carry, an integer past 64 bits, is a 400 now)
            encode(items)
        exchange = ResponsesExchange(body, history + items, tenant, key_id, self._store, token, self._threads)
        # A conversation is bounded as a request is: the engine's request it makes, and what a response
        # stores of it (every field of every item kept, as the client sent them, to be listed and carried on)
        size = max(len(exchange.chat_body), carried + len(raw) if body.store else 0)
        if size > self._max_body:
            raise PayloadTooLarge(
                f"The conversation is {size:,} bytes with its earlier turns, more than the "
                f"{self._max_body:,} the gateway takes in one request (gateway.max_body_bytes).",
                param="previous_response_id" if history else "input",
            )
        return exchange

    async def retrieve(self, tenant: str, response_id: str) -> dict[str, Any]:
        return (await self._found(tenant, response_id)).response

    async def _found(self, tenant: str, response_id: str) -> StoredResponse:
        """The tenant's stored response by that id (NotFound where it has none)."""
        found = None
        if _RESPONSE_ID.fullmatch(response_id):
            found = await self._threads.call(self._store.get, tenant, response_id)
        if found is None:
            raise _not_found(response_id)
        return found

    async def input_items(
        self,
        tenant: str,
        response_id: str,
        order: str,
        limit: int,
        after: str | None = None,
        before: str | None = None,
    ) -> dict[str, Any]:
        """A page of the response's input items in `order`: those after the item `after` (the SDK's next
        page names the last item of the one before), or before the item `before`, `limit` of them."""
        found = await self._found(tenant, response_id)
        items = found.input_items if order == "asc" else found.input_items[::-1]
        start, end = 0, len(items)
        if after is not None:
            start = _position(items, after, "after") + 1
        if before is not None:
            end = _position(items, before, "before")
        page = items[start:end][:limit] if before is None else items[start:end][-limit:]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": end - start > limit,  # (past the page, away from its cursor)
        }

    async def delete(self, tenant: str, response_id: str) -> dict[str, Any]:
        if not _RESPONSE_ID.fullmatch(response_id) or not await self._threads.call(
            self._store.delete, tenant, response_id
        ):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def cancel(self, tenant: str, response_id: str) -> dict[str, Any]:
        await self.retrieve(tenant, response_id)  # 404 when there is none
        raise InvalidRequest(
            "Only background responses can be cancelled; this one was answered in its request.",
            param="response_id",
            code="not_background",
        )


def check_line(raw: bytes) -> None:
    """A batch line's body checked as a request would be (InvalidRequest naming the field), before the
    batch is accepted; its previous_response_id is resolved when the line runs."""
    body = parse_body(ResponsesRequest, raw)
    ResponsesExchange(body, input_items(body.input, "0"), "", None, cast(ResponseStore, None), "0")


def _position(items: list[dict[str, Any]], item_id: str, param: str) -> int:
    """Where the item `item_id` is in `items` (a page's cursor); a 400 naming `param` where it is not."""
    for at, item in enumerate(items):
        if item.get("id") == item_id:
            return at
    raise InvalidRequest(f"'{param}' names no input item of this response: '{item_id}'.", param=param)


def _not_found(response_id: str) -> APIError:
    return NotFound(f"No response found with id '{response_id[:64]}'.", param="response_id")


def _previous_not_found(response_id: str) -> APIError:
    return InvalidRequest(
        f"Previous response with id '{response_id[:64]}' not found.",
        param="previous_response_id",
        code="previous_response_not_found",
    )


class ResponsesExchange:
    """One /v1/responses request: its chat body, and its answer told as a response (and stored)."""

    api = "responses"

    def __init__(
        self,
        body: ResponsesRequest,
        items: list[dict[str, Any]],
        tenant: str,
        key_id: str | None,
        store: ResponseStore,
        token: str,
        threads: StoreThreads | None = None,
    ) -> None:
        self.body = body
        self.items = items
        self._tenant, self._key_id, self._store = tenant, key_id, store
        self._threads = threads or StoreThreads.default_executor()
        self.id = "resp_" + token
        self._items = 0  # its output items' ids: the response's own, numbered (one random draw a response)
        self.created_at = int(time.time())
        self.chat_body = encode(self._chat())
        self.final: dict[str, Any] | None = None
        self.prompt_tokens = 0
        self._frame: dict[str, Any] | None = None  # the response object's fixed fields (_framed)
        # the response as it starts (a stream's first two events): written here, so that what it echoes of
        # the request and JSON cannot carry (tools, reasoning: an integer past 64 bits) is a 400 now
        self.snapshot = encode(self.response("in_progress", [], None))

    def _chat(self) -> dict[str, Any]:
        body = self.body
        messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + (
            chat_messages(self.items)
        )
        if not messages:
            raise InvalidRequest("input holds no message to answer.", param="input")
        chat: dict[str, Any] = {
            k: v for k, v in (body.model_extra or {}).items() if k not in _OWN_FIELDS
        }  # engine options pass through, as on chat completions
        chat.update(model=body.model, messages=messages, stream=body.stream)
        if body.stream:
            chat["stream_options"] = {"include_usage": True}
        for name in ("temperature", "top_p", "user", "parallel_tool_calls"):
            if getattr(body, name) is not None:
                chat[name] = getattr(body, name)
        if body.max_output_tokens is not None:
            chat["max_tokens"] = body.max_output_tokens
        offered = chat_tools(body.tools or [])
        if isinstance(body.tool_choice, dict) and body.tool_choice.get("type") == "allowed_tools":
            offered = allowed_tools(offered, body.tool_choice)
        if offered:
            chat["tools"] = offered
            if body.tool_choice is not None:
                chat["tool_choice"] = chat_tool_choice(body.tool_choice)
        if body.text and isinstance(body.text.get("format"), dict):
            wanted = response_format(body.text["format"])
            if wanted is not None:
                chat["response_format"] = wanted
        return chat

    # the response object

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        error: dict[str, Any] | None = None,
        incomplete: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        answer = (self._frame or self._framed()).copy()  # (a stream tells it twice or more: made once)
        answer["status"] = status
        answer["error"] = error
        answer["incomplete_details"] = incomplete
        answer["output"] = output
        if usage is not None:  # (absent until the answer ends, as OpenAI's; `user` only where given)
            answer["usage"] = usage_of(usage)
        if self.body.user is not None:
            answer["user"] = self.body.user
        return answer

    def _framed(self) -> dict[str, Any]:
        """The response object's fields, in OpenAI's order; those that change are filled by `response`."""
        body = self.body
        self._frame = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": None,
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": body.model,
            "output": None,
            "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
            "previous_response_id": body.previous_response_id,
            "reasoning": body.reasoning or {"effort": None, "summary": None},
            "store": body.store,
            "temperature": body.temperature,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": [_echoed(tool) for tool in body.tools or []],
            "top_p": body.top_p,
            "truncation": body.truncation or "disabled",
        }
        return self._frame

    def finished(self, answer: Answer, output: list[dict[str, Any]]) -> dict[str, Any]:
        if answer.finish_reason == "length":
            return self.response(
                "incomplete", output, answer.usage, incomplete={"reason": "max_output_tokens"}
            )
        return self.response("completed", output, answer.usage)

    def item_id(self, prefix: str) -> str:
        self._items += 1
        return f"{prefix}_{self.id[5:]}{self._items:x}"

    async def keep(self, response: dict[str, Any]) -> None:
        """Store the response (with `store`), before the client can name it."""
        self.final = response
        if self.body.store:
            await self._threads.call(self._store.put, self._tenant, self._key_id, response, self.items)

    # answers

    def stream_response(self, headers: dict[str, str]) -> DialectStream:
        encoder = ResponsesEncoder(self)
        return DialectStream(encoder, headers, on_end=lambda: self._keep_streamed(encoder))

    async def _keep_streamed(self, encoder: ResponsesEncoder) -> None:
        await self.keep(encoder.closing_response())

    async def whole(self, response: web.StreamResponse) -> web.StreamResponse:
        """A whole chat answer (or an error) as a response object (or the error, unchanged: OpenAI's)."""
        body = response.body if isinstance(response, web.Response) else None
        if not isinstance(body, bytes):
            return response
        headers = {
            k: v for k, v in response.headers.items() if k.lower().startswith(("x-corral-", "x-ratelimit"))
        }
        if response.status != 200:
            return web.Response(
                body=body, status=response.status, content_type="application/json", headers=headers
            )
        answer = answer_of_completion(orjson.loads(body))
        output: list[dict[str, Any]] = []
        if answer.reasoning:
            output.append(reasoning_item(self.item_id("rs"), answer.reasoning, "completed"))
        if answer.text or not answer.calls:
            output.append(message_item(self.item_id("msg"), answer.text, "completed"))
        calls = [call_item(self.item_id("fc"), call, "completed") for call in answer.calls]
        if answer.finish_reason == "length":  # cut by max_output_tokens: arguments not whole JSON are cut
            for call in calls:
                if not whole_json(call["arguments"]):
                    call["status"] = "incomplete"  # (not carried on: an engine reads them as JSON)
        final = self.finished(answer, output + calls)
        await self.keep(final)
        return json_response(final, headers=headers)


def _echoed(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as the response lists it: a function's `strict` and `parameters` always there."""
    if tool.get("type") == "function":
        return {"strict": None, "parameters": None, **tool}
    return tool
