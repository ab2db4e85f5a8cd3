"""The autoscaler's loop over many deployments and their live changes, on the supervisor's replica set
with a runtime that starts nothing: each deployment is decided at its own interval, one configured while
the loop waits is decided at once, replicas over a lowered `max_replicas` are drained at once, and a model
is held on demand only when every deployment of it may be at zero."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest

from corral.cluster import Supervisor
from corral.cluster.autoscale import Autoscaler
from corral.config import ModelSpec, SupervisorSettings, parse_spec
from corral.engines import LaunchPlan, SimEngineAdapter
from corral.routing import ReplicaSet, ReplicaState

PLAN = LaunchPlan(capacity=4)


def model(name: str, autoscale: str, second: str | None = None) -> ModelSpec:
    deployments = [f"      - {{engine: sim, gpu: l4, autoscale: {autoscale}}}"]
    if second is not None:
        deployments.append(f"      - {{engine: sim, gpu: l4, autoscale: {second}}}")
    spec = f"models:\n  - name: {name}\n    arch: llama-3.1-8b\n    deployments:\n" + "\n".join(deployments)
    return parse_spec(spec, source="test").models[0]


class NoRuntime:
    """A runtime that starts nothing: the supervisor is not started, its replicas are only declared."""

    assigns_gpus = False

    async def start(self, replica_id: str, plan: LaunchPlan) -> object:
        raise AssertionError("the supervisor was not started: no replica is launched")


@pytest.fixture
async def scaler() -> AsyncIterator[tuple[Autoscaler, Supervisor]]:
    supervisor = Supervisor(ReplicaSet(), NoRuntime(), SupervisorSettings(probe_interval=0.1))  # type: ignore[arg-type]
    made = Autoscaler(supervisor, lambda: {}, grace_s=1.0)
    task = asyncio.create_task(made.run())
    yield made, supervisor
    task.cancel()
    await asyncio.gather(task, *made._drains, return_exceptions=True)


async def until(condition: Callable[[], bool], what: str, within: float = 5) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def test_a_deployment_configured_while_the_loop_waits_is_decided_at_once(
    scaler: tuple[Autoscaler, Supervisor],
) -> None:
    """Before, the loop slept the shortest interval as it stood before the change (up to 300 s): a new
    model scaled to zero held its first requests past `hold_s`, a new model waited for its first replica."""
    autoscaler, supervisor = scaler
    autoscaler.configure(
        model("slow", "{min_replicas: 1, max_replicas: 2, interval_s: 300}"),
        0,
        SimEngineAdapter(),
        [PLAN] * 2,
    )
    await until(lambda: len(supervisor.members("slow")) == 1, "the first deployment was decided")
    autoscaler.configure(
        model("new", "{min_replicas: 1, max_replicas: 2, interval_s: 300}"), 0, SimEngineAdapter(), [PLAN] * 2
    )
    await until(
        lambda: len(supervisor.members("new")) == 1, "a deployment configured later was decided at once"
    )


async def test_each_deployment_is_decided_at_its_own_interval(scaler: tuple[Autoscaler, Supervisor]) -> None:
    """Before, every deployment was decided at the shortest interval of them all."""
    autoscaler, _ = scaler
    bounds = "{{min_replicas: 0, max_replicas: 2, interval_s: {interval}, down_cooldown_s: 600}}"
    autoscaler.configure(model("quick", bounds.format(interval=0.02)), 0, SimEngineAdapter(), [PLAN] * 2)
    autoscaler.configure(model("calm", bounds.format(interval=60)), 0, SimEngineAdapter(), [PLAN] * 2)
    quick, calm = autoscaler._groups[("quick", 0)], autoscaler._groups[("calm", 0)]
    await until(lambda: len(quick.wanted) >= 20, "the quick deployment was decided 20 times")
    assert len(calm.wanted) == 1  # once when it was configured, next in a minute


async def test_replicas_over_a_lowered_max_replicas_are_drained_at_once(
    scaler: tuple[Autoscaler, Supervisor],
) -> None:
    """Before, they went one per `down_cooldown_s`, and the change itself restarted the cooldown: 8 → 2
    took six minutes at the defaults."""
    autoscaler, supervisor = scaler
    bounds = "{{min_replicas: 1, max_replicas: {most}, interval_s: 0.05, down_cooldown_s: 60}}"
    autoscaler.configure(model("m", bounds.format(most=8)), 0, SimEngineAdapter(), [PLAN] * 8)
    running = supervisor.add("m", SimEngineAdapter(), [PLAN] * 8)
    for number, replica in enumerate(running):
        replica.state, replica.outstanding = ReplicaState.READY, number  # (m-0 idle … m-7 with 7 in flight)
    await until(lambda: len(autoscaler._groups[("m", 0)].wanted) >= 3, "decisions at max_replicas 8")
    assert len(supervisor.members("m")) == 8

    autoscaler.configure(model("m", bounds.format(most=2)), 0, SimEngineAdapter(), [PLAN] * 2)  # a live apply
    await until(lambda: len(supervisor.members("m")) == 2, "drained down to the new max_replicas", within=2)
    assert [r.id for r in supervisor.members("m")] == ["m-6", "m-7"]  # the least busy went
    events = [e["message"] for e in supervisor.replicas.events if e["kind"] == "scale"]
    assert events == ["scale down 8 → 2 (wants 2): drain m-0, m-1, m-2, m-3, m-4, m-5"], events


def test_a_model_is_held_on_demand_only_when_every_deployment_of_it_may_be_at_zero() -> None:
    """Before, the deployment configured last decided: one from zero beside one that always runs held
    the model's requests (and `/ready` counted it ready) as if it had no replica."""
    supervisor = Supervisor(ReplicaSet(), NoRuntime(), SupervisorSettings())  # type: ignore[arg-type]
    autoscaler = Autoscaler(supervisor, lambda: {})
    mixed = model("m", "{min_replicas: 1, max_replicas: 2}", "{min_replicas: 0, max_replicas: 2, hold_s: 30}")
    autoscaler.configure(mixed, 0, SimEngineAdapter(), [PLAN] * 2)
    autoscaler.configure(mixed, 1, SimEngineAdapter(), [PLAN] * 2)
    assert "m" not in supervisor.replicas.on_demand

    both = model(
        "m",
        "{min_replicas: 0, max_replicas: 2, hold_s: 90}",
        "{min_replicas: 0, max_replicas: 2, hold_s: 30}",
    )
    autoscaler.configure(both, 0, SimEngineAdapter(), [PLAN] * 2)
    autoscaler.configure(both, 1, SimEngineAdapter(), [PLAN] * 2)
    assert supervisor.replicas.on_demand["m"] == 90  # the longest hold of them
