"""What every dialect shares: the engine's chat-completions answer read into one `Answer` (whole, or as
its stream goes), and the stream response that tells each piece in the dialect's own events.

The relay, the cache and mid-stream failover all work on chat-completions bytes; a dialect's stream is an
`EventStream` whose `write` reads those bytes (chunks.py) and writes the dialect's events instead
(`Encoder`), so the stages before it never know which client API asked.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from aiohttp import web

from corral.dialects.chunks import ChunkReader
from corral.protocol.events import EventBuffer
from corral.protocol.usage import engine_usage

__all__ = [
    "Answer",
    "Checked",
    "DialectStream",
    "Encoder",
    "Exchange",
    "ToolCall",
    "answer_of_completion",
    "error_of_body",
    "not_shown",
    "whole_json",
]

logger = logging.getLogger(__name__)

_SEP = b"\n\n"
# What reading an engine's event of an unexpected shape raises (a string where an object goes, a list for a
# number); the answer is then cut with the dialect's error event, not left without its end
_MISSHAPEN = (AttributeError, KeyError, TypeError, ValueError, OverflowError)
_write = web.StreamResponse.write  # (the stream's own write, called without super() on the token path)
Checked = Callable[[], Awaitable[None]]  # the key's limits checked (RateLimited), before costly reading


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class Answer:
    """One choice of a chat completion, as far as it has come."""

    text: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None  # the stop string that ended it, where the engine says (vLLM)
    usage: dict[str, Any] | None = None
    model: str = ""


def answer_of_completion(data: dict[str, Any]) -> Answer:
    """A whole chat completion's first choice."""
    choices = data.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    message = choice.get("message") or {}
    answer = Answer(
        text=_text(message.get("content")),
        reasoning=str(message.get("reasoning_content") or message.get("reasoning") or ""),
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason") if isinstance(choice.get("stop_reason"), str) else None,
        usage=engine_usage(data.get("usage")),
        model=str(data.get("model") or ""),
    )
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        answer.calls.append(
            ToolCall(str(call.get("id") or ""), str(function.get("name") or ""), _arguments(function))
        )
    return answer


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    return str(content or "")


def _arguments(function: dict[str, Any]) -> str:
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        return arguments
    return orjson.dumps(arguments or {}).decode()


def not_shown(what: str) -> str:
    """What a model reads in place of `what` a tool returned that its chat turn cannot carry (a tool's
    message is text on every engine)."""
    return f"[{what} the tool returned: not shown here, this model reads a tool's result as text only]"


