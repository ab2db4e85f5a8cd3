"""A replica's lifecycle at its edges, over small Python engines and stand-in runtimes: how long a start may
take, a port no two live replicas share, a log kept within its bounds by an engine that crashes soon after
each start, an engine's leftovers stopped on Ray as locally, and a stop that waits for a drain's."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from aiohttp import web
from aiohttp.test_utils import TestServer

from corral.cluster import LocalProcessRuntime, Supervisor
from corral.cluster.ray_runtime import _EngineHost
from corral.cluster.runtime import PortBook
from corral.config import SupervisorSettings
from corral.engines import LaunchPlan, SimEngineAdapter
from corral.routing import ReplicaSet, ReplicaState

from ..conftest import pid_alive

FAST = SupervisorSettings(
    probe_interval=0.2,
    probe_timeout=0.5,
    backoff_initial=0.05,
    backoff_max=0.05,
    stop_timeout=1.0,
    ready_timeout=5.0,
)

# An engine answering /health on its port after `delay` s, having written `noise` bytes of output, and
# exiting (code 1) `crash` s after its first answer (never where negative). (No braces: each argument is
# formatted with the replica's host and port.)
ENGINE = """
import http.server, os, sys, threading, time
port, delay, noise, crash = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
sys.stdout.write(("x" * 99 + chr(10)) * (noise // 100))
sys.stdout.flush()
time.sleep(delay)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        if crash >= 0:
            threading.Timer(crash, os._exit, (1,)).start()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def engine(
    delay: float = 0.0, noise: int = 0, crash: float = -1.0, startup_s: float | None = None
) -> LaunchPlan:
    argv = (sys.executable, "-c", ENGINE, "{port}", str(delay), str(noise), str(crash))
    return LaunchPlan(argv=argv, metrics_path=None, startup_s=startup_s)


def sizes_of(folder: Path) -> dict[str, int]:
    return {path.name: path.stat().st_size for path in folder.iterdir()}


async def until(condition: Callable[[], bool], within: float = 5) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_an_engines_own_startup_allowance_never_shortens_ready_timeout(tmp_path: Path) -> None:
    """vLLM's plan allows 600 s; an operator who sets a longer ready_timeout (a huge model) gets it."""
    supervisor = Supervisor(ReplicaSet(), LocalProcessRuntime(tmp_path), FAST)
    (replica,) = supervisor.add("m", SimEngineAdapter(), [engine(delay=1.0, startup_s=0.3)])
    try:
        await supervisor.start()
        await until(lambda: replica.state is ReplicaState.READY)
        assert replica.restarts == 0, replica.last_error
    finally:
        await supervisor.stop()


async def test_a_start_that_takes_too_long_names_the_deadline_it_was_given(tmp_path: Path) -> None:
    settings = FAST.model_copy(update={"ready_timeout": 0.5, "max_start_failures": 1})
    supervisor = Supervisor(ReplicaSet(), LocalProcessRuntime(tmp_path), settings)
    (replica,) = supervisor.add("m", SimEngineAdapter(), [engine(delay=30, startup_s=1.5)])
    try:
        await supervisor.start()
        await until(lambda: replica.state is ReplicaState.FAILED)
        assert replica.last_error is not None and replica.last_error.startswith("not ready within 1.5s")
    finally:
        await supervisor.stop()


async def test_no_two_live_replicas_are_handed_one_port(tmp_path: Path) -> None:
    """A port drawn free is free only until something binds it: a second draw may give it again (13% of
    batches of 64 did). It stays booked while its replica runs, and comes free once it has stopped."""
    draws = iter([40001, 40001, 40002, 40001])
    runtime = LocalProcessRuntime(tmp_path, ports=PortBook(draw=lambda host: next(draws)))
    sleeper = LaunchPlan(argv=("sleep", "30"))
    first = await runtime.start("m-0", sleeper)
    second = await runtime.start("m-1", sleeper)
    try:
        assert (first.url, second.url) == ("http://127.0.0.1:40001", "http://127.0.0.1:40002")
        await first.stop(1.0)
        third = await runtime.start("m-2", sleeper)
        assert third.url == "http://127.0.0.1:40001"
        await third.stop(1.0)
    finally:
        await asyncio.gather(first.stop(1.0), second.stop(1.0))
    real = PortBook()
    ports = [real.take("127.0.0.1") for _ in range(256)]
    assert len(set(ports)) == len(ports)


async def test_a_replica_that_crashes_soon_after_each_start_keeps_its_log_within_bounds(
    tmp_path: Path,
) -> None:
    """Its log used to be rotated only between probes of a ready replica: one that exited before the first
    probe interval grew without bound (30 MiB against 2 MiB). It is rotated before each start now."""
    limit, noise = 50 * 1024, 60_000  # each start writes more than the limit
    settings = FAST.model_copy(
        update={"probe_interval": 5.0, "replica_log_max_mb": limit / 2**20, "replica_log_keep": 1}
    )
    supervisor = Supervisor(ReplicaSet(), LocalProcessRuntime(tmp_path), settings)
    (replica,) = supervisor.add("m", SimEngineAdapter(), [engine(noise=noise, crash=0.05)])
    try:
        await supervisor.start()
        await until(lambda: replica.restarts >= 6, within=10)
    finally:
        await supervisor.stop()
    sizes = sizes_of(tmp_path)
    assert set(sizes) == {"m-0.log", "m-0.log.1"}, sizes
    assert sum(sizes.values()) <= 2 * (limit + noise + 1024), sizes  # (1 + keep) logs of a start or so each


async def test_a_ray_replicas_stop_ends_what_its_engine_left_behind_after_it_exited(tmp_path: Path) -> None:
    """vLLM's engine core and workers hold GPU memory: they must not outlive an API server that crashed.
    The Ray actor's stop SIGKILLs the engine's process group in the end, as a local replica's does."""
    spawner = (
        "import subprocess, sys\np = subprocess.Popen(['sleep', '60'])\nprint(p.pid, flush=True)\nsys.exit(3)"
    )
    host = _EngineHost()
    log = tmp_path / "m-0.log"
    host.start([sys.executable, "-c", spawner], {}, str(log), signal.SIGTERM, (1 << 20, 1), ("127.0.0.1", 0))
    assert host.wait() == 3
    child = int(log.read_text().split()[-1])
    try:
        assert pid_alive(child)
        host.stop(1.0)
        await until(lambda: not pid_alive(child), within=3)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


class _SlowToStop:
    """A running replica whose engine takes its time to stop (its SIGTERM grace), never healthy."""

    url, pid, log_path = "http://127.0.0.1:9", None, None

    def __init__(self, runtime: _SlowRuntime) -> None:
        self._runtime = runtime
        self._exit = asyncio.Event()

    async def wait(self) -> int:
        await self._exit.wait()
        return 0

    async def stop(self, grace: float) -> None:
        self._runtime.stopping += 1
        await asyncio.sleep(0.8)
        self._runtime.stopped.append(time.monotonic())
        self._exit.set()


class _SlowRuntime:
    assigns_gpus = False

    def __init__(self) -> None:
        self.stopping = 0  # stops begun
        self.stopped: list[float] = []  # when each ended

    async def start(self, replica_id: str, plan: LaunchPlan) -> _SlowToStop:
        return _SlowToStop(self)


async def test_stop_waits_for_the_engine_a_drain_is_stopping() -> None:
    """A drain (an apply's scale-down) cancels the replica's lifecycle, whose engine stop goes on: the drain
    ends, and `Supervisor.stop` returns, only once that engine has stopped."""
    runtime = _SlowRuntime()
    supervisor = Supervisor(ReplicaSet(), runtime, FAST.model_copy(update={"probe_interval": 0.05}))  # type: ignore[arg-type]
    (replica,) = supervisor.add("m", SimEngineAdapter(), [LaunchPlan(metrics_path=None)])
    await supervisor.start()
    drain = asyncio.ensure_future(supervisor.drain(replica.id, 0.0))
    await until(lambda: runtime.stopping == 1)  # (the drain has settled: its engine is being stopped)
    assert not runtime.stopped and not drain.done()
    await supervisor.stop()
    returned = time.monotonic()
    assert runtime.stopping == 1 and len(runtime.stopped) == 1 and runtime.stopped[0] <= returned
    await drain
    assert supervisor.replicas.of("m") == []


async def test_a_replica_whose_process_exited_is_not_made_ready_by_another_server_on_its_port() -> None:
    """Another process on its port (the engine could not bind it, and exited) answers its health check:
    that is a failed start, not a ready replica."""
    app = web.Application()

    async def healthy(request: web.Request) -> web.Response:
        return web.Response()

    app.router.add_get("/health", healthy)
    async with TestServer(app, host="127.0.0.1") as other:

        class Exited:
            url, pid, log_path = str(other.make_url("")).rstrip("/"), None, None

            async def wait(self) -> int:
                return 1

            async def stop(self, grace: float) -> None:
                return None

        class Runtime:
            assigns_gpus = False

            async def start(self, replica_id: str, plan: LaunchPlan) -> Exited:
                return Exited()

        settings = FAST.model_copy(update={"max_start_failures": 2})
        supervisor = Supervisor(ReplicaSet(), Runtime(), settings)  # type: ignore[arg-type]
        (replica,) = supervisor.add("m", SimEngineAdapter(), [LaunchPlan(metrics_path=None)])
        try:
            await supervisor.start()
            await until(lambda: replica.state is ReplicaState.FAILED)
            assert replica.last_error == "exited with code 1 while starting"
        finally:
            await supervisor.stop()
