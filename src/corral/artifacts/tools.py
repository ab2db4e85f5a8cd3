"""The external tools that make artifacts (pip, cmake, a converter script), each run under a time limit.

A tool runs with stdin closed (pip cannot stop to ask for a password) and its stdout and stderr merged. Past
its limit, or when the caller is interrupted, the tool and every process it started are killed (cmake's make
and compilers, pip's build steps), and the lock its caller holds (`locks`) comes free for the processes
waiting on it. A hung tool (a dead package index, a stalled download) is then an ArtifactTimeout naming the
step, its limit and its last output, not a `corral prepare` that never ends.

A tool stays in corral's process group, so a terminal's Ctrl-C or hang-up reaches it as it reaches corral:
a tool run by a prepare in a worker thread (a `corral apply`) ends with `corral up`, not at its limit.
"""

from __future__ import annotations

import contextlib
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
_DRAIN_S = 5.0  # how long output is read after the tool exits (a process it left may hold it open)
_POLL_S = 0.5  # how often a tool with nothing to say is checked for having exited


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
        )
    except OSError as exc:
        raise ArtifactError(f"could not {what}: cannot run {command[0]}: {exc.strerror or exc}") from exc
    lines = _Lines(on_line)
    assert proc.stdout is not None
    try:
        with proc.stdout:
            finished = _read_until(proc, deadline, lines) and _exited(proc, deadline)
    except BaseException:
        _kill_tree(proc)
        raise
    if not finished:
        _kill_tree(proc)
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


def _read_until(proc: subprocess.Popen[bytes], deadline: float, lines: _Lines) -> bool:
    """Read the tool's output into `lines` until its end (True) or `deadline` (False). Once the tool has
    exited, a process it left holding its output is waited for `_DRAIN_S` at most (then its status says)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if proc.poll() is not None:
                left = min(left, _DRAIN_S)
                deadline = time.monotonic() + left
            if selector.select(min(left, _POLL_S)):
                data = os.read(fd, 1 << 16)
                if not data:
                    lines.close()
                    return True
                lines.feed(data)
    lines.close()
    return proc.poll() is not None


def _exited(proc: subprocess.Popen[bytes], deadline: float) -> bool:
    """Whether the tool exits by `deadline` (its output may end before it does)."""
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return False
    return True


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """Kill the tool and every process it started, then reap it. Each is stopped first, from the tool
    down, so none starts another (or is left to init by its parent's death) before all are killed."""
    tree = [proc.pid, *_descendants(proc.pid)] if proc.returncode is None else []  # (a reaped pid: reused?)
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in tree:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
    proc.wait()


def _descendants(root: int) -> list[int]:
    """The processes below `root`, parents before their children (from /proc: Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # (it ended as the folder was read)
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, queue = [], list(children.get(root, []))
    while queue:
        pid = queue.pop(0)
        found.append(pid)
        queue += children.get(pid, [])
    return found


def _duration(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 120 else f"{seconds:g} s"
