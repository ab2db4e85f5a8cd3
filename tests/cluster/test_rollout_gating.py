"""Every rollout gates its new revision before a request reaches it, whatever runs now: a model scaled to
zero gets one new replica started and gated (a broken build rolls back having served nothing; a good one
completes and is then the autoscaler's, which takes it back to zero), and an embedding model's replicas,
which serve `/v1/embeddings` alone, are warmed up with an embedding and roll out (golden_eval cases, which
check text, are refused for them before anything changes). A real reconciler and supervisor; the replicas
are simulators running in this process, the sim engine's own launch plans pointed at them."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from aiohttp import web

from corral.cluster import LocalProcessRuntime, Supervisor
from corral.cluster.reconcile import Reconciler
from corral.config import ClusterSpec, DeploymentSpec, ModelSpec, Paths, SpecError, parse_spec
from corral.engines import EngineAdapter, LaunchPlan, SimEngineAdapter, launch_plans
from corral.perf import load_catalog
from corral.perf.calibration import calibrated_efficiency
from corral.routing import ReplicaSet
from corral.sim import SimFleet, SimOptions, build_server

AT_ZERO = """
auth: {{open: true}}
supervisor: {{probe_interval: 0.2, probe_timeout: 2}}
models:
  - name: m
    arch: llama-3.1-8b
    rollout:
      steps: [1.0]
      step_s: 0
      ready_timeout_s: 20
      golden_eval: [{{name: says, prompt: "Say something.", max_tokens: 4, regex: "\\\\S"}}]
    deployments:
      - engine: sim
        gpu: l4
        max_num_seqs: {build}
        replicas: 0
        autoscale: {{min_replicas: 0, max_replicas: 1, interval_s: 0.2, down_cooldown_s: 1}}
"""
EMBEDDING = """
auth: {{open: true}}
supervisor: {{probe_interval: 0.2, probe_timeout: 2}}
models:
  - name: e
    arch: llama-3.1-8b
    task: embed
    rollout: {{steps: [1.0], step_s: 0, ready_timeout_s: 20{golden}}}
    deployments: [{{engine: sim, gpu: l4, max_num_seqs: {build}}}]
"""
OLD, NEW, BROKEN = 4, 8, 16  # the builds (max_num_seqs) of the specs, each served at a URL of its own


class Cluster:
    """A reconciler over a started supervisor whose `prepare` gives the sim engine's plans for a
    deployment, each pointed at the URL serving its build (`max_num_seqs`)."""

    def __init__(self, spec: ClusterSpec, urls: dict[int, str], logs: Path) -> None:
        self.urls = urls
        self.engine = SimEngineAdapter()
        self.supervisor = Supervisor(ReplicaSet(), LocalProcessRuntime(logs), spec.supervisor)
        self.reconciler = Reconciler(self.supervisor, spec, self.prepare, self.tell)

    def prepare(self, model: ModelSpec, deployment: DeploymentSpec) -> tuple[EngineAdapter, list[LaunchPlan]]:
        plans = launch_plans(self.engine, model, deployment, Paths.from_env(), lambda *_: None)
        url = self.urls[deployment.max_num_seqs]
        return self.engine, [dataclasses.replace(p, argv=(), env={}, url=url) for p in plans]

    async def tell(self, model: ModelSpec) -> None:
        return None

    async def start(self) -> None:
        """Start what the spec runs, and the autoscaler (as `corral up` does)."""
        prepared = []
        for model in self.reconciler.spec.models:
            for deployment in model.deployments:
                most = deployment.autoscale.max_replicas if deployment.autoscale else deployment.replicas
                engine, plans = self.prepare(model, deployment.model_copy(update={"replicas": most}))
                self.supervisor.add(model.name, engine, plans[: deployment.replicas])
                prepared.append((model.name, engine, plans))
        await self.supervisor.start()
        self.reconciler.start(prepared)

    async def stop(self) -> None:
        await self.reconciler.stop()
        await self.supervisor.stop()

    async def roll_out(self, spec: ClusterSpec, model: str) -> dict[str, object]:
        """Apply `spec` (a rollout of `model`) and wait for the rollout's end: its last state."""
        revisions = self.reconciler._revisions.get(model, 0)
        changes = await self.reconciler.apply(spec, grace_s=2.0)
        assert [c["action"] for c in changes] == ["rollout"], changes
        await until(lambda: self.rollout(model).get("revision") == revisions + 1)
        await until(lambda: self.rollout(model).get("phase") in ("completed", "rolled_back"))
        await until(lambda: not self.reconciler._lock.locked() and not self.supervisor.replicas.splits)
        return self.rollout(model)

    def rollout(self, model: str) -> dict[str, object]:
        return self.supervisor.replicas.rollouts.get(model, {})

    def events(self) -> list[str]:
        return [str(e["message"]) for e in self.supervisor.replicas.events]


