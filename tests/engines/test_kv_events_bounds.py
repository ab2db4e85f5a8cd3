"""What a replica's KV-cache view takes from its publisher, and from whom: only the engine corral launched
(another local user cannot reach the socket), batches within a size bound, ranks the engine has, blocks
within its capacity, and a large batch in pieces, the event loop running between them; a gap in the
sequence (batches lost) empties the view as a restart does."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from corral.engines import LaunchPlan
from corral.engines.kv_events import KvCacheView, KvEventFeed, kv_events_config
from corral.engines.load import EngineLoad


def _stored(hashes: list[Any], rank: int | None = None, size: int = 16) -> bytes:
    batch: list[Any] = [time.time(), [{"type": "BlockStored", "block_hashes": hashes, "block_size": size}]]
    return msgpack.packb(batch if rank is None else [*batch, rank])


def _frames(seq: int, payload: bytes) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), payload]


def _launched_feed(context: zmq.asyncio.Context) -> tuple[KvEventFeed, str]:
    """A feed for a vLLM replica corral launches, and the endpoint the engine is told to publish to."""
    plan = LaunchPlan(argv=("vllm",), kv_events_args=("--kv-events-config", kv_events_config("{events}")))
    feed = KvEventFeed(context, plan, remote=False)
    return feed, json.loads(feed.plan.argv[-1].format())["endpoint"]


def _engine_publisher(context: zmq.asyncio.Context, endpoint: str) -> zmq.asyncio.Socket:
    """A publisher as vLLM's: it binds an ipc:// endpoint or one with a wildcard, and connects to another."""
    publisher = context.socket(zmq.PUB)
    if endpoint.startswith("ipc://") or "*" in endpoint:
        publisher.bind(endpoint)
    else:
        publisher.connect(endpoint)
    return publisher


@asynccontextmanager
async def _following(feed: KvEventFeed) -> AsyncIterator[KvCacheView]:
    """The view `feed` keeps while it follows its engine's publisher; the feed closed after."""
    view = feed.view()
    follow = asyncio.create_task(feed.follow(view, lambda: None))
    try:
        yield view
    finally:
        follow.cancel()
        await asyncio.gather(follow, return_exceptions=True)
        feed.close()


async def test_a_foreign_publisher_on_this_host_does_not_reach_a_launched_engine_s_view() -> None:
    context = zmq.asyncio.Context()
    feed, endpoint = _launched_feed(context)
    try:
        async with _following(feed) as view:
            engine = _engine_publisher(context, endpoint)
            # another process on the host, connecting where the engine publishes
            stranger = context.socket(zmq.PUB)
            stranger.connect(endpoint)
            began, seq = time.monotonic(), 0
            while time.monotonic() - began < 4 and (len(view.blocks) < 10 or time.monotonic() - began < 0.5):
                seq += 1
                forged = [
                    time.time(),
                    [{"type": "BlockStored", "block_hashes": [b"forged"]}, ["AllBlocksCleared"]],
                ]
                await stranger.send_multipart(_frames(seq, msgpack.packb(forged)))
                await engine.send_multipart(_frames(seq, _stored([b"engine%d" % seq])))
                await asyncio.sleep(0.02)
            # none of the stranger's batches arrive, and the engine's do
            assert b"forged" not in view.blocks and view.cleared == 0
            assert len(view.blocks) >= 10
            assert _private(endpoint)  # in a directory only this user may enter
    finally:
        context.destroy(linger=0)  # (the engine's and the stranger's sockets with it)
    assert not _private(endpoint)  # the feed's directory goes with it


def _private(endpoint: str) -> bool:
    """Whether the ipc:// endpoint is in a directory that is there and only its user (this one) may enter."""
    assert endpoint.startswith("ipc://")
    try:
        mode = os.stat(os.path.dirname(endpoint.removeprefix("ipc://")))
    except FileNotFoundError:
        return False
    return stat.S_IMODE(mode.st_mode) == 0o700 and mode.st_uid == os.getuid()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to try as another user")
