"""The batch runner against faults, over a real store (SQLite; Redis Streams where the queue matters) and a
stand-in executor: an engine's answer that is not JSON fails its line and the runner goes on; a store that
refuses commits still has the runner renew its leases; a runner stopped while a lease call is under way
hands back what that call took, its attempt undone."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from sqlalchemy.orm import Session

from corral.admission import Principal
from corral.batch import BatchLine, BatchRunner, BatchStore, LineResult, NewBatch
from corral.batch.queue_redis import RedisLines
from corral.config import BatchSettings
from corral.routing import Replica, ReplicaSet, ReplicaState
from corral.store import KeyStore, open_database
from corral.store.batch_rows import BatchLineRow
from tests.batch.running import running, until

REDIS = "redis://127.0.0.1:6379/0"


class Executor:
    """Answers a line as a chat replica would; a line whose prompt is "html" gets a proxy's HTML page with
    a 200 (an engine behind a misconfigured proxy)."""

    def __init__(self) -> None:
        self.answered = 0

    async def run_line(
        self, principal: Principal, path: str, body: bytes, request_id: str | None = None
    ) -> tuple[int, bytes]:
        self.answered += 1
        prompt = orjson.loads(body)["messages"][0]["content"]
        if prompt == "html":
            return 200, b"<html><body>502 Bad Gateway</body></html>"
        return 200, orjson.dumps({"object": "chat.completion", "choices": [], "echo": prompt})


@pytest.fixture
def prefixes() -> Iterator[list[str]]:
    """Redis prefixes used by a test, deleted after it."""
    used: list[str] = []
    yield used
    client = redis.Redis.from_url(REDIS)
    for prefix in used:
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)


def _store(
    queue: str, tmp_path: Path, prefixes: list[str], kind: type[BatchStore] = BatchStore
) -> BatchStore:
    database = open_database(f"sqlite:///{tmp_path / 'batch.db'}")
    if queue == "sql":
        return kind(database)
    prefixes.append(f"test:{uuid.uuid4().hex[:8]}:")
    return kind(database, RedisLines(REDIS, prefix=prefixes[-1]))


def _runner(store: BatchStore, executor: Executor, tmp_path: Path, lease_s: float = 30) -> BatchRunner:
    """A runner over one ready 4-slot replica of `m`, every slot free for batch lines."""
    replicas = ReplicaSet()
    replicas.add(Replica(id="m-0", model="m", engine="sim", state=ReplicaState.READY, capacity=4))
    settings = BatchSettings(poll_s=0.02, lease_s=lease_s, headroom=0, max_share=1.0)
    keys = KeyStore(open_database(f"sqlite:///{tmp_path / 'batch.db'}"))  # (lines without a key: unused)
    nothing_waiting: dict[str, int] = {}
    return BatchRunner(store, executor, keys, replicas, lambda: nothing_waiting, settings)


def _batch(store: BatchStore, prompts: list[str]) -> str:
    batch = store.create_batch(NewBatch("acme", None, "/v1/chat/completions", "file-x", timedelta(hours=1)))
    bodies = [orjson.dumps({"model": "m", "messages": [{"role": "user", "content": p}]}) for p in prompts]
    assert store.start(batch.id, "m", [(f"c{i}", body) for i, body in enumerate(bodies)])
    return batch.id


def _finished(store: BatchStore, batch_id: str) -> bool:
    found = store.batch("acme", batch_id)
    return found is not None and found.status == "completed"


@pytest.mark.parametrize("queue", ["sql", "redis"])
async def test_an_answer_that_is_not_json_fails_its_line_and_the_runner_goes_on(
    queue: str, tmp_path: Path, prefixes: list[str]
) -> None:
    """Before, the HTML page raised in the commit of its tick: every result of the tick rolled back, and the
    same commit failed at every tick after, so the runner renewed, finished and leased nothing again."""
    store = _store(queue, tmp_path, prefixes)
    first = _batch(store, ["a", "html", "b", "c"])
    async with running(_runner(store, Executor(), tmp_path)):
        await until(lambda: _finished(store, first))
        later = _batch(store, ["d", "e"])  # the runner still runs batches
        await until(lambda: _finished(store, later))
    batch = store.batch("acme", first)
    assert batch is not None and batch.counts == {"total": 4, "completed": 3, "failed": 1}
    assert batch.output_file_id and batch.error_file_id
    output = (store.files.file_content("acme", batch.output_file_id) or b"").splitlines()
    assert sorted(orjson.loads(x)["custom_id"] for x in output) == ["c0", "c2", "c3"]
    (error,) = [
        orjson.loads(x) for x in (store.files.file_content("acme", batch.error_file_id) or b"").splitlines()
    ]
    assert error["custom_id"] == "c1" and error["response"]["status_code"] == 502
    assert error["response"]["body"]["error"]["type"] == "upstream_error"


class CommitsRefused(BatchStore):
    """A store whose commits fail (a statement the database refuses) while the rest of it answers."""

    def commit_many(self, owner: str, results: list[tuple[BatchLine, LineResult]]) -> int:
        raise RuntimeError("the commit failed")


async def test_a_failed_commit_keeps_the_results_and_the_pass_still_renews_their_leases(
    tmp_path: Path, prefixes: list[str]
) -> None:
    """A failed commit skipped the rest of the pass: the leases of the results kept for the next try were
    never renewed, lapsed, and another gateway ran the lines again."""
    store = _store("sql", tmp_path, prefixes, CommitsRefused)
    _batch(store, ["a"])
    executor, lease_s = Executor(), 0.6
    async with running(_runner(store, executor, tmp_path, lease_s=lease_s)):
        await until(lambda: executor.answered == 1)
        held_until = time.monotonic() + 3 * lease_s  # (renewed every lease_s / 3 while held)
        while time.monotonic() < held_until:
            assert store.lease("other-gateway", "m", 5, lease_s=30) == []  # still held, never lapsed
            await asyncio.sleep(0.05)


class HeldLease(BatchStore):
    """A store whose lease call waits for the test (a slow database) before it leases."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.entered, self.proceed, self.left = threading.Event(), threading.Event(), threading.Event()

    def lease(self, *args: Any, **kwargs: Any) -> list[BatchLine]:
        self.entered.set()
        self.proceed.wait(10)
        try:
            return super().lease(*args, **kwargs)
        finally:
            self.left.set()


