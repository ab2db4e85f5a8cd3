"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as a dialect over chat
completions.

`system`, the turns' text, image, `tool_use` and `tool_result` blocks, `tools` (`input_schema`),
`tool_choice` (auto, any, tool, none), `stop_sequences`, `max_tokens`, `temperature`, `top_p` and `top_k`
become one chat completions request; the answer becomes a message (`content` blocks, `stop_reason`,
`usage`) or Anthropic's stream (`message_start`, `content_block_start`/`_delta`/`_stop`, `message_delta`,
`message_stop`). Keys come as `x-api-key` (Anthropic's clients) or as a Bearer token; errors are in
Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, with its status codes (an
overloaded cluster is 529).
"""

from __future__ import annotations

import os
from collections import deque
from typing import Annotated, Any, Literal

import orjson
from aiohttp import web
from pydantic import Field, StrictBool

from corral.dialects.chat import (
    Answer,
    Checked,
    DialectStream,
    Encoder,
    ToolCall,
    answer_of_completion,
    error_of_body,
    json_response,
    not_shown,
    sse,
    whole_json,
)
from corral.protocol import APIError, InvalidRequest, parse_body
from corral.protocol.types import Body, encode, parse_part

__all__ = ["Messages", "MessagesRequest", "anthropic_error"]

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors)
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use"}


class Message(Body):
    role: Literal["user", "assistant", "system"]  # (Claude Code sends system turns among the messages)
    content: str | list[dict[str, Any]]


class Tool(Body):
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    input_schema: dict[str, Any]


class MessagesRequest(Body):
    model: Annotated[str, Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, lt=2**31)]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=16)] | None = None
    stream: StrictBool = False
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=1)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class CountRequest(Body):
    model: Annotated[str, Field(min_length=1)]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None


def anthropic_error(exc: APIError) -> web.Response:
    return _error(exc.status, exc.message, exc.headers())


def _error(status: int, message: str, headers: dict[str, str]) -> web.Response:
    """An error in Anthropic's shape: its type by status; an overloaded cluster (503) is Anthropic's 529."""
    status = 529 if status == 503 else status
    kind = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return json_response({"type": "error", "error": {"type": kind, "message": message}}, status, headers)


class Messages:
    """The dialect: a request opened into an exchange."""

    name = "messages"

    def credentials(self, request: web.Request) -> str | None:
        key = request.headers.get("x-api-key")
        return f"Bearer {key}" if key else request.headers.get("Authorization")  # (an empty one: not given)

    def error_response(self, exc: APIError) -> web.Response:
        return anthropic_error(exc)

    async def open(
        self, raw: bytes, tenant: str, key_id: str | None, before_history: Checked | None = None
    ) -> MessagesExchange:
        """The request opened into an exchange (`before_history`: unused, a message carries its history)."""
        return MessagesExchange(parse_body(MessagesRequest, raw))

    def count_request(self, raw: bytes) -> bytes:
        """A count_tokens request as the chat request whose prompt admission would count."""
        body = parse_body(CountRequest, raw)
        chat: dict[str, Any] = {"model": body.model, "messages": _chat_messages(body.system, body.messages)}
        if body.tools:
            chat["tools"] = [_chat_tool(t, i) for i, t in enumerate(body.tools)]
        return encode(chat)


class MessagesExchange:
    api = "messages"

    def __init__(self, body: MessagesRequest) -> None:
        self.body = body
        self.id = "msg_" + os.urandom(16).hex()
        self.chat_body = encode(self._chat())
        self.prompt_tokens = (
            0  # the gateway's estimate, said in message_start (the engine's comes at the end)
        )

    def _chat(self) -> dict[str, Any]:
        body = self.body
        messages = _chat_messages(body.system, body.messages)
        chat: dict[str, Any] = dict(  # (Anthropic's other fields, such as thinking, are not the engine's)
            model=body.model, messages=messages, max_tokens=body.max_tokens, stream=body.stream
        )
        last = messages[-1] if messages else {}
        if last.get("role") == "assistant" and "tool_calls" not in last:
            # a prefill: the answer goes on from the assistant's text, as Anthropic's does (vLLM when asked
            # so; llama.cpp continues a final assistant message by itself, and asked so does not stream it
            # back first, as Anthropic's does not; gateway/failover.py reads the text sent accordingly)
            chat["continue_final_message"] = True
            chat["add_generation_prompt"] = False
        if body.stream:
            chat["stream_options"] = {"include_usage": True}
        if body.stop_sequences:
            chat["stop"] = body.stop_sequences
        for name in ("temperature", "top_p", "top_k"):
            if getattr(body, name) is not None:
                chat[name] = getattr(body, name)
        if body.metadata and isinstance(body.metadata.get("user_id"), str):
            chat["user"] = body.metadata["user_id"]
        if body.tools:
            chat["tools"] = [_chat_tool(t, i) for i, t in enumerate(body.tools)]
        if body.tool_choice is not None:
            choice, parallel = _chat_tool_choice(body.tool_choice)
            chat["tool_choice"] = choice
            if parallel is not None:
                chat["parallel_tool_calls"] = parallel
        return chat

    def message(self, answer: Answer, content: list[dict[str, Any]]) -> dict[str, Any]:
        stop_reason, stop_sequence = self._stop(answer)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.body.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": _usage(answer.usage),
        }

    def _stop(self, answer: Answer) -> tuple[str | None, str | None]:
        reason = answer.finish_reason
        if reason == "length":  # (a call cut short too: its input is not whole)
            return "max_tokens", None
        if answer.calls:
            return "tool_use", None
        if reason == "stop" and answer.stop_reason and answer.stop_reason in (self.body.stop_sequences or []):
            return "stop_sequence", answer.stop_reason
        if reason == "stop" and self.body.stop_sequences and not answer.stop_reason:
            # the engine did not say which stop ended it: one whose text is not in the answer did
            return "end_turn", None
        return _STOP.get(reason or "stop", "end_turn"), None

    def stream_response(self, headers: dict[str, str]) -> DialectStream:
        return DialectStream(MessagesEncoder(self), headers)

    async def whole(self, response: web.StreamResponse) -> web.StreamResponse:
        body = response.body if isinstance(response, web.Response) else None
        if not isinstance(body, bytes):
            return response
        headers = {
            k: v for k, v in response.headers.items() if k.lower().startswith(("x-corral-", "retry-after"))
        }
        if response.status != 200:
            return _error(response.status, error_of_body(body)[0], headers)
        answer = answer_of_completion(orjson.loads(body))
        content: list[dict[str, Any]] = []
        if answer.reasoning:
            content.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
        if answer.text or not answer.calls:
            content.append({"type": "text", "text": answer.text})
        content += [_tool_use(call) for call in answer.calls]
        return json_response(self.message(answer, content), headers=headers)


class MessagesEncoder(Encoder):
    """Anthropic's stream events (the common ones written from bytes: they are most of a stream's work)."""

    def __init__(self, exchange: MessagesExchange) -> None:
        self.exchange = exchange
        self.answer = Answer()
        self._index = -1
        self._open: str | None = None  # the open block's kind: text, thinking, tool_use
        self._text_event = b""  # the open text block's delta event, its text to fill
        self._call: ToolCall | None = None  # the call whose block is open
        # calls begun while another's block was open (blocks cannot interleave; an engine's parallel calls'
        # deltas may): each opens once the open call's arguments are whole JSON and another call's turn
        # comes, or is told whole once the open block closes for good
        self._held: deque[ToolCall] = deque()
        # text and thinking that came while a call's arguments were not whole or calls waited (a block
        # closed is closed for good: the calls' later arguments would be lost), told after the calls
        self._late: list[tuple[str, str]] = []
        self._unwhole = ("", -1)  # (call id, arguments' length) last read as not whole JSON

    def start(self) -> bytes:
        exchange = self.exchange
        message: dict[str, Any] = {
            "id": exchange.id,
            "type": "message",
            "role": "assistant",
            "model": exchange.body.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": exchange.prompt_tokens, "output_tokens": 1},
        }
        return sse("message_start", {"type": "message_start", "message": message}) + _PING

    def _block(self, kind: str, block: bytes) -> bytes:
        """Open a content block (`block`: its JSON), the open one closed first."""
        return self._close() + self._start(kind, block)

    def _start(self, kind: str, block: bytes) -> bytes:
        self._index += 1
        self._open = kind
        return (
            b'event: content_block_start\ndata: {"type":"content_block_start","index":'
            + str(self._index).encode()
            + b',"content_block":'
            + block
            + b"}\n\n"
        )

    def _delta(self, delta: bytes) -> bytes:
        return (
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":'
            + str(self._index).encode()
            + b',"delta":'
            + delta
            + b"}\n\n"
        )

    def _close(self) -> bytes:
        """Close the open block for good: the calls held behind it follow, each told whole."""
        out = self._end_block()
        while self._held:
            out += self._open_call(self._held.popleft()) + self._end_block()
        return out

    def _end_block(self) -> bytes:
        if self._open is None:
            return b""
        out = self._delta(b'{"type":"signature_delta","signature":""}') if self._open == "thinking" else b""
        self._open = self._call = None
        return (
            out
            + b'event: content_block_stop\ndata: {"type":"content_block_stop","index":'
            + str(self._index).encode()
            + b"}\n\n"
        )

    def _open_call(self, call: ToolCall) -> bytes:
        """A call's block opened, with its arguments so far as one delta."""
        block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
        out = self._start("tool_use", orjson.dumps(block))
        self._call = call
        return out + (self._input(call.arguments) if call.arguments else b"")

    def _input(self, delta: str) -> bytes:
        return self._delta(b'{"type":"input_json_delta","partial_json":' + orjson.dumps(delta) + b"}")

    def _turn(self) -> bytes:
        """Another call's turn: while the open call's arguments are whole, it closes and the first held
        call opens (a delta for it since is told in its block, live)."""
        out = b""
        while self._held and self._open_call_whole():
            out += self._end_block() + self._open_call(self._held.popleft())
        return out

    def _open_call_whole(self) -> bool:
        """Whether the open call's arguments are whole JSON (read only where they may be: ending with a
        closing bracket, and grown since last read)."""
        call = self._call
        if call is None:
            return False
        arguments = call.arguments
        if self._unwhole == (call.id, len(arguments)) or arguments.rstrip()[-1:] not in ("}", "]"):
            return False
        if whole_json(arguments):
            return True
        self._unwhole = (call.id, len(arguments))
        return False

    def _later(self, kind: str, delta: str) -> bool:
        """Keep a text or thinking delta to tell after the calls, where telling it now would close a call
        whose arguments are still coming (or calls waiting behind it)."""
        if not self._late and not (self._open == "tool_use" and (self._held or not self._open_call_whole())):
            return False
        if self._late and self._late[-1][0] == kind:
            self._late[-1] = (kind, self._late[-1][1] + delta)
        else:
            self._late.append((kind, delta))
        return True

    def text(self, delta: str) -> bytes:
        return self.text_escaped(orjson.dumps(delta)[1:-1])

    def text_escaped(self, escaped: bytes) -> bytes:
        if self._open == "text":
            return self._text_event % escaped
        if self._open == "tool_use" and self._later("text", orjson.loads(b'"' + escaped + b'"')):
            return b""
        out = self._block("text", _TEXT_BLOCK)
        self._text_event = self._delta(b'{"type":"text_delta","text":"%s"}')  # (the block's index: fixed)
        return out + self._text_event % escaped

    def reasoning(self, delta: str) -> bytes:
        if self._open == "tool_use" and self._later("thinking", delta):
            return b""
        out = b"" if self._open == "thinking" else self._block("thinking", _THINKING_BLOCK)
        return out + self._delta(b'{"type":"thinking_delta","thinking":' + orjson.dumps(delta) + b"}")

    def _told_late(self) -> bytes:
        """The text and thinking kept while calls came (`_later`), after them, each its own block."""
        late, self._late = self._late, []
        out = b""
        for kind, delta in late:
            out += self.text(delta) if kind == "text" else self.reasoning(delta)
        return out + self._close()

    def tool_call(self, call: ToolCall) -> bytes:
        if self._open != "tool_use":
            return self._close() + self._open_call(call)
        self._held.append(call)
        return self._turn()

    def tool_arguments(self, call: ToolCall, delta: str) -> bytes:
        if call is self._call:
            return self._input(delta)
        return self._turn()  # (a held call's arguments are told with it; a closed one's are not told)

    def finish(self) -> bytes:
        out = self._close()
        if self._late:
            out += self._told_late()
        if self._index < 0:  # an empty answer still has its (empty) text block
            out += self._block("text", _TEXT_BLOCK) + self._close()
        stop_reason, stop_sequence = self.exchange._stop(self.answer)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": _usage(self.answer.usage),
        }
        return out + sse("message_delta", delta) + _MESSAGE_STOP

    def error(self, message: str, code: str | None) -> bytes:
        return sse("error", {"type": "error", "error": {"type": "api_error", "message": message}})


