"""A rollout's golden-eval gate holds the new replica's answers to the spec's `rollout.eval_latency_s`: a
rollout of a model whose new replica (simulated, on an L4's real-time step times) answers the golden prompt
slower than the bound rolls back with the old replica still serving, and the same rollout with a bound the
answers meet completes (a real supervisor and rollout; the replicas are simulators already running)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from corral.cluster import LocalProcessRuntime, Supervisor
from corral.cluster.rollout import Rollout
from corral.config import parse_spec
from corral.engines import LaunchPlan, SimEngineAdapter
from corral.perf import load_catalog
from corral.perf.calibration import calibrated_efficiency
from corral.routing import ReplicaSet
from corral.sim import SimFleet, SimOptions, build_server

SPEC = """
auth: {{open: true}}
supervisor: {{probe_interval: 0.2, probe_timeout: 2}}
models:
  - name: m
    arch: llama-3.1-8b
    rollout:
      steps: [1.0]
      step_s: 0
      ready_timeout_s: 20
      golden_eval: [{{name: story, prompt: "Tell a story.", max_tokens: 16, regex: "\\\\S"}}]
      eval_latency_s: {latency}
    deployments:
      - {{engine: sim, gpu: l4, max_num_seqs: 4}}
"""


@pytest.fixture
async def engines() -> AsyncIterator[list[str]]:
    """Two simulated replicas of `m` in real time, the running revision's and the new one's: on an L4 an
    8B model's one-token warm-up takes about 0.08 s, the golden answer's 16 decode steps about 1.2 s."""
    options = SimOptions(model="llama-3.1-8b", gpu="l4", time_scale=1, served_name="m")
    catalog, efficiency = load_catalog(), calibrated_efficiency()
    fleet = SimFleet([build_server(options, catalog, efficiency) for _ in range(2)])
    await fleet.start([0, 0])
    yield fleet.urls
    await fleet.stop()


async def roll_out(
    engines: list[str], tmp_path: Path, latency: float
) -> tuple[str, str, list[tuple[str, int]]]:
    """Roll `m` from a replica on the first engine to one on the second under a spec with
    `eval_latency_s: latency`: (outcome, the rollout's last message, the replicas serving then)."""
    spec = parse_spec(SPEC.format(latency=latency), source="test")
    model = spec.models[0]
    engine = SimEngineAdapter()
    supervisor = Supervisor(ReplicaSet(), LocalProcessRuntime(tmp_path / "logs"), spec.supervisor)
    supervisor.add("m", engine, [LaunchPlan(url=engines[0], capacity=4)])
    await supervisor.start()
    try:
        new = [(0, engine, LaunchPlan(url=engines[1], capacity=4))]
        rollout = Rollout(supervisor, "m", new, model.rollout, revision=1, grace_s=1)
        outcome = await rollout.run()
        serving = [(r.id, r.revision) for r in supervisor.replicas.of("m") if r.ready]
        return outcome, rollout.state["message"], serving
    finally:
        await supervisor.stop()


async def test_a_new_replica_slower_than_eval_latency_s_is_rolled_back(
    engines: list[str], tmp_path: Path
) -> None:
    outcome, message, serving = await roll_out(engines, tmp_path, latency=0.6)
    assert outcome == "rolled_back"
    assert "m-1 failed the gate: golden eval 'story'" in message, message  # the warm-up was in time
    assert "over the 0.6s limit" in message, message
    assert serving == [("m-0", 0)]  # the old revision serves on, the candidate got no traffic


async def test_a_new_replica_within_eval_latency_s_takes_over(engines: list[str], tmp_path: Path) -> None:
    outcome, message, serving = await roll_out(engines, tmp_path, latency=10)
    assert outcome == "completed", message
    assert serving == [("m-1", 1)]
