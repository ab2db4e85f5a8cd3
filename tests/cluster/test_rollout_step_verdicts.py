"""A rollout says what each traffic step judged: the requests the new revision served and failed in it, or
that no traffic reached it (the step then passes unjudged, as before), and whether engine TTFTs could be
compared; its state (`corral rollout status`) ends with the totals. A real supervisor and rollout over
simulated replicas already running; the requests are counted on the new replica as the gateway counts
them (`served`, `failures`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from corral.cli.control import _rollout_line
from corral.cluster import LocalProcessRuntime, Supervisor
from corral.cluster.rollout import Rollout, Unit
from corral.config import parse_spec
from corral.engines import LaunchPlan, SimEngineAdapter
from corral.perf import load_catalog
from corral.perf.calibration import calibrated_efficiency
from corral.routing import ReplicaSet
from corral.sim import SimFleet, SimOptions, build_server

SPEC = """
auth: {open: true}
supervisor: {probe_interval: 0.2, probe_timeout: 2}
models:
  - name: m
    arch: llama-3.1-8b
    rollout: {strategy: blue_green, steps: [0.5, 1.0], step_s: 1, ready_timeout_s: 20}
    deployments:
      - {engine: sim, gpu: l4, max_num_seqs: 4}
"""


@pytest.fixture
async def engines() -> AsyncIterator[list[str]]:
    options = SimOptions(model="llama-3.1-8b", gpu="l4", time_scale=20, served_name="m")
    catalog, efficiency = load_catalog(), calibrated_efficiency()
    fleet = SimFleet([build_server(options, catalog, efficiency) for _ in range(2)])
    await fleet.start([0, 0])
    yield fleet.urls
    await fleet.stop()


async def test_each_step_says_how_many_requests_it_judged_or_that_it_judged_none(
    engines: list[str], tmp_path: Path
) -> None:
    spec = parse_spec(SPEC, source="test")
    engine = SimEngineAdapter()
    supervisor = Supervisor(ReplicaSet(), LocalProcessRuntime(tmp_path / "logs"), spec.supervisor)
    supervisor.add("m", engine, [LaunchPlan(url=engines[0], capacity=4)])
    await supervisor.start()
    try:
        new: list[Unit] = [(0, engine, LaunchPlan(url=engines[1], capacity=4))]
        rollout = Rollout(supervisor, "m", new, spec.models[0].rollout, revision=1, grace_s=1)

        async def traffic_in_the_first_step() -> None:
            while rollout.state.get("step") != 1:  # noqa: ASYNC110 (the rollout's state is a plain dict)
                await asyncio.sleep(0.02)
            candidate = next(r for r in supervisor.replicas.of("m") if r.revision == 1)
            candidate.served, candidate.failures = candidate.served + 30, candidate.failures + 1

        counting = asyncio.create_task(traffic_in_the_first_step())
        outcome = await rollout.run()
        await counting
    finally:
        await supervisor.stop()
    assert outcome == "completed", rollout.state
    events = [str(e["message"]) for e in supervisor.replicas.events]
    first = next(m for m in events if m.startswith("step 1: ") and "traffic to" not in m)
    assert first == (  # (no request went through the engines: they report no TTFT)
        "step 1: revision 1 served 30 requests, 1 failed; TTFT not compared (not reported by both "
        "revisions' engines)"
    )
    assert "step 2: not judged: no traffic reached revision 1" in events, events
    assert (rollout.state["served"], rollout.state["failed"]) == (30, 1)
    shown = _rollout_line(rollout.state)  # what `corral rollout status` prints
    assert shown.endswith(
        "completed, 100% of traffic: every replica runs the new revision; its traffic "
        "steps judged 30 requests, 1 failed"
    ), shown
