"""Adapter placement (routing/adapters.py) against the engine's batch (`max_loras`: distinct adapters one
batch runs) and its slots, on replicas built here: a new adapter goes where a batch has room (placed as
before where none has), one tenant's adapters spread rather than fill a batch, a replica holds no more
than its slots once idle, and the gateway counts every load the engine makes."""

from __future__ import annotations

from pathlib import Path

from corral.config import DeploymentSpec, ModelSpec, Paths
from corral.config.models import LoraSettings
from corral.engines import engine_named
from corral.routing import Replica, ReplicaSet, ReplicaState
from corral.routing.adapters import Adapter, AdapterPlacement
from corral.routing.sync import apply_snapshot, replica_snapshot
from tests.conftest import DATA


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _replicas(count: int, slots: int = 4, max_loras: int = 2) -> list[Replica]:
    return [
        Replica(
            f"m-{i}",
            "m",
            "sim",
            state=ReplicaState.READY,
            adapter_slots=slots,
            max_loras=max_loras,
            started_at=1.0,
        )
        for i in range(count)
    ]


def _adapter(name: str) -> Adapter:
    return Adapter(name, "m", f"{name}@0", f"/adapters/{name}")


def test_a_new_adapter_goes_to_a_replica_whose_batch_has_room_not_to_a_full_one() -> None:
    placement = AdapterPlacement(min_resident_s=0)
    full, calm = _replicas(2)
    for name in ("x", "y"):  # full runs max_loras (2) distinct adapters
        placement.use(full, _adapter(name))
        full.outstanding += 1
    calm.outstanding = 3  # base requests: no adapter in its batch
    assert placement.candidates(_adapter("z"), [full, calm]) == [calm]
    # a request of an adapter full runs already joins its batch there
    assert placement.candidates(_adapter("x"), [full, calm]) == [full]
    # an idle holder whose batch is full is passed by for a replica that can start the adapter now
    held = _adapter("held")
    placement.done(full, held, placement.use(full, held)[0])
    assert placement.candidates(held, [full, calm]) == [calm]


def test_where_every_batch_is_full_the_request_is_placed_as_before() -> None:
    """No replica can start it now: placed as it was before max_loras was known (the engine queues it)."""
    placement = AdapterPlacement(min_resident_s=0)
    replicas = _replicas(2)
    for i, replica in enumerate(replicas):
        for name in (f"a{i}", f"b{i}"):
            placement.use(replica, _adapter(name))
    assert placement.candidates(_adapter("new"), replicas) == [replicas[0]]


def test_one_tenants_adapters_spread_rather_than_fill_a_batch() -> None:
    """mallory keeps long requests in flight on distinct adapters; with max_loras 3 it takes at most 2 of
    a replica's batch places while another replica can start its next one, so the batch keeps a place for
    another tenant's new adapter."""
    placement = AdapterPlacement(min_resident_s=0)
    replicas = _replicas(2, max_loras=3)
    placed = []
    for name in ("s00", "s01", "s02", "s03"):
        adapter = _adapter(name)
        (replica,) = placement.candidates(adapter, replicas, "mallory")
        placement.use(replica, adapter, "mallory")
        replica.outstanding += 1
        placed.append(replica.id)
    assert sorted(placed) == ["m-0", "m-0", "m-1", "m-1"]  # two on each, not three on one
    assert len(placement.candidates(_adapter("s00"), replicas, "mallory")) == 1  # its running one: fine
    victim = _adapter("s05")
    (replica,) = placement.candidates(victim, replicas, "victim")  # a place left on each for another tenant
    residence = placement.use(replica, victim, "victim")[0]
    assert residence is not None and residence.tenants == {"victim": 1}
    placement.done(replica, victim, residence, "victim")
    assert residence.tenants == {}


