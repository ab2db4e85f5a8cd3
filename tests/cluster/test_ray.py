"""The Ray runtime on a multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`), with nodes
declaring GPU resources, running real llama.cpp replicas as actors."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import ray
from ray.cluster_utils import Cluster

from corral.cluster import Supervisor
from corral.cluster.ray_runtime import RayRuntime
from corral.cluster.reconcile import Reconciler
from corral.config import ClusterSpec, GatewaySettings, Paths, SupervisorSettings, load_spec, parse_spec
from corral.engines import LaunchPlan, LlamaCppEngine, Resources, SimEngineAdapter, VllmEngine, launch_plans
from corral.gateway import GatewayServer
from corral.routing import ReplicaSet, ReplicaState, Router

from ..conftest import DATA
from ..gateway.conftest import make_services

pytestmark = pytest.mark.slow  # real engines or servers, or long drills (`make test-fast` skips)

SETTINGS = SupervisorSettings(
    probe_interval=0.5,
    # A failed probe takes a replica out of routing at once. With 1 s, a probe that was slow on the loaded
    # CI machine (Ray's processes and the whole suite on 2 cores) most likely made the one serving replica
    # of the joining-node test unroutable for a probe interval: 133 quick 503s in one CI run of 2026-12-03,
    # which no run alone or under a CPU hog reproduced. No test here relies on a probe timing out.
    probe_timeout=5,
    unhealthy_after=2,
    backoff_initial=0.2,
    backoff_max=1,
    stop_timeout=2,
    ready_timeout=60,
)
MESSAGES = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[tuple[Cluster, dict[str, object]]]:
    local = {"node_ip_address": "127.0.0.1"}  # every node on loopback: traffic stays on this machine
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "num_gpus": 0, **local})
    nodes = {
        "one_gpu": cluster.add_node(num_cpus=2, num_gpus=1, **local),
        "b": cluster.add_node(num_cpus=2, num_gpus=2, **local),
        "c": cluster.add_node(num_cpus=2, num_gpus=2, **local),
        "d": cluster.add_node(num_cpus=2, num_gpus=2, **local),
    }
    cluster.wait_for_nodes()
    ray.init(
        address=cluster.address, log_to_driver=False, include_dashboard=False, _node_ip_address="127.0.0.1"
    )
    yield cluster, nodes
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture
async def fleet(
    ray_cluster: tuple[Cluster, dict[str, object]], llama_plan: LaunchPlan, tmp_path: Path
) -> AsyncIterator[tuple[Supervisor, str]]:
    runtime = RayRuntime(tmp_path / "logs", placement_timeout=20)
    replicas = ReplicaSet()
    supervisor = Supervisor(replicas, runtime, SETTINGS)
    plan = dataclasses.replace(llama_plan, resources=Resources(gpus=2, cpus=1))
    supervisor.add("smollm2", LlamaCppEngine(), [plan, plan])
    await supervisor.start()
    gateway = GatewayServer(
        GatewaySettings(port=0), Router(replicas), make_services(replicas, tmp_path / "c.db")
    )
    await gateway.start()
    yield supervisor, f"http://127.0.0.1:{gateway.port}/v1"
    await gateway.stop()
    await supervisor.stop()


async def all_ready(supervisor: Supervisor, within: float = 90) -> None:
    deadline = time.monotonic() + within
    while not all(r.ready for r in supervisor.replicas):
        assert time.monotonic() < deadline, [(r.id, r.state, r.last_error) for r in supervisor.replicas]
        await asyncio.sleep(0.2)


def node_ids(nodes: dict[str, object]) -> dict[str, str]:
    return {name: node.node_id for name, node in nodes.items()}  # type: ignore[attr-defined]


async def test_replicas_run_as_actors_on_nodes_with_enough_gpus(
    ray_cluster: tuple[Cluster, dict[str, object]], fleet: tuple[Supervisor, str]
) -> None:
    supervisor, base_url = fleet
    await all_ready(supervisor)
    ids = node_ids(ray_cluster[1])
    placed = {r.node for r in supervisor.replicas.of("smollm2")}
    assert len(placed) == 2 and placed <= {ids["b"], ids["c"], ids["d"]}  # never the 1-GPU node
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
    for _ in range(4):
        reply = await client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=8)
        assert reply.choices[0].message.content


async def test_removing_a_node_moves_its_replica_and_traffic_keeps_flowing(
    ray_cluster: tuple[Cluster, dict[str, object]], fleet: tuple[Supervisor, str]
) -> None:
    cluster, nodes = ray_cluster
    supervisor, base_url = fleet
    await all_ready(supervisor)
    victim = supervisor.replicas.of("smollm2")[0]
    doomed = next(n for n in nodes.values() if n.node_id == victim.node)  # type: ignore[attr-defined]
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=60)
    answered = 0

    async def keep_asking() -> None:
        nonlocal answered
        while True:
            reply = await client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=4)
            assert reply.choices[0].message.content is not None
            answered += 1
            await asyncio.sleep(0.1)

    traffic = asyncio.create_task(keep_asking())
    await asyncio.sleep(0.5)
    cluster.remove_node(doomed, allow_graceful=False)
    started = time.monotonic()
    while not (victim.restarts >= 1 and victim.state is ReplicaState.READY):
        assert time.monotonic() - started < 90, victim.snapshot()
        assert not traffic.done(), traffic.exception()
        await asyncio.sleep(0.2)
    await asyncio.sleep(0.5)
    traffic.cancel()
    assert victim.node != doomed.node_id  # type: ignore[attr-defined]
    assert answered > 5
    ids = node_ids(nodes)
    assert victim.node in {ids["b"], ids["c"], ids["d"]}


async def test_a_replica_needing_more_gpus_than_any_node_has_is_refused(
    ray_cluster: tuple[Cluster, dict[str, object]], llama_plan: LaunchPlan, tmp_path: Path
) -> None:
    runtime = RayRuntime(tmp_path, placement_timeout=3)
    with pytest.raises(OSError, match="no Ray node has room"):
        await runtime.start("big-0", dataclasses.replace(llama_plan, resources=Resources(gpus=3)))


PROBE = Path(__file__).with_name("ray_engine_probe.py")


@pytest.fixture(scope="module")
def vllm_ray_plan() -> LaunchPlan:
    """vLLM's real launch plan for a replica on its Ray executor (TP=2), its server module swapped for the
    probe, which reports where the engine's Ray workers land."""
    spec: ClusterSpec = load_spec(DATA / "vllm-ray-cluster.yaml")
    model = spec.models[0]
    deployment = model.deployments[0]
    assert deployment.ray_workers
    (plan,) = launch_plans(VllmEngine(), model, deployment, Paths.from_env(), lambda _: None)
    assert Path(plan.argv[1]).name == "vllm_ray_entry.py"
    assert plan.argv[2] == "vllm.entrypoints.openai.api_server"
    server = (*plan.argv[:2], str(PROBE), *plan.argv[3:])
    return LaunchPlan(
        argv=server, env=plan.env, health_path="/health", resources=plan.resources, key_env=plan.key_env
    )


