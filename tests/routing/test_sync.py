"""The replica-set snapshot a supervisor publishes to gateway workers, and the mirror each keeps."""

from __future__ import annotations

import math
import time

import msgpack
import pytest

from corral.engines import EngineFeatures, EngineLoad, parse_vllm_load
from corral.engines.kv_events import KvCacheView
from corral.routing import Replica, ReplicaSet, ReplicaState, Router, RouteRequest
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


def test_an_engine_s_absurd_kv_figures_reach_the_workers_bounded_and_routing_goes_on() -> None:
    """Any engine corral scrapes writes its load (an `external` server, a KV-event publisher of its own):
    a /metrics page claiming a cache of 2^64 tokens made the snapshot fail (orjson writes no integer past
    64 bits: the workers were sent no replica set again), and a KV-event batch stamped +inf reached the
    workers' mirrors as null, where every prefix-routed request then failed (a 500 each)."""
    page = (
        'vllm:cache_config_info{block_size="4294967296",num_gpu_blocks="4294967296"} 1.0\n'
        "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
    )
    huge = parse_vllm_load(page)
    assert huge.kv_capacity_tokens is not None and 0 < huge.kv_capacity_tokens <= 2**53

    view = KvCacheView()
    stored = {"type": "BlockStored", "block_hashes": [1], "block_size": 16}
    with pytest.raises(ValueError, match="stamped"):
        view.apply(1, msgpack.packb([math.inf, [stored]]))
    with pytest.raises(ValueError, match="stamped"):
        view.apply(2, msgpack.packb([math.nan, [stored]]))
    assert view.blocks == {}  # (the batches were refused whole)
    view.apply(3, msgpack.packb([1e18, [stored]]))  # an engine's clock far ahead (or a lie): not refused...
    view.apply(4, msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [1]}]]))
    followed = view.stamp(EngineLoad(running=0, waiting=0))
    assert followed.kv_evicted_through <= time.time() + 60  # ... but its eviction frontier is not past now

    owner = ReplicaSet(["m"])
    for index, load in enumerate((huge, followed)):
        replica = Replica(id=f"m-{index}", model="m", engine="external", url=f"http://x:{index}")
        replica.state, replica.load = ReplicaState.READY, load
        owner.add(replica)
    mirror = ReplicaSet()
    apply_snapshot(mirror, replica_snapshot(owner), worker=0, workers=2)
    assert [r.load for r in mirror] == [huge, followed]
    router = Router(mirror)  # prefix_affinity, which follows the KV events
    for _ in range(2):
        request = RouteRequest(model="m", tokens=300, prompt="a document " * 200, prompt_tokens=200)
        router.release(router.acquire(request), request, True)


def test_an_engine_s_negative_or_endless_figures_are_read_as_none_or_at_their_bound() -> None:
    load = EngineLoad(
        running=-5,
        waiting=10**30,
        kv_usage=-0.5,
        prompt_tokens_total=float("nan"),
        generated_tokens_total=-1.0,
        ttft_mean_s=float("inf"),
        itl_mean_s=-1.0,
        kv_capacity_tokens=-4096,
        kv_cached_tokens=2**70,
        kv_evicted_tokens_total=-3,
        kv_evicted_through=float("nan"),
    )
    assert (load.running, load.kv_usage, load.prompt_tokens_total, load.generated_tokens_total) == (
        0,
        0,
        0,
        0,
    )
    assert 0 < load.waiting <= 1_000_000
    assert load.ttft_mean_s is None and load.itl_mean_s == 0.0 and load.kv_capacity_tokens is None
    assert load.kv_cached_tokens is not None and load.kv_cached_tokens <= 2**53
    assert (load.kv_evicted_tokens_total, load.kv_evicted_through) == (0, 0.0)
    assert EngineLoad(running=0, waiting=0, kv_usage=1.5).kv_usage == 1.0
