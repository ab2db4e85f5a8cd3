"""Autoscaling on supervised simulated replicas under the openai client's load: a step from 1× to 8× load
scales up within a bounded time and brings TTFT p95 back under the objective, the step down scales down
without losing a request; a model scaled to zero holds its first requests while a replica starts. The
feed-forward mode sizes for the arrival rate with the performance model in one move."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import openai
import pytest

from corral.cluster import Supervisor
from corral.cluster.autoscale import Autoscaler, _Group
from corral.config import ModelSpec, SupervisorSettings, parse_spec
from corral.engines import LaunchPlan, SimEngineAdapter
from corral.routing import Replica, ReplicaSet, ReplicaState
from tests.cluster.load import Load
from tests.conftest import RunningCluster, start_cluster

pytestmark = pytest.mark.slow  # real engines or servers, or long drills (`make test-fast` skips)

STEP = """
supervisor: {probe_interval: 0.5}
auth: {open: true}
queue: {timeout: 120}
models:
  - name: alpha
    arch: llama-3.1-8b
    deployments:
      - engine: sim
        gpu: l4
        time_scale: 10
        max_num_seqs: 2
        replicas: 1
        autoscale: {min_replicas: 1, max_replicas: 4, interval_s: 0.5, queue_wait_s: 0.3, down_cooldown_s: 3}
"""
ZERO = """
supervisor: {probe_interval: 0.5}
auth: {open: true}
models:
  - name: alpha
    arch: llama-3.1-8b
    deployments:
      - engine: sim
        gpu: l4
        time_scale: 10
        replicas: 0
        autoscale: {min_replicas: 0, max_replicas: 2, interval_s: 0.5, down_cooldown_s: 2, hold_s: 60}
"""
SLO_S = 0.4  # TTFT p95 the test holds the cluster to, wall clock as the client sees it


def ready_count(cluster: RunningCluster) -> int:
    return sum(r["state"] == "ready" for r in cluster.status()["replicas"])


def wait_for(condition: object, what: str, timeout: float) -> float:
    started = time.monotonic()
    while not condition():  # type: ignore[operator]
        assert time.monotonic() - started < timeout, what
        time.sleep(0.2)
    return time.monotonic() - started


def test_a_load_step_scales_up_meets_the_slo_and_scales_down_losing_nothing(tmp_path: Path) -> None:
    spec = tmp_path / "step.yaml"
    spec.write_text(STEP)
    cluster = start_cluster(tmp_path, spec)
    load = Load(cluster.base_url, "alpha", max_tokens=64)
    try:
        load.add_users([True])
        time.sleep(3)
        assert ready_count(cluster) == 1  # 1× load fits one replica: no scaling
        stepped = time.monotonic()
        load.add_users([True] * 7)
        took = wait_for(lambda: ready_count(cluster) == 4, "scaled up to 4 replicas", timeout=30)
        assert took < 20
        overloaded = load.ttft_p95_since(stepped)
        settled = time.monotonic() + 2
        wait_for(lambda: len(load.answers) > 0 and load.answers[-1].at > settled + 4, "load ran on", 60)
        recovered = load.ttft_p95_since(settled)
        assert overloaded is not None and recovered is not None
        assert recovered < SLO_S < overloaded, (overloaded, recovered)

        load.remove_users(7)
        wait_for(lambda: ready_count(cluster) == 1, "scaled back down to 1 replica", timeout=60)
        events = [e["message"] for e in cluster.status()["events"] if e["kind"] == "scale"]
        assert any(m.startswith("scale up 1 → ") for m in events)
        assert any(m.startswith("scale down 2 → 1") for m in events)
    finally:
        load.stop()
        cluster.stop()
    assert load.failures == []


def test_scale_from_zero_holds_the_first_requests(tmp_path: Path) -> None:
    spec = tmp_path / "zero.yaml"
    spec.write_text(ZERO)
    cluster = start_cluster(tmp_path, spec)
    try:
        assert cluster.status()["replicas"] == []
        for _ in range(2):  # from zero, back to zero, and from zero again
            answers: list[str] = []

            def ask(answers: list[str] = answers) -> None:
                client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0, timeout=90)
                answer = client.chat.completions.create(
                    model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=4
                )
                answers.append(answer.choices[0].finish_reason or "")

            users = [threading.Thread(target=ask) for _ in range(3)]
            for thread in users:
                thread.start()
            for thread in users:
                thread.join(timeout=90)
            assert len(answers) == 3  # held in the queue, not refused, while the first replica started
            wait_for(lambda: cluster.status()["replicas"] == [], "scaled to zero when idle", timeout=30)
        events = [e["message"] for e in cluster.status()["events"]]
        assert "requests wait for a first replica" in " ".join(events)
    finally:
        cluster.stop()


async def test_feed_forward_sizes_for_the_arrival_rate_in_one_move() -> None:
    spec = parse_spec(
        STEP.replace("interval_s: 0.5", "interval_s: 0.5, mode: feed_forward").replace(
            "    arch: llama-3.1-8b", "    arch: llama-3.1-8b\n    slo: {ttft_p95: 0.5}"
        ),
        source="test",
    )
    model: ModelSpec = spec.models[0]
    supervisor = Supervisor(ReplicaSet(), runtime=None, settings=SupervisorSettings())  # type: ignore[arg-type]
    plan = LaunchPlan(capacity=2)
    scaler = Autoscaler(supervisor, lambda: {})
    state = _Group(model, 0, SimEngineAdapter(), [plan] * 4)
    one = Replica(id="alpha-0", model="alpha", engine="sim", capacity=2, state=ReplicaState.READY)
    pressure = {"queued": 0.0, "oldest_wait_s": 0.0, "arrived": 0.0}

    state.rate = 0.2  # a trickle: one replica (an L4 replica sustains about 0.45 req/s here)
    assert await scaler.desired(state, [one], pressure) == 1
    state.rate = 60.0  # requests/s, far over what one L4 replica sustains at time_scale 10
    assert await scaler.desired(state, [one], pressure) == 4
    assert "req/s arriving" in state.reason
    reactive = _Group(parse_spec(STEP, source="test").models[0], 0, SimEngineAdapter(), [plan] * 4, rate=60.0)
    assert await scaler.desired(reactive, [one], pressure) == 1  # the reactive mode waits for load to show
