"""What the batch runner tells the autoscaler, over a real store (SQLite): a model with a batch in progress
waits for lines to run even with no replica ready (which wakes one from zero); the slots its lines hold
and the lines it sent, so that the autoscaler leaves them out of demand; nothing held once they finish."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import orjson

from corral.admission import Principal
from corral.batch import BatchRunner, BatchStore, NewBatch
from corral.config import BatchSettings
from corral.routing import Replica, ReplicaSet, ReplicaState
from corral.store import KeyStore, open_database


class HeldLines:
    """Holds each line's slot on the replica, as the gateway's router counts it, until `finish` is set."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.finish = asyncio.Event()

    async def run_line(
        self, principal: Principal, path: str, body: bytes, request_id: str | None = None
    ) -> tuple[int, bytes]:
        self.replica.outstanding += 1
        try:
            await self.finish.wait()
        finally:
            self.replica.outstanding -= 1
        return 200, orjson.dumps({"object": "chat.completion", "choices": []})


async def until(condition: Callable[[], bool], what: str, within: float = 10) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def test_the_runner_reports_waiting_batches_and_the_slots_and_lines_of_its_own(tmp_path: Path) -> None:
    replicas = ReplicaSet()
    replica = Replica(id="m-0", model="m", engine="sim", state=ReplicaState.STARTING, capacity=8)
    replicas.add(replica)
    database = open_database(f"sqlite:///{tmp_path / 'batch.db'}")
    store = BatchStore(database)
    lines = HeldLines(replica)
    nothing_queued: dict[str, int] = {}
    settings = BatchSettings(poll_s=0.02)  # (max_share 0.8, headroom 1: 6 of 8 slots)
    runner = BatchRunner(store, lines, KeyStore(database), replicas, lambda: nothing_queued, settings)
    batch = store.create_batch(NewBatch("acme", None, "/v1/chat/completions", "file-x", timedelta(hours=1)))
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert store.start(batch.id, "m", [(f"c{i}", body) for i in range(10)])
    task = asyncio.create_task(runner.run())
    try:
        await until(lambda: "m" in runner.pressure(), "the batch in progress was seen")
        assert runner.pressure() == {
            "m": {"batch_in_flight": 0.0, "batch_arrived": 0.0, "batch_pending": 1.0}
        }

        replica.state = ReplicaState.READY
        await until(lambda: replica.outstanding == 6, "the lines took the runner's share of the slots")
        assert runner.pressure() == {
            "m": {"batch_in_flight": 6.0, "batch_arrived": 6.0, "batch_pending": 1.0}
        }

        lines.finish.set()
        await until(lambda: runner.pressure()["m"]["batch_pending"] == 0.0, "the batch finished")
        assert runner.pressure() == {
            "m": {"batch_in_flight": 0.0, "batch_arrived": 10.0, "batch_pending": 0.0}
        }
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class RefusedAtIntake(HeldLines):
    """A line whose body asks too much is refused at once (400), never queued; the others run."""

    async def run_line(
        self, principal: Principal, path: str, body: bytes, request_id: str | None = None
    ) -> tuple[int, bytes]:
        if b"too-much" in body:
            return 400, orjson.dumps({"error": {"message": "max_tokens is past the context"}})
        return await super().run_line(principal, path, body, request_id)


async def test_lines_refused_before_the_queue_are_no_batch_arrivals(tmp_path: Path) -> None:
    """A tenant's batch of lines refused at intake (no tokens, never queued) must not read as batch arrivals:
    the autoscaler takes batch arrivals off the queue's, so they would hide interactive ones."""
    replicas = ReplicaSet()
    replica = Replica(id="m-0", model="m", engine="sim", state=ReplicaState.READY, capacity=8)
    replicas.add(replica)
    database = open_database(f"sqlite:///{tmp_path / 'batch.db'}")
    store = BatchStore(database)
    lines = RefusedAtIntake(replica)
    lines.finish.set()
    runner = BatchRunner(store, lines, KeyStore(database), replicas, dict, BatchSettings(poll_s=0.02))
    batch = store.create_batch(NewBatch("acme", None, "/v1/chat/completions", "file-x", timedelta(hours=1)))
    good = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    bad = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "too-much"}]})
    assert store.start(batch.id, "m", [(f"c{i}", bad if i % 2 else good) for i in range(10)])
    task = asyncio.create_task(runner.run())
    try:
        await until(lambda: runner.pressure().get("m", {}).get("batch_pending") == 0.0, "the batch finished")
        assert runner.pressure()["m"]["batch_arrived"] == 5.0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