def test_another_user_cannot_connect_to_the_engine_s_kv_event_socket() -> None:
    context = zmq.asyncio.Context()
    feed, endpoint = _launched_feed(context)
    engine = _engine_publisher(context, endpoint)
    try:
        kind, address = (
            ("unix", endpoint.removeprefix("ipc://"))
            if endpoint.startswith("ipc://")
            else ("tcp", endpoint.removeprefix("tcp://"))
        )
        probe = (
            "import socket, sys\n"
            "kind, address = sys.argv[1], sys.argv[2]\n"
            "if kind == 'unix':\n"
            "    s = socket.socket(socket.AF_UNIX); target = address\n"
            "else:\n"
            "    host, port = address.rsplit(':', 1); s = socket.socket(); target = (host, int(port))\n"
            "try:\n"
            "    s.connect(target)\n"
            "except OSError as exc:\n"
            "    print(type(exc).__name__)\n"
            "else:\n"
            "    print('connected')\n"
        )
        python = next(
            (p for p in ("/usr/bin/python3", sys.executable) if os.access(p, os.X_OK)), sys.executable
        )
        try:
            done = subprocess.run(
                [python, "-I", "-c", probe, kind, address],
                user=65534,
                group=65534,
                capture_output=True,
                text=True,
                timeout=10,
            )
        except PermissionError:
            done = None
        if done is None or done.returncode != 0:
            pytest.skip("no python that runs as another user (nobody) here")
        assert done.stdout.strip() == "PermissionError"
    finally:
        feed.close()
        engine.close(linger=0)
        context.destroy(linger=0)


def test_a_gap_in_the_sequence_empties_the_view_as_a_restart_does() -> None:
    view = KvCacheView()
    view.apply(1, _stored([b"a", b"b"]))
    view.apply(2, _stored([b"c"]))
    assert set(view.blocks) == {b"a", b"b", b"c"} and view.cleared == 0
    view.apply(4, _stored([b"d"]))  # batch 3 (which may have removed a, b) was lost
    assert set(view.blocks) == {b"d"} and view.cleared == 1
    view.apply(1, _stored([b"e"]))  # the publisher started over
    assert set(view.blocks) == {b"e"} and view.cleared == 2


def test_a_batch_naming_a_rank_the_engine_has_not_is_refused() -> None:
    view = KvCacheView(ranks=2)
    view.apply(1, _stored([b"zero"], rank=0))
    view.apply(1, _stored([b"one"], rank=1))
    with pytest.raises(ValueError, match="rank 2 from an engine of 2"):
        view.apply(1, _stored([b"two"], rank=2))
    with pytest.raises(ValueError, match="rank -1"):
        view.apply(1, _stored([b"minus"], rank=-1))
    assert set(view.blocks) == {b"zero", b"one"} and view.cleared == 0
    # a running server's publisher: one sequence, whatever rank its batches name (none remembered apart)
    server = KvCacheView(ranks=None)
    for seq in range(1, 2001):
        server.apply(seq, _stored([seq], rank=seq * 7919))
    assert len(server.blocks) == 2000 and server.cleared == 0


def test_the_view_holds_no_more_blocks_than_the_engine_can() -> None:
    view = KvCacheView()
    assert 0 < view.most_blocks <= 2**22  # bounded before the engine's capacity is known
    view.apply(1, _stored(list(range(60))))
    load = view.stamp(EngineLoad(running=0, waiting=0, kv_capacity_tokens=40 * 16))  # 40 blocks of 16
    assert view.most_blocks == 80 and load.kv_cached_tokens == 60 * 16
    view.apply(2, _stored(list(range(60, 80))))
    assert len(view.blocks) == 80 and view.cleared == 0
    view.apply(3, _stored([80]))  # more than the engine holds: the view is no longer its cache
    assert len(view.blocks) == 0 and view.cleared == 1
    data_parallel = KvCacheView(ranks=4)
    data_parallel.apply(1, _stored([1]))
    data_parallel.stamp(EngineLoad(running=0, waiting=0, kv_capacity_tokens=40 * 16))
    assert data_parallel.most_blocks == 4 * 80  # each rank its own cache
    for bad in (["a string"], [b"x" * 65], [1.5]):  # block hashes are 32 bytes or 64-bit ints
        with pytest.raises(ValueError, match="block hash"):
            view.apply(4, _stored(bad))


