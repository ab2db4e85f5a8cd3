"""The durable queue on its own (SQLite): leases, their takeover and its limit, results kept only under
the lease, backoff, and a cancelled batch that still had lines in a runner's hands."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import orjson

from corral.store import open_database
from corral.store.batch import BatchStore, LineResult, NewBatch


def _store(tmp_path: Path) -> BatchStore:
    return BatchStore(open_database(f"sqlite:///{tmp_path / 'queue.db'}"))


def _batch(store: BatchStore, lines: int) -> str:
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    new = NewBatch("acme", None, "/v1/chat/completions", "file-x", timedelta(hours=1))
    batch = store.create_batch(new, "m", [(f"c{i}", body) for i in range(lines)])
    return batch.id


def _ok() -> LineResult:
    return LineResult(200, b'{"choices": []}', "req_1")


def test_a_line_has_one_result_whoever_held_its_lease(tmp_path: Path) -> None:
    store = _store(tmp_path)
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


def test_a_line_taken_over_too_often_fails_and_a_backoff_holds_a_line_back(tmp_path: Path) -> None:
    store = _store(tmp_path)
    batch_id = _batch(store, 2)
    for _ in range(3):
        assert store.lease("runner", "m", 1, lease_s=0.01, max_attempts=3)
        time.sleep(0.02)
    assert store.lease("runner", "m", 1, lease_s=30, max_attempts=3) == []  # c0 is failed instead
    assert store.lease("runner", "m", 1, lease_s=30, max_attempts=3)[0].custom_id == "c1"
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
    tmp_path: Path,
) -> None:
    store = _store(tmp_path)
    batch_id = _batch(store, 3)
    given_back, lapsed, finished = store.lease("runner", "m", 3, lease_s=0.05)
    cancelled = store.cancel("acme", batch_id)
    assert cancelled is not None and cancelled.status == "cancelling"
    assert store.cancel("globex", batch_id) is None  # another tenant's: not found
    assert store.commit("runner", finished, _ok())  # a line in hand when cancelled still counts
    store.release("runner", given_back, after_s=5)  # handed back (a retry): must not keep it open
    time.sleep(0.1)  # and `lapsed`'s runner died: its lease runs out
    assert store.housekeeping() == [batch_id]
    batch = store.batch("acme", batch_id)
    assert batch is not None and batch.status == "cancelled"
    assert batch.counts == {"total": 3, "completed": 1, "failed": 2}
    assert batch.output_file_id and batch.error_file_id
    errors = store.files.file_content("acme", batch.error_file_id) or b""
    assert sorted(orjson.loads(x)["custom_id"] for x in errors.splitlines()) == sorted(
        [given_back.custom_id, lapsed.custom_id]
    )
