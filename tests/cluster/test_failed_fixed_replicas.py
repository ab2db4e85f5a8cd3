"""Fixed-count deployments and the replicas the supervisor gave up on (failed after max_start_failures): an
apply does not count them as running (it replaces them, and says so), the reconciler's loop replaces them
with the autoscaler's backoff; a rollout takes the new spec's count; replicas an apply adds run the model's
revision. A real reconciler on a supervisor that is not started (its replicas are only declared)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

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
    """Replicas in `failing` cannot be launched; any other never gets past its start (nothing runs)."""

    assigns_gpus = False

    def __init__(self, failing: set[str]) -> None:
        self.failing = failing

    async def start(self, replica_id: str, plan: LaunchPlan) -> object:
        if replica_id in self.failing:
            raise RuntimeError("no GPU")
        await asyncio.Event().wait()
        raise AssertionError


async def told(model: ModelSpec) -> None:
    return None


@pytest.fixture
async def cluster() -> AsyncIterator[Reconciler]:
    """Two replicas of alpha started, alpha-0 starting (for ever), alpha-1 given up on."""
    running = spec()
    supervisor = Supervisor(ReplicaSet(), Runtime({"alpha-1", "alpha-2"}), running.supervisor)  # type: ignore[arg-type]
    engine, plans = prepare(running.models[0], running.models[0].deployments[0])
    failed = supervisor.add("alpha", engine, plans)[1]
    await supervisor.start()
    reconciler = Reconciler(supervisor, running, prepare, told, gpu_count=lambda: 8)
    try:
        await until(lambda: failed.state is ReplicaState.FAILED, "alpha-1 given up on")
        yield reconciler
    finally:
        await reconciler.stop()
        await asyncio.gather(*reconciler.autoscaler._drains, return_exceptions=True)
        await supervisor.stop()


def ids(reconciler: Reconciler) -> list[str]:
    return [r.id for r in reconciler.autoscaler._supervisor.members("alpha")]


async def until(condition: Callable[[], bool], what: str, within: float = 3.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def test_an_apply_replaces_a_failed_replica_and_says_so(cluster: Reconciler) -> None:
    """Before, the failed replica counted toward `replicas`: `nothing to change`, and it never ran again."""
    changes = await cluster.apply(spec(), grace_s=1.0)
    assert [(c["action"], c["replicas"]) for c in changes] == [("scale_up", 1)]
    assert "in place of failed alpha-1" in str(changes[0]["detail"])
    await until(lambda: ids(cluster) == ["alpha-0", "alpha-2"], "alpha-1 drained, alpha-2 in its place")


async def test_a_lower_count_drains_the_failed_replica_not_a_serving_one(cluster: Reconciler) -> None:
    changes = await cluster.apply(spec(replicas=1), grace_s=1.0)
    assert [(c["action"], c["detail"]) for c in changes] == [
        ("drain_failed", "failed alpha-1 drained, 1 left")
    ]
    await until(lambda: ids(cluster) == ["alpha-0"], "only the failed replica drained")


async def test_the_reconcilers_loop_replaces_failed_replicas_with_backoff(cluster: Reconciler) -> None:
    """Before, nothing ever started a fixed-count deployment's failed replica again."""
    cluster.start([])
    await until(lambda: "alpha-2" in ids(cluster), "replaced at once the first time")
    # its replacement (alpha-2) fails too: drained, and the next one waits
    await until(lambda: ids(cluster) == ["alpha-0"], "the failed replacement drained")
    supervisor = cluster.autoscaler._supervisor
    await asyncio.sleep(0.5)
    assert ids(cluster) == ["alpha-0"]  # held back (30 s), not started again at once
    events = [str(e["message"]) for e in supervisor.replicas.events]
    assert any(m.startswith("replace alpha-2 in 30s") for m in events), events


