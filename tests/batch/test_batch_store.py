"""The durable queue on its own, its lines in SQL (SQLite) and in Redis Streams: leases, their takeover
and its limit, results kept only under the lease, backoff, a cancelled batch that still had lines in a
runner's hands; validation's steps; Redis losing a batch's lines; a store from before a column."""

from __future__ import annotations

import sqlite3
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from tempfile import SpooledTemporaryFile

import orjson
import pytest
import redis
from sqlalchemy import Engine, select, update
from sqlalchemy.exc import DataError
from sqlalchemy.orm import Session

from corral.batch import BatchStore, LineResult, NewBatch, queue_sql
from corral.batch import results as result_files
from corral.batch.queue import ResultRow
from corral.batch.queue_redis import RedisLines
from corral.batch.retries import Retries
from corral.store import open_database
from corral.store.batch_rows import BatchLineRow, BatchRow

REDIS = "redis://127.0.0.1:6379/0"


def _batch(store: BatchStore, lines: int, tenant: str = "acme") -> str:
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    new = NewBatch(tenant, None, "/v1/chat/completions", "file-x", timedelta(hours=1))
    batch = store.create_batch(new)
    assert batch.status == "validating"
    assert store.start(batch.id, "m", [(f"c{i}", body) for i in range(lines)])
    return batch.id


def _ok() -> LineResult:
    return LineResult(200, b'{"choices": []}', "req_1")


def test_a_line_has_one_result_whoever_held_its_lease(store: BatchStore) -> None:
    batch_id = _batch(store, 1)
    (first,) = store.lease("runner-a", "m", 5, lease_s=0.05)
    assert store.lease("runner-b", "m", 5, lease_s=30) == []  # leased: nobody else takes it
    time.sleep(0.1)  # runner-a's lease runs out (it died, say)
    (second,) = store.lease("runner-b", "m", 5, lease_s=30)
    assert second.attempts == 2
    assert not store.commit("runner-a", first, _ok())  # too late: its result is dropped
    assert store.commit("runner-b", second, _ok())
    assert not store.commit("runner-b", second, _ok())  # and never twice
    assert store.housekeeping() == [batch_id]
    batch = store.batch("acme", batch_id)
    assert batch is not None and batch.status == "completed" and batch.counts["completed"] == 1


def test_a_line_taken_over_too_often_fails_and_a_backoff_holds_a_line_back(store: BatchStore) -> None:
    batch_id = _batch(store, 2)
    for _ in range(3):
        assert store.lease("runner", "m", 1, lease_s=0.01, max_attempts=3)
        time.sleep(0.02)
    taken = store.lease("runner", "m", 1, lease_s=30, max_attempts=3)
    taken += store.lease("runner", "m", 1, lease_s=30, max_attempts=3)
    assert [x.custom_id for x in taken] == ["c1"]  # c0 is failed instead
    store.housekeeping()
    batch = store.batch("acme", batch_id)
    assert batch is not None and batch.counts == {"total": 2, "completed": 0, "failed": 1}

    other = _batch(store, 1)
    (line,) = [x for x in store.lease("runner", "m", 5, lease_s=30) if x.batch_id == other]
    store.release("runner", line, after_s=0.3)
    assert [x for x in store.lease("runner", "m", 5, lease_s=30) if x.batch_id == other] == []
    time.sleep(0.35)
    assert [x.custom_id for x in store.lease("runner", "m", 5, lease_s=30) if x.batch_id == other] == ["c0"]


def test_a_cancelled_batch_finishes_even_when_its_lines_come_back_or_their_runner_died(
    store: BatchStore,
) -> None:
    batch_id = _batch(store, 3)
    started = time.monotonic()  # (a lease long enough to commit and release under load: 50 ms was not)
    given_back, lapsed, finished = store.lease("runner", "m", 3, lease_s=1.0)
    cancelled = store.cancel("acme", batch_id)
    assert cancelled is not None and cancelled.status == "cancelling"
    assert store.cancel("globex", batch_id) is None  # another tenant's: not found
    assert store.commit("runner", finished, _ok())  # a line in hand when cancelled still counts
    store.release("runner", given_back, after_s=5)  # handed back (a retry): must not keep it open
    time.sleep(max(0.0, started + 1.1 - time.monotonic()))  # and `lapsed`'s runner died: its lease runs out
    assert store.housekeeping() == [batch_id]
    batch = store.batch("acme", batch_id)
    assert batch is not None and batch.status == "cancelled"
    assert batch.counts == {"total": 3, "completed": 1, "failed": 2}
    assert batch.output_file_id and batch.error_file_id
    errors = store.files.file_content("acme", batch.error_file_id) or b""
    assert sorted(orjson.loads(x)["custom_id"] for x in errors.splitlines()) == sorted(
        [given_back.custom_id, lapsed.custom_id]
    )


