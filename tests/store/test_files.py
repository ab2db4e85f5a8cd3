"""Files in the store: a result file of 2 GiB or more has its size kept on PostgreSQL, in a store made
before the size column was widened too (brought forward when corral opens it)."""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, inspect, text
from sqlalchemy.orm import Session
from sqlalchemy.types import BigInteger

from corral.store import open_database
from corral.store.files import FileQuotaExceeded, FileStore, NewFile, write_file
from corral.store.schema import bring_forward


def test_a_file_of_2_gib_is_kept_in_a_store_made_with_a_4_byte_size_column(fresh_postgres: str) -> None:
    """`corral_files.bytes` was an INTEGER: a batch's output of 2 GiB could not be stored
    (NumericValueOutOfRange), and its finalising failed every pass. A store made so is widened to BIGINT
    as corral opens it."""
    engine = open_database(fresh_postgres)
    with engine.begin() as connection:  # as an earlier corral made it
        connection.execute(text("ALTER TABLE corral_files ALTER COLUMN bytes TYPE INTEGER"))
    engine.dispose()
    engine = open_database(fresh_postgres)
    (size,) = [c["type"] for c in inspect(engine).get_columns("corral_files") if c["name"] == "bytes"]
    assert isinstance(size, BigInteger)
    with Session(engine) as session, session.begin():  # (its parts hold 3 bytes: the size is what is told)
        new = NewFile("acme", "batch_output", "out.jsonl", io.BytesIO(b"{}\n"), 2**31 + 5)
        file_id = write_file(session, new).id
    found = FileStore(engine).file("acme", file_id)
    assert found is not None and found.bytes == 2**31 + 5
    engine.dispose()


def test_a_batch_is_refused_at_the_byte_quota_its_lines_would_never_run_at(tmp_path: Path) -> None:
    """A tenant holding exactly its byte quota could make a batch (held + 0 > quota is false), yet the
    runner refuses every line once the tenant's bytes reach the quota: the batch ran nothing. At its file
    count, it may still make a batch of its last upload."""
    files = FileStore(open_database(f"sqlite:///{tmp_path / 'files.db'}"))
    content = b'{"custom_id": "c0"}\n'
    files.add_file(NewFile("acme", "batch", "in.jsonl", io.BytesIO(content), len(content)), (1, len(content)))
    with pytest.raises(FileQuotaExceeded, match="bytes"):
        files.check_room("acme", (1, len(content)), 0)
    assert files.check_room("acme", (1, len(content) + 1), 0) == len(content)  # at its file count: a batch


def test_the_widening_waits_a_moment_for_its_lock_then_is_left_for_the_next_start(
    fresh_postgres: str,
) -> None:
    """The ALTER queued without a lock_timeout behind an earlier gateway's open transaction on corral_files
    (ACCESS EXCLUSIVE), and every other gateway's file and batch queries queued behind it. Now it waits
    `widen_wait_s`, is skipped, and the other changes are committed all the same."""
    engine = open_database(fresh_postgres)
    with engine.begin() as connection:  # as an earlier corral made it
        connection.execute(text("ALTER TABLE corral_files ALTER COLUMN bytes TYPE INTEGER"))
        connection.execute(text("ALTER TABLE corral_batches DROP COLUMN result_bytes"))
    engine.dispose()
    older = create_engine(fresh_postgres)
    with older.connect() as gateway:  # an earlier gateway's transaction that read the table
        gateway.execute(text("SELECT count(*) FROM corral_files")).scalar()
        began, newer = time.monotonic(), create_engine(fresh_postgres)
        assert not bring_forward(newer, widen_wait_s=0.3)
        assert time.monotonic() - began < 3
        assert not isinstance(_column(older, "corral_files", "bytes"), BigInteger)  # left for the next start
        assert _column(older, "corral_batches", "result_bytes") is not None  # committed
    bring_forward(newer, widen_wait_s=0.3)  # the next start: widened
    assert isinstance(_column(older, "corral_files", "bytes"), BigInteger)
    older.dispose()
    newer.dispose()


def _column(engine: Engine, table: str, name: str) -> Any:
    return next((c["type"] for c in inspect(engine).get_columns(table) if c["name"] == name), None)
