"""How the line queue ends lines, in SQL (SQLite) and in Redis Streams: results that are not JSON or cannot
be written are kept as their line's error, not raised; a batch's expiry lets the lines running finish with
their results; a finished batch's entries leave its tenant's stream and never hold another tenant's lines
back; tidying keeps a batch whose lines are being queued while it runs."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from corral.batch import BatchStore, LineResult, NewBatch
from corral.batch.queue_redis import RedisLines
from corral.store import open_database

REDIS = "redis://127.0.0.1:6379/0"
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


@pytest.fixture
def prefix() -> Iterator[str]:
    made = f"test:{uuid.uuid4().hex[:8]}:"
    yield made
    client = redis.Redis.from_url(REDIS)
    for key in client.scan_iter(f"{made}*"):
        client.delete(key)


@pytest.fixture(params=["sql", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path, prefix: str) -> BatchStore:
    engine = open_database(f"sqlite:///{tmp_path / 'queue.db'}")
    return (
        BatchStore(engine) if request.param == "sql" else BatchStore(engine, RedisLines(REDIS, prefix=prefix))
    )


@pytest.fixture
def on_redis(tmp_path: Path, prefix: str) -> BatchStore:
    return BatchStore(open_database(f"sqlite:///{tmp_path / 'queue.db'}"), RedisLines(REDIS, prefix=prefix))


def _batch(
    store: BatchStore, lines: int, tenant: str = "acme", window: timedelta = timedelta(hours=1)
) -> str:
    batch = store.create_batch(NewBatch(tenant, None, "/v1/chat/completions", "file-x", window))
    assert store.start(batch.id, "m", [(f"c{i}", BODY) for i in range(lines)])
    return batch.id


def _ok() -> LineResult:
    return LineResult(200, b'{"choices": []}', "req_1")


def _file(store: BatchStore, file_id: str | None, tenant: str = "acme") -> list[dict[str, Any]]:
    assert file_id is not None
    return [orjson.loads(line) for line in (store.files.file_content(tenant, file_id) or b"").splitlines()]


def test_answers_that_are_not_json_or_cannot_be_written_are_their_lines_errors(store: BatchStore) -> None:
    """An HTML page from a proxy, NaN, a byte-order mark: before, `commit_many` raised on the first and
    rolled back its tick's other results with it."""
    batch_id = _batch(store, 5)
    lines = sorted(store.lease("runner", "m", 5, lease_s=30), key=lambda line: line.line)
    answers = [
        LineResult(200, b"<html>502 Bad Gateway</html>", "req_0"),
        _ok(),
        LineResult(200, b"NaN", "req_2"),
        LineResult(400, b"\xef\xbb\xbf{}", "req_3"),
        LineResult(200, b"{}", "req_\ud800"),  # a request id orjson cannot write
    ]
    assert store.commit_many("runner", list(zip(lines, answers, strict=True))) == 5
    assert store.housekeeping() == [batch_id]
    batch = store.batch("acme", batch_id)
    assert batch is not None and batch.counts == {"total": 5, "completed": 1, "failed": 4}
    assert [x["custom_id"] for x in _file(store, batch.output_file_id)] == ["c1"]
    errors = {x["custom_id"]: x["response"] for x in _file(store, batch.error_file_id)}
    assert {custom_id: e["status_code"] for custom_id, e in errors.items()} == {
        "c0": 502,
        "c2": 502,
        "c3": 502,
        "c4": 500,
    }
    assert errors["c0"]["body"]["error"]["type"] == "upstream_error"
    assert "answered 400" in errors["c3"]["body"]["error"]["message"]
    assert errors["c4"]["body"]["error"]["code"] == "result_not_stored"


def test_expiry_lets_lines_running_finish_with_their_results(store: BatchStore) -> None:
    """A line running when the window ended was marked expired at once: its result was dropped (its usage
    recorded all the same) and the error file said it never ran. Now it is treated as cancel treats it:
    pending lines and lapsed leases expire, a live lease commits."""
    batch_id = _batch(store, 3, window=timedelta(milliseconds=400))
    (running,) = store.lease("runner-a", "m", 1, lease_s=30)
    (lapsed,) = store.lease("runner-b", "m", 1, lease_s=0.05)  # (its gateway died)
    deadline = time.monotonic() + 5
    while (found := store.batch("acme", batch_id)) is not None and time.time() < found.expires_at.timestamp():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert store.lease("runner-c", "m", 5, lease_s=30) == []  # nothing starts past the window
    assert store.housekeeping() == []  # not finalised while a line runs
    assert store.commit("runner-a", running, _ok())
    assert not store.commit("runner-b", lapsed, _ok())  # its lease lapsed: it expired
    assert store.housekeeping() == [batch_id]
    batch = store.batch("acme", batch_id)
    assert batch is not None and batch.status == "expired"
    assert batch.counts == {"total": 3, "completed": 1, "failed": 2}
    assert [x["custom_id"] for x in _file(store, batch.output_file_id)] == [running.custom_id]
    errors = _file(store, batch.error_file_id)
    assert sorted(x["custom_id"] for x in errors) == sorted({"c0", "c1", "c2"} - {running.custom_id})
    assert {x["error"]["code"] for x in errors} == {"batch_expired"}


