"""The replica-set snapshot a supervisor publishes to gateway workers, and the mirror each keeps."""

from __future__ import annotations

from corral.engines import EngineFeatures, EngineLoad
from corral.routing import Replica, ReplicaSet, ReplicaState
from corral.routing.sync import apply_snapshot, capacity_share, replica_snapshot


def _owner() -> ReplicaSet:
    replicas = ReplicaSet(["a", "b"])
    replicas.add(
        Replica(id="a-0", model="a", engine="vllm", url="http://x:1", capacity=5, context_length=4096)
    )
    replicas.add(Replica(id="a-1", model="a", engine="vllm", url="http://x:2", capacity=5, api_key="secret"))
    return replicas


def test_a_mirror_follows_state_load_and_membership_and_keeps_its_own_counters() -> None:
    owner, mirror = _owner(), ReplicaSet()
    apply_snapshot(mirror, replica_snapshot(owner), worker=0, workers=2)
    assert mirror.models() == ["a", "b"]
    assert [r.id for r in mirror] == ["a-0", "a-1"]
    assert mirror.ready("a") == []
    assert mirror.context_length("a") == 4096
    assert [r.api_key for r in mirror] == [None, "secret"]  # the engine key travels to the workers

    served = next(iter(mirror))
    served.outstanding = 3  # the worker's own: a snapshot never overwrites it
    first = next(iter(owner))
    first.state = ReplicaState.READY
    first.load = EngineLoad(running=2, waiting=1, kv_usage=0.5)
    first.features = EngineFeatures(echo=False)
    apply_snapshot(mirror, replica_snapshot(owner), worker=0, workers=2)
    assert [r.id for r in mirror.ready("a")] == ["a-0"]
    assert served.outstanding == 3 and served.load == first.load
    assert mirror.features("a").echo is False  # derived facts are recomputed when features change

    owner.remove(first)
    apply_snapshot(mirror, replica_snapshot(owner), worker=0, workers=2)
    assert [r.id for r in mirror] == ["a-1"]


def test_capacity_is_split_between_workers_and_adds_up() -> None:
    for capacity in (1, 5, 8, 256):
        for workers in (1, 2, 3, 16):
            shares = [capacity_share(capacity, w, workers) for w in range(workers)]
            assert all(s is not None and s >= 1 for s in shares)
            assert sum(s or 0 for s in shares) == max(capacity, workers)  # each worker can admit one
    assert capacity_share(None, 0, 4) is None
