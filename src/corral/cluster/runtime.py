"""Replica runtimes: where and how an engine process runs.

The supervisor talks only to `ReplicaRuntime`; the local runtime starts engines as child processes on this
machine (a Ray runtime starts them as actors on a cluster's nodes). Each local replica runs in its own
process group, so stopping it stops everything it spawned, and asks the kernel to end it if corral dies.
A replica's output goes to `<logs>/<replica>.log`, rotated by size (`rotate_log`). Each replica listens on
a port booked for it until it has stopped (`PortBook`), so no two live replicas are handed the same one;
a vLLM CPU replica is bound to cores no other live replica holds while there are such (`CoreBook`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Protocol
from urllib.parse import quote

from corral.cluster.cores import CoreBook
from corral.engines import LaunchPlan

__all__ = [
    "AttachedReplica",
    "LocalProcessRuntime",
    "NoRoom",
    "PortBook",
    "ReplicaRuntime",
    "RunningReplica",
    "die_with_parent",
    "free_port",
    "log_name",
    "log_tail",
    "rotate_log",
]

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_KILLED_WAIT_S = 10.0  # how long a stop waits for a process it has killed before leaving it behind


class NoRoom(OSError):
    """The cluster has no room for the replica now (no Ray node with the GPUs it reserves free: a node
    rebooting, a pod's image still pulling). Not the replica's failure: it waits and is tried again, never
    given up on for it."""


class RunningReplica(Protocol):
    """A started replica: where it listens, and how to wait for and stop it."""

    url: str
    pid: int | None
    log_path: Path | None  # where its output goes, when it is a file on this machine

    async def wait(self) -> int:
        """Return the exit code once the replica has exited."""
        ...

    async def stop(self, grace: float) -> None:
        """Stop gracefully (SIGTERM), then forcefully after `grace` seconds."""
        ...


class ReplicaRuntime(Protocol):
    """Starts replicas from launch plans. `assigns_gpus`: the runtime picks each replica's GPUs itself (Ray),
    rather than the plan's CUDA_VISIBLE_DEVICES."""

    assigns_gpus: bool

    async def start(self, replica_id: str, plan: LaunchPlan) -> RunningReplica: ...


class AttachedReplica:
    """A server that runs on its own (plan.url): never exits from our side, nothing to stop."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.pid: int | None = None
        self.log_path: Path | None = None
        self._forever = asyncio.Event()

    async def wait(self) -> int:
        await self._forever.wait()
        return 0

    async def stop(self, grace: float) -> None:
        return None


class PortBook:
    """The ports handed to live replicas, by host. A port nothing listens on is free only until something
    binds it: two replicas started close together could each be drawn the same one (vLLM binds with
    SO_REUSEPORT, so both would serve on it), so a port stays booked from its draw until its replica has
    stopped, and a draw that clashes with a booked one is drawn again. `draw(host)`: a port nothing listens
    on there now."""

    def __init__(self, draw: Callable[[str], int] | None = None, tries: int = 64) -> None:
        self._draw = draw or free_port
        self._tries = tries
        self._booked: set[tuple[str, int]] = set()

    def book(self, host: str, port: int) -> bool:
        """Book a port drawn elsewhere (on a Ray node); False where a live replica holds it."""
        if (host, port) in self._booked:
            return False
        self._booked.add((host, port))
        return True

    def take(self, host: str) -> int:
        """A port nothing listens on at `host` and no live replica holds, booked; OSError if none comes."""
        for _ in range(self._tries):
            port = self._draw(host)
            if self.book(host, port):
                return port
        raise OSError(f"no free port on {host} that no replica holds came in {self._tries} draws")

    def release(self, host: str, port: int) -> None:
        """Its replica has stopped: the port may be handed out again."""
        self._booked.discard((host, port))


class LocalProcess:
    """An engine running as a child process group on this machine; `on_stopped` is called once, when a stop
    has ended (its port may go to another replica then)."""

    def __init__(
        self,
        process: asyncio.subprocess.Process,
        url: str,
        log_path: Path | None = None,
        on_stopped: Callable[[], None] | None = None,
    ) -> None:
        self._process = process
        self.url = url
        self.pid: int | None = process.pid
        self.log_path = log_path
        self._on_stopped = on_stopped

    async def wait(self) -> int:
        return await self._process.wait()

    async def stop(self, grace: float) -> None:
        try:
            await self._stop(grace)
        finally:
            stopped, self._on_stopped = self._on_stopped, None
            if stopped is not None:
                stopped()

    async def _stop(self, grace: float) -> None:
        if self._process.returncode is not None:
            self._signal_group(signal.SIGKILL)  # reap anything the engine left in its group
            return
        self._signal_group(signal.SIGTERM)
        try:
            await asyncio.wait_for(self._process.wait(), grace)
        except TimeoutError:
            self._signal_group(signal.SIGKILL)
            try:  # a process in an uninterruptible sleep (a GPU driver's hang) outlives even SIGKILL
                await asyncio.wait_for(self._process.wait(), _KILLED_WAIT_S)
            except TimeoutError:
                logger.error(
                    "engine process %s did not exit %.0f s after SIGKILL (stuck in the kernel: a GPU "
                    "driver hang?); left behind, its GPUs may still be held",
                    self.pid,
                    _KILLED_WAIT_S,
                )
                return
        self._signal_group(signal.SIGKILL)

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._process.pid, sig)


class LocalProcessRuntime:
    """Runs each replica as a local process on a free port (booked in `ports` until it has stopped), a vLLM
    CPU replica on cores booked in `cores` the same way, logging to `<logs>/<replica>.log`."""

    assigns_gpus = False

    def __init__(
        self,
        logs: Path,
        host: str = "127.0.0.1",
        ports: PortBook | None = None,
        cores: CoreBook | None = None,
    ) -> None:
        self._logs = logs
        self._host = host
        self._ports = ports if ports is not None else PortBook()
        self._cores = cores if cores is not None else CoreBook()

    async def start(self, replica_id: str, plan: LaunchPlan) -> RunningReplica:
        if plan.url is not None:
            return AttachedReplica(plan.url)
        host, port = self._host, self._ports.take(self._host)
        cores: list[int] = []

        def stopped() -> None:
            self._ports.release(host, port)
            self._cores.release(cores)

        try:
            env, cores = self._cores.take(plan.env)
            process, log_path = await self._spawn(replica_id, replace(plan, env=env), port)
        except BaseException:
            stopped()
            raise
        return LocalProcess(process, f"http://{host}:{port}", log_path, on_stopped=stopped)

    async def _spawn(
        self, replica_id: str, plan: LaunchPlan, port: int
    ) -> tuple[asyncio.subprocess.Process, Path]:
        argv = [arg.format(host=self._host, port=port) for arg in plan.argv]
        self._logs.mkdir(parents=True, exist_ok=True)
        log_path = self._logs / log_name(replica_id)
        with log_path.open("ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(argv)}\n".encode())
            log.flush()
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, **plan.env},
                start_new_session=True,
                preexec_fn=die_with_parent(plan.death_signal) if sys.platform == "linux" else None,
            )
        return process, log_path


def log_name(replica_id: str) -> str:
    """A replica's log's file name: its id, a `/` (a model named `org/model`) escaped as in a URL, so that
    no two replicas' ids share a name (`a/b-0` and `a_b-0`)."""
    return quote(replica_id, safe="") + ".log"


def log_tail(path: Path | None, lines: int = 6, max_bytes: int = 16384) -> list[str]:
    """The last non-empty lines of a replica's log (of its latest start), for a failure report."""
    if path is None:
        return []
    try:
        with path.open("rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - max_bytes))
            text = log.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    latest = text.rsplit("\n=== ", 1)[-1].split("\n", 1)[-1] if "\n=== " in text else text
    return [line.rstrip() for line in latest.splitlines() if line.strip()][-lines:]


def rotate_log(path: Path, max_bytes: int, keep: int) -> bool:
    """Rotate a replica's log once it is over `max_bytes`: `<log>.1` … `<log>.<keep>` move one along (the
    oldest is dropped), the log is copied to `<log>.1` and emptied in place. The engine keeps its file
    open and appends to it (opened O_APPEND), so it goes on writing at the emptied file's start; output it
    writes between the copy's end and the emptying is lost (logrotate's `copytruncate`). Whether it
    rotated; a log that cannot be read or written is left as it is (logged)."""
    try:
        if path.stat().st_size <= max_bytes:
            return False
        for number in range(keep - 1, 0, -1):
            older = path.with_name(f"{path.name}.{number}")
            if older.exists():
                older.replace(path.with_name(f"{path.name}.{number + 1}"))
        if keep:
            shutil.copyfile(path, path.with_name(f"{path.name}.1"))
        os.truncate(path, 0)
    except OSError as exc:
        logger.warning("could not rotate the replica log %s: %s", path, exc)
        return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the engine binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> Callable[[], None]:
    """The child's `preexec_fn`: the kernel sends it `sig` when corral exits without stopping it (kill -9, a
    crash). A parent that died between the fork and the request is noticed too (the kernel would not)."""
    parent = os.getpid()

    def pact() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return pact
