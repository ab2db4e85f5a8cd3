"""What an exact-cache entry holds, and turning it back into an answer of either kind.

A streamed answer is kept as its events (the engine's own chunking, without the usage chunk and `[DONE]`)
plus its usage; a whole answer as its JSON body. A stream request served from a whole answer gets the
answer as one role-and-content chunk and a finish chunk; a whole request served from a stream gets the
stream's deltas joined. An answer with anything else (tool calls, logprobs, reasoning, a refusal, several
choices, a top-level member the other kind would not carry: vLLM's `prompt_logprobs`, llama.cpp's
`timings`) is only replayed the way it was stored. Only an answer that said it ended (each of its choices
with a finish reason of `_FINISHED`: not vLLM's `abort` or an `error`) and carries no error is kept, and
only one within the cache's `max_entry_bytes` (`Collected`: a stream stops being collected past it).
A hit is told under an id and a time of its own (`Entry.answering`): the stored ones name the request
that first asked (vLLM's id carries its x-request-id).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import Any

import orjson

from corral.protocol.usage import engine_usage

__all__ = ["Collected", "Entry", "entry_from_stream", "entry_from_whole"]

_SEP = b"\n\n"
_DONE = b"data: [DONE]"
_EMPTY: tuple[Any, ...] = (None, [], {}, "")  # a member with one of these values says nothing
# The finish reasons of an answer that ended as the model meant (vLLM's `abort`, an engine's `error` and
# anything unknown are an answer cut short: never kept, so never replayed as the answer).
_FINISHED = frozenset({"stop", "length", "tool_calls", "function_call", "content_filter"})
# An answer's top-level members either kind carries (copied by a conversion); another one that says
# something (vLLM's `prompt_logprobs`, `prompt_token_ids`) makes it not convertible. llama.cpp's `timings`
# (which the relay takes off a whole answer unless asked for) and OpenAI's `obfuscation` padding say
# nothing of the answer: dropped.
_HEAD = ("id", "created", "model", "system_fingerprint", "service_tier")
_TOP = frozenset({*_HEAD, "object", "choices", "usage", "timings", "obfuscation"})
_KINDS = ("stream", "whole")


class Collected(list[bytes]):
    """A stream's events as written to the client, collected for the cache up to `limit` bytes: past it
    what was collected is dropped and nothing more is (the answer is not kept: `entry_from_stream` finds no
    `[DONE]`), so one tenant's huge answer is neither held whole in memory nor parsed to be kept."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.size = 0
        self.over = False

    def append(self, item: bytes) -> None:
        if self.over:
            return
        self.size += len(item)
        if self.size > self.limit:
            self.over = True
            self.clear()
            return
        super().append(item)


@dataclass(frozen=True)
class Entry:
    kind: str  # "stream" | "whole"
    chat: bool  # /v1/chat/completions (else /v1/completions)
    events: tuple[bytes, ...] = ()  # stream: each `data: {...}` event, without its separator
    body: bytes = b""  # whole: the JSON answer
    usage: dict[str, Any] | None = None
    group: str | None = None  # semantic cache: the digest of everything but the last user turn
    vector: str | None = None  # semantic cache: that turn's embedding, little-endian float32, base64
    question: str | None = None  # semantic cache: that turn's text (the lexical guard compares it)

    def encode(self) -> bytes:
        return orjson.dumps(
            {
                "kind": self.kind,
                "chat": self.chat,
                "events": [e.decode() for e in self.events],
                "body": self.body.decode(),
                "usage": self.usage,
                "group": self.group,
                "vector": self.vector,
                "question": self.question,
            }
        )

    @classmethod
    def decode(cls, data: bytes) -> Entry:
        """The entry `encode` made; ValueError for anything else (another version's, or not an entry)."""
        raw = orjson.loads(data)
        if (
            not isinstance(raw, dict)
            or raw.get("kind") not in _KINDS
            or not isinstance(raw.get("chat"), bool)
        ):
            raise ValueError("not a cache entry")
        events, body = raw.get("events"), raw.get("body")
        if not isinstance(events, list) or not all(isinstance(e, str) for e in events):
            raise ValueError("an entry whose events are not text")
        if not isinstance(body, str) or (raw["kind"] == "stream") != bool(events):
            raise ValueError("an entry of neither kind")
        extra = [raw.get(k) for k in ("group", "vector", "question")]
        if not all(v is None or isinstance(v, str) for v in extra):
            raise ValueError("an entry whose semantic members are not text")
        return cls(
            raw["kind"],
            raw["chat"],
            tuple(e.encode() for e in events),
            body.encode(),
            engine_usage(raw.get("usage")),  # (checked again: an older gateway's, in a shared Redis)
            *extra,
        )

    def answering(self, request_id: str, created: int) -> Entry:
        """The entry told as the answer to another request: its id that request's, in the engine's shape
        (`chatcmpl-` or `cmpl-` and the request's id, as vLLM names answers), and `created` its time. Only
        the members `"id"` and `"created"` holding the stored values are rewritten, as bytes (a member's
        name and value in quotes can only be a member: a text holding them has its quotes escaped), over
        the whole answer at once (a hit on a 1 MiB stream: about a millisecond)."""
        first = self.events[0] if self.kind == "stream" else self.body
        data = orjson.loads(first.removeprefix(b"data: "))
        data = data if isinstance(data, dict) else {}
        old_id, old_created = data.get("id"), data.get("created")
        prefix = old_id.split("-", 1)[0] if isinstance(old_id, str) and "-" in old_id else ""
        new_id = orjson.dumps(f"{prefix or ('chatcmpl' if self.chat else 'cmpl')}-{request_id}")
        swaps: list[tuple[bytes, bytes]] = []
        if isinstance(old_id, str):
            old = orjson.dumps(old_id)
            swaps += [(b'"id":' + old, b'"id":' + new_id), (b'"id": ' + old, b'"id": ' + new_id)]
        if isinstance(old_created, int) and not isinstance(old_created, bool):
            for colon in (b":", b": "):
                for end in (b",", b"}"):
                    was, now = (
                        b'"created"%s%d%s' % (colon, old_created, end),
                        b'"created"%s%d%s'
                        % (
                            colon,
                            created,
                            end,
                        ),
                    )
                    swaps.append((was, now))
        whole = _SEP.join(self.events) if self.kind == "stream" else self.body
        for was, now in swaps:
            whole = whole.replace(was, now)
        if self.kind == "stream":
            return replace(self, events=tuple(whole.split(_SEP)))
        return replace(self, body=whole)

    def text(self) -> str | None:
        """The answer's text (its first choice), for comparing two answers; None if it has none."""
        whole = self.whole()
        if whole is None:
            return None
        choices = orjson.loads(whole).get("choices") or [{}]
        first = choices[0]
        content = (first.get("message") or {}).get("content") if self.chat else first.get("text")
        return content if isinstance(content, str) else None

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


