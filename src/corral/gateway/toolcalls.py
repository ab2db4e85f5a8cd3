"""Tool calls for models whose engine cannot make them (`EngineFeatures.tools` false: a llama.cpp model
whose chat template knows no tools, a vLLM model with no tool-call parser): the gateway asks for them as
structured output and tells the answer back as OpenAI's `tool_calls`.

The request's `tools` become a system message listing the functions and a `response_format` JSON schema
the engine's constrained decoding holds the answer to: `{"name": <one of them>, "arguments": <its
parameters>}`, or with `tool_choice: auto` also `{"content": <text>}`; a named `tool_choice` allows that
function only, `none` answers in text. Earlier assistant tool calls and tool results in the conversation
become text turns the model's template can take. The answer's JSON is read back: a call becomes one
`tool_calls` entry (`finish_reason: tool_calls`), a `content` the message's text, choice by choice (n > 1).
A streamed answer is held until its JSON is whole, then sent as the chunks an engine would have sent, each
choice under its own index (so its first token comes with its last).

Refused up front (400 naming the field), as OpenAI refuses them or as they cannot be answered right:
`tool_choice: required` or a named function without the function in `tools`; `tools` with the request's own
`response_format` (the engine holds one schema at a time; with `tool_choice: none` no schema is asked, so
both may come); `stop` with `tool_choice: required` or a named function (the engine would apply it to the
call's JSON and cut it). With `auto`, a stop string found in the JSON ends the answer there, and the cut
JSON comes back as the text it was, as an answer cut by `max_tokens` does.
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
    extra = body.model_extra or {}
    if extra.get("tools") or extra.get("tool_choice") is not None:  # (a choice without tools: refused)
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
        self._tools = {str(_name(t)): t["function"] for t in tools}
        choice = body.get("tool_choice")
        self._choice = choice if choice is not None else "auto" if tools else "none"
        self._answer_schema = self._schema()
        self.active = self._answer_schema is not None  # the answer is JSON to read back (a call may come)
        if self.active:
            _check_beside_schema(body, self._choice)

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
        if choice == "none" or (choice == "auto" and not self._tools):
            return None
        if choice == "required" and not self._tools:
            raise InvalidRequest(
                "tool_choice is required but tools names no function: send tools, or tool_choice none.",
                param="tool_choice",
            )
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
                "id": "call_" + uuid.uuid4().hex[:24],  # (each choice's call its own)
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
    """The relay's event filter for an emulated stream: each choice's content is held until the stream's
    end, then told as its tool call's (or text's) chunks, choice by choice under its own index; the usage
    chunk and [DONE] follow as they came."""

    def __init__(self, emulation: ToolEmulation, inner: Any) -> None:
        self._emulation = emulation
        self._inner = inner  # the SSEFilter (usage, done)
        self._texts: dict[int, list[str]] = {}  # each choice's content, by its index
        self._finishes: dict[int, str] = {}
        self._first: dict[str, Any] | None = None

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
                index = choice.get("index")
                if not isinstance(index, int):  # (an engine that numbers no choice answers one)
                    index = 0
                text = self._texts.get(index)
                if text is None:
                    text = self._texts[index] = []
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    text.append(str(delta["content"]))
                if choice.get("finish_reason"):
                    self._finishes[index] = choice["finish_reason"]
        return bytes(out)

    def _told(self) -> bytes:
        """The held answer's chunks (once): each choice's, in the order of their indexes."""
        first, self._first = self._first, None
        if first is None:
            return b""
        head = {k: v for k, v in first.items() if k not in ("choices", "usage")}
        out = bytearray()
        for index in sorted(self._texts):
            message, final = self._emulation.message("".join(self._texts[index]), self._finishes.get(index))
            delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
            if "tool_calls" in message:
                delta["tool_calls"] = [{"index": 0, **message["tool_calls"][0]}]
            for told in (
                {"index": index, "delta": delta, "finish_reason": None},
                {"index": index, "delta": {}, "finish_reason": final},
            ):
                out += b"data: " + orjson.dumps({**head, "choices": [told]}) + _SEP
        return bytes(out)


def _check_beside_schema(body: dict[str, Any], choice: Any) -> None:
    """Refuse what cannot go with an answer asked for as JSON: the client's own `response_format` (the
    engine holds one schema at a time) and, where a call must come (`required`, a named function), a
    `stop` string: the engine would apply it to the call's JSON and cut the call short."""
    if body.get("response_format") is not None:
        raise InvalidRequest(
            f"The model '{body.get('model')}' makes tool calls as structured output, one schema at a "
            "time: send tools or response_format, not both (or tool_choice none).",
            param="response_format",
            code="unsupported_parameter",
        )
    if choice != "auto" and body.get("stop"):
        raise InvalidRequest(
            f"The model '{body.get('model')}' makes tool calls as JSON its engine writes, which a stop "
            "string would cut short: with tool_choice required or a named function, send no stop.",
            param="stop",
            code="unsupported_parameter",
        )


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