async def until(condition: Callable[[], bool], within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "not within the deadline"
        await asyncio.sleep(0.05)


def simulator(**options: object) -> SimOptions:
    return SimOptions(model="llama-3.1-8b", gpu="l4", time_scale=20, **options)  # type: ignore[arg-type]


@pytest.fixture
async def builds() -> AsyncIterator[tuple[dict[int, str], list[int]]]:
    """The builds of `m` and `e`: good generation simulators (OLD, NEW), a broken one (BROKEN) that is
    healthy but answers 500 to chat requests (counted in the list returned beside the URLs), and embedding
    simulators of `e` (OLD + 100, NEW + 100)."""
    catalog, efficiency = load_catalog(), calibrated_efficiency()
    fleet = SimFleet(
        [
            build_server(simulator(served_name="m"), catalog, efficiency),
            build_server(simulator(served_name="m"), catalog, efficiency),
            build_server(simulator(served_name="e", embed_dim=64), catalog, efficiency),
            build_server(simulator(served_name="e", embed_dim=384), catalog, efficiency),
        ]
    )
    await fleet.start([0, 0, 0, 0])
    asked: list[int] = []

    async def chat(request: web.Request) -> web.Response:
        asked.append(1)
        return web.json_response({"error": {"message": "the build is broken"}}, status=500)

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    broken = web.Application()
    broken.router.add_post("/v1/chat/completions", chat)
    broken.router.add_get("/health", health)
    runner = web.AppRunner(broken, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    urls = dict(zip([OLD, NEW, OLD + 100, NEW + 100], fleet.urls, strict=True))
    urls[BROKEN] = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield urls, asked
    await runner.cleanup()
    await fleet.stop()


def at_zero(build: int) -> ClusterSpec:
    return parse_spec(AT_ZERO.format(build=build), source="test")


async def test_a_broken_build_of_a_model_at_zero_rolls_back_having_served_nothing(
    builds: tuple[dict[int, str], list[int]], tmp_path: Path
) -> None:
    urls, asked = builds
    cluster = Cluster(at_zero(OLD), urls, tmp_path / "logs")
    await cluster.start()
    try:
        assert cluster.supervisor.members("m") == []  # idle at zero
        state = await cluster.roll_out(at_zero(BROKEN), "m")
        assert state["phase"] == "rolled_back", state
        assert "failed the gate: golden eval 'warm-up': the replica answered 500" in str(state["message"])
        assert len(asked) == 1  # the warm-up alone: no request of a client reached the broken build
        assert not any("passed the gate" in m for m in cluster.events())
        assert cluster.reconciler.spec == at_zero(OLD)  # the spec is rolled back too
        await until(lambda: cluster.supervisor.members("m") == [])  # the candidate drained: zero again
    finally:
        await cluster.stop()


async def test_a_rollout_at_zero_gates_one_new_replica_then_leaves_it_to_the_autoscaler(
    builds: tuple[dict[int, str], list[int]], tmp_path: Path
) -> None:
    urls, _ = builds
    cluster = Cluster(at_zero(OLD), urls, tmp_path / "logs")
    await cluster.start()
    try:
        state = await cluster.roll_out(at_zero(NEW), "m")
        assert state["phase"] == "completed", state
        assert any(m.endswith("passed the gate (1 golden prompts)") for m in cluster.events())
        serving = [(r.url, r.revision, r.ready) for r in cluster.supervisor.members("m")]
        assert serving == [(urls[NEW], 1, True)]
        assert cluster.reconciler.spec == at_zero(NEW)
        # idle, the autoscaler takes the model back to zero after down_cooldown_s (1 s)
        await until(lambda: cluster.supervisor.members("m") == [])
        assert any("scale down 1 → 0" in m for m in cluster.events())
    finally:
        await cluster.stop()


def embedding(build: int, golden: str = "") -> ClusterSpec:
    return parse_spec(EMBEDDING.format(build=build + 100, golden=golden), source="test")


async def test_a_rollout_of_an_embedding_model_warms_up_with_an_embedding_and_completes(
    builds: tuple[dict[int, str], list[int]], tmp_path: Path
) -> None:
    urls, _ = builds
    cluster = Cluster(embedding(OLD), urls, tmp_path / "logs")
    await cluster.start()
    try:
        await until(lambda: [r.ready for r in cluster.supervisor.members("e")] == [True])
        state = await cluster.roll_out(embedding(NEW), "e")
        assert state["phase"] == "completed", state
        assert [(r.url, r.revision) for r in cluster.supervisor.members("e")] == [(urls[NEW + 100], 1)]
    finally:
        await cluster.stop()


def test_golden_eval_on_an_embedding_model_is_a_spec_error() -> None:
    """Golden cases check generated text; an embedding model's gate is its warm-up embedding: a spec giving
    it golden cases is refused when it is read (by `spec check`, `up` and `apply` alike)."""
    golden = ', golden_eval: [{prompt: "cat", contains: "0."}]'
    with pytest.raises(SpecError, match=r"model 'e': rollout.golden_eval checks generated text"):
        embedding(NEW, golden)


async def test_a_rolled_back_build_gives_the_gateways_the_old_settings_without_waiting_on_an_apply(
    builds: tuple[dict[int, str], list[int]], tmp_path: Path
) -> None:
    """The gateways hold the new spec's settings (the response cache's version among them) from the
    rollout's start until told the old ones: a rollback tells them as the rollout ends, not once an apply
    preparing meanwhile lets go of the lock (the old replicas' answers were kept as the new revision's)."""
    urls, _ = builds
    cluster = Cluster(at_zero(OLD), urls, tmp_path / "logs")
    told: list[ModelSpec] = []

    async def tell(model: ModelSpec) -> None:
        told.append(model)

    cluster.reconciler._on_model = tell
    await cluster.start()
    try:
        await cluster.reconciler.apply(at_zero(BROKEN), grace_s=2.0)
        assert told == [at_zero(BROKEN).models[0]]
        async with cluster.reconciler._lock:  # (as an apply preparing a change of another model holds it)
            await until(lambda: cluster.rollout("m").get("phase") == "rolled_back")
            await until(lambda: told[-1] == at_zero(OLD).models[0], within=5)
    finally:
        await cluster.stop()


async def test_a_model_parked_at_zero_replicas_takes_a_new_build_without_a_rollout(
    builds: tuple[dict[int, str], list[int]], tmp_path: Path
) -> None:
    """A deployment fixed at `replicas: 0` (parked, not autoscaled) has nothing to gate or replace: a new
    build is taken as the spec, not rolled back for want of a replica to gate."""
    urls, asked = builds
    parked = at_zero(OLD).models[0]
    fixed = parked.model_copy(
        update={"deployments": [parked.deployments[0].model_copy(update={"autoscale": None, "replicas": 0})]}
    )
    spec = at_zero(OLD).model_copy(update={"models": [fixed]})
    cluster = Cluster(spec, urls, tmp_path / "logs")
    await cluster.start()
    try:
        wanted_model = fixed.model_copy(
            update={"deployments": [fixed.deployments[0].model_copy(update={"max_num_seqs": BROKEN})]}
        )
        wanted = spec.model_copy(update={"models": [wanted_model]})
        await cluster.reconciler.apply(wanted, grace_s=2.0)
        await until(lambda: not cluster.reconciler._lock.locked())
        assert cluster.reconciler.spec.models[0] == wanted_model
        assert cluster.rollout("m").get("phase") != "rolled_back" and cluster.supervisor.members("m") == []
        assert any("the new spec is taken" in m for m in cluster.events()) and not asked
    finally:
        await cluster.stop()


async def test_a_rollback_whose_old_settings_cannot_be_told_still_frees_the_model(
    builds: tuple[dict[int, str], list[int]], tmp_path: Path
) -> None:
    """Telling the gateways the old settings may fail (an adapter gone from its path): the rollback still
    hands the model back to the autoscaler and keeps the old spec, rather than leaving it frozen."""
    urls, _ = builds
    cluster = Cluster(at_zero(OLD), urls, tmp_path / "logs")

    async def tell(model: ModelSpec) -> None:
        if model == at_zero(OLD).models[0]:
            raise RuntimeError("the adapter's files are gone")

    cluster.reconciler._on_model = tell
    await cluster.start()
    try:
        state = await cluster.roll_out(at_zero(BROKEN), "m")
        assert state["phase"] == "rolled_back"
        assert "m" not in cluster.reconciler.autoscaler.frozen and cluster.reconciler.spec == at_zero(OLD)
    finally:
        await cluster.stop()
