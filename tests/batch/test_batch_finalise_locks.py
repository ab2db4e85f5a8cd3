"""Finalising a batch holds SQLite's one write lock for a few parts at a time: its output file was written
in the transaction that moved its status (1.5 GiB of answers: 30 s), and another gateway worker's writes
failed past their 5 s busy timeout ('database is locked': 503s). The files are written unlinked first, no
one sees them (a gateway killed before the status moved leaves none half-written), and they are linked
with the status in one short transaction; those never linked are discarded once the batch is finished."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import pytest
from sqlalchemy import func, insert, select, text
from sqlalchemy.orm import Session

from corral.batch import BatchStore, LineResult, NewBatch
from corral.store import open_database
from corral.store.batch_rows import BatchRow
from corral.store.files import PART_BYTES, FilePartRow, FileStore, NewFile
from tests.store.locking import BUSY_S, OtherWorker

BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


def _ran(url: str, lines: int, answer_bytes: int) -> str:
    """A batch whose `lines` have all been answered (`answer_bytes` each), to finalise; its id."""
    store = BatchStore(open_database(url))
    batch = store.create_batch(NewBatch("acme", None, "/v1/chat/completions", "file-x", timedelta(hours=1)))
    assert store.start(batch.id, "m", [(f"c{i}", BODY) for i in range(lines)])
    answer = orjson.dumps({"v": "a" * answer_bytes})
    leased = store.lease("runner", "m", lines, lease_s=60)
    assert store.commit_many("runner", [(line, LineResult(200, answer, "req")) for line in leased]) == lines
    return batch.id


def _output_lines(store: BatchStore, batch_id: str) -> int:
    found = store.batch("acme", batch_id)
    assert found is not None and found.status == "completed" and found.output_file_id is not None
    return len((store.files.file_content("acme", found.output_file_id) or b"").splitlines())


def _parts(store: BatchStore, file_id: str | None = None) -> int:
    query = select(func.count()).select_from(FilePartRow)
    if file_id is not None:
        query = query.where(FilePartRow.file_id == file_id)
    with Session(store.files._engine) as session:
        return int(session.scalar(query) or 0)


def test_another_worker_writes_while_a_batchs_output_is_written(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'batch.db'}"
    batch_id = _ran(url, 16, PART_BYTES)  # (an output of 17 parts)
    other = OtherWorker(url)
    engine = other.slow_parts(url, "INSERT")
    store = BatchStore(engine)
    store.files = FileStore(engine, parts_at_once=1)
    with other.writing():
        assert store.housekeeping() == [batch_id]
    assert other.failures == [], f"the other worker's writes waited past its busy timeout ({BUSY_S} s)"
    assert len(other.waits) >= 4 and max(other.waits) < BUSY_S  # it wrote all along the finalising
    assert _output_lines(store, batch_id) == 16


_KILLED_BEFORE_THE_STATUS = """
import pathlib, sys, time
from sqlalchemy import event
from corral.batch import BatchStore
from corral.store import open_database
from corral.store.files import FileStore

url, marker = sys.argv[1], pathlib.Path(sys.argv[2])
engine = open_database(url)

def status_moving():  # the batch's status is about to move, its files written: killed here
    marker.touch()
    time.sleep(600)

event.listen(engine, "connect", lambda c, _r: c.create_function("status_moving", 0, status_moving))
engine.dispose()
store = BatchStore(engine)
store.files = FileStore(engine, parts_at_once=1)
store.housekeeping()
"""


def test_a_gateway_killed_between_the_files_and_the_status_leaves_no_file_half_written(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'batch.db'}"
    batch_id = _ran(url, 3, 1000)
    store = BatchStore(open_database(url))
    with store.files._engine.begin() as connection:
        connection.execute(
            text(
                "CREATE TRIGGER status_moving BEFORE UPDATE OF status ON corral_batches "
                "WHEN NEW.status = 'completed' BEGIN SELECT status_moving(); END"
            )
        )
    marker = tmp_path / "moving"
    gateway = subprocess.Popen([sys.executable, "-c", _KILLED_BEFORE_THE_STATUS, url, str(marker)])
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert gateway.poll() is None and time.monotonic() < deadline, "the finalising never got there"
            time.sleep(0.05)
    finally:
        os.kill(gateway.pid, signal.SIGKILL)
        gateway.wait()
    with store.files._engine.begin() as connection:
        connection.execute(text("DROP TRIGGER status_moving"))
    found = store.batch("acme", batch_id)
    assert found is not None and found.status == "in_progress" and found.output_file_id is None
    assert _parts(store) > 0  # its output was written, in transactions of their own...
    assert store.files.files("acme", None, 10, None) == []  # ...and no one sees it
    with Session(store.files._engine) as session:
        counted = session.scalar(select(BatchRow.result_bytes).where(BatchRow.id == batch_id))
    assert store.files.bytes_held(["acme"]) == {"acme": counted}  # (the results counted once: the batch's)
    assert store.housekeeping() == [batch_id]  # the next pass finishes it
    assert _output_lines(store, batch_id) == 3
    store.housekeeping()  # and the killed gateway's files go, the batch finished
    output = store.batch("acme", batch_id)
    assert output is not None and output.output_file_id is not None
    assert _parts(store) == _parts(store, output.output_file_id)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_files_never_linked_are_seen_by_no_one_and_discarded_once_their_batch_is_finished(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = (
        f"sqlite:///{tmp_path / 'batch.db'}"
        if backend == "sqlite"
        else request.getfixturevalue("fresh_postgres")
    )
    batch_id = _ran(url, 3, 1000)
    store = BatchStore(open_database(url))
    store.files = FileStore(store.files._engine, parts_at_once=1)
    content = b"x" * (2 * PART_BYTES + 1)  # as a finaliser killed before linking it leaves it
    left = store.files.write_unlinked(
        NewFile("acme", "batch_output", f"{batch_id}_output.jsonl", io.BytesIO(content), len(content))
    )
    assert _parts(store, left) == 3
    assert store.files.file("acme", left) is None and store.files.files("acme", None, 10, None) == []
    assert store.files.bytes_held(["acme"])["acme"] < len(content)  # (the results so far alone)
    assert store.files.sweep_expired(datetime.now(UTC) + timedelta(days=400)) == 0
    assert store.housekeeping() == [batch_id]
    assert _output_lines(store, batch_id) == 3
    assert store.files.unlinked() == [(left, f"{batch_id}_output.jsonl")]  # (discarded the pass after)
    store.housekeeping()
    assert store.files.unlinked() == [] and _parts(store, left) == 0
    found = store.batch("acme", batch_id)
    assert found is not None and found.output_file_id is not None
    with store.files._engine.begin() as connection:  # a part whose file is gone (a gateway died deleting it)
        connection.execute(insert(FilePartRow).values(file_id="file-gone", seq=0, data=b"x"))
    assert store.tidy() == 0 and _parts(store) == _parts(store, found.output_file_id)
    assert store.files.delete_file("acme", found.output_file_id) and _parts(store) == 0