def entry_from_whole(body: bytes, chat: bool) -> Entry | None:
    """The entry for a whole answer; None unless it is a JSON answer with choices that ended."""
    data = orjson.loads(body)
    if not isinstance(data, dict) or not data.get("choices"):
        return None
    if not all(isinstance(c, dict) and c.get("finish_reason") in _FINISHED for c in data["choices"]):
        return None  # cut short (vLLM's `abort`, an `error`) or never said it ended
    return Entry("whole", chat, body=body, usage=engine_usage(data.get("usage")))


def entry_from_stream(written: list[bytes], chat: bool, usage: dict[str, Any] | None) -> Entry | None:
    """The entry for a stream as it was written to the client; None unless it ended with `[DONE]`."""
    events = [e.strip() for e in b"".join(written).split(_SEP) if e.strip()]
    if not events or events[-1] != _DONE:
        return None
    kept: list[bytes] = []
    started: set[Any] = set()  # the choices' indexes seen, and those that ended well
    finished: set[Any] = set()
    for event in events[:-1]:
        if not event.startswith(b"data: {") or event.find(b"\n") >= 0:
            return None  # a comment or an event of several lines: not a plain answer
        data = orjson.loads(event[6:])
        if not isinstance(data, dict) or "error" in data or data.get("object") == "error":
            return None  # the engine failed mid-answer (vLLM sends an error event, then [DONE])
        choices = data.get("choices")
        if not choices and "usage" in data:
            continue  # the usage chunk: made again on replay for clients that ask
        if "usage" in data:  # usage on a content chunk (llama.cpp): kept apart, given only if asked
            data.pop("usage")
            event = b"data: " + orjson.dumps(data)
        kept.append(event)
        for choice in choices or []:
            index, reason = choice.get("index", 0), choice.get("finish_reason")
            started.add(index)
            if reason and reason not in _FINISHED:
                return None  # cut short: vLLM's `abort` (a drain, a shutdown), an `error`
            if reason:
                finished.add(index)
    if not kept or not started or finished != started:
        return None  # an answer (or one of its choices) that never said it ended is not kept
    return Entry("stream", chat, events=tuple(kept), usage=usage)


def _chunks_of(body: bytes, chat: bool) -> list[bytes] | None:
    data = orjson.loads(body)
    choices = data.get("choices") or []
    if len(choices) != 1 or _extra(data, _TOP):
        return None
    choice = choices[0]
    if _extra(choice, {"index", "message", "text", "finish_reason"}):
        return None
    head = {k: data.get(k) for k in _HEAD if k in data}
    if chat:
        message = choice.get("message") or {}
        if _extra(message, {"role", "content"}):
            return None  # tool calls, a refusal, reasoning: told only the way they were stored
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
        if _extra(data, _TOP):
            return None  # a member a whole answer would lose (vLLM's `prompt_token_ids`, llama.cpp's timings)
        head = head or {k: data.get(k) for k in _HEAD if k in data}
        for choice in data.get("choices") or []:
            if choice.get("index", 0) != 0 or _extra(choice, {"index", "delta", "text", "finish_reason"}):
                return None
            delta = choice.get("delta") or {}
            if _extra(delta, {"role", "content"}):
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


def _extra(part: dict[str, Any], known: Collection[str]) -> bool:
    """`part` says something besides `known` (logprobs, tool calls, reasoning…) that a conversion would
    lose. An empty value says nothing: vLLM's older versions write `"tool_calls": []` into every message,
    and engines write `"refusal": null` or `""` into answers that have none."""
    return any(key not in known and value not in _EMPTY for key, value in part.items())
