"""The engine's chat-completions events read for a dialect's stream: whole events in, their JSON objects
out, in order, and whether [DONE] was among them.

Most of a stream is text deltas that differ from one another only in their text: an engine writes the
same id, model, created time, index and nulls around every token. Once one such event has been read, its
bytes before and after the text are the stream's template; a run of events that match it byte for byte is
then read as the texts alone, in one split and one parse for the whole run, with no object built per
event. Anything else (the first events, reasoning, tool calls, the finish, usage, an error) is parsed
event by event, and an event that breaks the template ends the run (it is learnt again from a later one).
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["ChunkReader"]

_SEP = b"\n\n"
_DONE = b"data: [DONE]\n\n"
_CONTENT = b'"content":'


class ChunkReader:
    """Reads one stream's whole events (see the module's docstring)."""

    __slots__ = ("_least", "_prefix", "_separator", "_suffix")

    def __init__(self) -> None:
        self._prefix = b""  # the template's bytes up to its text's opening quote ("" before it is learnt)
        self._suffix = b""  # from its closing quote to the end of the event
        self._separator = b""
        self._least = 0  # the template's length around an empty text

    def read(self, events: bytes) -> tuple[list[Any], bool]:
        """(the events' objects in order, a run of template events as one list of their texts; whether the
        stream ended with [DONE], after which nothing is read)."""
        done = events.endswith(_DONE)
        if done:
            events = events[: -len(_DONE)]
        items: list[Any] = []
        at, size = 0, len(events)
        while at < size:
            if self._prefix and events.startswith(self._prefix, at):
                run = self._run(events, at)
                if run is not None:
                    texts, at = run
                    items.append(texts)
                    continue
            end = events.find(_SEP, at)
            end = size if end < 0 else end
            event = events[at:end]
            at = end + len(_SEP)
            payload = _payload(event)
            if payload == b"[DONE]":
                return items, True
            try:
                chunk = orjson.loads(payload) if payload else None
            except orjson.JSONDecodeError:
                continue
            if not isinstance(chunk, dict):
                continue
            items.append(chunk)
            self._learn(event, chunk)  # (a text delta read here is one the template does not match)
        return items, done

    def one(self, event: bytes) -> bytes | None:
        """The text of `event`, as the engine escaped it (the inside of a JSON string: checked, not decoded;
        a dialect writes it as it came), if `event` is one whole event of the template around a text (a
        token as an engine streams it: one event a read); else None (read it with `read`)."""
        prefix = self._prefix
        if not prefix or len(event) < self._least or not event.startswith(prefix):
            return None
        suffix = self._suffix
        if not event.endswith(suffix):
            return None
        # the text with its quotes (the template's last and first bytes), read as one JSON string: escapes,
        # UTF-8 and surrogates checked, and a quote not escaped (another event's) fails it
        quoted = event[len(prefix) - 1 : len(event) - len(suffix) + 1]
        try:
            orjson.loads(quoted)
        except orjson.JSONDecodeError:
            return None
        return quoted[1:-1]

    def _run(self, events: bytes, at: int) -> tuple[list[str], int] | None:
        """The texts of the template's events from `at` on and where they end; None where they do not
        read as texts (an event among them that only began like the template)."""
        parts = events[at + len(self._prefix) :].split(self._separator)
        last = parts[-1]
        cut = last.find(self._suffix)
        if cut >= 0:  # the run's last event, then the rest
            parts[-1] = last[:cut]
            end = len(events) - len(last) + cut + len(self._suffix)
        else:  # its last event began like the template and ends otherwise (the finish): read alone
            parts.pop()
            end = len(events) - len(last) - len(self._prefix)
            if not parts:
                return None
        try:
            texts = orjson.loads(b'["' + b'","'.join(parts) + b'"]')
        except orjson.JSONDecodeError:
            return None
        # each part a JSON string's inside: a quote that was not would have split it or broken the parse
        if not isinstance(texts, list) or len(texts) != len(parts):
            return None
        return texts, end

    def _learn(self, event: bytes, chunk: dict[str, Any]) -> None:
        """Take `event` as the template if it is a text delta alone and its text is where a probe shows."""
        text = text_alone(chunk)
        if text is None:
            return
        told = _CONTENT + orjson.dumps(text)
        at = event.find(told)
        if at < 0 or event.find(told, at + 1) >= 0:  # escaped otherwise by the engine, or said twice
            return
        opened = at + len(_CONTENT) + 1
        prefix, suffix = event[:opened], event[at + len(told) - 1 :] + _SEP
        probe = prefix + b"\\u0000probe" + suffix  # (the same bytes around another text)
        try:
            read = orjson.loads(_payload(probe[: -len(_SEP)]))
        except orjson.JSONDecodeError:
            return
        if isinstance(read, dict) and text_alone(read) == "\x00probe":
            self._prefix, self._suffix, self._separator = prefix, suffix, suffix + prefix
            self._least = len(prefix) + len(suffix)


def text_alone(chunk: dict[str, Any]) -> str | None:
    """The text of a chunk that says nothing else a stream reads (choice 0's text: no finish, usage,
    reasoning, tool call or error), else None."""
    if chunk.get("usage") is not None or "error" in chunk:
        return None
    choices = chunk.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    delta = choice.get("delta")
    if choice.get("index", 0) != 0 or choice.get("finish_reason") or not isinstance(delta, dict):
        return None
    if delta.get("reasoning_content") or delta.get("reasoning") or delta.get("tool_calls"):
        return None
    content = delta.get("content")
    return content if isinstance(content, str) and content else None


def _payload(event: bytes) -> bytes:
    """An event's data (the relay and the cache write `data: ...` alone on one line)."""
    if event.startswith(b"data: ") and event.find(b"\n") < 0:  # (find: bytes' `in` costs twice as much)
        return event[6:]
    return b"".join(line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")).strip()
