"""A gateway worker's control follower and what a (re)connecting worker is told. One message that cannot be
taken (a model's tokenizer file gone) is logged and the next taken; a reply that cannot be read answers its
admin call with an error; however the follower ends, the calls waiting are answered (the worker then stops,
and the pool starts it again). The pool replays each model's latest settings and the latest cluster
settings, not every announcement ever made, and none of a model removed since."""

from __future__ import annotations

import asyncio
import shutil
from typing import Any

import orjson
import pytest

from corral.cli.worker import _follow, _RemoteControl
from corral.cluster.workers import WorkerPool
from corral.routing import Replica, ReplicaSet


class Writer:
    """The control socket's writing end, as the remote control uses it."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.lines.append(data)

    async def drain(self) -> None:
        return None


async def test_a_message_that_fails_is_logged_and_the_next_taken(caplog: pytest.LogCaptureFixture) -> None:
    reader = asyncio.StreamReader()
    remote = _RemoteControl(Writer())  # type: ignore[arg-type]
    taken: list[bytes] = []

    def take(line: bytes) -> None:
        if b"tokenizer" in line:
            raise FileNotFoundError("tokenizer.json")
        message = orjson.loads(line)
        if "reply" in message:
            remote.answered(message)
        taken.append(line)

    follower = asyncio.create_task(_follow(reader, take, remote, 0))
    call = asyncio.create_task(remote.drain("m-0", 1.0))
    await asyncio.sleep(0)
    reader.feed_data(b'{"model_settings": {"tokenizer": "/gone"}}\n{"models": []}\n')
    reader.feed_data(b'{"reply": 1}\n')  # no result: it cannot be read
    with pytest.raises(ValueError, match="could not be read"):
        await asyncio.wait_for(call, 2)
    assert taken == [b'{"models": []}\n']
    assert "a control message could not be taken" in caplog.text
    waiting = asyncio.create_task(remote.drain("m-1", 1.0))
    await asyncio.sleep(0)
    reader.feed_eof()
    await asyncio.wait_for(follower, 2)
    with pytest.raises(ValueError, match="control connection ended"):
        await asyncio.wait_for(waiting, 2)
    with pytest.raises(ValueError):  # and any later call at once
        await asyncio.wait_for(remote.drain("m-2", 1.0), 2)


def test_a_restarted_worker_is_told_the_latest_settings_of_the_models_served() -> None:
    replicas = ReplicaSet()
    replicas.declare("m")
    pool = WorkerPool(replicas, {"gateway": {}, "models": []}, 2, "info:text", 1.0)
    try:
        for i in range(1000):
            pool.announce_model({"name": "m", "routing": f"policy-{i}", "adapters": []})
        pool.announce_cluster({"models": {"m": "x"}})
        pool.announce_model({"name": "gone", "routing": None, "tokenizer": "/tmp/gone.json"})
        replayed: Any = [orjson.loads(line) for line in pool._replayed().splitlines()]
        assert replayed == [
            {"model_settings": {"name": "m", "routing": "policy-999", "adapters": []}},
            {"cluster_settings": {"models": {"m": "x"}}},
        ]
    finally:
        shutil.rmtree(pool._dir)


async def test_a_connecting_worker_is_told_the_replica_set_of_now_and_how_many_lines_replay() -> None:
    """A restarted worker listened on the spec it was started from and the last snapshot published (up to
    0.2 s old) before its follower took the replay: requests in that window went by a model's old settings,
    to replicas gone, and missed new ones. It is now sent the replica set as it is, and told how many of the
    lines after it replay the announcements, to take them before it listens."""
    replicas = ReplicaSet(["m"])
    pool = WorkerPool(replicas, {"gateway": {}, "models": []}, 1, "info:text", 1.0)
    await pool.serve_control()
    pool.announce_model({"name": "m", "routing": "least_load", "adapters": []})
    pool.announce_cluster({"models": {"m": "least_load"}})
    replicas.add(Replica(id="m-7", model="m", engine="vllm", url="http://127.0.0.1:1"))  # (since published)
    reader, writer = await asyncio.open_unix_connection(str(pool.control_path), limit=1 << 24)
    try:
        writer.write(orjson.dumps({"worker": 0}) + b"\n")
        config = orjson.loads(await asyncio.wait_for(reader.readline(), 5))
        snapshot = orjson.loads(await asyncio.wait_for(reader.readline(), 5))
        assert [r["id"] for r in snapshot["replicas"]] == ["m-7"]
        assert config["replayed"] == 2
        replayed = [orjson.loads(await asyncio.wait_for(reader.readline(), 5)) for _ in range(2)]
        assert replayed == [
            {"model_settings": {"name": "m", "routing": "least_load", "adapters": []}},
            {"cluster_settings": {"models": {"m": "least_load"}}},
        ]
    finally:
        writer.close()
        await pool.stop()