async def test_a_runner_stopped_while_leasing_hands_back_what_the_lease_took(
    tmp_path: Path, prefixes: list[str]
) -> None:
    """The thread leased after the run task was cancelled: its lines never reached the runner, sat out their
    lease and kept the attempt it counted (restarts are promised never to use up max_attempts)."""
    store = _store("sql", tmp_path, prefixes, HeldLease)
    assert isinstance(store, HeldLease)
    batch_id = _batch(store, ["a"])
    task = asyncio.create_task(_runner(store, Executor(), tmp_path).run())
    await until(store.entered.is_set)
    task.cancel()  # the gateway stops while the lease is under way
    store.proceed.set()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert await asyncio.to_thread(store.left.wait, 10)
    with Session(open_database(f"sqlite:///{tmp_path / 'batch.db'}")) as session:
        row = session.get(BatchLineRow, (batch_id, 0))
        assert row is not None and (row.state, row.lease_owner, row.attempts) == ("pending", None, 0)


class SlowPass(BatchStore):
    """A store whose look for pending work takes as long as the test says (a pass checking big input
    files, a slow database)."""

    slow = 0.0

    def pending(self) -> Any:
        time.sleep(self.slow)
        return super().pending()


class Endless(Executor):
    """A line that runs until the test ends it (a long generation)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def run_line(
        self, principal: Principal, path: str, body: bytes, request_id: str | None = None
    ) -> tuple[int, bytes]:
        self.answered += 1
        await self.release.wait()
        return 200, b"{}"


async def test_leases_are_renewed_while_a_pass_takes_longer_than_a_lease(
    tmp_path: Path, prefixes: list[str]
) -> None:
    """Renewal waited for its turn in the pass, behind checking input files: a pass longer than a lease
    (forty 100 MB batches to check) let the lines running lapse, and another gateway ran them again."""
    store = _store("sql", tmp_path, prefixes, SlowPass)
    assert isinstance(store, SlowPass)
    _batch(store, ["a"])
    executor, lease_s = Endless(), 0.6
    async with running(_runner(store, executor, tmp_path, lease_s=lease_s)):
        await until(lambda: executor.answered == 1)
        store.slow = 3 * lease_s  # the next pass takes three leases
        held_until = time.monotonic() + 3 * lease_s
        while time.monotonic() < held_until:
            assert store.lease("other-gateway", "m", 5, lease_s=30) == []  # still held, never lapsed
            await asyncio.sleep(0.05)
        store.slow = 0.0
        executor.release.set()
