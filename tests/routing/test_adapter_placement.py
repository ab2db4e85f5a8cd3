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
    residence, load, unload = placement.use(first, a)
    assert load and unload == []  # loaded there
    placement.done(first, a, residence)
    assert placement.candidates(a, replicas) == [first]  # held: it goes there again, no load
    assert placement.use(first, a)[1:] == (False, [])
    first.outstanding = 1
    (second,) = placement.candidates(b, replicas)  # b is loaded on the least busy free replica
    assert second is not first


def test_slots_are_given_up_by_least_recent_use_never_in_flight_or_young() -> None:
    placement = AdapterPlacement(min_resident_s=0)
    (replica,) = _replicas(1, slots=2)
    a, b, c, d = (_adapter(n) for n in "abcd")
    for adapter in (a, b):
        placement.done(replica, adapter, placement.use(replica, adapter)[0])
    in_a = placement.use(replica, a)[0]  # a used again (and still in flight): b is the least recently used
    _, loads, unloads = placement.use(replica, c)
    assert loads and [r.adapter for r in unloads] == ["b"]
    # a and c are in flight: d takes a slot past the two, given back once one of them ends
    _, loads, unloads = placement.use(replica, d)
    assert loads and unloads == []
    assert sorted(placement.resident(replica)) == ["a", "c", "d"]
    assert [r.adapter for r in placement.done(replica, a, in_a)] == ["a"]
    assert sorted(placement.resident(replica)) == ["c", "d"]

    young = AdapterPlacement(min_resident_s=3600)  # loaded within the hour: kept, whatever its slots
    for adapter in (a, b, c):
        assert young.done(replica, adapter, young.use(replica, adapter)[0]) == []
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
    assert placement.use(new, _adapter("b")) == (None, False, [])  # never loaded at run time


def test_a_request_ending_after_its_adapter_was_forgotten_leaves_the_new_load_alone() -> None:
    placement = AdapterPlacement(min_resident_s=0)
    (replica,) = _replicas(1, slots=1)
    a, b = _adapter("a"), _adapter("b")
    old = placement.use(replica, a)[0]
    placement.failed_load(replica, old)  # the engine lost it: the next request loads it again
    new, load, _ = placement.use(replica, a)
    assert load and new is not old
    placement.done(replica, a, old)  # the first request ends: not the new load's count
    assert new is not None and new.in_flight == 1
    assert placement.use(replica, b)[2] == []  # a is in flight: not given up for b


def test_one_adapters_burst_does_not_hold_another_adapters_requests_on_its_full_replica() -> None:
    placement = AdapterPlacement(min_resident_s=0, spread_interval_s=0)
    replicas = _replicas(3)
    for replica in replicas:
        replica.capacity = 32
    burst, quiet = _adapter("burst"), _adapter("quiet")
    home = replicas[0]
    placement.use(home, quiet)
    for _ in range(200):
        placement.use(home, burst)
    home.outstanding = 201
    assert len(placement.candidates(quiet, replicas)) == 2  # its holder is full: it may load elsewhere


def test_a_restarted_replica_holds_nothing_and_anywhere_leaves_the_choice_to_the_policy() -> None:
    placement = AdapterPlacement(min_resident_s=0)
    replicas = _replicas(2)
    a = _adapter("a")
    (home,) = placement.candidates(a, replicas)
    placement.done(home, a, placement.use(home, a)[0])
    home.started_at = 2.0  # restarted by the supervisor
    assert not placement.holds(home, a) and placement.resident(home) == []
    anywhere = _adapter("x", placement="anywhere")
    assert placement.candidates(anywhere, replicas) == replicas
