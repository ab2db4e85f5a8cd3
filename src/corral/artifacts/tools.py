"""The external tools that make artifacts (pip, cmake, a converter script), each run under a time limit.

A tool runs in a process group of its own, stdin closed (pip cannot stop to ask for a password) and its
stdout and stderr merged. Past its limit, or when the caller is interrupted (Ctrl-C), the whole group is
killed: cmake's make and compilers, pip's build steps go with it, and the lock its caller holds (`locks`)
comes free for the processes waiting on it. A hung tool (a dead package index, a stalled download) is then
an ArtifactTimeout naming the step, its limit and its last output, not a `corral prepare` that never ends.

Being outside corral's process group, a tool does not get a terminal's Ctrl-C itself: corral kills its
group on the KeyboardInterrupt.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from corral.artifacts.errors import ArtifactError, ArtifactTimeout

__all__ = ["ToolRun", "run_tool", "tool_error"]

_TAIL_LINES = 40  # what a run keeps of its output, for its error messages
_LINE_MAX = 64 << 10  # a longer stretch without a newline is passed on as a line of its own


@dataclass(frozen=True)
class ToolRun:
    """A tool that finished within its limit: its exit status and the last lines it printed."""

    returncode: int
    output: str


def run_tool(
    command: Sequence[str],
    what: str,
    limit_s: float,
    *,
    cwd: Path | None = None,
    on_line: Callable[[bytes], None] | None = None,
    hint: str = "",
) -> ToolRun:
    """Run `command` for `limit_s` seconds at most, passing each line it prints to `on_line`. `what` says
    the step as a verb phrase ("install vllm==0.11.0") for the ArtifactError raised when the command cannot
    start, and the ArtifactTimeout raised when it runs past its limit (with `hint`, what the user can do)."""
    deadline = time.monotonic() + limit_s
    try:
        proc = subprocess.Popen(
            list(command),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            process_group=0,
        )
    except OSError as exc:
        raise ArtifactError(f"could not {what}: cannot run {command[0]}: {exc.strerror or exc}") from exc
    lines = _Lines(on_line)
    assert proc.stdout is not None
    try:
        with proc.stdout:
            finished = _read_until(proc.stdout.fileno(), deadline, lines) and _exited(proc, deadline)
    except BaseException:
        _kill_group(proc)
        raise
    if not finished:
        _kill_group(proc)
        raise ArtifactTimeout(
            f"could not {what}: it did not finish within {_duration(limit_s)}, its limit, and was stopped "
            f"with the processes it started{f' ({hint})' if hint else ''}. "
            f"Its last output: {tool_error(lines.tail())}"
        )
    return ToolRun(proc.returncode, lines.tail())


def tool_error(output: str, lines: int = 3) -> str:
    """What a failed tool (pip, cmake) said went wrong: its `ERROR:` lines, else its last lines, whole."""
    text = [line.strip() for line in output.strip().splitlines() if line.strip()]
    errors = [line for line in text if line.startswith(("ERROR:", "error:", "CMake Error"))]
    return " ".join((errors or text)[-lines:]) or "(it printed nothing)"


class _Lines:
    """A tool's output split into lines: each passed on, the last `_TAIL_LINES` kept."""

    def __init__(self, on_line: Callable[[bytes], None] | None) -> None:
        self._on_line = on_line
        self._kept: deque[bytes] = deque(maxlen=_TAIL_LINES)
        self._partial = b""

    def feed(self, data: bytes) -> None:
        *whole, self._partial = (self._partial + data).split(b"\n")
        for line in whole:
            self._emit(line + b"\n")
        if len(self._partial) > _LINE_MAX:
            self.close()

    def close(self) -> None:
        if self._partial:
            self._emit(self._partial)
            self._partial = b""

    def tail(self) -> str:
        return b"".join([*self._kept, self._partial]).decode(errors="replace")

    def _emit(self, line: bytes) -> None:
        self._kept.append(line)
        if self._on_line is not None:
            self._on_line(line)


def _read_until(fd: int, deadline: float, lines: _Lines) -> bool:
    """Read `fd` into `lines` until its end (True) or `deadline` (False)."""
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if selector.select(left):
                data = os.read(fd, 1 << 16)
                if not data:
                    lines.close()
                    return True
                lines.feed(data)
    return False


def _exited(proc: subprocess.Popen[bytes], deadline: float) -> bool:
    """Whether the tool exits by `deadline` (its output may end before it does)."""
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return False
    return True


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill the tool's whole process group, then reap the tool. The group is killed only while the tool is
    unreaped: its id cannot have passed to another group then."""
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _duration(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 120 else f"{seconds:g} s"
