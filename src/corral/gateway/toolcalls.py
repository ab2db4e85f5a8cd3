"""Tool calls for models whose engine cannot make them (`EngineFeatures.tools` false: a llama.cpp model
whose chat template knows no tools, a vLLM model with no tool-call parser): the gateway asks for them as
structured output and tells the answer back as OpenAI's `tool_calls`.

The request's `tools` become a system message listing the functions and a `response_format` JSON schema
the engine's constrained decoding holds the answer to: `{"name": <one of them>, "arguments": <its
parameters>}`, or with `tool_choice: auto` also `{"content": <text>}`; a named `tool_choice` allows that
function only, `none` answers in text. Earlier assistant tool calls and tool results in the conversation
become text turns the model's template can take. The answer's JSON is read back: a call becomes one
`tool_calls` entry (`finish_reason: tool_calls`), a `content` the message's text. A streamed answer is held
until its JSON is whole, then sent as the chunks an engine would have sent (so its first token comes
with its last). Requests that name both `tools` and their own `response_format` are refused (400): the
engine holds one schema at a time.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from corral.protocol import ChatCompletionRequest, InvalidRequest
from corral.protocol.types import encode

__all__ = ["HeldStream", "ToolEmulation", "names_tools"]

_SEP = b"\n\n"
_DONE = b"data: [DONE]"


def names_tools(body: ChatCompletionRequest) -> bool:
    """A chat request that offers tools or holds tool calls or results (for an engine without tools, the
    gateway's to emulate); read from the validated body, so other requests pay no second parse."""
    if (body.model_extra or {}).get("tools"):
        return True
    return any(m.role == "tool" or (m.model_extra or {}).get("tool_calls") for m in body.messages)


class ToolEmulation:
    """One request's emulated tool calls: its rewritten body, and its answer read back."""

    def __init__(self, body: dict[str, Any]) -> None:
        tools = body.get("tools") or []
        if not isinstance(tools, list) or not all(_name(t) for t in tools):
            raise InvalidRequest(
                "tools must be a list of {type: function, function: {name, ...}}.", param="tools"
            )
        if tools and body.get("response_format") is not None:
            raise InvalidRequest(
                f"The model '{body.get('model')}' makes tool calls as structured output, one schema at a "
                "time: send tools or response_format, not both.",
                param="response_format",
                code="unsupported_parameter",
            )
        self._tools = {str(_name(t)): t["function"] for t in tools}
        self._choice = body.get("tool_choice", "auto" if tools else "none")
        self.call_id = "call_" + uuid.uuid4().hex[:24]
        self._answer_schema = self._schema()
        self.active = self._answer_schema is not None  # the answer is JSON to read back (a call may come)

    def request(self, body: dict[str, Any]) -> bytes:
        """The chat body to send the engine instead."""
        out = {k: v for k, v in body.items() if k not in ("tools", "tool_choice", "parallel_tool_calls")}
        out["messages"] = _plain_turns(body.get("messages") or [])
        schema = self._answer_schema
        if schema is not None:
            listing = encode(
                [
                    {"name": n, "description": f.get("description", ""), "parameters": f.get("parameters")}
                    for n, f in self._tools.items()
                ]
            ).decode()
            how = (
                'Call one of these functions by answering with JSON {"name": ..., "arguments": {...}}'
                if self._choice != "auto"
                else 'To call one of these functions answer with JSON {"name": ..., "arguments": {...}}; '
                'to answer in words, with JSON {"content": "..."}'
            )
            out["messages"] = [
                {"role": "system", "content": f"Functions: {listing}\n{how}."},
                *out["messages"],
            ]
            out["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "tool_call", "schema": schema},
            }
        return encode(out)

    def _schema(self) -> dict[str, Any] | None:
        choice = self._choice
        if choice == "none" or not self._tools:
            return None
        if isinstance(choice, dict):
            function = choice.get("function")
            wanted = function.get("name") if isinstance(function, dict) else None
            if not isinstance(wanted, str) or wanted not in self._tools:
                raise InvalidRequest(
                    f"tool_choice names a function not in tools: {wanted!r}.", param="tool_choice"
                )
            names = [wanted]
        elif choice in ("auto", "required"):
            names = list(self._tools)
        else:
            raise InvalidRequest(
                "tool_choice must be none, auto, required or a named function.", param="tool_choice"
            )
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": name},
                    "arguments": self._tools[name].get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name in names
        ]
        if choice == "auto":  # (no other key beside the text: a call's name there would skip its schema)
            calls.append(
                {
                    "type": "object",
                    "properties": {"content": {"type": "string"}},
                    "required": ["content"],
                    "additionalProperties": False,
                }
            )
        return calls[0] if len(calls) == 1 else {"anyOf": calls}

    def message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """(the assistant message, its finish reason) of the answer's JSON and the engine's finish reason:
        a call that ended well finished with tool_calls."""
        message, told = self._read(text)
        return message, told if told and finish in ("stop", None) else finish

    def _read(self, text: str) -> tuple[dict[str, Any], str | None]:
        try:
            data = orjson.loads(text)
        except orjson.JSONDecodeError:
            return {"role": "assistant", "content": text}, None  # cut short (length): kept as it came
        if isinstance(data, dict) and isinstance(data.get("name"), str) and data["name"] in self._tools:
            call = {
                "id": self.call_id,
                "type": "function",
                "function": {
                    "name": data["name"],
                    "arguments": _dumped(data.get("arguments") or {}),
                },
            }
            return {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
        if isinstance(data, dict) and isinstance(data.get("content"), str):
            return {"role": "assistant", "content": data["content"]}, None
        return {"role": "assistant", "content": text}, None

    def whole(self, body: bytes) -> bytes:
        """A whole chat answer with its JSON read back."""
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            return body
        for choice in data.get("choices") or []:
            message = choice.get("message") or {}
            told, choice["finish_reason"] = self.message(
                str(message.get("content") or ""), choice.get("finish_reason")
            )
            choice["message"] = {**message, **told}
        return orjson.dumps(data)

    def stream(self, inner: Any) -> HeldStream:
        return HeldStream(self, inner)


class HeldStream:
    """The relay's event filter for an emulated stream: content is held until the stream's end, then told
    as a tool call's (or text's) chunks; the usage chunk and [DONE] follow as they came."""

    def __init__(self, emulation: ToolEmulation, inner: Any) -> None:
        self._emulation = emulation
        self._inner = inner  # the SSEFilter (usage, done)
        self._text: list[str] = []
        self._first: dict[str, Any] | None = None
        self._finish: str | None = None

    @property
    def done(self) -> bool:
        return bool(self._inner.done)

    def feed(self, data: bytes) -> bytes:
        out = bytearray()
        for event in self._inner.feed(data).split(_SEP):
            if not event:
                continue
            if event.startswith(_DONE):
                out += self._told() + event + _SEP
                continue
            try:
                chunk = orjson.loads(event[event.find(b"{") :])
            except orjson.JSONDecodeError:
                out += event + _SEP
                continue
            choices = chunk.get("choices") if isinstance(chunk, dict) else None
            if not choices:  # the usage chunk, an error: they come after the answer
                out += self._told() + event + _SEP
                continue
            if self._first is None:
                self._first = chunk
            for choice in choices:
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    self._text.append(str(delta["content"]))
                if choice.get("finish_reason"):
                    self._finish = choice["finish_reason"]
        return bytes(out)

    def _told(self) -> bytes:
        """The held answer's chunks (once)."""
        first, self._first = self._first, None
        if first is None:
            return b""
        message, final = self._emulation.message("".join(self._text), self._finish)
        head = {k: v for k, v in first.items() if k not in ("choices", "usage")}
        delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
        if "tool_calls" in message:
            delta["tool_calls"] = [{"index": 0, **message["tool_calls"][0]}]
        chunks = [
            {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
            {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": final}]},
        ]
        return b"".join(b"data: " + orjson.dumps(c) + _SEP for c in chunks)


def _name(tool: Any) -> str | None:
    if isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("function"), dict):
        name = tool["function"].get("name")
        return name if isinstance(name, str) and name else None
    return None


def _function(call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    return function if isinstance(function, dict) else {}


def _dumped(value: Any) -> str:
    """JSON text of a value (nested past what orjson writes: its text as it came)."""
    try:
        return orjson.dumps(value).decode()
    except orjson.JSONEncodeError:
        return str(value)


def _plain_turns(messages: list[Any]) -> list[Any]:
    """Tool calls and results as text turns a template without tools can take."""
    out = []
    for message in messages:
        if not isinstance(message, dict):
            out.append(message)
            continue
        if message.get("role") == "assistant" and message.get("tool_calls"):
            calls = message["tool_calls"] if isinstance(message["tool_calls"], list) else []
            said = [{"name": _function(c).get("name"), "arguments": _arguments(c)} for c in calls]
            text = _dumped(said[0] if len(said) == 1 else said)
            out.append({"role": "assistant", "content": text})
        elif message.get("role") == "tool":
            content = message.get("content")
            text = content if isinstance(content, str) else _dumped(content)
            out.append(
                {"role": "user", "content": f"Function result ({message.get('tool_call_id')}): {text}"}
            )
        else:
            out.append(message)
    return out


def _arguments(call: Any) -> Any:
    arguments = _function(call).get("arguments")
    if isinstance(arguments, str):
        try:
            return orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return arguments
    return arguments
