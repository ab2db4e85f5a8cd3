"""The supervisor's publishing of the replica set to its gateway workers (`cluster/workers.py`) goes on
past a round that fails."""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest

from corral.cluster.workers import WorkerPool
from corral.routing import Replica, ReplicaSet, ReplicaState

from .test_supervisor import until


async def test_a_replica_set_that_cannot_be_sent_once_does_not_end_the_workers_updates(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A snapshot that cannot be made (here a figure orjson cannot write: an integer past 64 bits, as an
    engine's cache size once was) is logged, once, and the next change still reaches the workers: the
    publishing task used to end at the first error, and the workers then routed on a replica set that never
    changed again (replicas that died, new ones never seen)."""
    replicas = ReplicaSet(["m"])
    replica = Replica(id="m-0", model="m", engine="vllm", url="http://127.0.0.1:1")
    replicas.add(replica)
    pool = WorkerPool(replicas, {"gateway": {}}, count=1, logs="warning:auto", shutdown_grace=1)
    await pool.serve_control()
    reader, writer = await asyncio.open_unix_connection(str(pool.control_path), limit=1 << 24)
    writer.write(orjson.dumps({"worker": 0}) + b"\n")
    await reader.readline()  # its configuration
    assert orjson.loads(await reader.readline())["replicas"][0]["state"] == "starting"
    publishing = asyncio.create_task(pool._publish())
    try:
        with caplog.at_level(logging.ERROR, logger="corral.cluster.workers"):
            replica.adapter_slots = 2**64
            await until(lambda: "could not be sent" in caplog.text, within=5)
            await asyncio.sleep(0.5)  # (rounds that fail the same way again)
        assert caplog.text.count("could not be sent") == 1
        replica.adapter_slots = 0
        replica.state = ReplicaState.READY
        published = orjson.loads(await asyncio.wait_for(reader.readline(), 5))
        assert published["replicas"][0]["state"] == "ready"
    finally:
        publishing.cancel()
        writer.close()
        await pool.stop()
