"""Adapter placement (routing/adapters.py) on replicas built here: holders first, slots kept by least
recent use, nothing in flight or freshly loaded given up, a burst spread one replica at a time by demand,
and a restarted replica holding nothing."""

from __future__ import annotations

import time

from corral.routing import Replica, ReplicaState
from corral.routing.adapters import Adapter, AdapterPlacement


def _replicas(count: int, slots: int = 2) -> list[Replica]:
    return [
        Replica(f"m-{i}", "m", "sim", state=ReplicaState.READY, adapter_slots=slots, started_at=1.0)
        for i in range(count)
    ]


def _adapter(name: str, placement: str = "affinity") -> Adapter:
    return Adapter(name, "m", f"{name}@0", f"/adapters/{name}", placement=placement)


def test_a_request_goes_where_its_adapter_is_and_a_new_one_to_a_free_slot() -> None:
    placement = AdapterPlacement(min_resident_s=0)
    replicas = _replicas(3)
    a, b = _adapter("a"), _adapter("b")
    (first,) = placement.candidates(a, replicas)
    assert placement.use(first, a) == (True, [])  # loaded there
    placement.done(first, a)
    assert placement.candidates(a, replicas) == [first]  # held: it goes there again, no load
    assert placement.use(first, a) == (False, [])
    first.outstanding = 1
    (second,) = placement.candidates(b, replicas)  # b is loaded on the least busy free replica
    assert second is not first


def test_slots_are_given_up_by_least_recent_use_never_in_flight_or_young() -> None:
    placement = AdapterPlacement(min_resident_s=0)
    (replica,) = _replicas(1, slots=2)
    a, b, c, d = (_adapter(n) for n in "abcd")
    for adapter in (a, b):
        placement.use(replica, adapter)
        placement.done(replica, adapter)
    placement.use(replica, a)  # a used again (and still in flight): b is the least recently used
    loads, unloads = placement.use(replica, c)
    assert loads and [r.adapter for r in unloads] == ["b"]
    # a and c are in flight: d takes a slot past the two, given back once one of them ends
    loads, unloads = placement.use(replica, d)
    assert loads and unloads == []
    assert sorted(placement.resident(replica)) == ["a", "c", "d"]
    assert [r.adapter for r in placement.done(replica, a)] == ["a"]
    assert sorted(placement.resident(replica)) == ["c", "d"]

    young = AdapterPlacement(min_resident_s=3600)  # loaded within the hour: kept, whatever its slots
    for adapter in (a, b, c):
        young.use(replica, adapter)
        assert young.done(replica, adapter) == []
    assert len(young.resident(replica)) == 3
    assert young.loads_last_minute(replica) == 3


def test_a_burst_of_one_adapter_spreads_one_replica_at_a_time_by_demand() -> None:
    placement = AdapterPlacement(min_resident_s=0, spread_interval_s=0.2)
    replicas = _replicas(4)
    hot = _adapter("hot")
    held = set()
    for _ in range(40):  # 40 requests in flight, all of one adapter: its share is every replica
        (chosen, *more) = placement.candidates(hot, replicas)
        picked = min([chosen, *more], key=lambda r: r.outstanding)
        placement.use(picked, hot)
        picked.outstanding += 1
        held = {r.id for r in replicas if placement.holds(r, hot)}
    assert len(held) == 2  # one more replica within the interval, not all four at once
    time.sleep(0.25)
    more = placement.candidates(hot, replicas)
    assert len(more) == 3  # the demand still calls for more: one more replica after the interval
    # a cold adapter with one request in flight among the burst's does not spread
    cold = _adapter("cold")
    (home,) = placement.candidates(cold, replicas)
    placement.use(home, cold)
    home.outstanding += 5
    time.sleep(0.25)
    assert placement.candidates(cold, replicas) == [home]


def test_llamacpp_replicas_hold_the_adapters_they_started_with() -> None:
    placement = AdapterPlacement()
    old = Replica("m-0", "m", "llamacpp", state=ReplicaState.READY, adapters=("a",))
    new = Replica("m-1", "m", "llamacpp", state=ReplicaState.READY, adapters=("a", "b"))
    assert placement.candidates(_adapter("a"), [old, new]) == [old, new]
    assert placement.candidates(_adapter("b"), [old, new]) == [new]  # (the old revision's lacks it)
    assert placement.candidates(_adapter("c"), [old, new]) == []
    assert placement.use(new, _adapter("b")) == (False, [])  # never loaded at run time


def test_a_restarted_replica_holds_nothing_and_anywhere_leaves_the_choice_to_the_policy() -> None:
    placement = AdapterPlacement(min_resident_s=0)
    replicas = _replicas(2)
    a = _adapter("a")
    (home,) = placement.candidates(a, replicas)
    placement.use(home, a)
    placement.done(home, a)
    home.started_at = 2.0  # restarted by the supervisor
    assert not placement.holds(home, a) and placement.resident(home) == []
    anywhere = _adapter("x", placement="anywhere")
    assert placement.candidates(anywhere, replicas) == replicas
