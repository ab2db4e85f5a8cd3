"""The supervisor with the local process runtime, over real llama-server processes."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from corral.cluster import LocalProcessRuntime, Supervisor
from corral.config import SupervisorSettings
from corral.engines import LaunchPlan, LlamaCppEngine
from corral.routing import Replica, ReplicaSet, ReplicaState

from ..conftest import pid_alive

pytestmark = pytest.mark.slow  # real engines or servers, or long drills (`make test-fast` skips)

FAST = SupervisorSettings(
    probe_interval=0.3,
    probe_timeout=0.5,
    unhealthy_after=2,
    backoff_initial=0.2,
    backoff_max=1.0,
    stop_timeout=1.0,
    ready_timeout=60,
)


@pytest.fixture
async def supervisor(tmp_path: Path) -> AsyncIterator[Supervisor]:
    sup = Supervisor(ReplicaSet(), LocalProcessRuntime(tmp_path / "logs"), FAST)
    yield sup
    await sup.stop()


async def until(condition, within: float = 30) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


async def start_one(sup: Supervisor, plan: LaunchPlan) -> Replica:
    (replica,) = sup.add("smollm2", LlamaCppEngine(), [plan])
    await sup.start()
    await until(lambda: replica.ready)
    return replica


async def test_replica_becomes_ready_and_its_load_is_read(
    supervisor: Supervisor, llama_plan: LaunchPlan
) -> None:
    replica = await start_one(supervisor, llama_plan)
    assert replica.url.startswith("http://127.0.0.1:") and replica.pid
    await until(lambda: replica.load is not None, within=5)
    assert replica.load is not None and replica.load.running == 0
    assert supervisor.replicas.ready("smollm2") == [replica]


async def test_killed_replica_leaves_routing_at_once_and_is_restarted(
    supervisor: Supervisor, llama_plan: LaunchPlan
) -> None:
    replica = await start_one(supervisor, llama_plan)
    old_pid = replica.pid
    assert old_pid is not None
    os.kill(old_pid, signal.SIGKILL)
    await until(lambda: not replica.ready, within=1)
    await until(lambda: replica.ready and replica.pid != old_pid)
    assert replica.restarts == 1
    assert replica.last_error is not None and "exited with code -9" in replica.last_error


async def test_hung_replica_is_marked_unhealthy_then_replaced(
    supervisor: Supervisor, llama_plan: LaunchPlan
) -> None:
    replica = await start_one(supervisor, llama_plan)
    old_pid = replica.pid
    assert old_pid is not None
    os.kill(old_pid, signal.SIGSTOP)  # alive, accepts connections, never answers
    await until(lambda: replica.state is ReplicaState.UNHEALTHY, within=FAST.probe_interval + 2)
    await until(lambda: replica.ready and replica.pid != old_pid)
    assert "health probes" in (replica.last_error or "")
    assert not pid_alive(old_pid)


async def test_stop_ends_every_replica_process(supervisor: Supervisor, llama_plan: LaunchPlan) -> None:
    replicas = supervisor.add("smollm2", LlamaCppEngine(), [llama_plan, llama_plan])
    await supervisor.start()
    await until(lambda: all(r.ready for r in replicas))
    pids = [r.pid for r in replicas]
    await supervisor.stop()
    assert all(r.state is ReplicaState.STOPPED for r in replicas)
    assert not any(pid_alive(p) for p in pids if p)


async def test_crashing_engine_backs_off_exponentially(supervisor: Supervisor) -> None:
    crash = LaunchPlan(argv=("sh", "-c", "exit 3"))
    (replica,) = supervisor.add("broken", LlamaCppEngine(), [crash])
    started = time.monotonic()
    await supervisor.start()
    await until(lambda: replica.restarts >= 4, within=10)
    # backoffs 0.2 + 0.4 + 0.8 (+ start-up) before the 4th restart: not a tight loop
    assert time.monotonic() - started >= 1.4
    assert replica.last_error == "exited with code 3 while starting"
    assert replica.state is not ReplicaState.READY


async def test_a_new_replica_takes_a_plan_no_live_replica_of_its_deployment_holds(tmp_path: Path) -> None:
    settings = FAST.model_copy(update={"max_start_failures": 1})
    supervisor = Supervisor(ReplicaSet(), LocalProcessRuntime(tmp_path / "logs"), settings)
    gpus = [LaunchPlan(argv=("sh", "-c", "exit 3"), env={"CUDA_VISIBLE_DEVICES": str(i)}) for i in range(3)]
    try:
        (first,) = supervisor.add("m", LlamaCppEngine(), gpus[:1], group=0)
        supervisor.add("m", LlamaCppEngine(), gpus[:2], group=1)
        assert supervisor.unused_plans("m", 0, gpus) == gpus[1:]  # declared, not started: holds GPU 0
        assert supervisor.unused_plans("m", 1, gpus) == gpus[2:]  # each deployment counts its own
        alike = [LaunchPlan(argv=("llama-server",))] * 2
        assert supervisor.unused_plans("m", 0, alike) == alike  # plans that hold nothing of their own
        await supervisor.start()
        await until(lambda: first.state is ReplicaState.FAILED, within=10)
        await asyncio.sleep(0.1)  # its lifecycle has returned: the process is gone
        assert supervisor.unused_plans("m", 0, gpus) == gpus  # a failed replica holds no GPU
    finally:
        await supervisor.stop()


async def test_a_replica_given_up_on_is_drained_without_waiting_for_a_scrape(tmp_path: Path) -> None:
    """A drain waits for a scrape newer than itself saying the engine is idle: a replica whose engine is
    gone (it failed its starts) never gets one, and its drain ends at once, not after the whole grace."""
    from corral.engines import EngineLoad

    settings = FAST.model_copy(update={"max_start_failures": 1})
    supervisor = Supervisor(ReplicaSet(), LocalProcessRuntime(tmp_path / "logs"), settings)
    try:
        (replica,) = supervisor.add("m", LlamaCppEngine(), [LaunchPlan(argv=("sh", "-c", "exit 3"))])
        await supervisor.start()
        await until(lambda: replica.state is ReplicaState.FAILED, within=10)
        replica.load = EngineLoad(running=2, waiting=0, scraped_monotonic=time.monotonic() - 60)  # long ago
        began = time.monotonic()
        await supervisor.drain(replica.id, 10.0)
        assert time.monotonic() - began < 3
    finally:
        await supervisor.stop()


async def test_a_stop_leaves_behind_a_process_that_outlives_sigkill(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine stuck in the kernel (a GPU driver's hang) is not reaped even by SIGKILL: the stop gives up
    on it after a while, rather than holding the control plane (drains, applies, shutdown) for good."""
    from corral.cluster import runtime

    class Stuck:
        returncode = None
        pid = 2**22 + 12345  # (no such process: its signals go nowhere)

        async def wait(self) -> int:
            await asyncio.sleep(3600)
            return -9

    monkeypatch.setattr(runtime, "_KILLED_WAIT_S", 0.2)
    process = runtime.LocalProcess(Stuck(), "http://127.0.0.1:9")  # type: ignore[arg-type]
    began = time.monotonic()
    await process.stop(grace=0.2)
    assert time.monotonic() - began < 2


