"""Engines' KV-cache events followed by the supervisor and the prefix index, end to end: `corral up` with
two simulated replicas (supervised as vLLM is, publishing vLLM's ZMQ events to the supervisor) whose KV
caches hold about three documents each.

A document the gateway sent to a replica counts as cached there until that replica's engine evicts it: here
another client, talking to the engine directly, fills the engine's cache with its own documents. The
engine's events say so, and the index forgets the document; without them it would keep counting it (the
gateway's own traffic is far below the cache's size).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from corral.config import Paths

from ..conftest import chat, cluster_of, get_json

# Llama-3.1-8B's KV takes 128 KiB a token: a quarter GiB is a 2,048-token cache (128 blocks of 16)
FLEET = (
    "supervisor: {probe_interval: 0.2}\nauth: {open: true}\n"
    "models:\n  - name: llama-8b\n    arch: llama-3.1-8b\n"
    "    deployments: [{engine: sim, replicas: 2, gpu: l4, time_scale: 20, "
    "engine_args: [--kv-cache-gib, '0.25']}]\n"
)


def _document(name: str) -> str:
    return f"{name}: " + " ".join(f"{name}{i}" for i in range(600))  # about 600 of the simulator's tokens


def _chat(url: str, document: str) -> str:
    return chat(url, "llama-8b", document)[1]


def _until(check, what: str, timeout: float = 10.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            assert value, what
            return value
        time.sleep(0.1)


def test_a_document_another_client_pushed_out_of_the_engine_s_cache_stops_counting_as_cached(
    tmp_path: Path,
) -> None:
    with cluster_of(tmp_path, FLEET) as cluster:

        def _replica(rid: str) -> dict:
            return next(r for r in cluster.status()["replicas"] if r["id"] == rid)

        index_of = lambda: get_json(cluster.url + "/admin/routing")[1]["prefix_index"]["llama-8b"]  # noqa: E731
        first = _chat(cluster.url, _document("alpha"))
        other = _chat(cluster.url, _document("beta"))  # the least loaded replica: the other one
        assert {first, other} == {r["id"] for r in cluster.status()["replicas"]}
        # the engine's events reach the supervisor: the document's blocks are cached there
        _until(lambda: (_replica(first)["kv_cached_tokens"] or 0) >= 512, "no KV events")
        blocks = index_of()["replicas"][first]["blocks"]
        assert blocks >= 600 * 7 // 128  # the document's ~4,200 bytes, in the index's 128-byte blocks

        engine = _replica(first)["url"]
        for n in range(5):  # another client's documents, straight to the engine: about 3,000 tokens
            _chat(engine, _document(f"other{n}"))
        _until(lambda: _replica(first)["kv_evicted_tokens_total"] >= 600, "nothing evicted")
        forgot = lambda: (held := index_of()["replicas"])[first]["blocks"] == 0 and held  # noqa: E731
        replicas = _until(forgot, "the evicted document still counts as cached")
        assert replicas[other]["blocks"] >= 600 * 6 // 128  # the other replica's document is still there
        assert replicas[first]["engine_cached_blocks"] > 0  # the other client's documents


def test_with_kv_events_off_the_engine_publishes_none_and_the_index_keeps_its_own_bound(
    tmp_path: Path,
) -> None:
    spec = FLEET.replace("time_scale: 20, ", "time_scale: 20, kv_events: false, ")
    assert spec != FLEET
    with cluster_of(tmp_path, spec) as cluster:
        replica = _chat(cluster.url, _document("alpha"))
        status = cluster.status()["replicas"]
        assert [r["kv_cached_tokens"] for r in status] == [None, None]  # not followed
        assert all(r["kv_capacity_tokens"] == 2048 for r in status)  # the metrics still tell its size
        index = get_json(cluster.url + "/admin/routing")[1]["prefix_index"]["llama-8b"]["replicas"]
        assert index[replica]["engine_cached_blocks"] is None and index[replica]["blocks"] > 0
        log = (Paths.from_env().logs / f"{replica}.log").read_text()
        started = [line for line in log.splitlines() if " starting: " in line][-1]  # this run's command
        assert "--time-scale" in started and "--kv-events-endpoint" not in started


async def test_a_data_parallel_engine_s_ranks_each_publish_to_their_own_endpoint() -> None:
    """vLLM with `--data-parallel-size 2` runs two engines, rank r publishing to the endpoint + `_dp<r>`
    (vLLM's rule for an endpoint naming "inproc"; for ranks past 0 it refuses an ipc:// one without): each
    binds its own socket in the feed's private directory, the feed connects to both, and one view counts
    both engines' blocks. A batch of another shape (a map) is passed over, not the end of the feed."""
    import msgpack
    import zmq
    import zmq.asyncio

    from corral.engines import LaunchPlan
    from corral.engines.kv_events import KvEventFeed, data_parallel_size, kv_events_config

    assert data_parallel_size(["--data-parallel-size", "2"]) == data_parallel_size(["-dp=2", "-dp", "2"]) == 2
    assert data_parallel_size(["--data-parallel-size=3"]) == 3 and data_parallel_size(["-dp", "x"]) == 1
    # (vLLM's parser reads `_` as `-`, and `-dp=2`: one publisher bound where the engine had two ranks)
    assert data_parallel_size(["--data_parallel_size", "2"]) == data_parallel_size(["-dp=2"]) == 2
    context = zmq.asyncio.Context()
    plan = LaunchPlan(
        argv=("vllm",), kv_events_args=("--kv-events-config", kv_events_config("{events}")), kv_events_ranks=2
    )
    feed = KvEventFeed(context, plan, remote=False)
    config = json.loads(feed.plan.argv[-1].format())  # as the runtime fills the command line in
    endpoint = config["endpoint"]
    assert endpoint.startswith("ipc://") and "inproc" in endpoint
    view = feed.view()
    follow = asyncio.create_task(feed.follow(view, lambda: None))
    publishers = []
    for rank in range(2):
        publisher = context.socket(zmq.PUB)
        publisher.bind(endpoint if rank == 0 else f"{endpoint}_dp{rank}")  # as vLLM's rank r
        publishers.append(publisher)
    stored = {"type": "BlockStored", "parent_block_hash": None, "token_ids": [], "block_size": 16}
    deadline, seq = time.monotonic() + 10, 0
    while len(view.blocks) < 2 and time.monotonic() < deadline:  # (until both subscriptions are through)
        seq += 1
        await publishers[0].send_multipart([b"", seq.to_bytes(8, "big"), msgpack.packb({"a": 1})])
        for rank, publisher in enumerate(publishers):
            batch = [time.time(), [{**stored, "block_hashes": [rank]}], rank]
            await publisher.send_multipart([b"", seq.to_bytes(8, "big"), msgpack.packb(batch)])
        await asyncio.sleep(0.05)
    assert set(view.blocks) == {0, 1} and view.block_size == 16
    follow.cancel()
    feed.close()
    for publisher in publishers:
        publisher.close(linger=0)
    context.destroy(linger=0)


def test_an_engine_that_restarts_has_an_empty_cache_and_its_documents_stop_counting(tmp_path: Path) -> None:
    import os
    import signal

    with cluster_of(tmp_path, FLEET) as cluster:
        replica = _chat(cluster.url, _document("alpha"))
        index_of = lambda: get_json(cluster.url + "/admin/routing")[1]["prefix_index"]["llama-8b"]  # noqa: E731
        assert index_of()["replicas"][replica]["blocks"] > 0
        (pid,) = [r["pid"] for r in cluster.status()["replicas"] if r["id"] == replica]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            shown = next(r for r in cluster.status()["replicas"] if r["id"] == replica)
            if shown["state"] == "ready" and shown["pid"] != pid:
                break
            time.sleep(0.2)
        assert shown["state"] == "ready" and shown["pid"] != pid  # the supervisor started it again
        assert index_of()["replicas"][replica]["blocks"] == 0  # its old documents no longer count
