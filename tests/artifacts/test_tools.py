"""External tools run under a time limit: past it, or on an interruption, the tool and what it started die."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from corral.artifacts import ArtifactError, ArtifactTimeout
from corral.artifacts.locks import build_once
from corral.artifacts.tools import run_tool
from tests.artifacts.conftest import read_pids, wait_gone


def _hanging_tool(tmp_path: Path) -> tuple[list[str], Path]:
    """A shell that starts a sleeper in the background, says so, and waits for it: a tool stuck in a child."""
    pids = tmp_path / "pids"
    script = f'sleep 300 & echo "$$ $!" > {pids}.tmp; mv {pids}.tmp {pids}; echo started the sleeper; wait'
    return ["sh", "-c", script], pids


def test_a_tool_past_its_limit_is_stopped_with_the_processes_it_started(tmp_path: Path) -> None:
    command, pids = _hanging_tool(tmp_path)
    started = time.monotonic()
    with pytest.raises(ArtifactTimeout) as stopped:
        run_tool(command, "install the thing", 1.0, hint="is the index reachable?")
    assert time.monotonic() - started < 30  # (not the sleeper's 300 s)
    shell, sleeper = read_pids(pids)
    assert wait_gone([shell, sleeper]) == []
    message = str(stopped.value)
    assert message.startswith("could not install the thing: it did not finish within 1 s")
    assert "is the index reachable?" in message and "started the sleeper" in message


def test_a_tool_whose_child_keeps_its_output_open_is_judged_by_its_own_status(tmp_path: Path) -> None:
    """The tool exits at once, but a child it left in the background still holds its output: it was
    waited for until the limit and told as a timeout; its output is read a few seconds more."""
    pids = tmp_path / "pids"
    started = time.monotonic()
    done = run_tool(["sh", "-c", f"sleep 300 & echo $! > {pids}; echo built"], "build the thing", 120.0)
    try:
        assert (done.returncode, done.output) == (0, "built\n")
        assert time.monotonic() - started < 30
    finally:
        for pid in read_pids(pids):
            os.kill(pid, signal.SIGKILL)


def test_a_terminals_ctrl_c_reaches_the_tool(tmp_path: Path) -> None:
    """A tool run from a worker thread (a `corral apply`'s prepare) in a process group of its own did not
    get the terminal's Ctrl-C: `corral up` waited for it to end or reach its limit (an hour)."""
    pids = tmp_path / "pids"
    program = (
        "import threading; from corral.artifacts.tools import run_tool; "
        f"t = threading.Thread(target=run_tool, args=(['sh', '-c', 'echo $$ > {pids}; exec sleep 300'], "
        "'install the thing', 300.0), daemon=True); t.start(); t.join()"
    )
    corral = subprocess.Popen([sys.executable, "-c", program], start_new_session=True)
    try:
        tool = read_pids(pids, within=30)
        os.killpg(corral.pid, signal.SIGINT)  # (what a terminal sends its foreground job)
        assert wait_gone(tool) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(corral.pid, signal.SIGKILL)
        corral.wait()


def test_an_interrupted_tool_is_stopped_with_the_processes_it_started(tmp_path: Path) -> None:
    """Ctrl-C (here: an error raised while its output is read) stops the tool; it does not run on."""
    command, pids = _hanging_tool(tmp_path)

    class Interrupted(Exception):
        pass

    def interrupt(line: bytes) -> None:
        raise Interrupted(line)

    with pytest.raises(Interrupted):
        run_tool(command, "install the thing", 300.0, on_line=interrupt)
    assert wait_gone(read_pids(pids)) == []


def test_a_tool_within_its_limit_gives_its_status_and_what_it_printed(tmp_path: Path) -> None:
    seen: list[bytes] = []
    script = "echo one; echo two >&2; printf 'no newline'; exit 3"
    done = run_tool(["sh", "-c", script], "run the thing", 30.0, on_line=seen.append)
    assert done.returncode == 3
    assert seen == [b"one\n", b"two\n", b"no newline"]
    assert done.output == "one\ntwo\nno newline"


def test_a_tool_that_cannot_start_is_an_error_naming_the_step(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match=r"could not build the thing: cannot run .*no-such-tool"):
        run_tool([str(tmp_path / "no-such-tool")], "build the thing", 30.0)


def test_a_build_stopped_at_its_limit_frees_its_lock_and_leaves_no_marker(tmp_path: Path) -> None:
    marker, lock = tmp_path / "thing" / ".ready", tmp_path / ".thing.lock"
    command, _ = _hanging_tool(tmp_path)
    with pytest.raises(ArtifactTimeout):
        build_once(marker, lock, lambda: run_tool(command, "build the thing", 1.0).output)
    assert not marker.exists()
    with lock.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (raises BlockingIOError while it is held)
        fcntl.flock(handle, fcntl.LOCK_UN)
