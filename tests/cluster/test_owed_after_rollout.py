"""A fixed-count deployment's replacement owed for a failed replica (backing off) when a rollout of its
model completes is owed no more: the new revision runs the spec's count, and the owed one (the old spec's
engine and plan) started afterwards would run a third replica of the old revision beside them. (A rollout
rolled back keeps it: tests/cluster/test_failed_fixed_replicas.py.) A real reconciler and supervisor; the
replicas are simulators in this process, the sim engine's launch plans pointed at them, one at a URL where
nothing answers (its replica is given up on)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

from corral.cluster import LocalProcessRuntime, Supervisor, free_port
from corral.cluster.reconcile import Reconciler
from corral.config import ClusterSpec, DeploymentSpec, ModelSpec, Paths, parse_spec
from corral.engines import EngineAdapter, LaunchPlan, SimEngineAdapter, launch_plans
from corral.perf import load_catalog
from corral.perf.calibration import calibrated_efficiency
from corral.routing import ReplicaSet, ReplicaState
from corral.sim import SimFleet, SimOptions, build_server

SPEC = """
auth: {{open: true}}
supervisor: {{probe_interval: 0.1, probe_timeout: 2, ready_timeout: 1, max_start_failures: 1}}
models:
  - name: m
    arch: llama-3.1-8b
    rollout: {{steps: [1.0], step_s: 0, ready_timeout_s: 20}}
    deployments: [{{engine: sim, gpu: l4, replicas: 2, max_num_seqs: {build}}}]
"""
OLD, NEW = 4, 8  # the builds (max_num_seqs): the old one's second plan points where nothing answers


def spec(build: int) -> ClusterSpec:
    return parse_spec(SPEC.format(build=build), source="test")


async def until(condition: Callable[[], bool], what: str, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def test_a_completed_rollout_owes_no_replacement_of_the_old_revision(tmp_path: Path) -> None:
    catalog, efficiency = load_catalog(), calibrated_efficiency()
    options = SimOptions(model="llama-3.1-8b", gpu="l4", time_scale=20, served_name="m")
    fleet = SimFleet([build_server(options, catalog, efficiency) for _ in (OLD, NEW)])
    await fleet.start([0, 0])
    urls = {OLD: [fleet.urls[0], f"http://127.0.0.1:{free_port()}"], NEW: [fleet.urls[1]] * 2}
    engine = SimEngineAdapter()

    def prepare(model: ModelSpec, deployment: DeploymentSpec) -> tuple[EngineAdapter, list[LaunchPlan]]:
        plans = launch_plans(engine, model, deployment, Paths.from_env(), lambda *_: None)
        at = zip(plans, urls[deployment.max_num_seqs], strict=True)
        return engine, [dataclasses.replace(p, argv=(), env={}, url=url) for p, url in at]

    async def told(model: ModelSpec) -> None:
        return None

    running = spec(OLD)
    supervisor = Supervisor(ReplicaSet(), LocalProcessRuntime(tmp_path / "logs"), running.supervisor)
    reconciler = Reconciler(supervisor, running, prepare, told, gpu_count=lambda: 8)
    supervisor.add("m", *prepare(running.models[0], running.models[0].deployments[0]))
    await supervisor.start()
    reconciler.start([])
    try:
        # m-1 given up on, replaced at once by m-2 (the same plan), given up on too: owed, backing off
        await until(lambda: reconciler.autoscaler.owed("m", 0) == ["m-2"], "m-2's replacement owed")
        await until(lambda: supervisor.members("m")[0].state is ReplicaState.READY, "m-0 ready")
        assert [c["action"] for c in await reconciler.apply(spec(NEW), grace_s=1.0)] == ["rollout"]
        await until(lambda: supervisor.replicas.rollouts.get("m", {}).get("phase") == "completed", "done")
        await until(lambda: "m" not in reconciler.autoscaler.frozen, "the rollout's end taken")
        assert [(r.url, r.revision) for r in supervisor.members("m")] == [(fleet.urls[1], 1)] * 2
        assert reconciler.autoscaler.owed("m", 0) == []
    finally:
        await reconciler.stop()
        await asyncio.gather(*reconciler.autoscaler._drains, return_exceptions=True)
        await supervisor.stop()
        await fleet.stop()
