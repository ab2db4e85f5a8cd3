"""Server-sent-event framing for relayed streams, without re-encoding what passes through.

The relay asks every engine for usage (`stream_options.include_usage`), so it can account for tokens even
when the client did not ask. This filter passes complete events through as the same bytes, and looks
inside only the few events that can hold usage or the `[DONE]` marker (a fast substring test per chunk).
An engine that ends its lines with CRLF (or CR) is read, and relayed, with LF ends (protocol/events.py):
its reads never end with LF LF, so they take the buffer's way, which the reads of an LF engine skip.
"""

from __future__ import annotations

from typing import Any

import orjson

from corral.protocol.events import EventBuffer
from corral.protocol.usage import engine_usage

__all__ = ["SSEFilter"]

_USAGE = b'"usage"'
_DONE = b"data: [DONE]"
_SEP = b"\n\n"


class SSEFilter:
    """Feeds upstream bytes, returns bytes for the client; notes usage and whether the stream finished."""

    __slots__ = ("_buffer", "_keep_usage", "done", "events", "usage")

    def __init__(self, keep_usage: bool) -> None:
        self._keep_usage = keep_usage
        self._buffer = EventBuffer()
        self.done = False
        self.usage: dict[str, Any] | None = None
        self.events = 0  # reads of complete events fed through: what a stream without its usage pays at least

    def feed(self, data: bytes) -> bytes:
        """Bytes of the complete events in what came before and `data`; a partial event waits for the next
        chunk (EventTooLarge past MAX_EVENT_BYTES)."""
        buffer = self._buffer
        if buffer.parts or not data.endswith(_SEP):  # (rare: an event split across reads)
            data = buffer.complete(data)
            if not data:
                return b""
        self.events += 1  # (one event a read as engines stream; a read of several counts once: never over)
        usage, done = data.find(_USAGE), data.find(_DONE)
        if usage < 0 and done < 0:
            return data
        # Only the events from the first one that can hold usage or [DONE] are looked into (the tail of a
        # stream); a read that holds many events passes the ones before that through as they are.
        first = usage if done < 0 else done if usage < 0 else min(usage, done)
        start = data.rfind(_SEP, 0, first) + len(_SEP)
        if start < len(_SEP):
            return self._inspect(data)
        return data[:start] + self._inspect(data[start:])

    def _inspect(self, complete: bytes) -> bytes:
        kept: list[bytes] = []
        for event in complete.split(_SEP):
            if not event:
                continue
            if event.startswith(_DONE):
                self.done = True
            elif event.find(_USAGE) >= 0:
                event = self._take_usage(event)
                if not event:
                    continue
            kept.append(event)
        return _SEP.join(kept) + _SEP if kept else b""

    def _take_usage(self, event: bytes) -> bytes:
        """Record the usage in `event`; the event as the client should see it (empty: drop it).

        A client that did not ask for usage gets none: a usage-only chunk is dropped, and usage attached to
        a content chunk (llama.cpp does this for /v1/completions) is removed from it, re-encoding that one
        event.
        """
        payload = event[event.find(b"{") :]
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return event
        usage = chunk.get("usage") if isinstance(chunk, dict) else None
        if not isinstance(usage, dict):
            return event
        self.usage = engine_usage(usage)  # (counted only as checked; the client is told what came)
        if self._keep_usage:
            return event
        if not chunk.get("choices"):
            return b""
        del chunk["usage"]
        return b"data: " + orjson.dumps(chunk)