_PING = b'event: ping\ndata: {"type":"ping"}\n\n'
_MESSAGE_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
_TEXT_BLOCK = b'{"type":"text","text":""}'
_THINKING_BLOCK = b'{"type":"thinking","thinking":""}'


def _usage(usage: dict[str, Any] | None) -> dict[str, int]:
    """Anthropic's usage: its `input_tokens` are those not read from the cache (its clients add the cache's
    to them for the prompt's whole count), where OpenAI's prompt_tokens count the cached ones too."""
    usage = usage or {}
    prompt = int(usage.get("prompt_tokens") or 0)
    cached = min(prompt, int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0))
    return {
        "input_tokens": prompt - cached,
        "output_tokens": int(usage.get("completion_tokens") or 0),
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _tool_use(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = orjson.loads(call.arguments or "{}")
    except orjson.JSONDecodeError:
        arguments = {"_raw": call.arguments}  # the engine's arguments were not JSON: kept, not lost
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments}


def _chat_messages(
    system: str | list[dict[str, Any]] | None, messages: list[Message]
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if system:
        text = system if isinstance(system, str) else "".join(_block_text(b, "system") for b in system)
        out.append({"role": "system", "content": text})
    for i, message in enumerate(messages):
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        if message.role == "system":
            text = "".join(_block_text(b, f"messages[{i}].content") for b in message.content)
            out.append({"role": "system", "content": text})
            continue
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(message.content):
            where = f"messages[{i}].content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": _block_text(block, where)})
            elif kind == "image":
                parts.append({"type": "image_url", "image_url": {"url": _image_url(block, where)}})
            elif kind == "tool_use" and message.role == "assistant":
                calls.append(
                    {
                        "id": str(block.get("id") or ""),
                        "type": "function",
                        "function": {
                            "name": str(block.get("name") or ""),
                            "arguments": encode(block.get("input") or {}).decode(),
                        },
                    }
                )
            elif kind == "tool_result" and message.role == "user":
                result = _result(block, where)
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result})
            elif kind in ("thinking", "redacted_thinking"):
                continue  # the model's own reasoning is not sent back to the engine
            else:
                raise InvalidRequest(
                    f"{where} is a block of type '{kind}', which this server does not take in a "
                    f"{message.role} turn.",
                    param=where,
                )
        if calls:
            out.append({"role": "assistant", "content": _joined(parts) or None, "tool_calls": calls})
        elif parts:
            out.append({"role": message.role, "content": _joined(parts)})
    return out


