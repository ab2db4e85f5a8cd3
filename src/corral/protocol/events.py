"""A stream of server-sent events read as whole events: the relay's filter, failover's continuation and a
dialect's stream all take an engine's bytes this way."""

from __future__ import annotations

__all__ = ["MAX_EVENT_BYTES", "EventBuffer", "EventTooLarge"]

_SEP = b"\n\n"
# an engine's event at most, its separator beside (a token's is ~200 bytes; vLLM's first event of a 32k-token
# prompt echoed with its logprobs ~11 MB)
MAX_EVENT_BYTES = 32 * 1024 * 1024


class EventTooLarge(Exception):
    """A replica sent more than MAX_EVENT_BYTES without ending an event: a broken engine, not a stream."""


class EventBuffer:
    """A stream's bytes handed on as whole events. An event's start waits for its end, each read searched
    once (a replica sending a long event a few bytes a read costs a search of each read, not of all it has
    sent so far), and no more than MAX_EVENT_BYTES of it (and its separator) is kept (EventTooLarge)."""

    __slots__ = ("_size", "parts")

    def __init__(self) -> None:
        self.parts: list[bytes] = []  # an event's start, read so far
        self._size = 0

    def complete(self, data: bytes) -> bytes:
        """The whole events among what came before and `data`; b"" while none has ended."""
        if not data:
            return b""
        if self.parts:
            if data.find(_SEP) < 0 and not (data[:1] == b"\n" and self.parts[-1][-1:] == b"\n"):
                self._keep(data)  # the same event goes on
                return b""
            data = b"".join(self.parts) + data
            self.parts.clear()
            self._size = 0
        if data.endswith(_SEP):
            return data
        end = data.rfind(_SEP) + len(_SEP)  # (rare: an event split across reads; its start kept for later)
        if end < len(_SEP):
            self._keep(data)
            return b""
        self._keep(data[end:])
        return data[:end]

    def _keep(self, part: bytes) -> None:
        self.parts.append(part)
        self._size += len(part)
        if self._size > MAX_EVENT_BYTES + len(_SEP):
            raise EventTooLarge(f"the replica sent {self._size:,} bytes without ending an event")
