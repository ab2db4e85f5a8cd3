"""The checks behind rollouts and autoscaling, on real objects with the state the supervisor publishes:
the golden eval's four kinds of check and its latency bound (against a simulated replica), a rollout
step's error-ratio, TTFT and readiness checks, and the autoscaler's KV-cache, prefill and utilisation
pushes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from corral.cluster import Supervisor
from corral.cluster.autoscale import Autoscaler, _Group
from corral.cluster.evalgate import check_answer, run_gate
from corral.cluster.rollout import Rollout, _Abort
from corral.config import EvalCase, RolloutSpec, SupervisorSettings, parse_spec
from corral.engines import EngineLoad, LaunchPlan, SimEngineAdapter
from corral.perf import load_catalog
from corral.perf.calibration import calibrated_efficiency
from corral.routing import Replica, ReplicaSet, ReplicaState
from corral.sim import SimFleet, SimOptions, build_server


def case(**check: object) -> EvalCase:
    return EvalCase(prompt="q", **check)  # type: ignore[arg-type]


def test_each_kind_of_golden_check() -> None:
    assert check_answer(case(exact="Paris"), " Paris\n") is None
    assert "expected exactly" in (check_answer(case(exact="Paris"), "Paris, France") or "")
    assert check_answer(case(contains="Paris"), "It is Paris.") is None
    assert "contain" in (check_answer(case(contains="Paris"), "Lyon") or "")
    assert check_answer(case(regex=r"\d{4}"), "in 1789") is None
    assert "match" in (check_answer(case(regex=r"^\d+$"), "twelve") or "")
    schema = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}
    assert check_answer(case(json_schema=schema), '{"city": "Paris"}') is None
    assert "schema" in (check_answer(case(json_schema=schema), '{"town": "Paris"}') or "")
    assert "expected JSON" in (check_answer(case(json_schema=schema), "Paris") or "")
    with pytest.raises(ValueError, match="exactly one check"):
        EvalCase(prompt="q", exact="a", contains="b")


@pytest.fixture
async def sim_replica() -> AsyncIterator[Replica]:
    options = SimOptions(model="llama-3.1-8b", gpu="l4", time_scale=1, served_name="m")
    fleet = SimFleet([build_server(options, load_catalog(), calibrated_efficiency())])
    await fleet.start([0])
    yield Replica(id="m-1", model="m", engine="sim", url=fleet.urls[0], state=ReplicaState.READY)
    await fleet.stop()


async def test_the_gate_holds_answers_to_their_latency_bound(sim_replica: Replica) -> None:
    cases = [EvalCase(name="long", prompt="Tell a story.", max_tokens=64, regex=".")]
    async with aiohttp.ClientSession() as session:
        assert await run_gate(session, sim_replica, cases, latency_s=30) is None
        slow = await run_gate(session, sim_replica, cases, latency_s=0.05)  # 64 L4 steps take longer
    assert slow is not None and "over the 0.05s limit" in slow


async def test_the_warm_up_is_not_held_to_the_latency_bound() -> None:
    """An engine's first request pays one-time costs (compiling, caches): the warm-up absorbs them; the
    golden answers after it are what `eval_latency_s` bounds."""
    asked = 0

    async def chat(request: web.Request) -> web.Response:
        nonlocal asked
        asked += 1
        if asked == 1:
            await asyncio.sleep(0.6)  # the first request after a start
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": "Paris"}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    cases = [EvalCase(name="capital", prompt="The capital of France?", max_tokens=4, contains="Paris")]
    async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session:
        engine = Replica(id="m-1", model="m", engine="x", url=str(server.make_url("")).rstrip("/"))
        assert await run_gate(session, engine, cases, latency_s=0.3) is None
    assert asked == 2


def rollout(**policy: object) -> Rollout:
    supervisor = Supervisor(ReplicaSet(), runtime=None, settings=SupervisorSettings())  # type: ignore[arg-type]
    return Rollout(supervisor, "m", [], RolloutSpec(**policy), revision=1, grace_s=1)  # type: ignore[arg-type]


def replica(
    rid: str, revision: int, served: int = 0, failures: int = 0, ttft: float | None = None
) -> Replica:
    load = EngineLoad(running=0, waiting=0, ttft_mean_s=ttft) if ttft is not None else None
    return Replica(
        id=rid, model="m", engine="sim", state=ReplicaState.READY, revision=revision,
        served=served, failures=failures, load=load,
    )  # fmt: skip


def test_a_step_fails_on_errors_slow_first_tokens_or_a_replica_that_is_not_ready() -> None:
    check = rollout(max_error_ratio=0.1, max_ttft_ratio=1.5)
    old = [replica("m-0", 0, ttft=0.10)]
    new = [replica("m-1", 1, served=30, failures=2, ttft=0.12)]
    check._check_health(new, old, {"m-1": (0, 0)}, final=True)  # 2/30 failed, TTFT 1.2×: fine
    new[0].failures = 5
    with pytest.raises(_Abort, match="5 of 30 requests to revision 1 failed"):
        check._check_health(new, old, {"m-1": (0, 0)}, final=True)
    slow = [replica("m-1", 1, served=30, ttft=0.2)]
    with pytest.raises(_Abort, match=r"TTFT 200 ms is over 1.5× the old replicas' 100 ms"):
        check._check_health(slow, old, {"m-1": (0, 0)}, final=True)
    quiet = [replica("m-1", 1)]
    check._check_health(quiet, old, {"m-1": (0, 0)}, final=True)  # no request in the step: no verdict
    quiet[0].state = ReplicaState.UNHEALTHY
    with pytest.raises(_Abort, match="m-1 became unhealthy"):
        check._check_health(quiet, old, {"m-1": (0, 0)}, final=False)


async def test_a_new_replica_not_ready_in_time_fails_the_rollout() -> None:
    starting = replica("m-1", 1)
    starting.state = ReplicaState.STARTING
    with pytest.raises(_Abort, match=r"not ready within 0\.3s"):
        await rollout(ready_timeout_s=0.3)._until_ready([starting])
    starting.state, starting.last_error = ReplicaState.RESTARTING, "exited with code 1"
    with pytest.raises(_Abort, match="m-1 cannot start: exited with code 1"):
        await rollout()._until_ready([starting])


SCALED = """
models:
  - name: m
    arch: llama-3.1-8b
    deployments:
      - engine: sim
        gpu: l4
        max_num_seqs: 4
        autoscale: {min_replicas: 1, max_replicas: 6, target_utilization: 0.5, kv_usage_high: 0.8,
                    prefill_tokens_high: 4000}
