"""What the autoscaler keeps and shares: two autoscaled deployments of one model split its queue by their
share of its slots (each sized for all of it gave the model twice what it needs); a live apply keeps the
backoff of replacing failed replicas; a replica scaled down may finish its requests for the gateway's
shutdown grace when that is longer, and a drain that runs out of grace says how many requests it cut.
Real autoscalers on a supervisor that is not started (its replicas are only declared)."""

from __future__ import annotations

import asyncio
import math
import time

from corral.cluster import Supervisor
from corral.cluster.autoscale import Autoscaler
from corral.cluster.reconcile import Reconciler
from corral.config import ModelSpec, SupervisorSettings, parse_spec
from corral.engines import LaunchPlan, SimEngineAdapter
from corral.routing import ReplicaSet, ReplicaState

PLAN = LaunchPlan(capacity=4)
TWO = """models:
  - name: m
    arch: llama-3.1-8b
    deployments:
      - {engine: sim, gpu: l4, replicas: 1,
         autoscale: {min_replicas: 1, max_replicas: 8, target_utilization: 1.0}}
      - {engine: sim, gpu: l4, replicas: 1,
         autoscale: {min_replicas: 1, max_replicas: 8, target_utilization: 1.0}}
"""


class NoRuntime:
    assigns_gpus = False


def two() -> ModelSpec:
    return parse_spec(TWO, source="test").models[0]


def supervisor() -> Supervisor:
    return Supervisor(ReplicaSet(), NoRuntime(), SupervisorSettings(probe_interval=0.1))  # type: ignore[arg-type]


async def test_two_deployments_split_the_models_queue() -> None:
    """Both replicas full (4 of 4 slots), 8 requests queued: 2 more replicas of 4 slots serve them, 4 in
    all, not 2 more for each deployment (6 before)."""
    made = supervisor()
    for group in (0, 1):
        for replica in made.add("m", SimEngineAdapter(), [PLAN], group):
            replica.state, replica.outstanding = ReplicaState.READY, 4
    pressure = {"m": {"queued": 8.0, "oldest_wait_s": 0.0, "arrived": 0.0}}
    scaler = Autoscaler(made, lambda: pressure)
    wants = []
    for group in (0, 1):
        scaler.configure(two(), group, SimEngineAdapter(), [PLAN] * 8)
        state = scaler._groups[("m", group)]
        wants.append(await scaler.desired(state, made.members("m", group), pressure["m"]))
    assert sum(wants) == math.ceil((8 + 8) / 4)
    pressure["m"].update(queued=0.0, oldest_wait_s=60.0)  # a long wait pushes one of them, not both
    pushed = [
        await scaler.desired(scaler._groups[("m", g)], made.members("m", g), pressure["m"]) for g in (0, 1)
    ]
    assert pushed == [2, 1]


async def test_from_zero_one_deployment_wakes_for_the_queue() -> None:
    zero = TWO.replace("min_replicas: 1", "min_replicas: 0").replace("replicas: 1,", "replicas: 0,")
    model = parse_spec(zero, source="test").models[0]
    pressure = {"queued": 3.0, "oldest_wait_s": 0.0, "arrived": 0.0}
    scaler = Autoscaler(supervisor(), lambda: {"m": pressure})
    for group in (0, 1):
        scaler.configure(model, group, SimEngineAdapter(), [PLAN] * 8)
    wants = [await scaler.desired(scaler._groups[("m", g)], [], pressure) for g in (0, 1)]
    assert wants == [1, 0]


async def test_a_live_apply_keeps_the_backoff_of_replacing_failed_replicas() -> None:
    """Before, any live settings apply (or finished rollout) reset it: a broken GPU's replicas were
    replaced at once again."""
    scaler = Autoscaler(supervisor(), lambda: {})
    scaler.configure(two(), 0, SimEngineAdapter(), [PLAN] * 8)
    state = scaler._groups[("m", 0)]
    state.replace_wait, state.held_until, state.failed_at = 240.0, time.monotonic() + 240, time.monotonic()
    state.replaced.add("m-3")
    state.replacements.add("m-4")
    scaler.configure(two(), 0, SimEngineAdapter(), [PLAN] * 8)  # e.g. its `routing:` changed
    again = scaler._groups[("m", 0)]
    assert again is not state
    assert (again.replace_wait, again.held_until, again.failed_at) == (
        240.0,
        state.held_until,
        state.failed_at,
    )
    assert (again.replaced, again.replacements) == ({"m-3"}, {"m-4"})


async def test_a_drain_out_of_grace_records_the_requests_it_cut() -> None:
    made = supervisor()
    scaler = Autoscaler(made, lambda: {}, grace_s=0.3)
    (replica,) = made.add("m", SimEngineAdapter(), [PLAN])
    replica.state, replica.outstanding = ReplicaState.READY, 2  # two streams that outlast the grace
    scaler._drain(replica)
    await asyncio.gather(*scaler._drains)
    events = [str(e["message"]) for e in made.replicas.events]
    assert events == ["drain of m-0 timed out after its 0.3s grace: 2 requests in flight cut"]