def test_a_batchs_results_are_written_in_line_order_past_memory_sized_slices(
    store: BatchStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,203 lines, read back 500 at a time, about 10 MB of answers: the result files are spooled to disk
    past 8 MiB instead of assembled in memory; every line is there once, in its input order, an answer in
    the output file and a refusal in the error file."""
    spools: list[SpooledTemporaryFile[bytes]] = []

    class Watched(SpooledTemporaryFile):  # type: ignore[type-arg]
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            spools.append(self)

        def __exit__(self, *exc: object) -> None:
            self.was_on_disk = self._rolled  # type: ignore[attr-defined]
            super().__exit__(*exc)  # type: ignore[arg-type]

    monkeypatch.setattr(result_files, "SpooledTemporaryFile", Watched)
    reads: list[int] = []
    results = store.lines.results

    def counted(session: Session, batch_id: str) -> Iterator[ResultRow]:
        rows = results(session, batch_id)
        assert not isinstance(rows, list)  # read as they are written, not all at once
        for row in rows:
            reads.append(1)
            yield row

    monkeypatch.setattr(store.lines, "results", counted)
    batch_id = _batch(store, 1203)
    lines = []
    while taken := store.lease("runner", "m", 400, lease_s=60):
        lines += taken
    assert len(lines) == 1203
    pad = "x" * 8000
    for line in lines:
        index = int(line.custom_id[1:])
        status = 500 if index % 100 == 7 else 200
        body = orjson.dumps({"index": index, "pad": pad})
        assert store.commit("runner", line, LineResult(status, body, f"req_{index}"))
    assert store.housekeeping() == [batch_id]
    batch = store.batch("acme", batch_id)
    assert batch is not None and batch.status == "completed"
    assert batch.counts == {"total": 1203, "completed": 1191, "failed": 12}
    assert batch.output_file_id and batch.error_file_id
    output = (store.files.file_content("acme", batch.output_file_id) or b"").splitlines()
    errors = (store.files.file_content("acme", batch.error_file_id) or b"").splitlines()
    answered = [orjson.loads(x) for x in output]
    assert [x["custom_id"] for x in answered] == [f"c{i}" for i in range(1203) if i % 100 != 7]
    assert all(x["response"]["body"]["index"] == int(x["custom_id"][1:]) for x in answered)
    assert [orjson.loads(x)["custom_id"] for x in errors] == [f"c{i}" for i in range(1203) if i % 100 == 7]
    assert len(reads) == 1203
    assert [spool.was_on_disk for spool in spools] == [True, False]  # the output past 8 MiB, the errors not


def test_a_batch_is_started_or_failed_once_and_a_validating_batch_can_be_cancelled(store: BatchStore) -> None:
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    new = NewBatch("acme", None, "/v1/chat/completions", "file-x", timedelta(hours=1))
    assert store.pending() == (False, [])  # what the runner asks each tick
    batch = store.create_batch(new)
    assert [b.id for b in store.validating()] == [batch.id]
    assert store.pending() == (True, [])
    assert store.start(batch.id, "m", [("a", body)])
    assert store.pending() == (False, ["m"])
    assert not store.start(batch.id, "m", [("a", body)])  # a second runner's start changes nothing
    assert not store.fail(batch.id, [{"code": "x", "message": "late", "line": None}])
    assert store.validating() == []
    assert len(store.lease("runner", "m", 5, lease_s=30)) == 1  # queued once

    failed = store.create_batch(new)
    assert store.fail(failed.id, [{"code": "empty_file", "message": "nothing", "line": None}])
    found = store.batch("acme", failed.id)
    assert found is not None and found.status == "failed" and found.errors and "failed" in found.times

    waiting = store.create_batch(new)
    cancelled = store.cancel("acme", waiting.id)
    assert cancelled is not None and cancelled.status == "cancelling"
    assert not store.start(waiting.id, "m", [("a", body)])  # validation finds it cancelled
    assert waiting.id in store.housekeeping()
    found = store.batch("acme", waiting.id)
    assert found is not None and found.status == "cancelled"


def test_a_batch_whose_lines_redis_lost_is_queued_again(tmp_path: Path) -> None:
    engine = open_database(f"sqlite:///{tmp_path / 'queue.db'}")
    prefix = f"test:{uuid.uuid4().hex[:8]}:"
    store = BatchStore(engine, RedisLines(REDIS, prefix=prefix))
    batch_id = _batch(store, 3)
    (line,) = store.lease("runner", "m", 1, lease_s=30)
    assert store.commit("runner", line, _ok())
    client = redis.Redis.from_url(REDIS)
    for key in client.scan_iter(f"{prefix}*"):  # Redis restarted without persistence, say
        client.delete(key)
    assert store.housekeeping() == []
    (again,) = store.validating()  # the runner checks its input file again and queues every line
    assert again.id == batch_id
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert store.start(batch_id, "m", [(f"c{i}", body) for i in range(3)])
    for line in store.lease("runner", "m", 5, lease_s=30):
        assert store.commit("runner", line, _ok())
    assert store.housekeeping() == [batch_id]
    found = store.batch("acme", batch_id)
    assert found is not None and found.counts == {"total": 3, "completed": 3, "failed": 0}
    for key in client.scan_iter(f"{prefix}*"):
        client.delete(key)


def test_a_store_made_before_a_column_gains_it(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    open_database(f"sqlite:///{path}")
    with sqlite3.connect(path) as db:
        db.execute("ALTER TABLE corral_batches DROP COLUMN counts")  # as an earlier corral made it
    store = BatchStore(open_database(f"sqlite:///{path}"))
    batch_id = _batch(store, 1)
    for line in store.lease("runner", "m", 5, lease_s=30):
        store.commit("runner", line, _ok())
    assert store.housekeeping() == [batch_id]
    found = store.batch("acme", batch_id)
    assert found is not None and found.counts == {"total": 1, "completed": 1, "failed": 0}


def _redis_store(tmp_path: Path) -> tuple[BatchStore, str]:
    prefix = f"test:{uuid.uuid4().hex[:8]}:"
    return BatchStore(
        open_database(f"sqlite:///{tmp_path / 'queue.db'}"), RedisLines(REDIS, prefix=prefix)
    ), prefix


def _forget(prefix: str) -> None:
    client = redis.Redis.from_url(REDIS)
    for key in client.scan_iter(f"{prefix}*"):
        client.delete(key)


def test_a_batch_cancelled_while_its_lines_are_being_queued_still_finishes(tmp_path: Path) -> None:
    store, prefix = _redis_store(tmp_path)
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    lines = [(f"c{i}", body) for i in range(5)]
    batch = store.create_batch(NewBatch("acme", None, "/v1/chat/completions", "file-x", timedelta(hours=1)))
    store.lines.add(None, batch.id, "m", "acme", lines[:2])  # type: ignore[arg-type]  # the first chunk went in
    assert store.cancel("acme", batch.id).status == "cancelling"  # type: ignore[union-attr]
    store.lines.add(None, batch.id, "m", "acme", lines)  # type: ignore[arg-type]  # and then the rest
    assert not store.start(batch.id, "m", lines)
    assert store.housekeeping() == [batch.id]
    found = store.batch("acme", batch.id)
    assert found is not None and found.status == "cancelled"
    assert found.counts == {"total": 5, "completed": 0, "failed": 5}
    _forget(prefix)


def test_gateways_on_another_queue_leave_a_batch_alone_and_finished_batches_lines_are_tidied(
    tmp_path: Path,
) -> None:
    store, prefix = _redis_store(tmp_path)
    on_sql = BatchStore(open_database(f"sqlite:///{tmp_path / 'queue.db'}"))
    batch_id = _batch(store, 2)
    assert on_sql.validating() == [] and on_sql.pending() == (False, []) and on_sql.housekeeping() == []
    found = on_sql.batch("acme", batch_id)
    assert found is not None and found.status == "in_progress"  # not finalised as empty, not re-queued
    for line in store.lease("runner", "m", 5, lease_s=30):
        store.commit("runner", line, _ok())
    store.lines.add(None, "batch_gone", "m", "acme", [("x", b"{}")])  # type: ignore[arg-type]  # left by a crash
    assert store.housekeeping() == [batch_id]
    assert store.tidy() == 1  # batch_gone's lines: its batch is not running
    assert not list(redis.Redis.from_url(REDIS).scan_iter(f"{prefix}b:*"))
    _forget(prefix)


def _queued(store: BatchStore, batch_id: str) -> int:
    """The lines the queue still holds for `batch_id` (rows in SQL, keys in Redis)."""
    if isinstance(store.lines, RedisLines):
        return len(list(redis.Redis.from_url(REDIS).scan_iter(store.lines._key(batch_id, "*"))))
    with Session(store.lines._engine) as session:
        return len(session.scalars(select(BatchLineRow.line).where(BatchLineRow.batch_id == batch_id)).all())


def test_a_finished_batchs_lines_leave_the_queue_once_its_results_are_in_its_files(
    store: BatchStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each line holds a request's body and its answer: kept after the batch ended, they outlived the
    files a tenant deletes or that expire (in SQL the rows stayed for good)."""
    monkeypatch.setattr(queue_sql, "_DROP_AT_ONCE", 2)  # (5 lines: dropped in three steps)
    batch_id, other = _batch(store, 5), _batch(store, 1)
    for line in store.lease("runner", "m", 5, lease_s=30):
        if line.batch_id == batch_id:
            store.commit("runner", line, _ok())
    assert _queued(store, batch_id) > 0
    assert store.housekeeping() == [batch_id]
    batch = store.batch("acme", batch_id)
    assert batch is not None and batch.output_file_id is not None
    output = (store.files.file_content("acme", batch.output_file_id) or b"").splitlines()
    assert sorted(orjson.loads(line)["custom_id"] for line in output) == [f"c{i}" for i in range(5)]
    assert _queued(store, batch_id) == 0
    assert _queued(store, other) > 0  # a batch still running keeps its lines


def test_sql_tidying_drops_the_lines_of_finished_and_vanished_batches_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = BatchStore(open_database(f"sqlite:///{tmp_path / 'queue.db'}"))
    finished, running = _batch(store, 3), _batch(store, 2)
    for line in store.lease("runner", "m", 5, lease_s=30):
        if line.batch_id == finished:
            store.commit("runner", line, _ok())
    monkeypatch.setattr(store.lines, "drop", lambda batch_id: None)  # the gateway died before dropping
    assert store.housekeeping() == [finished]
    monkeypatch.undo()
    with Session(store.lines._engine) as session, session.begin():
        store.lines.add(session, "batch_gone", "m", "acme", [("x", b"{}")])  # no batch row at all
        # a store from before the row kept its counts: they were counted from the lines
        session.execute(update(BatchRow).where(BatchRow.id == finished).values(counts=None))
    assert _queued(store, finished) == 3 and _queued(store, "batch_gone") == 1
    assert store.tidy() == 2
    assert _queued(store, finished) == 0 and _queued(store, "batch_gone") == 0
    found = store.batch("acme", finished)  # its counts were kept before its lines went
    assert found is not None and found.counts == {"total": 3, "completed": 3, "failed": 0}
    assert _queued(store, running) == 2
    assert store.tidy() == 0


def test_a_batch_never_checked_within_its_window_expires(store: BatchStore) -> None:
    batch = store.create_batch(
        NewBatch("acme", None, "/v1/chat/completions", "file-x", timedelta(milliseconds=10))
    )
    time.sleep(0.02)
    assert store.housekeeping() == [batch.id]
    found = store.batch("acme", batch.id)
    assert found is not None and found.status == "expired" and found.counts["total"] == 0


def test_lines_are_dealt_fairly_between_tenants(store: BatchStore) -> None:
    """Eve's 50-line batch came first; bob's 3 lines do not wait for all of hers: the tenant with the
    fewest lines running gets the next slot (before, the oldest batch took every slot until it ended; in
    Redis, until its model's one stream reached bob's lines)."""
    eves = _batch(store, 50, tenant="eve")
    bobs = _batch(store, 3, tenant="bob")
    first = store.lease("runner-a", "m", 4, lease_s=30)
    assert sorted(line.batch_id == bobs for line in first) == [False, False, True, True]
    more = store.lease("runner-b", "m", 3, lease_s=30)  # (another runner: the count is the store's)
    assert [line.batch_id for line in more] == [bobs, eves, eves]  # bob's last, then eve's again
    assert [line.line for line in first + more if line.batch_id == bobs] == [0, 1, 2]


def test_finished_batches_are_deleted_once_their_files_have_expired(tmp_path: Path) -> None:
    """A tenant making and cancelling batches in a loop does not grow the table for good: a finished batch
    goes once its window's end plus the files' expiry has passed (its output and error files are gone)."""
    store = BatchStore(open_database(f"sqlite:///{tmp_path / 'b.db'}"), file_expiry=timedelta(seconds=0.3))
    done = store.create_batch(
        NewBatch("acme", None, "/v1/chat/completions", "file-x", timedelta(milliseconds=10))
    )
    running = _batch(store, 1)
    time.sleep(0.02)
    assert store.housekeeping() == [done.id]  # (expired unchecked: finished)
    assert store.batch("acme", done.id) is not None  # kept while its files may be
    time.sleep(0.3)
    store.housekeeping()
    assert store.batch("acme", done.id) is None
    assert store.batch("acme", running) is not None  # unfinished: kept


def test_a_batch_finished_late_keeps_its_row_while_its_files_live(tmp_path: Path) -> None:
    """A batch finalised after its window's end (a line in hand till then, a runner that was down) writes
    files that expire after the files' expiry from then: its row goes only once they are gone."""
    store = BatchStore(open_database(f"sqlite:///{tmp_path / 'b.db'}"), file_expiry=timedelta(seconds=0.5))
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    new = NewBatch("acme", None, "/v1/chat/completions", "file-x", timedelta(milliseconds=400))
    batch = store.create_batch(new)
    assert store.start(batch.id, "m", [("c0", body)])
    (line,) = store.lease("runner", "m", 1, lease_s=30)  # (within its window: none is leased past it)
    time.sleep(1.0)  # past its window and the files' expiry after it
    assert store.commit("runner", line, _ok())
    store.housekeeping()  # finalised now: its files last 0.5 s from now
    store.housekeeping()  # (its window and the expiry after it have passed: its files have not)
    found = store.batch("acme", batch.id)
    assert found is not None and found.output_file_id
    assert store.files.file("acme", found.output_file_id) is not None
    time.sleep(0.6)
    store.housekeeping()  # the files swept, then the row
    assert store.batch("acme", batch.id) is None


class ResultsRefused(queue_sql.SqlLines):
    """A line queue whose results cannot be written into files for the batches named (a result file the
    store refused: one of 2 GiB passed the 4-byte `bytes` column on PostgreSQL)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.refused: set[str] = set()
        self.tries = 0

    def results(self, session: Session, batch_id: str) -> Iterator[ResultRow]:
        if batch_id in self.refused:
            self.tries += 1
            raise DataError("INSERT INTO corral_files ...", {}, ValueError("integer out of range"))
        return super().results(session, batch_id)


def test_a_batch_that_cannot_be_finalised_holds_no_other_back_and_is_failed_after_its_tries(
    tmp_path: Path,
) -> None:
    """One batch whose finalising raised aborted housekeeping: every batch after it was never finalised or
    expired, and its 2 GB output was spooled and inserted again every 2 s, for good."""
    engine = open_database(f"sqlite:///{tmp_path / 'queue.db'}")
    queue, now = ResultsRefused(engine), [0.0]
    store = BatchStore(engine, queue, retries=Retries(tries=3, first_s=10, clock=lambda: now[0]))
    poisoned, other = _batch(store, 2), _batch(store, 1)
    queue.refused.add(poisoned)
    for line in store.lease("runner", "m", 5, lease_s=30):
        assert store.commit("runner", line, _ok() if line.line == 0 else LineResult(500, b"{}", "req_2"))
    assert store.housekeeping() == [other]
    assert store.housekeeping() == [] and queue.tries == 1  # backed off: not tried again at once
    now[0] += 10
    assert store.housekeeping() == [] and queue.tries == 2
    now[0] += 20  # (the backoff doubles)
    assert store.housekeeping() == [poisoned] and queue.tries == 4  # (once more: written as it fails?)
    found = store.batch("acme", poisoned)
    assert found is not None and found.status == "failed" and found.errors
    assert found.errors[0]["code"] == "finalizing_failed"
    assert found.counts == {"total": 2, "completed": 1, "failed": 1}  # as far as its lines got
    assert _queued(store, poisoned) == 2  # its results could not be written: kept, not dropped
