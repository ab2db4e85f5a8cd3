"""When a batch is given up on, and what it keeps: only an error known to be permanent (the store refusing
a value for good) fails a batch whose finalising or check raised; an outage (a Redis failover's READONLY,
its memory full, the temporary disk full) is backed off for good; a batch failed keeps its results, written
as its files or left in the queue. A result counts toward its batch's bytes only where it was kept, and a
batch queued again starts its count from nothing."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import orjson
import pytest
import redis
from sqlalchemy import Engine, select
from sqlalchemy.exc import DataError
from sqlalchemy.orm import Session

from corral.batch import BatchStore, LineResult, NewBatch, queue_sql
from corral.batch.queue import ResultRow
from corral.batch.retries import Retries
from corral.store import open_database
from corral.store.batch_rows import BatchLineRow, BatchRow

REDIS = "redis://127.0.0.1:6379/0"
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


class _Overflow(Exception):
    sqlstate = "22003"  # numeric_value_out_of_range, as psycopg tells it


def _refused() -> DataError:
    """PostgreSQL's int4 refusing a 2 GiB file size: a value the store never holds."""
    return DataError("INSERT INTO corral_files ...", {}, _Overflow("integer out of range"))


PASSING = [
    redis.exceptions.ReadOnlyError("READONLY You can't write against a read only replica."),
    redis.exceptions.OutOfMemoryError("OOM command not allowed when used memory > 'maxmemory'."),
    OSError(errno.ENOSPC, "No space left on device"),
    MemoryError(),
    RuntimeError("a bug"),
]


@pytest.mark.parametrize("error", PASSING, ids=lambda e: type(e).__name__)
def test_an_error_not_known_to_be_permanent_is_backed_off_for_good(error: BaseException) -> None:
    """Before, any error but the store or Redis down counted: five READONLYs of a failover (~75 s) failed
    the batch and dropped its results."""
    now = [0.0]
    retries = Retries(tries=3, first_s=5, most_s=300, clock=lambda: now[0])
    waits = []
    for _ in range(60):
        assert not retries.failed("batch_1", error)
        assert not retries.due("batch_1")
        waits.append(_wait(retries, now))
    assert waits[:4] == [5, 10, 20, 40] and max(waits) == 300  # doubled, capped


def test_a_value_the_store_refuses_for_good_gives_up_after_its_tries() -> None:
    now = [0.0]
    retries = Retries(tries=3, first_s=5, clock=lambda: now[0])
    assert [retries.failed("batch_1", _refused()) for _ in range(3)] == [False, False, True]


def _wait(retries: Retries, now: list[float]) -> float:
    """How long the batch is backed off (moves the clock to its end)."""
    began = now[0]
    while not retries.due("batch_1"):
        now[0] += 5
    return now[0] - began