def test_scale_downs_get_the_gateways_shutdown_grace_when_it_is_longer() -> None:
    """Before, the autoscaler's drains had 120 s, whatever the spec said."""
    for grace, expected in ((10.0, 120.0), (900.0, 900.0)):
        spec = parse_spec(f"gateway: {{shutdown_grace: {grace}}}\n" + TWO, source="test")
        reconciler = Reconciler(
            supervisor(), spec, lambda m, d: (SimEngineAdapter(), []), lambda m: asyncio.sleep(0)
        )
        assert reconciler.autoscaler._grace == expected


async def test_a_deployment_may_give_its_scaled_down_replicas_a_grace_of_its_own() -> None:
    """`autoscale.drain_grace_s`: long streams need more than the gateway's grace; a scale-down drains
    within the deployment's own (0.3 s here, where the autoscaler's is 120 s)."""
    made = supervisor()
    own = TWO.replace("target_utilization: 1.0}", "drain_grace_s: 0.3}", 1)
    model = parse_spec(own, source="t").models[0]
    assert model.deployments[0].autoscale is not None and model.deployments[0].autoscale.drain_grace_s == 0.3
    scaler = Autoscaler(made, lambda: {})
    scaler.configure(model, 0, SimEngineAdapter(), [PLAN] * 8)
    (replica,) = made.add("m", SimEngineAdapter(), [PLAN], 0)
    replica.state, replica.outstanding = ReplicaState.READY, 1  # a stream that outlasts the grace
    scaler._scale_down(scaler._groups[("m", 0)], [replica], 0)
    await asyncio.wait_for(asyncio.gather(*scaler._drains), 5)
    events = [str(e["message"]) for e in made.replicas.events]
    assert events[-1] == "drain of m-0 timed out after its 0.3s grace: 1 request in flight cut"


MAXED = """models:
  - name: m
    arch: llama-3.1-8b
    deployments:
      - {engine: sim, gpu: l4, replicas: 2,
         autoscale: {min_replicas: 1, max_replicas: 2, target_utilization: 1.0}}
      - {engine: sim, gpu: l4, replicas: 0,
         autoscale: {min_replicas: 0, max_replicas: 8, target_utilization: 1.0}}
"""
FIXED = """models:
  - name: m
    arch: llama-3.1-8b
    deployments:
      - {engine: sim, gpu: l4, replicas: 1}
      - {engine: sim, gpu: l4, replicas: 0,
         autoscale: {min_replicas: 0, max_replicas: 8, target_utilization: 1.0}}
"""


async def test_a_deployment_at_zero_takes_the_queue_its_full_neighbours_cannot_grow_for() -> None:
    """The queue was split by the model's live slots, so a burst deployment at zero beside a full fixed
    one (or one at its max) got none of it and did not wake: 32 queued, it wanted 0 (8 before the split)."""
    for text, first in ((MAXED, 2), (FIXED, 1)):
        model = parse_spec(text, source="test").models[0]
        made = supervisor()
        for replica in made.add("m", SimEngineAdapter(), [PLAN] * first, 0):
            replica.state, replica.outstanding = ReplicaState.READY, 4
        pressure = {"m": {"queued": 32.0, "oldest_wait_s": 0.0, "arrived": 0.0}}
        scaler = Autoscaler(made, lambda: pressure)  # noqa: B023 (called here, in this turn)
        for group, deployment in enumerate(model.deployments):
            if deployment.autoscale is not None:
                scaler.configure(model, group, SimEngineAdapter(), [PLAN] * 8)
        state = scaler._groups[("m", 1)]
        assert await scaler.desired(state, made.members("m", 1), pressure["m"]) == 8


async def test_the_queues_wait_pushes_a_deployment_that_can_grow_not_one_backing_off() -> None:
    """The oldest wait pushes one deployment of the model: the first below its max. When that one backed
    off (its replacements of failed replicas failing too), the push still chose it, it could not grow,
    and the other deployment got nothing however long requests waited."""
    made = supervisor()
    for group in (0, 1):
        for replica in made.add("m", SimEngineAdapter(), [PLAN], group):
            replica.state = ReplicaState.READY
    pressure = {"m": {"queued": 0.0, "oldest_wait_s": 60.0, "arrived": 0.0}}
    scaler = Autoscaler(made, lambda: pressure)
    for group in (0, 1):
        scaler.configure(two(), group, SimEngineAdapter(), [PLAN] * 8)
    scaler._groups[("m", 0)].held_until = time.monotonic() + 240  # backing off: it cannot grow now

    async def pushes() -> list[int]:
        return [
            await scaler.desired(scaler._groups[("m", g)], made.members("m", g), pressure["m"])
            for g in (0, 1)
        ]

    assert await pushes() == [1, 2]
    scaler._groups[("m", 0)].held_until = time.monotonic()  # its backoff over, the first is pushed again
    assert await pushes() == [2, 1]
    made.add("m", SimEngineAdapter(), [PLAN], 1)  # the second's new replica, on its way
    assert await pushes() == [1, 1]  # (the first was pushed too: one wait, two replicas)
