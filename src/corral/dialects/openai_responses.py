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

import asyncio
import os
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
)
from corral.dialects.responses_stream import (
    ResponsesEncoder,
    call_item,
    message_item,
    reasoning_item,
    usage_of,
)
from corral.protocol import APIError, InvalidRequest, NotFound, PayloadTooLarge, parse_body
from corral.protocol.types import Body, encode, parse_part
from corral.store import ResponseStore

__all__ = ["Responses", "ResponsesRequest", "check_line"]

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


class FunctionTool(Body):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


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

    def __init__(self, store: ResponseStore, max_body_bytes: int = 4 * 1024 * 1024) -> None:
        self._store = store
        self._max_body = max_body_bytes

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
            if before_history is not None:
                await before_history()
            previous = await asyncio.to_thread(self._store.get, tenant, body.previous_response_id)
            if previous is None:
                raise InvalidRequest(
                    f"Previous response with id '{body.previous_response_id}' not found.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            output = previous.response.get("output") or []
            history = previous.input_items + [item for item in output if _continues(item)]
            carried = previous.size
        token = os.urandom(16).hex()  # the response's id, and its input items' (one random draw a request)
        items = _input_items(body.input, token)
        if body.store:  # (stored as sent: what JSON cannot carry, an integer past 64 bits, is a 400 now)
            encode(items)
        exchange = ResponsesExchange(body, history + items, tenant, key_id, self._store, token)
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
        found = await asyncio.to_thread(self._store.get, tenant, response_id)
        if found is None:
            raise _not_found(response_id)
        return found.response

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
        found = await asyncio.to_thread(self._store.get, tenant, response_id)
        if found is None:
            raise _not_found(response_id)
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
        if not await asyncio.to_thread(self._store.delete, tenant, response_id):
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
    ResponsesExchange(body, _input_items(body.input, "0"), "", None, cast(ResponseStore, None), "0")


def _position(items: list[dict[str, Any]], item_id: str, param: str) -> int:
    """Where the item `item_id` is in `items` (a page's cursor); a 400 naming `param` where it is not."""
    for at, item in enumerate(items):
        if item.get("id") == item_id:
            return at
    raise InvalidRequest(f"'{param}' names no input item of this response: '{item_id}'.", param=param)


def _not_found(response_id: str) -> APIError:
    return NotFound(f"No response found with id '{response_id}'.", param="response_id")


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
    ) -> None:
        self.body = body
        self.items = items
        self._tenant, self._key_id, self._store = tenant, key_id, store
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
            _messages(self.items)
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
        offered = _chat_tools(body.tools or [])
        if isinstance(body.tool_choice, dict) and body.tool_choice.get("type") == "allowed_tools":
            offered = _allowed(offered, body.tool_choice)
        if offered:
            chat["tools"] = offered
            if body.tool_choice is not None:
                chat["tool_choice"] = _chat_tool_choice(body.tool_choice)
        if body.text and isinstance(body.text.get("format"), dict):
            response_format = _response_format(body.text["format"])
            if response_format is not None:
                chat["response_format"] = response_format
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
            await asyncio.to_thread(self._store.put, self._tenant, self._key_id, response, self.items)

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
        if calls and answer.finish_reason == "length":  # cut by max_output_tokens: its arguments too
            calls[-1]["status"] = "incomplete"  # (not carried on: an engine reads them as JSON)
        final = self.finished(answer, output + calls)
        await self.keep(final)
        return json_response(final, headers=headers)


