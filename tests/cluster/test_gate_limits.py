"""The golden-eval gate's limits: a candidate that takes connections and never answers fails within the
rollout's own limits (named in the verdict), not a fixed 120 s; a rollback asked for while it is gated
stops the gate at once. An engine's load says how old it is on the monotonic clock."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from corral.cluster import Supervisor
from corral.cluster.evalgate import gate_adapter, run_gate
from corral.cluster.rollout import Rollout, _Abort
from corral.config import AdapterSpec, EvalCase, RolloutSpec, SupervisorSettings
from corral.engines import EngineLoad
from corral.routing import Replica, ReplicaSet


@pytest.fixture
async def silent() -> AsyncIterator[str]:
    """A URL whose server takes connections and reads, answers, nothing."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.setblocking(False)
    held: list[socket.socket] = []

    async def accept() -> None:
        while True:
            conn, _ = await asyncio.get_running_loop().sock_accept(server)
            held.append(conn)

    accepting = asyncio.create_task(accept())
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    accepting.cancel()
    for conn in held:
        conn.close()
    server.close()


async def test_a_candidate_that_never_answers_fails_within_the_rollouts_limit(silent: str) -> None:
    replica = Replica(id="m-1", model="m", engine="sim", url=silent)
    cases = [EvalCase(name="q", prompt="2+2?", max_tokens=4, contains="4")]
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        verdict = await run_gate(
            session, replica, cases, 0.2, 0.5, timeout_name="the rollout's ready_timeout_s"
        )
    assert time.monotonic() - started < 3
    assert verdict == "golden eval 'warm-up': no answer within 0.5s (the rollout's ready_timeout_s)"


async def test_a_rollback_stops_the_gate_at_once() -> None:
    supervisor = Supervisor(ReplicaSet(), None, SupervisorSettings())  # type: ignore[arg-type]
    rollout = Rollout(supervisor, "m", [], RolloutSpec(), 1, 1.0)

    async def gate() -> str | None:
        await asyncio.sleep(60)  # a gate waiting out its requests' timeouts
        return None

    gating = asyncio.create_task(rollout._unless_aborted(gate()))
    await asyncio.sleep(0.05)
    rollout.abort("rollback asked for")
    with pytest.raises(_Abort, match="rollback asked for"):
        await asyncio.wait_for(gating, 2)


def test_a_loads_age_is_on_the_monotonic_clock() -> None:
    """Before, only the wall clock's time was kept: stepped back an hour, a reading 10 minutes old passed
    for fresh."""
    load = EngineLoad(running=0, waiting=0)
    assert abs(load.scraped_monotonic - time.monotonic()) < 1


async def test_an_adapters_gate_on_a_replica_that_never_answers_ends_within_its_bound(
    silent: str, tmp_path: Path
) -> None:
    """A replacing adapter's gate runs inside an apply, holding every other apply back: its load request
    had no limit at all (a hung replica held the apply lock for good), and its requests waited the
    rollout's ready_timeout_s (900 s by default). Each waits 120 s at most (`most_s`: 0.3 here)."""
    replica = Replica(id="m-1", model="m", engine="vllm", url=silent)
    adapter = AdapterSpec.model_validate({"name": "tuned", "source": {"path": str(tmp_path)}})
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        verdict = await gate_adapter(session, replica, adapter, str(tmp_path), RolloutSpec(), most_s=0.3)
    assert time.monotonic() - started < 3
    assert verdict is not None and "within 0.3s (an adapter's gate at most (0.3 s))" in verdict