@asynccontextmanager
async def _followed_publisher() -> AsyncIterator[tuple[zmq.asyncio.Socket, KvCacheView]]:
    """A publisher on a free loopback port, as an engine's given `kv_events_urls`, and the view a feed
    following it keeps: (publisher, view); the feed, the publisher and their context closed after."""
    context = zmq.asyncio.Context()
    publisher = context.socket(zmq.PUB)
    port = publisher.bind_to_random_port("tcp://127.0.0.1")
    plan = LaunchPlan(url="http://127.0.0.1:1", kv_events_urls=(f"tcp://127.0.0.1:{port}",))
    try:
        async with _following(KvEventFeed(context, plan, remote=False)) as view:
            yield publisher, view
    finally:
        publisher.close(linger=0)
        context.destroy(linger=0)


async def test_a_batch_past_the_size_bound_never_reaches_the_view_and_its_loss_empties_it() -> None:
    async with _followed_publisher() as (publisher, view):
        seq = 0

        async def until_one_arrives() -> None:
            nonlocal seq
            deadline = time.monotonic() + 3
            held = len(view.blocks)
            while len(view.blocks) == held and time.monotonic() < deadline:
                seq += 1
                await publisher.send_multipart(_frames(seq, _stored([b"small%d" % seq])))
                await asyncio.sleep(0.02)
            assert len(view.blocks) > held

        await until_one_arrives()  # (the subscription is through)
        assert view.cleared == 0
        seq += 1
        huge = [i.to_bytes(32, "big") for i in range(300_000)]  # some 10 MB
        await publisher.send_multipart(_frames(seq, _stored(huge)))
        await until_one_arrives()
        assert huge[0] not in view.blocks and len(view.blocks) < 1000
        assert view.cleared == 1  # the batch lost: the sequence has a gap


async def test_a_large_batch_is_applied_in_pieces_the_event_loop_running_between_them() -> None:
    async with _followed_publisher() as (publisher, view):
        seen: list[int] = []

        async def watch() -> None:  # another task on the loop: what it sees while the batch is applied
            while True:
                seen.append(len(view.blocks))
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        try:
            seq, deadline = 0, time.monotonic() + 3
            while not view.blocks and time.monotonic() < deadline:
                seq += 1
                await publisher.send_multipart(_frames(seq, _stored([b"first"])))
                await asyncio.sleep(0.02)
            assert view.blocks
            large = 200_000
            await publisher.send_multipart(_frames(seq + 1, _stored(list(range(large)))))
            while len(view.blocks) < large + 1:
                if time.monotonic() > deadline + 5:
                    break
                await asyncio.sleep(0.01)
            assert len(view.blocks) == large + 1
            assert any(1 < n < large + 1 for n in seen)  # the loop ran with the batch half applied
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)


def test_a_unix_socket_path_fits() -> None:
    """The endpoint's path, with a data-parallel rank's suffix, fits a Unix socket's 107 bytes."""
    context = zmq.asyncio.Context()
    plan = LaunchPlan(
        argv=("vllm",),
        kv_events_args=("--kv-events-config", kv_events_config("{events}")),
        kv_events_ranks=64,
    )
    feed = KvEventFeed(context, plan, remote=False)
    try:
        endpoint = json.loads(feed.plan.argv[-1].format())["endpoint"]
        assert len(os.fsencode(endpoint.removeprefix("ipc://") + "_dp63")) <= 107
    finally:
        feed.close()
        context.destroy(linger=0)


def test_corral_sim_s_replicas_publish_where_a_data_parallel_engine_s_ranks_would() -> None:
    from corral.engines.kv_events import rank_endpoint
    from corral.sim import offset_endpoint

    for endpoint in ("ipc:///tmp/corral-kv-x/kv-events.inproc", "tcp://*:5557", "tcp://127.0.0.1:5557"):
        assert [offset_endpoint(endpoint, i) for i in range(3)] == [
            rank_endpoint(endpoint, i) for i in range(3)
        ]
    assert offset_endpoint("ipc:///tmp/kv", 2) == "ipc:///tmp/kv_dp2"


def test_a_process_that_never_closed_its_feed_leaves_no_directory_behind() -> None:
    """A supervisor that ended without stopping (a test's, a crash unwinding) left its 0700 directory and
    socket in the temporary directory, a pair per replica (19 in one CI run)."""
    probe = "from corral.engines.kv_events import _private_dir; print(_private_dir())"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    made = done.stdout.strip()
    assert "corral-kv-" in made and not os.path.exists(made)