async def test_an_apply_while_a_replacement_backs_off_replaces_it_once(cluster: Reconciler) -> None:
    """The failed replica drained, its replacement owed for 30 s: an apply then saw the deployment one
    short and added a replica, and when the wait ended the loop started the owed one too, on the GPU the
    apply's replica had taken (three replicas where the spec says two, two on one GPU)."""
    cluster.start([])
    await until(lambda: "alpha-2" in ids(cluster), "replaced at once the first time")
    await until(lambda: ids(cluster) == ["alpha-0"], "the failed replacement drained")
    changes = await cluster.apply(spec(), grace_s=1.0)  # (the same spec: any apply)
    assert [(c["action"], c["detail"]) for c in changes] == [
        ("scale_up", "1 replica added, 2 now, in place of failed alpha-2")
    ]
    fixed = cluster.autoscaler._fixed[("alpha", 0)]
    fixed.held_until = time.monotonic()  # (the backoff ends)
    await asyncio.sleep(0.5)
    supervisor = cluster.autoscaler._supervisor
    assert len(ids(cluster)) == 2, ids(cluster)
    gpus = [supervisor.plan_gpus(supervisor.unit(r)[2]) for r in ids(cluster)]
    assert len(set(gpus)) == 2, gpus


async def test_a_rollout_takes_the_new_specs_count_and_apply_adds_at_the_models_revision(
    cluster: Reconciler,
) -> None:
    """Before, a rollout with a count change kept the count running now (the change dropped without a
    word), and a scale-up's replicas ran revision 0 beside a rollout's."""
    units, _ = cluster._units(spec(replicas=3, time_scale=25).models[0])
    assert len(units) == 3
    supervisor = cluster.autoscaler._supervisor
    for replica in supervisor.members("alpha"):
        replica.revision = 2
    await cluster.apply(spec(replicas=3), grace_s=1.0)
    added = [r for r in supervisor.members("alpha") if r.id not in ("alpha-0", "alpha-1")]
    assert [r.revision for r in added] == [2, 2]


async def test_a_rolled_back_rollout_keeps_the_replacement_it_found_owed(cluster: Reconciler) -> None:
    """A failed replica's replacement owed (backing off) when a rollout began: the reconciler's loop forgot
    it as soon as the rollout froze the model, and after a rollback the deployment ran one replica short
    for good (here alpha-0 alone, where the spec says two). An unrelated apply meanwhile must not settle
    it either (the rollout, not the apply, owns the model's replicas)."""
    cluster.start([])
    await until(lambda: "alpha-2" in ids(cluster), "replaced at once the first time")
    await until(lambda: ids(cluster) == ["alpha-0"], "the failed replacement drained, its own owed")
    assert cluster.autoscaler.owed("alpha", 0) == ["alpha-2"]
    changes = await cluster.apply(spec(time_scale=25), grace_s=1.0)
    assert [c["action"] for c in changes] == ["rollout"]
    await until(lambda: len(ids(cluster)) == 2, "the rollout's first new replica started")
    assert await cluster.apply(spec(time_scale=25), grace_s=1.0) == []  # (the spec again: no change)
    await cluster.rollout_action("alpha", "rollback")
    supervisor = cluster.autoscaler._supervisor
    await until(
        lambda: (
            supervisor.replicas.rollouts["alpha"]["phase"] == "rolled_back"
            and "alpha" not in cluster.autoscaler.frozen
        ),
        "rolled back",
    )
    assert ids(cluster) == ["alpha-0"]
    assert cluster.autoscaler.owed("alpha", 0) == ["alpha-2"]
    cluster.autoscaler._fixed[("alpha", 0)].held_until = time.monotonic()  # (the backoff ends)
    await until(lambda: len(ids(cluster)) == 2, "the owed replacement started")
    assert [supervisor.unit(r)[0] for r in ids(cluster)] == [0, 0]


async def test_an_apply_while_a_rollback_is_put_back_is_refused_and_the_count_holds() -> None:
    """An apply that comes while a rolled-back rollout is being put back (its outcome set, the gateways
    told the old settings, the model still frozen) is refused as during the rollout: it was taken, saw the
    deployment one replica short (its failed replica drained, its replacement owed) and scaled it up, and
    the owed replacement started too: three replicas for `replicas: 2`."""
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