"""


async def test_the_autoscalers_signals() -> None:
    model = parse_spec(SCALED, source="test").models[0]
    supervisor = Supervisor(ReplicaSet(), runtime=None, settings=SupervisorSettings())  # type: ignore[arg-type]
    scaler = Autoscaler(supervisor, lambda: {})
    state = _Group(model, 0, SimEngineAdapter(), [LaunchPlan(capacity=4)] * 6)
    calm = {"queued": 0.0, "oldest_wait_s": 0.0, "arrived": 0.0}
    one = replica("m-0", 0)
    one.outstanding = 2
    assert await scaler.desired(state, [one], calm) == 1  # 2 of 4 slots: at the 50% target
    one.outstanding = 4
    assert await scaler.desired(state, [one], calm) == 2  # 4 busy slots want 8 at 50%
    one.outstanding = 0
    one.load = EngineLoad(running=1, waiting=0, kv_usage=0.85)
    assert await scaler.desired(state, [one], calm) == 2 and "KV cache 85% used" in state.reason
    one.load = None
    one.pending_prefill = 5000
    assert await scaler.desired(state, [one], calm) == 2 and "await prefill" in state.reason
    loading = replica("m-1", 0)
    loading.state = ReplicaState.STARTING
    assert await scaler.desired(state, [one, loading], calm) == 1  # capacity already on its way
    waited = {**calm, "queued": 1.0, "oldest_wait_s": 5.0}
    one.pending_prefill = 0
    assert await scaler.desired(state, [one], waited) == 2 and "waited 5.0s" in state.reason
