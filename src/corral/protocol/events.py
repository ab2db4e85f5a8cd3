"""A stream of server-sent events read as whole events: the relay's filter, failover's continuation and a
dialect's stream all take an engine's bytes this way.

Events end with a blank line, and SSE lets a line end with LF, CRLF or CR: engines that end theirs with
CRLF (sse-starlette's default, so llama-cpp-python's server) are read as if they used LF, which is what the
rest of the gateway splits on and what its clients are sent. The stream's first line ending decides, once:
an LF stream's bytes are handed on as they came, without a look for CRs in each read."""

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
    sent so far), and no more than MAX_EVENT_BYTES of it (and its separator) is kept (EventTooLarge). A
    stream whose lines end with CR or CRLF is handed on with LF ends (see the module's docstring)."""

    __slots__ = ("_after_cr", "_lf", "_size", "parts")

    def __init__(self) -> None:
        self.parts: list[bytes] = []  # an event's start, read so far
        self._size = 0
        self._lf: bool | None = None  # whether its lines end with LF alone (None: none ended yet)
        self._after_cr = False  # its last read ended with CR: an LF first in the next read ends that line

    def complete(self, data: bytes) -> bytes:
        """The whole events among what came before and `data`; b"" while none has ended."""
        if not data:
            return b""
        if not self._lf:
            data = self._as_lf(data)
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

    def _as_lf(self, data: bytes) -> bytes:
        """`data` with CRLF and CR line ends as LF where the stream's first line ended with CR; as it came
        where that line ended with LF (`complete` then calls this no more), or while no line has ended."""
        if self._lf is None:
            cr, lf = data.find(b"\r"), data.find(b"\n")
            if cr < 0 or 0 <= lf < cr:
                if lf >= 0:
                    self._lf = True
                return data
            self._lf = False
        if self._after_cr and data[:1] == b"\n":  # (a CRLF split between two reads)
            data = data[1:]
        self._after_cr = data[-1:] == b"\r"
        return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")

    def _keep(self, part: bytes) -> None:
        self.parts.append(part)
        self._size += len(part)
        if self._size > MAX_EVENT_BYTES + len(_SEP):
            raise EventTooLarge(f"the replica sent {self._size:,} bytes without ending an event")