def test_a_holder_full_beside_replicas_that_refused_the_adapter_is_no_error() -> None:
    """A busy adapter's holder is full, and every other replica refused this revision lately: the spread's
    loader list was empty and min() of it raised, a 500 for every request of the adapter for 30 s."""
    placement = AdapterPlacement(min_resident_s=0)
    holder, other = _replicas(2, max_loras=0)
    holder.capacity, other.capacity = 8, 8
    x = _adapter("x")
    placement.use(holder, x)
    holder.outstanding = 8
    placement.refused(other, x.engine_name)
    assert placement.candidates(x, [holder, other]) == [holder]


def test_an_idle_adapter_past_the_slots_is_given_back_however_young() -> None:
    placement = AdapterPlacement(min_resident_s=3600)
    replica = Replica("m-0", "m", "sim", state=ReplicaState.READY, adapter_slots=2, started_at=1.0)
    a, b, c = (_adapter(n) for n in "abc")
    in_flight = [(x, placement.use(replica, x)[0]) for x in (a, b)]
    _, load, unload = placement.use(replica, c)  # a and b in flight: c goes past the two slots
    assert load and unload == [] and len(placement.resident(replica)) == 3
    adapter, residence = in_flight[0]
    gone = placement.done(replica, adapter, residence)  # a idle: one past the slots, loaded just now
    assert [r.adapter for r in gone] == ["a"] and sorted(placement.resident(replica)) == ["b", "c"]


def test_cycling_through_many_adapters_keeps_the_account_within_the_slots_and_counts_each_load() -> None:
    """One client cycling sequentially over 12 adapters on a replica of 4 slots, 10 requests a second for
    a minute: the gateway's account grew to all 12 (the engine's LRU held 4: each request was a disk load
    the gateway neither saw nor counted). Past the slots an adapter is given back once idle, so the account
    holds the slots and the one in flight, and each load the engine makes is counted."""
    clock = _Clock()
    placement = AdapterPlacement(min_resident_s=10.0, clock=clock)
    replica = Replica("m-0", "m", "sim", state=ReplicaState.READY, adapter_slots=4, started_at=1.0)
    adapters = [_adapter(f"a{i}") for i in range(12)]
    loads = peak = 0
    held: set[str] = set()  # what an LRU engine of 4 slots holds, told each load and unload
    for turn in range(600):
        adapter = adapters[turn % len(adapters)]
        (chosen,) = placement.candidates(adapter, [replica])
        residence, load, unload = placement.use(chosen, adapter)
        held -= {r.adapter for r in unload}
        assert load == (adapter.name not in held)  # a load the engine makes is a load the gateway asks
        held.add(adapter.name)
        loads += load
        peak = max(peak, len(placement.resident(replica)))
        held -= {r.adapter for r in placement.done(chosen, adapter, residence)}
        assert len(placement.resident(replica)) <= 4 and held == set(placement.resident(replica))
        clock.now += 0.1
    assert peak <= 5
    assert placement.loads_last_minute(replica) == loads >= 600 - 4 * 6  # (each slot's adapter kept 10 s)


def test_max_loras_travels_from_the_plan_to_the_gateway_workers(tmp_path: Path) -> None:
    adapter = {"name": "s00", "source": {"path": str(DATA / "lora" / "corral-marker")}}
    model = ModelSpec.model_validate(
        {
            "name": "llama",
            "arch": "llama-3.1-8b",
            "lora": LoraSettings(max_loras=2, max_cpu_loras=4),
            "adapters": [adapter],
            "deployments": [DeploymentSpec(engine="sim", gpu="h100-sxm")],
        }
    )
    (plan,) = engine_named("sim").prepare(model, model.deployments[0], Paths(tmp_path), lambda _: None)
    assert (plan.adapter_slots, plan.max_loras) == (4, 2)
    owner, mirror = ReplicaSet(["llama"]), ReplicaSet()
    owner.add(Replica("llama-0", "llama", "sim", adapter_slots=4, max_loras=plan.max_loras))
    apply_snapshot(mirror, replica_snapshot(owner))
    assert [(r.adapter_slots, r.max_loras) for r in mirror] == [(4, 2)]
