"""Mid-stream failover: a stream whose replica dies or stalls after its first byte goes on on another
replica, and the client sees one uninterrupted stream.

The relay keeps the events it sent (`Transcript`: bytes, parsed only when a continuation needs them). On a
cut it asks another replica for the rest (`continuation_body`): a completion gets its prompt plus the text so
far; a chat gets the text so far as a final assistant message to continue (`continue_final_message`, which
vLLM needs and which keeps llama.cpp from sending that message back first), with `max_tokens` reduced by the
tokens already sent. `Continuation` rewrites the new replica's events into the original stream: its id, no
second role chunk, and usage for the whole answer (prompt = the
continuation's prompt less the text tokens sent; completion = the tokens sent plus the continuation's). A chat
the client ended with an assistant message of its own (a prefill the answer continued) has that message
extended rather than a second one added. A reasoning model's reasoning events count as tokens sent (charged,
and taken off `max_tokens`), but are not asked to be continued: a stream cut while still in its reasoning
ends with `stream_truncated`; one cut after it continues its content (what the new replica sends as
reasoning is passed on, not dropped).

It serves n = 1 streams whose answer is reproducible (temperature 0, or any request when the model's spec
says `mid_stream_failover: always`) on engines that can continue (llama.cpp, vLLM), without tools or echo.
Otherwise a cut stream ends with the `stream_truncated` error event, as before. A replica silent for
`gateway.stall_timeout` mid-stream is noticed by `StallWatch`, one timer per stream.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import orjson

from corral.gateway.context import RequestContext
from corral.protocol import ChatCompletionRequest, CompletionRequest
from corral.protocol.events import EventBuffer
from corral.protocol.usage import engine_usage

__all__ = ["SILENT", "Continuation", "Sent", "StallWatch", "Transcript", "can_fail_over", "continuation_body"]

_SEP = b"\n\n"
_DONE = b"data: [DONE]"


def can_fail_over(body: ChatCompletionRequest | CompletionRequest, mode: str, engine_can: bool) -> bool:
    """Whether a cut stream of `body` may be continued elsewhere (see the module)."""
    if not (body.stream and body.n == 1 and engine_can) or mode == "never":
        return False
    extra = body.model_extra or {}
    if extra.get("tools") or extra.get("functions"):
        return False  # a tool call cut mid-arguments cannot be continued as text
    if isinstance(body, CompletionRequest):
        if body.echo:
            return False  # the echoed prompt would be taken for generated text
        if len(body.prompts) != 1 or not isinstance(body.prompts[0], str):
            return False
    return mode == "always" or body.temperature == 0


@dataclass(frozen=True)
class Sent:
    """What the client has received of a stream."""

    id: str | None
    pieces: tuple[str, ...]  # the content of each event: one token each, as llama.cpp and vLLM stream them
    finished: bool  # a finish_reason went out: the answer is whole
    reasoning: int = 0  # events of reasoning (a reasoning model's, parsed by the engine): a token each
    thinking: bool = False  # the last of them was reasoning: the stream was cut in its reasoning

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def tokens(self) -> int:
        """Tokens generated so far: what the client is charged for, and what max_tokens has spent."""
        return len(self.pieces) + self.reasoning


class Transcript:
    """The bytes written to the client, kept so a continuation knows what was sent."""

    __slots__ = ("_sent",)

    def __init__(self) -> None:
        self._sent: list[bytes] = []

    def add(self, data: bytes) -> None:
        if data:
            self._sent.append(data)

    def summary(self) -> Sent:
        stream_id, pieces, finished, reasoning, thinking = None, [], False, 0, False
        for event in b"".join(self._sent).split(_SEP):
            chunk = _chunk(event)
            if chunk is None:
                continue
            stream_id = stream_id or chunk.get("id")
            for choice in chunk.get("choices") or []:
                piece = _content(choice)
                if piece:
                    pieces.append(piece)
                    thinking = False
                elif _reasoning(choice.get("delta")):
                    reasoning += 1
                    thinking = True
                finished = finished or bool(choice.get("finish_reason"))
        return Sent(stream_id, tuple(pieces), finished, reasoning, thinking)


def continuation_body(
    ctx: RequestContext, sent: Sent, token_ids: list[int] | None = None, prefill_echo: bool = False
) -> bytes:
    """The request for the rest of the answer, after `sent`. A completion continues from the exact tokens
    generated when the engine takes `token_ids` in a prompt (llama.cpp): the text alone may tokenize
    differently at the seams (":" + "\n" + "\n" comes back as ":" + "\n\n") and the answer change course.
    `prefill_echo`: the stream's first replica sends a chat's final assistant message back first where the
    request does not ask `continue_final_message` (llama.cpp), so a chat the client ended with its own
    assistant message (a prefill) and did not ask so has that message in the text sent already. The
    continuation asks it: no engine sends the continued message back (what it sends is all new)."""
    data = orjson.loads(ctx.upstream_body)
    for limit in ("max_tokens", "max_completion_tokens"):
        if isinstance(data.get(limit), int):
            data[limit] = max(1, data[limit] - sent.tokens)
    if isinstance(ctx.body, ChatCompletionRequest):
        echoed = prefill_echo and data.get("continue_final_message") is not True
        data["messages"] = _continued(data, sent.text, echoed)
        data["continue_final_message"] = True  # (llama.cpp continues a final assistant message without it)
        data["add_generation_prompt"] = False
    else:
        prompt = data["prompt"] if isinstance(data["prompt"], str) else data["prompt"][0]
        data["prompt"] = [prompt, *token_ids] if token_ids else prompt + sent.text
    return orjson.dumps(data)


def _continued(data: dict[str, Any], text: str, echoed: bool) -> list[Any]:
    """The chat's messages ending with the answer so far. An answer that
    continued the client's own final assistant message (llama.cpp continues one always, vLLM when asked
    to) extends that message: a second one would read as two turns (the prefill closed as one of its own),
    or be refused (llama.cpp, where it takes the last as a prefill: 400)."""
    messages = list(data["messages"])
    last: dict[str, Any] = messages[-1] if messages and isinstance(messages[-1], dict) else {}
    prefill = _text(last.get("content")) if last.get("role") == "assistant" else None
    if echoed and prefill is not None and text.startswith(prefill):
        messages[-1] = {**last, "content": text}  # (the engine sent it back first: the text sent has it)
    elif not echoed and prefill is not None and data.get("continue_final_message"):
        content = last.get("content")
        extended = [*content, {"type": "text", "text": text}] if isinstance(content, list) else prefill + text
        messages[-1] = {**last, "content": extended}
    else:
        messages.append({"role": "assistant", "content": text})
    return messages


def _text(content: Any) -> str:
    """A message's text: its content, or its text parts'."""
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    return str(content or "")


class Continuation:
    """Rewrites a continuation's SSE bytes into events of the original stream (a reasoning model's
    reasoning in it included: the stream continued after its reasoning, and the engine may read what it
    generates after the continued message as reasoning again)."""

    def __init__(self, sent: Sent, keep_usage: bool) -> None:
        self._sent = sent
        self._keep_usage = keep_usage
        self._buffer = EventBuffer()
        self.done = False
        self.usage: dict[str, Any] | None = None
        self.events = 0  # reads of complete events fed (as SSEFilter's: what a stream without usage pays)

    def feed(self, data: bytes) -> bytes:
        complete = self._buffer.complete(data)
        if not complete:
            return b""
        self.events += 1
        out = [self._rewrite(event) for event in complete.split(_SEP) if event]
        return b"".join(event + _SEP for event in out if event)

    def _rewrite(self, event: bytes) -> bytes:
        if event.startswith(_DONE):
            self.done = True
            return event
        chunk = _chunk(event)
        if chunk is None:
            return event
        chunk["id"] = self._sent.id or chunk.get("id")
        if isinstance(chunk.get("usage"), dict):
            usage = engine_usage(chunk["usage"])
            self.usage = None if usage is None else self._whole_usage(usage)
            if not self._keep_usage or self.usage is None:
                if not chunk.get("choices"):
                    return b""
                del chunk["usage"]
            else:
                chunk["usage"] = self.usage
        choices = [c for c in (self._rewrite_choice(c) for c in chunk.get("choices") or []) if c is not None]
        if chunk.get("choices") and not choices and "usage" not in chunk:
            return b""
        chunk["choices"] = choices
        return b"data: " + orjson.dumps(chunk)

    def _rewrite_choice(self, choice: dict[str, Any]) -> dict[str, Any] | None:
        """The choice without what the client already has; None when nothing is left of it."""
        delta = choice.get("delta")
        if isinstance(delta, dict):
            delta.pop("role", None)
            if not (delta.get("content") or choice.get("finish_reason") or delta.get("tool_calls")):
                return choice if _reasoning(delta) else None
        elif "text" in choice and not choice["text"] and not choice.get("finish_reason"):
            return None
        return choice

    def _whole_usage(self, usage: dict[str, Any]) -> dict[str, int]:
        sent = self._sent  # (its reasoning was generated, but is not in the continuation's prompt)
        prompt = max(0, int(usage.get("prompt_tokens") or 0) - len(sent.pieces))
        completion = sent.tokens + int(usage.get("completion_tokens") or 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _chunk(event: bytes) -> dict[str, Any] | None:
    start = event.find(b"{")
    if not event.startswith(b"data:") or start < 0:
        return None
    try:
        chunk = orjson.loads(event[start:])
    except orjson.JSONDecodeError:
        return None
    return chunk if isinstance(chunk, dict) else None


def _reasoning(delta: Any) -> bool:
    """A delta carrying reasoning (vLLM's reasoning parsers: `reasoning_content`, or newer `reasoning`)."""
    return isinstance(delta, dict) and bool(delta.get("reasoning_content") or delta.get("reasoning"))


def _content(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return str(delta.get("content") or "")
    return str(choice.get("text") or "")


SILENT = "the replica stopped sending tokens"  # a stream's problem: a stall or a read timeout


class StallWatch:
    """Cancels the copying task when the upstream has been silent for `stall` seconds: one timer per
    stream, moved on lazily when it fires early (the copy loop only notes when it started waiting). The
    cancel is the task's own `cancel()`, not a scheduled one: it lands on the read the task waits in (or is
    about to resume from), never on a write to the client half done."""

    __slots__ = ("_handle", "_stall", "expired", "loop", "task", "waiting_since")

    def __init__(self, stall: float) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self._stall = stall
        self.expired = False
        self.loop = asyncio.get_running_loop()
        self.waiting_since: float | None = self.loop.time()
        self._handle = self.loop.call_at(self.waiting_since + stall, self._check)

    def _check(self) -> None:
        now = self.loop.time()
        since = self.waiting_since
        if since is not None and now - since >= self._stall:
            self.expired = True
            self.task.cancel()
            return
        self._handle = self.loop.call_at((since if since is not None else now) + self._stall, self._check)

    def stop(self) -> None:
        self._handle.cancel()