def _stream(prefix: str, tenant: str) -> int:
    return int(redis.Redis.from_url(REDIS).xlen(f"{prefix}q:m:{tenant}"))


def test_a_finished_batchs_entries_leave_its_tenants_stream(on_redis: BatchStore, prefix: str) -> None:
    """A cancelled batch's lines stayed in its tenant's stream: the tenant with the fewest lines running is
    read first, each dead entry counted against the call's 2,000 reads, so bob's lines waited behind
    2,500 of them (and the entries stayed in Redis)."""
    dead = _batch(on_redis, 2500, tenant="aaa")
    bobs = _batch(on_redis, 3, tenant="bob")
    on_redis.cancel("aaa", dead)
    assert on_redis.housekeeping() == [dead]
    assert _stream(prefix, "aaa") == 0
    assert [line.batch_id for line in on_redis.lease("runner", "m", 3, lease_s=30)] == [bobs] * 3


def test_entries_of_batches_dropped_before_do_not_hold_another_tenants_lines(
    on_redis: BatchStore, prefix: str
) -> None:
    """Entries whose batch is gone (dropped by a corral from before, which left them in the stream) are
    read and deleted a bounded number a call, but they no longer take every read of the call."""
    dead = _batch(on_redis, 2500, tenant="aaa")
    bobs = _batch(on_redis, 3, tenant="bob")
    client = redis.Redis.from_url(REDIS)
    client.delete(*client.scan_iter(f"{prefix}b:{dead}:*"))  # its keys went, its entries stayed
    assert [line.batch_id for line in on_redis.lease("runner", "m", 3, lease_s=30)] == [bobs] * 3
    assert 0 < _stream(prefix, "aaa") < 2500  # (the dead entries read were deleted)


def test_tidying_keeps_a_batch_whose_lines_are_queued_meanwhile(
    on_redis: BatchStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tidying read the unfinished batches, then scanned Redis: a batch another gateway queued in between
    was not in the snapshot and lost its lines."""
    finished = _batch(on_redis, 1)
    for line in on_redis.lease("runner", "m", 5, lease_s=30):
        on_redis.commit("runner", line, _ok())
    assert on_redis.housekeeping() == [finished]
    on_redis.lines.add(None, "batch_gone", "m", "acme", [("x", b"{}")])  # type: ignore[arg-type]  # a crash's
    tidy, queued = on_redis.lines.tidy, []

    def meanwhile(*args: Any, **kwargs: Any) -> int:
        queued.append(_batch(on_redis, 3))  # another gateway checks and queues a batch
        return tidy(*args, **kwargs)

    monkeypatch.setattr(on_redis.lines, "tidy", meanwhile)
    assert on_redis.tidy() == 1  # batch_gone's
    assert [line.batch_id for line in on_redis.lease("runner", "m", 5, lease_s=30)] == queued * 3


def _settle_s(queue: RedisLines, batch_id: str) -> float:
    """The fastest of five housekeeping settles of a cancelled batch (its Redis time, less the noise)."""
    taken = []
    for _ in range(5):
        began = time.perf_counter()
        assert queue.settle(None, batch_id, "m", "cancel", time.time()) == 1  # type: ignore[arg-type]
        taken.append(time.perf_counter() - began)
    return min(taken)


def test_a_stopped_batchs_later_settles_read_only_its_leased_lines(on_redis: BatchStore) -> None:
    """A cancelled 50,000-line batch with a line still running: each housekeeping pass (every 2 s) walked
    every line's state in one script, 30-55 ms in which Redis served nothing else. Its pending lines are
    finished once now, as it is stopped, and a later settle reads only the lines leased: it costs what a
    1-line batch's does."""
    queue = on_redis.lines
    assert isinstance(queue, RedisLines)
    queue.add(None, "batch_big", "m", "acme", [(f"c{i}", BODY) for i in range(50_000)])  # type: ignore[arg-type]
    queue.add(None, "batch_small", "m", "bob", [("c0", BODY)])  # type: ignore[arg-type]
    running = queue.lease("runner", "m", 2, 300, 5)
    assert sorted(line.batch_id for line in running) == ["batch_big", "batch_small"]
    for batch_id in ("batch_big", "batch_small"):
        queue.cancel(batch_id)  # (the pending lines finish, once)
    big, small = _settle_s(queue, "batch_big"), _settle_s(queue, "batch_small")
    assert big < 3 * small + 0.002, (big, small)
    assert queue.counts(None, ["batch_big"])["batch_big"] == {  # type: ignore[arg-type]
        "total": 50_000,
        "completed": 0,
        "failed": 49_999,
    }