async def placement_of(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(url + "/placement") as response:
        return dict(await response.json())


async def start_ready(runtime: RayRuntime, replica_id: str, plan: LaunchPlan) -> Any:
    replica = await runtime.start(replica_id, plan)
    deadline = time.monotonic() + 180
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(replica.url + "/health") as response:
                    if response.status == 200:
                        return replica
            except aiohttp.ClientError:
                pass
            assert time.monotonic() < deadline, f"{replica_id} did not come up"
            await asyncio.sleep(0.5)


async def test_vllm_ray_workers_use_the_replicas_placement_group(
    ray_cluster: tuple[Cluster, dict[str, object]], vllm_ray_plan: LaunchPlan, tmp_path: Path
) -> None:
    assert vllm_ray_plan.resources == Resources(gpus=2, cpus=1, engine_workers=True)  # as its spec says
    runtime = RayRuntime(tmp_path, placement_timeout=20)
    replica = await start_ready(runtime, "smollm2-vllm-0", vllm_ray_plan)
    try:
        report = await placement_of(replica.url)
        groups = ray.util.placement_group_table()
        assert groups[report["group"]]["state"] == "CREATED"  # corral's group, not one vLLM made
        others = [g for key, g in groups.items() if key != report["group"] and g["state"] != "REMOVED"]
        assert not others  # vLLM reserved nothing of its own
        assert report["bundles"] == [{"GPU": 1.0, "CPU": 1.0}, {"GPU": 1.0}]
        workers = report["workers"]
        assert len(workers) == 2
        assert {w["node"] for w in workers} == {replica.node_id}  # tensor parallel ranks: one node
        assert sorted(g for w in workers for g in w["gpus"]) == ["0", "1"]  # one GPU each
        vllm_python = vllm_ray_plan.argv[0]
        assert all(w["executable"] == vllm_python and w["vllm"] for w in workers)  # vLLM's interpreter
        assert report["cuda_visible_devices"] is None  # the engine's own GPUs are its workers'
        # on the node's address, with no engine_api_key in the spec: a key of its own for this run
        assert replica.api_key and report["api_key"] == replica.api_key
    finally:
        await replica.stop(5)
    assert ray.util.placement_group_table()[report["group"]]["state"] == "REMOVED"


async def test_pipeline_stages_may_span_nodes_when_the_spec_allows(
    ray_cluster: tuple[Cluster, dict[str, object]], vllm_ray_plan: LaunchPlan, tmp_path: Path
) -> None:
    placement = Resources(gpus=3, cpus=1, engine_workers=True, span_nodes=True)  # no node has 3 GPUs
    runtime = RayRuntime(tmp_path, placement_timeout=20)
    plan = dataclasses.replace(vllm_ray_plan, resources=placement)
    replica = await start_ready(runtime, "smollm2-vllm-0", plan)
    try:
        workers = (await placement_of(replica.url))["workers"]
        assert len(workers) == 3 and len({w["node"] for w in workers}) >= 2
        assert replica.node_id in {w["node"] for w in workers}  # the engine sits with its first stage
    finally:
        await replica.stop(5)


async def test_engines_see_only_the_gpus_ray_assigned_them(
    ray_cluster: tuple[Cluster, dict[str, object]], tmp_path: Path
) -> None:
    plan = LaunchPlan(
        argv=(sys.executable, str(PROBE), "--host", "{host}", "--port", "{port}"),
        env={"CUDA_VISIBLE_DEVICES": "7"},  # a local device list from the spec: wrong on a Ray node
        health_path="/health",
        resources=Resources(gpus=1, cpus=0.5),
    )
    runtime = RayRuntime(tmp_path, placement_timeout=20)
    replicas = await asyncio.gather(*(start_ready(runtime, f"probe-{i}", plan) for i in range(3)))
    try:
        seen: dict[str, list[str]] = {}
        for replica in replicas:
            devices = (await placement_of(replica.url))["cuda_visible_devices"]
            assert devices is not None and len(devices.split(",")) == 1 and devices != "7"
            seen.setdefault(replica.node_id, []).append(devices)
        assert all(len(set(ids)) == len(ids) for ids in seen.values()), seen  # no GPU given out twice
    finally:
        await asyncio.gather(*(replica.stop(5) for replica in replicas))


async def test_stopping_a_replica_stops_its_engine_within_the_grace_period(
    ray_cluster: tuple[Cluster, dict[str, object]], tmp_path: Path
) -> None:
    """The actor stops the engine itself (SIGTERM, then the grace), while its other thread waits on the
    engine: with one thread the stop queued behind that wait until its timeout (grace + 5 s) and the
    actor was killed instead."""
    argv = (sys.executable, str(PROBE), "--host", "{host}", "--port", "{port}")
    plan = LaunchPlan(argv=argv, env={}, health_path="/health", resources=Resources(cpus=0.5))
    runtime = RayRuntime(tmp_path, placement_timeout=20)
    replica = await start_ready(runtime, "probe-0", plan)
    began = time.monotonic()
    await replica.stop(5)
    assert time.monotonic() - began < 5  # the probe exits on SIGTERM at once
    assert await asyncio.wait_for(replica.wait(), 5) == -signal.SIGTERM  # the engine's own exit, reported


async def test_a_ray_replicas_actor_rotates_its_engines_log(
    ray_cluster: tuple[Cluster, dict[str, object]], tmp_path: Path
) -> None:
    """The log is on the actor's node, out of the supervisor's reach: the actor rotates it by the limits
    `corral up` gives the runtime (supervisor.replica_log_max_mb, replica_log_keep), within a check or two."""
    argv = (sys.executable, str(PROBE), "--host", "{host}", "--port", "{port}")
    plan = LaunchPlan(argv=argv, env={}, health_path="/health", resources=Resources(cpus=0.5))
    runtime = RayRuntime(tmp_path, placement_timeout=20, log_limits=(4096, 1))
    replica = await start_ready(runtime, "probe-log", plan)
    try:
        log = tmp_path / "probe-log.log"
        with log.open("ab") as out:  # output beyond the limit, as the engine would write it
            out.write(b"spoken\n" + b"x" * 10_000 + b"\n")
        deadline = time.monotonic() + 15
        while log.stat().st_size > 4096:
            assert time.monotonic() < deadline, "the actor did not rotate its engine's log"
            await asyncio.sleep(0.2)
        assert b"spoken\n" in (tmp_path / "probe-log.log.1").read_bytes()
    finally:
        await replica.stop(5)


AUTOSCALED = """
auth: {open: true}
models:
  - name: alpha
    arch: llama-3.1-8b
    deployments:
      - engine: sim
        gpu: l4
        time_scale: 10
        max_num_seqs: 2
        ray_gpus: 4
        autoscale:
          {min_replicas: 1, max_replicas: 2, interval_s: 0.5, queue_wait_s: 0.3, down_cooldown_s: 600}
"""


async def test_an_engine_dies_with_its_actor_by_its_plans_signal(
    ray_cluster: tuple[Cluster, dict[str, object]], tmp_path: Path
) -> None:
    """A replica actor that dies takes its engine with it, even an engine that sleeps through SIGTERM
    (llama.cpp's server busy in a long prefill did, as a local replica): the engine's pact names the plan's
    signal, as a local replica's does. (Ray 2.60 also kills a dead worker's children itself, so this holds
    with a SIGTERM pact too: the test guards the behaviour, whichever of the two provides it.)"""
    argv = (sys.executable, str(PROBE), "--host", "{host}", "--port", "{port}", "--ignore-sigterm")
    plan = LaunchPlan(
        argv=argv, env={}, health_path="/health", death_signal=signal.SIGKILL, resources=Resources(cpus=0.5)
    )
    runtime = RayRuntime(tmp_path, placement_timeout=20)
    replica = await start_ready(runtime, "probe-0", plan)
    async with aiohttp.ClientSession() as session, session.get(replica.url + "/placement") as response:
        pid = (await response.json())["pid"]
    ray.kill(replica._actor)
    deadline = time.monotonic() + 10
    while b"zombie" not in _state(pid):  # (gone, or dead and not yet reaped)
        assert time.monotonic() < deadline, "the engine outlived its actor"
        await asyncio.sleep(0.1)
    with contextlib.suppress(ray.exceptions.RayError, ValueError):
        ray.util.remove_placement_group(replica._group)


def _state(pid: int) -> bytes:
    """The process's /proc status, lowered; "zombie" once it is gone."""
    try:
        return Path(f"/proc/{pid}/status").read_bytes().lower()
    except OSError:
        return b"zombie"


async def test_autoscaler_places_replicas_on_a_joining_node_and_a_node_drains_without_failures(
    ray_cluster: tuple[Cluster, dict[str, object]], tmp_path: Path
) -> None:
    """Each replica needs 4 GPUs (no node of the module's cluster has them): the first node that joins
    with 4 takes the first replica; under load the autoscaler asks for a second, which waits for room
    until another node joins and then runs there; draining the first node (admin API) cordons it in Ray
    and moves its traffic to the other without a failed request."""
    cluster, _ = ray_cluster
    local = {"node_ip_address": "127.0.0.1"}
    first = cluster.add_node(num_cpus=1, num_gpus=4, **local)
    spec = parse_spec(AUTOSCALED, source="test")
    runtime = RayRuntime(tmp_path / "logs", placement_timeout=120)
    supervisor = Supervisor(ReplicaSet(), runtime, SETTINGS)
    engine = SimEngineAdapter()
    plans = launch_plans(engine, spec.models[0], spec.models[0].deployments[0], Paths.from_env(), print)
    assert plans[0].resources.gpus == 4  # the deployment's ray_gpus
    supervisor.add("alpha", engine, plans[:1])
    services = make_services(supervisor.replicas, tmp_path / "c.db")

    async def told(model: object) -> None:
        return None

    reconciler = Reconciler(supervisor, spec, lambda m, d: (engine, plans), told, services.queue.pressure)
    parts = dataclasses.replace(services, control=reconciler)
    gateway = GatewayServer(GatewaySettings(port=0), Router(supervisor.replicas), parts)
    await gateway.start()
    await supervisor.start()
    reconciler.start([("alpha", engine, plans * 2)])
    base = f"http://127.0.0.1:{gateway.port}"
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    failures: list[str] = []
    stop = asyncio.Event()
    began = time.monotonic()

    async def user() -> None:
        while not stop.is_set():
            try:
                reply = await client.chat.completions.create(model="alpha", messages=MESSAGES, max_tokens=32)
                assert reply.choices[0].finish_reason
            except (openai.APIError, AssertionError) as exc:
                if not failures:  # what routing saw at the first failure (the rest are likely alike)
                    states = [(r.id, r.state.value, r.node, r.last_error) for r in supervisor.replicas]
                    failures.append(f"at {time.monotonic() - began:.1f} s: {states}")
                failures.append(repr(exc))

    users: list[asyncio.Task[None]] = []
    second = None
    try:
        await all_ready(supervisor)
        users = [asyncio.create_task(user()) for _ in range(6)]
        deadline = time.monotonic() + 30
        while len(supervisor.replicas.of("alpha")) < 2:
            assert time.monotonic() < deadline, "the autoscaler asked for no second replica"
            await asyncio.sleep(0.2)
        waiting = supervisor.replicas.of("alpha")[1]
        await asyncio.sleep(2)
        assert waiting.state is ReplicaState.STARTING and waiting.node is None  # no room anywhere yet
        second = cluster.add_node(num_cpus=1, num_gpus=4, **local)
        await all_ready(supervisor)
        assert waiting.node == second.node_id  # placed on the node that joined

        async with aiohttp.ClientSession() as session:
            async with session.post(f"{base}/admin/nodes/{first.node_id}/drain?grace=30") as response:
                drained = await response.json()
        assert response.status == 200, drained
        assert [r["replica"] for r in drained["replicas"]] == ["alpha-0"]
        await asyncio.sleep(3)  # traffic keeps flowing on the other node; a new replica finds no room
        assert all(r.node != first.node_id for r in supervisor.replicas.of("alpha"))
        cluster.remove_node(first)
        await asyncio.sleep(1)
    finally:
        stop.set()
        await asyncio.gather(*users)
        await reconciler.stop()
        await gateway.stop()
        await supervisor.stop()
        if second is not None:
            cluster.remove_node(second)
    assert failures == []
    events = [e["message"] for e in supervisor.replicas.events]
    assert any(m.startswith("scale up 1 → 2") for m in events)
    assert any(f"node {first.node_id} cordoned" in m for m in events)
