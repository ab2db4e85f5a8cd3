"""Signals the autoscaler reads that stopped coming: an engine whose metrics scrapes fail keeps its last
reading in the replica set, and a hung gateway worker (its event loop blocked, its process alive) keeps its
last queue report in the pool; neither may keep adding replicas once it is old."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import orjson

from corral.cluster import Supervisor
from corral.cluster.autoscale import Autoscaler, _Group
from corral.cluster.workers import WorkerPool
from corral.config import SupervisorSettings, parse_spec
from corral.engines import EngineLoad, LaunchPlan, SimEngineAdapter
from corral.routing import Replica, ReplicaSet, ReplicaState

SPEC = """
models:
  - name: m
    arch: llama-3.1-8b
    deployments:
      - engine: sim
        gpu: l4
        autoscale: {min_replicas: 1, max_replicas: 4}
"""


async def test_a_kv_cache_reading_a_failing_scrape_left_behind_adds_no_replica() -> None:
    settings = SupervisorSettings(probe_interval=1.0, probe_timeout=1.0)  # (fresh: 3 rounds of 2 s)
    supervisor = Supervisor(ReplicaSet(), runtime=None, settings=settings)  # type: ignore[arg-type]
    scaler = Autoscaler(supervisor, lambda: {})
    state = _Group(parse_spec(SPEC, source="test").models[0], 0, SimEngineAdapter(), [LaunchPlan(capacity=8)])
    replica = Replica(id="m-0", model="m", engine="sim", capacity=8, state=ReplicaState.READY)

    replica.load = EngineLoad(running=1, waiting=0, kv_usage=0.95, scraped_monotonic=time.monotonic() - 60)
    assert await scaler.desired(state, [replica], {}) == 1  # its scrapes have failed for a minute

    replica.load = EngineLoad(running=1, waiting=0, kv_usage=0.95, scraped_monotonic=time.monotonic() - 1)
    assert await scaler.desired(state, [replica], {}) == 2  # read a second ago: it presses
    assert state.reason == "KV cache 95% used"


def report(queued: int, wait: float, arrived: int, in_flight: int) -> bytes:
    queues = {"m": {"queued": queued, "oldest_wait_s": wait, "arrived": arrived}}
    return orjson.dumps({"report": {"queues": queues, "replicas": {"m-0": [in_flight, 0, 0, 0]}}}) + b"\n"


async def until(condition: Callable[[], bool], what: str, within: float = 10) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def test_a_hung_workers_last_queue_report_stops_counting() -> None:
    """Before, a worker's report counted until its process exited: a worker hung with requests queued for
    seconds read as a queue wait past `queue_wait_s` at every decision, each adding a replica."""
    now = [100.0]
    replicas = ReplicaSet()
    replica = Replica(id="m-0", model="m", engine="sim", capacity=8, state=ReplicaState.READY)
    replicas.add(replica)
    pool = WorkerPool(
        replicas, {"gateway": {}}, count=2, logs="warning:auto", shutdown_grace=1, clock=lambda: now[0]
    )
    await pool.serve_control()
    writers = []
    try:
        for index in range(2):
            reader, writer = await asyncio.open_unix_connection(str(pool.control_path))
            writer.write(orjson.dumps({"worker": index}) + b"\n")
            await reader.readline()  # its configuration
            await reader.readline()  # the replica set
            writers.append(writer)
        writers[0].write(report(queued=1, wait=0.2, arrived=10, in_flight=2))
        writers[1].write(report(queued=5, wait=8.0, arrived=30, in_flight=3))  # then it hangs
        await until(lambda: pool.pressure().get("m", {}).get("arrived") == 40, "both reports taken")
        assert replica.outstanding == 5

        now[0] += 3.0  # worker 1 has been silent for 3 s (six of its report periods)
        writers[0].write(report(queued=1, wait=0.3, arrived=12, in_flight=2))
        await until(lambda: pool.pressure()["m"]["arrived"] == 42, "worker 0's next report taken")
        # the hung worker's queue no longer counts; its arrivals so far still do (a counter)
        queue = pool.pressure()["m"]
        assert (queue["queued"], queue["oldest_wait_s"], queue["arrived"]) == (1, 0.3, 42)
        assert replica.outstanding == 2
    finally:
        for writer in writers:
            writer.close()
        await pool.stop()
