"""How the runner checks new batches, over a real store (SQLite) and a stand-in executor: in a task of its
own, so a slow check (a 100 MB input) does not hold up the lines of batches in progress; one batch at a
time, the tenant checked longest ago first; a batch whose check keeps raising is backed off and then
failed, not checked again every tick for its whole window."""

from __future__ import annotations

import io
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import orjson
import redis
from sqlalchemy.exc import DataError

from corral.admission import Principal
from corral.batch import BatchRunner, BatchStore, NewBatch
from corral.batch.retries import Retries
from corral.config import BatchSettings
from corral.routing import Replica, ReplicaSet, ReplicaState
from corral.store import KeyStore, NewFile, open_database
from tests.batch.running import running, until

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class Executor:
    """Answers every line at once, as a chat replica would."""

    def __init__(self) -> None:
        self.answered = 0

    async def run_line(
        self, principal: Principal, path: str, body: bytes, request_id: str | None = None
    ) -> tuple[int, bytes]:
        self.answered += 1
        return 200, orjson.dumps({"object": "chat.completion", "choices": []})


class SlowStarts(BatchStore):
    """A store whose queuing of a checked batch waits for the test once `proceed` is cleared (a 100 MB
    input being queued), and which notes the batches it queued, in order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.proceed = threading.Event()
        self.proceed.set()
        self.started: list[str] = []

    def start(self, batch_id: str, model: str, lines: list[tuple[str, bytes]]) -> bool:
        self.started.append(batch_id)
        self.proceed.wait(10)
        return super().start(batch_id, model, lines)


class BrokenStarts(BatchStore):
    """A store whose queuing of a checked batch raises every time: `error` (a value the store refuses for
    good, by default)."""

    tries = 0
    error: BaseException = DataError("INSERT INTO corral_batch_lines ...", {}, ValueError("out of range"))

    def start(self, batch_id: str, model: str, lines: list[tuple[str, bytes]]) -> bool:
        self.tries += 1
        raise self.error


def _store(tmp_path: Path, kind: type[BatchStore] = BatchStore) -> BatchStore:
    return kind(open_database(f"sqlite:///{tmp_path / 'batch.db'}"))


def _runner(store: BatchStore, tmp_path: Path, retries: Retries | None = None) -> BatchRunner:
    """A runner over one ready 4-slot replica of `m`, every slot free for batch lines."""
    replicas = ReplicaSet()
    replicas.add(Replica(id="m-0", model="m", engine="sim", state=ReplicaState.READY, capacity=4))
    settings = BatchSettings(poll_s=0.02, lease_s=30, headroom=0, max_share=1.0)
    keys = KeyStore(open_database(f"sqlite:///{tmp_path / 'batch.db'}"))
    nothing_waiting: dict[str, int] = {}
    given = {"check_retries": retries} if retries is not None else {}
    return BatchRunner(store, Executor(), keys, replicas, lambda: nothing_waiting, settings, **given)


def _submitted(store: BatchStore, tenant: str, lines: int = 2) -> str:
    """A batch made as the API makes one: its input uploaded, the batch `validating`."""
    content = b"".join(
        orjson.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": BODY})
        + b"\n"
        for i in range(lines)
    )
    uploaded = store.files.add_file(NewFile(tenant, "batch", "in.jsonl", io.BytesIO(content), len(content)))
    new = NewBatch(tenant, None, "/v1/chat/completions", uploaded.id, timedelta(hours=1))
    return store.create_batch(new).id


def _queued(store: BatchStore, tenant: str, lines: int) -> str:
    """A batch already checked and in progress."""
    batch = store.create_batch(NewBatch(tenant, None, "/v1/chat/completions", "file-x", timedelta(hours=1)))
    assert store.start(batch.id, "m", [(f"c{i}", orjson.dumps(BODY)) for i in range(lines)])
    return batch.id


def _status(store: BatchStore, tenant: str, batch_id: str) -> str | None:
    found = store.batch(tenant, batch_id)
    return found.status if found is not None else None


async def test_a_slow_check_does_not_hold_up_the_lines_of_batches_in_progress(tmp_path: Path) -> None:
    """Checking ran inside the pass that commits results and leases lines: one tenant's big (or broken)
    batches to check held another tenant's 5-line batch from 2.1 s to 56.8 s."""
    store = _store(tmp_path, SlowStarts)
    assert isinstance(store, SlowStarts)
    queued = _queued(store, "globex", 5)
    checking = _submitted(store, "acme")
    store.proceed.clear()
    try:
        async with running(_runner(store, tmp_path)):
            await until(lambda: store.started[-1] == checking)  # its check is under way, and stays
            await until(lambda: _status(store, "globex", queued) == "completed")
            assert _status(store, "acme", checking) == "validating"
            store.proceed.set()
            await until(lambda: _status(store, "acme", checking) in ("in_progress", "completed"))
    finally:
        store.proceed.set()


async def test_batches_are_checked_one_tenant_after_another(tmp_path: Path) -> None:
    """acme's three batches came first; globex's is checked after acme's first, not after all three."""
    store = _store(tmp_path, SlowStarts)
    assert isinstance(store, SlowStarts)
    acme = [_submitted(store, "acme") for _ in range(3)]
    globex = _submitted(store, "globex")
    async with running(_runner(store, tmp_path)):
        await until(lambda: len(store.started) == 4)
    assert store.started == [acme[0], globex, acme[1], acme[2]]


async def test_a_batch_whose_check_keeps_raising_is_backed_off_then_failed(tmp_path: Path) -> None:
    """Before, it was logged and checked again at every tick (its whole input read and parsed each time)
    until its window ended, 24 hours later."""
    store = _store(tmp_path, BrokenStarts)
    assert isinstance(store, BrokenStarts)
    broken = _submitted(store, "acme")
    retries = Retries(tries=3, first_s=0.1)
    async with running(_runner(store, tmp_path, retries)):
        began = time.monotonic()
        await until(lambda: _status(store, "acme", broken) == "failed")
        took = time.monotonic() - began
    assert store.tries == 3 and took >= 0.1 + 0.2  # (backed off 0.1 s, then 0.2 s)
    found = store.batch("acme", broken)
    assert found is not None and found.errors and found.errors[0]["code"] == "validation_failed"


async def test_a_batch_whose_check_meets_a_redis_failover_is_backed_off_not_failed(tmp_path: Path) -> None:
    """A minute of READONLY while Redis failed over counted as the batch's own fault: it was failed
    (`validation_failed`) though nothing was wrong with it."""
    store = _store(tmp_path, BrokenStarts)
    assert isinstance(store, BrokenStarts)
    store.error = redis.exceptions.ReadOnlyError("READONLY You can't write against a read only replica.")
    waiting = _submitted(store, "acme")
    retries = Retries(tries=2, first_s=0.01, most_s=0.01)
    async with running(_runner(store, tmp_path, retries)):
        await until(lambda: store.tries >= 6 or _status(store, "acme", waiting) != "validating")
    assert _status(store, "acme", waiting) == "validating"
