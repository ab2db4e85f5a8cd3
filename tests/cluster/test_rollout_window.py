"""An apply that comes while a rolled-back rollout is being put back (its outcome set, the gateways told the
old settings, the model still frozen) is refused as during the rollout: it was taken, saw the deployment one
replica short (its failed replica drained, its replacement owed) and scaled it up, and the owed
replacement started too: three replicas for `replicas: 2`. The runtime here starts nothing that answers
(`alpha-1` fails at once, others never come up): the reconciler's counting is what is tested."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from corral.cluster import Supervisor
from corral.cluster.changes import ApplyError
from corral.cluster.reconcile import Reconciler
from corral.config import ClusterSpec, DeploymentSpec, ModelSpec, Paths, parse_spec
from corral.engines import EngineAdapter, LaunchPlan, SimEngineAdapter, launch_plans
from corral.routing import ReplicaSet, ReplicaState

SPEC = """
auth: {{open: true}}
supervisor: {{probe_interval: 0.1, max_start_failures: 1}}
models:
  - name: alpha
    arch: llama-3.1-8b
    deployments: [{{engine: sim, gpu: l4, replicas: {replicas}, time_scale: {time_scale}}}]
"""


def spec(replicas: int = 2, time_scale: int = 20) -> ClusterSpec:
    return parse_spec(SPEC.format(replicas=replicas, time_scale=time_scale), source="test")


def prepare(model: ModelSpec, deployment: DeploymentSpec) -> tuple[EngineAdapter, list[LaunchPlan]]:
    engine = SimEngineAdapter()
    return engine, launch_plans(engine, model, deployment, Paths.from_env(), lambda *_: None)


class Runtime:
    assigns_gpus = False

    def __init__(self, failing: set[str]) -> None:
        self.failing = failing

    async def start(self, replica_id: str, plan: LaunchPlan) -> object:
        if replica_id in self.failing:
            raise RuntimeError("no GPU")
        await asyncio.Event().wait()
        raise AssertionError


async def until(condition: Callable[[], bool], what: str, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def test_an_apply_while_a_rollback_is_put_back_is_refused_and_the_count_holds() -> None:
    running = spec()
    supervisor = Supervisor(ReplicaSet(), Runtime({"alpha-1", "alpha-2"}), running.supervisor)  # type: ignore[arg-type]
    engine, plans = prepare(running.models[0], running.models[0].deployments[0])
    failed = supervisor.add("alpha", engine, plans)[1]
    await supervisor.start()
    window: dict[str, asyncio.Future[object]] = {}
    told_models: list[ModelSpec] = []

    async def told(model: ModelSpec) -> None:
        """The gateways told a model's settings: the rollout's new ones as it starts, the old ones when it
        has rolled back (the model still frozen): then an operator's apply comes."""
        told_models.append(model)
        if len(told_models) == 2 and "alpha" in reconciler.autoscaler.frozen:
            window["apply"] = asyncio.ensure_future(reconciler.apply(spec(time_scale=25), grace_s=1.0))
            await asyncio.sleep(0.1)  # (the apply asks for the lock while the rollback is put back)

    reconciler = Reconciler(supervisor, running, prepare, told, gpu_count=lambda: 8)
    ids = lambda: [r.id for r in supervisor.members("alpha")]  # noqa: E731
    try:
        await until(lambda: failed.state is ReplicaState.FAILED, "alpha-1 given up on")
        reconciler.start([])
        await until(lambda: reconciler.autoscaler.owed("alpha", 0) == ["alpha-2"], "alpha-2 owed")
        await until(lambda: ids() == ["alpha-0"], "drained")
        assert [c["action"] for c in await reconciler.apply(spec(time_scale=25), grace_s=1.0)] == ["rollout"]
        await until(lambda: len(ids()) == 2, "the rollout's first new replica")
        await reconciler.rollout_action("alpha", "rollback")
        await until(lambda: "apply" in window, "an apply while the rollback is put back")
        with pytest.raises(ApplyError, match="a rollout of alpha is still running"):
            await window["apply"]
        await until(lambda: "alpha" not in reconciler.autoscaler.frozen, "unfrozen")
        assert reconciler.autoscaler.owed("alpha", 0) == ["alpha-2"]  # (still owed: it starts when due)
        assert len(ids()) <= 2, ids()
    finally:
        await reconciler.stop()
        await supervisor.stop()