def error_of_body(body: bytes) -> tuple[str, str | None, str | None, str | None]:
    """(message, type, code, param) of an OpenAI-shaped error body (the gateway's and the relay's)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        return body.decode("utf-8", "replace")[:500], None, None, None
    return _error_of(data)


def _error_of(data: dict[str, Any]) -> tuple[str, str | None, str | None, str | None]:
    error = data.get("error") or {}
    if not isinstance(error, dict):
        return str(error), None, None, None
    return str(error.get("message") or ""), error.get("type"), error.get("code"), error.get("param")


class Exchange(Protocol):
    """One request in a dialect, as the pipeline sees it."""

    api: str  # its name in usage records and metrics: responses, messages
    chat_body: bytes  # the chat-completions request every stage after parsing works on
    prompt_tokens: int  # the gateway's estimate of its prompt (set by the pipeline)

    def stream_response(self, headers: dict[str, str]) -> DialectStream:
        """The response a stream is written to (chat-completions events in, the dialect's out)."""

    async def whole(self, response: web.StreamResponse) -> web.StreamResponse:
        """A whole answer, or an error answered before any stream began, in the dialect's shape."""


class Encoder(abc.ABC):
    """A dialect's stream events for an answer as it comes; each method returns the bytes to send."""

    answer: Answer

    @abc.abstractmethod
    def start(self) -> bytes: ...

    @abc.abstractmethod
    def text(self, delta: str) -> bytes: ...

    def text_escaped(self, escaped: bytes) -> bytes:
        """`text` for a delta as the engine escaped it (a JSON string's inside, checked): an encoder that
        writes it as it came saves decoding and encoding each token (the common event, kept cheap)."""
        return self.text(orjson.loads(b'"' + escaped + b'"'))

    @abc.abstractmethod
    def reasoning(self, delta: str) -> bytes: ...

    @abc.abstractmethod
    def tool_call(self, call: ToolCall) -> bytes: ...

    @abc.abstractmethod
    def tool_arguments(self, call: ToolCall, delta: str) -> bytes: ...

    @abc.abstractmethod
    def finish(self) -> bytes:
        """The answer ended well ([DONE]); `answer` holds all of it, usage included."""

    @abc.abstractmethod
    def error(self, message: str, code: str | None) -> bytes:
        """The answer was cut (the relay's error event); nothing follows."""


class DialectStream(web.StreamResponse):
    """A stream response that reads the chat-completions events written to it and sends the encoder's
    events instead. Events come whole from the relay and the cache; a part is kept until its end comes.
    `on_end` runs before the last event leaves (a stored response is stored before the client can name
    it). Its headers leave with its first event, as the relay's own EventStream's do."""

    _send_headers_immediately = False

    def __init__(
        self,
        encoder: Encoder,
        headers: dict[str, str],
        on_end: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(headers=headers)
        self.encoder = encoder
        self._on_end = on_end
        self._events = EventBuffer()  # an event's start is kept until its end comes
        self._started = False
        self._calls: dict[int, ToolCall] = {}
        self._reader = ChunkReader()
        self.ended = False  # finished or failed: the encoder has said its last event
        self._plain = False  # started, not ended, no event's start kept: a write may be one token

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._plain and data.__class__ is bytes:
            escaped = self._reader.one(data)
            if escaped is not None:  # one token, as engines stream them: its event alone, the short way
                await _write(self, self.encoder.text_escaped(escaped))
                return
        out: list[bytes] = []
        if not self._started:
            self._started = True
            out.append(self.encoder.start())
        buffered = self._events.complete(bytes(data))
        self._plain = False  # (until the events are read: a failure there leaves the short way shut)
        if buffered and not self.ended:
            texts: list[str] = []
            try:
                await self._read(buffered, out, texts)
            except _MISSHAPEN as exc:  # an engine's event of another shape (`delta: "x"`, `index: "a"`)
                logger.warning("an engine's stream could not be read (%s: %s)", type(exc).__name__, exc)
                out.append(self._told(texts))  # (the text read before it is told)
                await self._cut(out, "The engine's stream could not be read; its answer ends here.")
        self._plain = not self._events.parts and not self.ended
        if out:
            await _write(self, b"".join(out))

    async def _read(self, events: bytes, out: list[bytes], texts: list[str]) -> None:
        """Tell whole events in the encoder's; text read in one write is told as one delta at its end
        (tokens that came together, an engine ahead of its client, cost one event, not one each; `texts`
        holds what is read and not yet told)."""
        chunks, done = self._reader.read(events)
        answer = self.encoder.answer
        for chunk in chunks:
            if chunk.__class__ is list:  # a run of text deltas (chunks.py)
                texts += chunk
                continue
            if "error" in chunk:  # the relay's word that the stream was cut
                out.append(self._told(texts))
                message, _, code, _ = _error_of(chunk)
                await self._cut(out, message, code)
                return
            usage = chunk.get("usage")
            if usage is not None:
                answer.usage = engine_usage(usage)
            for choice in chunk.get("choices") or ():
                if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                    continue
                delta = choice.get("delta")
                if delta:
                    if delta.get("reasoning_content") or delta.get("reasoning") or delta.get("tool_calls"):
                        out.append(self._told(texts))
                        out.append(self._other(delta))
                    content = delta.get("content")
                    if content:
                        texts.append(str(content))
                finish = choice.get("finish_reason")
                if finish:
                    answer.finish_reason = finish
                    if isinstance(choice.get("stop_reason"), str):
                        answer.stop_reason = choice["stop_reason"]
        out.append(self._told(texts))
        if done:
            await self._end()
            out.append(self.encoder.finish())

    async def _cut(self, out: list[bytes], message: str, code: str | None = None) -> None:
        """The answer ends cut: the encoder's failure (first: a stored response says failed), after
        `on_end`."""
        failed = self.encoder.error(message, code)
        await self._end()
        out.append(failed)

    async def _end(self) -> None:
        """The encoder has said, or is about to say, its last event: `on_end` runs (once)."""
        self.ended = True
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            await on_end()

    def _told(self, texts: list[str]) -> bytes:
        """The text read since the last event told, as one delta."""
        if not texts:
            return b""
        text = "".join(texts)
        texts.clear()
        return self.encoder.text(text)

    def _other(self, delta: dict[str, Any]) -> bytes:
        """A delta's reasoning and tool calls (its text, the common part, is read by `_read`)."""
        out = b""
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if reasoning:
            self.encoder.answer.reasoning += str(reasoning)
            out += self.encoder.reasoning(str(reasoning))
        for part in delta.get("tool_calls") or ():
            out += self._tool_part(part)
        return out

    def _tool_part(self, part: dict[str, Any]) -> bytes:
        index = int(part.get("index", 0))
        function = part.get("function") or {}
        call = self._calls.get(index)
        out = b""
        if call is None:
            call = self._calls[index] = ToolCall(str(part.get("id") or f"call_{index}"), "")
            call.name = str(function.get("name") or "")
            self.encoder.answer.calls.append(call)
            out += self.encoder.tool_call(call)
        elif function.get("name") and not call.name:
            call.name = str(function["name"])
        arguments = function.get("arguments")
        if arguments:
            call.arguments += str(arguments)
            out += self.encoder.tool_arguments(call, str(arguments))
        return out


def whole_json(arguments: str) -> bool:
    """Whether a call's arguments so far are a whole JSON value (more would make them not one)."""
    try:
        orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return False
    return True


def sse(event: str, data: dict[str, Any]) -> bytes:
    """One server-sent event with a name (both dialects name theirs)."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + _SEP


def json_response(
    data: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=orjson.dumps(data), status=status, content_type="application/json", headers=headers
    )
