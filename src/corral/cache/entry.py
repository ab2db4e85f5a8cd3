"""What an exact-cache entry holds, and turning it back into an answer of either kind.

A streamed answer is kept as its events (the engine's own chunking, without the usage chunk and `[DONE]`)
plus its usage; a whole answer as its JSON body. A stream request served from a whole answer gets the
answer as one role-and-content chunk and a finish chunk; a whole request served from a stream gets the
stream's deltas joined. Answers with tool calls or several choices are only replayed as they were stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

__all__ = ["Entry", "entry_from_stream", "entry_from_whole"]

_SEP = b"\n\n"
_DONE = b"data: [DONE]"


@dataclass(frozen=True)
class Entry:
    kind: str  # "stream" | "whole"
    chat: bool  # /v1/chat/completions (else /v1/completions)
    events: tuple[bytes, ...] = ()  # stream: each `data: {...}` event, without its separator
    body: bytes = b""  # whole: the JSON answer
    usage: dict[str, Any] | None = None

    def encode(self) -> bytes:
        return orjson.dumps(
            {
                "kind": self.kind,
                "chat": self.chat,
                "events": [e.decode() for e in self.events],
                "body": self.body.decode(),
                "usage": self.usage,
            }
        )

    @classmethod
    def decode(cls, data: bytes) -> Entry:
        raw = orjson.loads(data)
        events = tuple(e.encode() for e in raw["events"])
        return cls(raw["kind"], raw["chat"], events, raw["body"].encode(), raw["usage"])

    @property
    def tokens(self) -> int:
        return int((self.usage or {}).get("total_tokens") or 0)

    def sse(self, with_usage: bool) -> bytes | None:
        """The answer as an SSE stream ending in `[DONE]`; None when it cannot be told as a stream."""
        events = list(self.events) if self.kind == "stream" else _chunks_of(self.body, self.chat)
        if events is None:
            return None
        if with_usage and self.usage is not None:
            first = orjson.loads(events[0].removeprefix(b"data: "))
            usage = {k: first.get(k) for k in ("id", "object", "created", "model")}
            usage.update(choices=[], usage=self.usage)
            events.append(b"data: " + orjson.dumps(usage))
        return _SEP.join([*events, _DONE]) + _SEP

    def whole(self) -> bytes | None:
        """The answer as one JSON body; None when it cannot be told so."""
        if self.kind == "whole":
            return self.body
        return _joined(self.events, self.chat, self.usage)


def entry_from_whole(body: bytes, chat: bool) -> Entry:
    data = orjson.loads(body)
    return Entry("whole", chat, body=body, usage=data.get("usage"))


def entry_from_stream(written: list[bytes], chat: bool, usage: dict[str, Any] | None) -> Entry | None:
    """The entry for a stream as it was written to the client; None unless it ended with `[DONE]`."""
    events = [e.strip() for e in b"".join(written).split(_SEP) if e.strip()]
    if not events or events[-1] != _DONE:
        return None
    kept = []
    for event in events[:-1]:
        if not event.startswith(b"data: {"):
            return None  # an error event or a comment: not an answer to keep
        data = orjson.loads(event[6:])
        if not data.get("choices") and "usage" in data:
            continue  # the usage chunk: made again on replay for clients that ask
        kept.append(event)
    return Entry("stream", chat, events=tuple(kept), usage=usage) if kept else None


def _chunks_of(body: bytes, chat: bool) -> list[bytes] | None:
    data = orjson.loads(body)
    choices = data.get("choices") or []
    if len(choices) != 1:
        return None
    choice = choices[0]
    head = {k: data.get(k) for k in ("id", "created", "model", "system_fingerprint") if k in data}
    if chat:
        message = choice.get("message") or {}
        if message.get("tool_calls"):
            return None
        delta = {"role": "assistant", "content": message.get("content") or ""}
        kind = "chat.completion.chunk"
        parts = [
            {"index": 0, "delta": delta, "finish_reason": None},
            {"index": 0, "delta": {}, "finish_reason": choice.get("finish_reason")},
        ]
    else:
        kind = "text_completion"
        parts = [
            {"index": 0, "text": choice.get("text") or "", "finish_reason": None},
            {"index": 0, "text": "", "finish_reason": choice.get("finish_reason")},
        ]
    return [b"data: " + orjson.dumps({**head, "object": kind, "choices": [part]}) for part in parts]


def _joined(events: tuple[bytes, ...], chat: bool, usage: dict[str, Any] | None) -> bytes | None:
    text: list[str] = []
    finish = None
    head: dict[str, Any] = {}
    for event in events:
        data = orjson.loads(event[6:])
        head = head or {k: data.get(k) for k in ("id", "created", "model", "system_fingerprint") if k in data}
        for choice in data.get("choices") or []:
            if choice.get("index", 0) != 0:
                return None
            delta = choice.get("delta") or {}
            if chat and (delta.get("tool_calls") or delta.get("function_call")):
                return None
            text.append((delta.get("content") if chat else choice.get("text")) or "")
            finish = choice.get("finish_reason") or finish
    content = "".join(text)
    if chat:
        message = {"role": "assistant", "content": content}
        answer = {**head, "object": "chat.completion", "choices": [{"index": 0, "message": message}]}
    else:
        answer = {**head, "object": "text_completion", "choices": [{"index": 0, "text": content}]}
    answer["choices"][0]["finish_reason"] = finish
    if usage is not None:
        answer["usage"] = usage
    return orjson.dumps(answer)
