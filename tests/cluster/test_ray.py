"""The Ray runtime on a multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`), with nodes
declaring GPU resources, running real llama.cpp replicas as actors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import openai
import pytest
import ray
from ray.cluster_utils import Cluster

from corral.cluster import Supervisor
from corral.cluster.ray_runtime import RayPlacement, RayRuntime
from corral.config import GatewaySettings, SupervisorSettings
from corral.engines import LaunchPlan, LlamaCppEngine
from corral.gateway import GatewayServer
from corral.routing import ReplicaSet, ReplicaState, Router

from ..gateway.conftest import make_services

SETTINGS = SupervisorSettings(
    probe_interval=0.5,
    probe_timeout=1,
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
    runtime = RayRuntime(
        tmp_path / "logs", placements={"smollm2": RayPlacement(gpus=2, cpus=1)}, placement_timeout=20
    )
    replicas = ReplicaSet()
    supervisor = Supervisor(replicas, runtime, SETTINGS)
    supervisor.add("smollm2", LlamaCppEngine(), [llama_plan, llama_plan])
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
    runtime = RayRuntime(tmp_path, placements={"big": RayPlacement(gpus=3)}, placement_timeout=3)
    with pytest.raises(OSError, match="no Ray node has room"):
        await runtime.start("big-0", llama_plan)