class Refusing(queue_sql.SqlLines):
    """A line queue whose results cannot be written into files while `error` is set (read `reads` times)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.error: BaseException | None = None
        self.until_reads = 0  # the error stops after this many reads (0: never)
        self.reads = 0

    def results(self, session: Session, batch_id: str) -> Iterator[ResultRow]:
        self.reads += 1
        if self.error is not None and (self.until_reads == 0 or self.reads <= self.until_reads):
            raise self.error
        return super().results(session, batch_id)


def _store(tmp_path: Path) -> tuple[BatchStore, Refusing, list[float]]:
    engine = open_database(f"sqlite:///{tmp_path / 'queue.db'}")
    queue, now = Refusing(engine), [0.0]
    return BatchStore(engine, queue, retries=Retries(tries=3, first_s=10, clock=lambda: now[0])), queue, now


def _batch(store: BatchStore, lines: int) -> str:
    batch = store.create_batch(NewBatch("acme", None, "/v1/chat/completions", "file-x", timedelta(hours=1)))
    assert store.start(batch.id, "m", [(f"c{i}", BODY) for i in range(lines)])
    return batch.id


def _run_all(store: BatchStore, owner: str = "runner", body: bytes = b'{"ok": 1}') -> int:
    return store.commit_many(
        owner, [(line, LineResult(200, body, "req")) for line in store.lease(owner, "m", 9, 30)]
    )


def _housekeep(store: BatchStore, now: list[float], passes: int) -> list[str]:
    finished = []
    for _ in range(passes):
        finished += store.housekeeping()
        now[0] += 300
    return finished


def test_a_batch_whose_files_cannot_be_written_for_a_while_is_not_failed(tmp_path: Path) -> None:
    """The temporary disk full for 20 passes (an hour and a half): the batch waits, and completes after."""
    store, queue, now = _store(tmp_path)
    batch_id = _batch(store, 3)
    assert _run_all(store) == 3
    queue.error = OSError(errno.ENOSPC, "No space left on device")
    assert _housekeep(store, now, 20) == []
    found = store.batch("acme", batch_id)
    assert found is not None and found.status == "in_progress" and found.errors is None
    queue.error = None
    assert store.housekeeping() == [batch_id]
    found = store.batch("acme", batch_id)
    assert found is not None and found.status == "completed" and found.output_file_id is not None
    assert len((store.files.file_content("acme", found.output_file_id) or b"").splitlines()) == 3


def test_a_batch_given_up_on_has_its_results_so_far_in_its_output_file(tmp_path: Path) -> None:
    """Refused for good by its last finalise, written when failed: its answers are not thrown away."""
    store, queue, now = _store(tmp_path)
    batch_id = _batch(store, 2)
    assert _run_all(store) == 2
    queue.error, queue.until_reads = _refused(), 3
    assert _housekeep(store, now, 3) == [batch_id]
    found = store.batch("acme", batch_id)
    assert found is not None and found.status == "failed" and found.errors
    assert found.errors[0]["code"] == "finalizing_failed" and found.output_file_id is not None
    assert len((store.files.file_content("acme", found.output_file_id) or b"").splitlines()) == 2
    assert store.tidy() == 0 and _lines(store, batch_id) == 0  # written: the lines went


def test_a_batch_whose_results_can_never_be_written_keeps_them_in_the_queue(tmp_path: Path) -> None:
    store, queue, now = _store(tmp_path)
    batch_id = _batch(store, 2)
    assert _run_all(store) == 2
    queue.error = _refused()
    assert _housekeep(store, now, 3) == [batch_id]
    found = store.batch("acme", batch_id)
    assert found is not None and found.status == "failed" and found.errors and found.output_file_id is None
    assert [e["code"] for e in found.errors] == ["finalizing_failed", "results_kept"]
    assert found.counts == {"total": 2, "completed": 2, "failed": 0}
    assert store.tidy() == 0 and _lines(store, batch_id) == 2  # kept, even by the start-up tidy


def _lines(store: BatchStore, batch_id: str) -> int:
    """The lines the (SQL) queue still holds for `batch_id`."""
    with Session(store.files._engine) as session:
        return len(session.scalars(select(BatchLineRow.line).where(BatchLineRow.batch_id == batch_id)).all())


def _result_bytes(store: BatchStore, batch_id: str) -> int | None:
    with Session(store.files._engine) as session:
        row = session.get(BatchRow, batch_id)
        assert row is not None
        return row.result_bytes


def test_only_the_results_kept_count_toward_the_batchs_bytes(store: BatchStore) -> None:
    """A runner whose lease lapsed committed a line another runner had committed: both counted (30,390
    bytes for 20,260)."""
    batch_id = _batch(store, 2)
    lapsed = store.lease("runner-a", "m", 2, lease_s=-1)  # (its renewals failed: lapsed at once)
    (taken,) = store.lease("runner-b", "m", 1, lease_s=30)
    body = b"x" * 10_000
    assert store.commit_many("runner-b", [(taken, LineResult(200, body, "req"))]) == 1
    assert store.commit_many("runner-a", [(line, LineResult(200, body, "req")) for line in lapsed]) == 1
    assert _result_bytes(store, batch_id) == 2 * (len(body) + 2 + 128)


def test_a_batch_queued_again_counts_its_results_from_nothing(store: BatchStore) -> None:
    """Redis lost its lines: queued again from its input, it ran them again; its first run's count stayed,
    so each result counted twice toward its tenant's quota."""
    batch_id = _batch(store, 2)
    body = b"x" * 10_000
    assert _run_all(store, body=body) == 2
    with Session(store.files._engine) as session, session.begin():  # (as `_finish` does on LOST)
        row = session.get(BatchRow, batch_id)
        assert row is not None
        row.status = "validating"
    store.lines.drop(batch_id)
    assert store.start(batch_id, "m", [(f"c{i}", BODY) for i in range(2)])
    assert _result_bytes(store, batch_id) == 0
    assert _run_all(store, body=body) == 2
    assert _result_bytes(store, batch_id) == 2 * (len(body) + 2 + 128)
