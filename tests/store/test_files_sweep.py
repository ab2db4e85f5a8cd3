"""Deleting files holds SQLite's one write lock for a few parts at a time: the sweep of expired files
deleted every part of up to a hundred files in one transaction (40 MiB files: 30 s), and another gateway
worker's writes failed past their 5 s busy timeout ('database is locked': 503s). A sweep cut short leaves
no file to read, and its parts go at the next start."""

from __future__ import annotations

import io
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine, event, func, select, text
from sqlalchemy.exc import OperationalError

from corral.batch import BatchStore
from corral.store import open_database
from corral.store.files import PART_BYTES, FilePartRow, FileRow, FileStore, NewFile
from tests.store.locking import BUSY_S, OtherWorker

PARTS = 8  # a file's parts (of 1 MiB)


def _expired_files(url: str, count: int) -> list[str]:
    files = FileStore(open_database(url))
    past = datetime.now(UTC) - timedelta(hours=1)
    content = b"x" * (PARTS * PART_BYTES)
    news = [
        NewFile("acme", "batch_output", f"o{i}.jsonl", io.BytesIO(content), len(content), past)
        for i in range(count)
    ]
    return [files.add_file(new).id for new in news]


def _parts(engine: Engine) -> int:
    with engine.connect() as connection:
        return int(connection.scalar(select(func.count()).select_from(FilePartRow)) or 0)


def test_another_worker_writes_while_expired_files_are_swept(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'files.db'}"
    _expired_files(url, 2)
    other = OtherWorker(url)
    engine = other.slow_parts(url, "DELETE")
    files = FileStore(engine, parts_at_once=1)
    with other.writing():
        assert files.sweep_expired() == 2
    assert other.failures == [], f"the other worker's writes waited past its busy timeout ({BUSY_S} s)"
    assert len(other.waits) >= 4 and max(other.waits) < BUSY_S  # it wrote all along the sweep
    assert _parts(engine) == 0


def test_a_sweep_cut_short_leaves_no_file_and_its_parts_go_at_the_next_start(tmp_path: Path) -> None:
    """The gateway stopped part-way (here: the store refused the fourth part's deletion)."""
    url = f"sqlite:///{tmp_path / 'files.db'}"
    ids = _expired_files(url, 2)
    engine = open_database(url)
    deleted = [0]

    def refuse_past_three() -> None:
        deleted[0] += 1
        if deleted[0] > 3:
            raise RuntimeError("the gateway stopped")

    event.listen(engine, "connect", lambda c, _r: c.create_function("part_cost", 0, refuse_past_three))
    engine.dispose()
    with engine.begin() as connection:
        connection.execute(
            text("CREATE TRIGGER part_cost BEFORE DELETE ON corral_file_parts BEGIN SELECT part_cost(); END")
        )
    files = FileStore(engine, parts_at_once=2)
    with pytest.raises(OperationalError):
        files.sweep_expired()
    with engine.connect() as connection:
        assert connection.scalar(select(func.count()).where(FileRow.id.in_(ids))) == 0  # gone at once
    assert 0 < _parts(engine) < 2 * PARTS  # some parts deleted, the others left behind
    with engine.begin() as connection:
        connection.execute(text("DROP TRIGGER part_cost"))
    BatchStore(engine).tidy()  # (a runner's start)
    assert _parts(engine) == 0
