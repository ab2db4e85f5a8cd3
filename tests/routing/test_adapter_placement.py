"""Adapter placement (routing/adapters.py) on replicas built here: holders first, slots kept by least
recent use, nothing in flight or freshly loaded given up (one past the slots goes once idle), a burst
spread one replica at a time by demand (a busy adapter that one replica carries is not copied), a new
adapter loaded where it gives up the least wanted one, and a restarted replica holding nothing."""

from __future__ import annotations

from corral.routing import Replica, ReplicaState
from corral.routing.adapters import Adapter, AdapterPlacement, Residence


class _Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


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

    young = AdapterPlacement(min_resident_s=3600)  # loaded within the hour: kept within its slots
    for adapter in (a, b):
        assert young.done(replica, adapter, young.use(replica, adapter)[0]) == []
    assert young.candidates(c, [replica]) == [replica]  # no slot may go: c is loaded past them...
    taken, load, unload = young.use(replica, c)
    assert load and unload == [] and len(young.resident(replica)) == 3
    # ...and the least recently used goes once c is idle (as the engine's LRU let it go to load c)
    assert [r.adapter for r in young.done(replica, c, taken)] == ["a"]
    assert sorted(young.resident(replica)) == ["b", "c"]
    assert young.loads_last_minute(replica) == 3


def test_a_burst_of_one_adapter_spreads_one_replica_at_a_time_by_demand() -> None:
    clock = _Clock()
    placement = AdapterPlacement(min_resident_s=0, spread_interval_s=2.0, clock=clock)
    replicas = _replicas(4)
    hot = _adapter("hot")
    in_flight: list[tuple[Replica, Residence | None]] = []

    def arrive() -> None:
        picked = min(placement.candidates(hot, replicas), key=lambda r: r.outstanding)
        in_flight.append((picked, placement.use(picked, hot)[0]))
        picked.outstanding += 1

    for _ in range(40):  # 40 requests in flight, all of one adapter, within a second
        arrive()
        clock.now += 0.02
    assert sum(placement.holds(r, hot) for r in replicas) == 1  # a moment's burst does not spread yet
    gained = []
    for _ in range(60):  # the burst lasts: a request ends and another comes every 0.5 s
        replica, residence = in_flight.pop(0)
        placement.done(replica, hot, residence)
        replica.outstanding -= 1
        arrive()
        held = sum(placement.holds(r, hot) for r in replicas)
        if held > 1 + len(gained):
            gained.append((clock.now, held))
        clock.now += 0.5
    # 40 in flight over 4 replicas fill 3 (10 each on average, plus the margin of 4): one at a time
    assert [held for _, held in gained] == [2, 3]
    assert gained[1][0] - gained[0][0] >= 2.0
    # a cold adapter with one request in flight among the burst's does not spread
    cold = _adapter("cold")
    (home,) = placement.candidates(cold, replicas)
    placement.use(home, cold)
    home.outstanding += 5
    clock.now += 30
    assert placement.candidates(cold, replicas) == [home]


def test_a_busy_adapter_one_replica_carries_is_not_copied_for_its_share() -> None:
    clock = _Clock()
    placement = AdapterPlacement(min_resident_s=0, spread_interval_s=0, clock=clock)
    replicas = _replicas(8)
    busy = _adapter("busy")
    home = replicas[0]
    placement.use(home, busy)
    for i, replica in enumerate(replicas[1:]):  # 7 requests of other adapters, one a replica
        placement.use(replica, _adapter(f"other{i}"))
        replica.outstanding = 1
    for _ in range(3):  # busy has 4 of the 11 in flight: by its share alone, 3 replicas' worth
        placement.use(home, busy)
    home.outstanding = 4 + 4  # and its holder carries the spread margin over the least busy
    for _ in range(30):  # for a minute
        assert placement.candidates(busy, replicas) == [home]
        clock.now += 2
    for _ in range(16):  # 20 in flight: more than one replica carries at the mean plus the margin
        placement.use(home, busy)
    home.outstanding += 16
    for _ in range(10):
        clock.now += 2
        if len(placement.candidates(busy, replicas)) == 2:
            break
    else:
        raise AssertionError("the busy adapter did not spread")


def test_a_new_adapter_gives_up_the_least_wanted_adapter_on_a_replica_about_as_busy() -> None:
    clock = _Clock()
    placement = AdapterPlacement(min_resident_s=10, clock=clock)
    wanted_home, rare_home, busy = _replicas(3, slots=2)
    wanted, rare, fresh = _adapter("wanted"), _adapter("rare"), _adapter("fresh")
    for _ in range(20):  # asked often, then idle
        placement.done(wanted_home, wanted, placement.use(wanted_home, wanted)[0])
    placement.done(rare_home, rare, placement.use(rare_home, rare)[0])  # asked once
    for replica in (wanted_home, rare_home):  # each then holds a second adapter, in use
        placement.use(replica, _adapter(f"{replica.id}-running"))
    placement.use(busy, _adapter("b1"))
    placement.use(busy, _adapter("b2"))  # its slots are in use: it gives up nothing
    clock.now += 30  # wanted and rare are both old and idle: either could be given up
    wanted_home.outstanding = rare_home.outstanding = 1
    assert placement.candidates(fresh, [wanted_home, rare_home, busy]) == [rare_home]
    residence, load, unload = placement.use(rare_home, fresh)
    assert load and [r.adapter for r in unload] == ["rare"]
    placement.done(rare_home, fresh, residence)
    # the replica is passed over when it carries more than one request beyond the least busy
    other = _adapter("other")
    rare_home.outstanding = 3
    clock.now += 30
    assert placement.candidates(other, [wanted_home, rare_home, busy]) == [wanted_home]


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