def _joined(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _block_text(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("text"), str):
        raise InvalidRequest(f"{where} needs its text.", param=where)
    return str(block["text"])


def _image_url(block: dict[str, Any], where: str) -> str:
    source = block.get("source")
    if not isinstance(source, dict):
        raise InvalidRequest(
            f"{where}.source must be an object: a base64 image or a url.", param=f"{where}.source"
        )
    if source.get("type") == "base64":
        if not isinstance(source.get("media_type"), str) or not isinstance(source.get("data"), str):
            raise InvalidRequest(
                f"{where}.source needs its media_type and data as strings.", param=f"{where}.source"
            )
        return f"data:{source['media_type']};base64,{source['data']}"
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return str(source["url"])
    raise InvalidRequest(f"{where}.source must be a base64 image or a url.", param=f"{where}.source")


def _result(block: dict[str, Any], where: str) -> str:
    """A tool result as a tool message's text (an engine's tool message carries text only)."""
    content = block.get("content")
    if isinstance(content, list):
        content = "".join(_result_text(part, f"{where}.content[{k}]") for k, part in enumerate(content))
    text = str(content or "")
    return f"Error: {text}" if block.get("is_error") else text


def _result_text(part: Any, where: str) -> str:
    """A tool result's block as text: an image or a document is told as a note that it is not shown (a
    tool's message carries text only; refusing it would refuse every later turn, which keep it)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("image", "document"):
        return not_shown("an image" if kind == "image" else "a document")
    if kind != "text":
        raise InvalidRequest(
            f"{where} is a block of type '{kind}', which a tool result does not take here.", param=where
        )
    return _block_text(part, where)


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") not in (None, "custom"):
        raise InvalidRequest(
            f"tools[{i}] is of type '{tool.get('type')}': this server runs client tools only (the server "
            "tools are Anthropic's).",
            param=f"tools[{i}].type",
        )
    parsed = parse_part(Tool, tool, f"tools[{i}]")
    function: dict[str, Any] = {"name": parsed.name, "parameters": parsed.input_schema}
    if parsed.description is not None:
        function["description"] = parsed.description
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: dict[str, Any]) -> tuple[str | dict[str, Any], bool | None]:
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise InvalidRequest(
        "tool_choice.type must be auto, any, tool (with a name) or none.", param="tool_choice"
    )