async def test_a_replica_the_cluster_has_no_room_for_waits_and_is_never_given_up(tmp_path: Path) -> None:
    """A runtime with no room for the replica (a Ray node rebooting) is no failure of the replica's: it is
    tried again, past `max_start_failures`, as no restart, and starts once there is room; a runtime whose
    watch raises (Ray's connection lost) has the replica started anew, not its lifecycle ended."""
    from corral.cluster.runtime import NoRoom

    class Crowded:
        assigns_gpus = False

        def __init__(self) -> None:
            self.tries = 0
            self.local = LocalProcessRuntime(tmp_path / "logs")

        async def start(self, replica_id: str, plan: LaunchPlan):  # type: ignore[no-untyped-def]
            self.tries += 1
            if self.tries <= 4:
                raise NoRoom("no Ray node has room for [{'GPU': 1.0}] (STRICT_PACK) within 0s")
            running = await self.local.start(replica_id, plan)
            if self.tries == 5:  # its watch fails once, as a Ray client's that lost the cluster
                real = running.wait

                async def lost() -> int:
                    await asyncio.sleep(0.3)
                    raise ConnectionError("Ray client disconnected")

                running.wait = lost  # type: ignore[method-assign]
                self.real_wait = real
            return running

    runtime = Crowded()
    settings = FAST.model_copy(update={"max_start_failures": 2, "backoff_max": 0.2})
    supervisor = Supervisor(ReplicaSet(), runtime, settings)  # type: ignore[arg-type]
    sleeper = LaunchPlan(argv=("sh", "-c", "sleep 30"), url="http://127.0.0.1:9")
    (replica,) = supervisor.add("m", LlamaCppEngine(), [sleeper])
    try:
        await supervisor.start()
        await until(lambda: runtime.tries >= 6, within=15)
        assert replica.state is not ReplicaState.FAILED
    finally:
        await supervisor.stop()