def _echoed(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as the response lists it: a function's `strict` and `parameters` always there."""
    if tool.get("type") == "function":
        return {"strict": None, "parameters": None, **tool}
    return tool


# the request's input


def _input_items(value: str | list[dict[str, Any]], token: str) -> list[dict[str, Any]]:
    """The request's input as items with ids (a string is one user message)."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    items = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise InvalidRequest(f"input[{i}] must be an object.", param=f"input[{i}]")
        kind = item.get("type") or "message"
        if kind == "message" or (kind is None and "role" in item):
            prefix = "msg_"
        elif kind in ("function_call", "function_call_output", "reasoning"):
            prefix = {"function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}[kind]
        else:
            raise InvalidRequest(
                f"input[{i}] is of type '{kind}', which this server does not take (it takes message, "
                "function_call, function_call_output and reasoning items).",
                param=f"input[{i}].type",
                code="unsupported_input_item",
            )
        normal = {"id": "", **item}  # (an id first, as OpenAI lists items; null or "" is none: made here)
        normal["id"], normal["type"] = item.get("id") or f"{prefix}{token}i{i:x}", kind
        if kind == "message" and isinstance(item.get("content"), str):  # listed as OpenAI lists it
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            normal["content"] = [{"type": part, "text": item["content"]}]
        items.append(normal)
    return items


def _continues(item: dict[str, Any]) -> bool:
    """An earlier output item the next turn's input holds (its message, its calls, its reasoning), unless
    its stream was cut before it ended (a call's arguments would be broken JSON to the engine)."""
    return (
        item.get("type") in ("message", "function_call", "reasoning") and item.get("status") != "incomplete"
    )


def _messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items as chat messages: consecutive function calls become one assistant turn's tool_calls."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequest(
                    f"input[{i}].role must be user, system, developer or assistant.", param=f"input[{i}].role"
                )
            # (a developer turn is a system turn to an engine's chat template)
            role = "system" if role == "developer" else role
            messages.append({"role": role, "content": _content(item.get("content"), i)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id") or item.get("id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # (its text and its calls: one turn)
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _output(item.get("output"), i)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
    return messages


def _output(output: Any, i: int) -> str:
    """A function call's output as a tool message's text: a string, its text parts joined, or (neither)
    its JSON."""
    if isinstance(output, str):
        return output
    if not isinstance(output, list):
        return encode(output).decode()
    text = _content(output, i, "output")
    if not isinstance(text, str):
        raise InvalidRequest(
            f"input[{i}].output holds an image: a tool's output reaches the model as text only here.",
            param=f"input[{i}].output",
            code="unsupported_content",
        )
    return text


def _content(content: Any, i: int, field: str = "content") -> str | list[dict[str, Any]]:
    where = f"input[{i}].{field}"
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of parts.", param=where)
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal"):
            parts.append({"type": "text", "text": str(part.get("text") or part.get("refusal") or "")})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise InvalidRequest(
                    "input_image parts need an image_url (file_id is not served here).", param=where
                )
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise InvalidRequest(
                f"{where} holds a part of type '{kind}', which this server does not take.",
                param=where,
                code="unsupported_content",
            )
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The function tools the model is offered: each function, and those of a `namespace` (Codex groups
    its sub-agent tools so). Hosted tools (web search, file search, code interpreter, ...) are OpenAI's to
    run: the cluster has none, so they are not offered (Codex sends web_search with every request)."""
    offered: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            offered.append(_chat_tool(tool, f"tools[{i}]"))
        elif kind == "namespace" and isinstance(tool.get("tools"), list):
            offered += [_chat_tool(t, f"tools[{i}].tools[{j}]") for j, t in enumerate(tool["tools"])]
        elif not isinstance(kind, str):
            raise InvalidRequest(f"tools[{i}] needs a type.", param=f"tools[{i}].type")
    return offered


def _chat_tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidRequest(f"{where} must be a function tool.", param=f"{where}.type")
    parsed = parse_part(FunctionTool, tool, where)
    function: dict[str, Any] = {"name": parsed.name, "parameters": parsed.parameters or {"type": "object"}}
    if parsed.description is not None:
        function["description"] = parsed.description
    if parsed.strict is not None:
        function["strict"] = parsed.strict
    return {"type": "function", "function": function}


def _allowed(offered: list[dict[str, Any]], choice: dict[str, Any]) -> list[dict[str, Any]]:
    """The offered function tools an `allowed_tools` choice names (its hosted tools: none to run here)."""
    listed = choice.get("tools")
    if not isinstance(listed, list) or not all(isinstance(tool, dict) for tool in listed):
        raise InvalidRequest("tool_choice.tools must be a list of tools.", param="tool_choice.tools")
    names = {str(tool.get("name")) for tool in listed if tool.get("type") == "function"}
    unknown = names - {tool["function"]["name"] for tool in offered}
    if unknown:
        raise InvalidRequest(
            f"tool_choice allows the function '{sorted(unknown)[0]}', which is not among the tools.",
            param="tool_choice",
        )
    return [tool for tool in offered if tool["function"]["name"] in names]


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise InvalidRequest(
                "tool_choice must be auto, none, required or a function.", param="tool_choice"
            )
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice.get("type") == "allowed_tools" and choice.get("mode") in ("auto", "required"):
        return str(choice["mode"])
    raise InvalidRequest(
        f"tool_choice of type '{choice.get('type')}' is not served here: use auto, none, required or "
        "{type: function, name} (the hosted tools are OpenAI's to run).",
        param="tool_choice",
        code="unsupported_tool",
    )


def _response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest(
                "text.format.schema must be a JSON schema object.", param="text.format.schema"
            )
        schema = {"name": fmt.get("name") or "answer", "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            schema["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": schema}
    raise InvalidRequest(
        "text.format.type must be text, json_object or json_schema.", param="text.format.type"
    )
