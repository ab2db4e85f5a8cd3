"""bring_forward on PostgreSQL beside an earlier corral's gateways still running: its changes wait a bounded
time for a table's lock (every later query of the table queues behind a waiting ALTER), are tried again,
and are not cut by a statement_timeout; a missing index is built CONCURRENTLY after the commit (a plain
CREATE INDEX holds every INSERT of the table for the whole build)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import pytest
from sqlalchemy import Engine, create_engine, exc, inspect, text

from corral.store import StoreError, open_database
from corral.store.schema import LockWaits, bring_forward

# an earlier gateway's usage write: without the columns its corral lacks
OLDER_INSERT = (
    "INSERT INTO corral_usage (at, key_id, tenant, model, input_tokens, output_tokens, latency_ms, status)"
    " VALUES (now(), 'k1', 'acme', 'm', 1, 1, 1.0, 200)"
)
QUICK = LockWaits(lock_s=0.3, attempts=3, backoff_s=0.1, index_s=10.0)
SCHEMA_LOCK = int.from_bytes(b"corral", "big")  # (the advisory lock bring_forward changes the schema under)
INDEX = "ix_corral_usage_tenant_at"
T = TypeVar("T")


def test_an_added_column_waits_a_bounded_time_for_its_lock_then_the_start_fails_clearly(
    fresh_postgres: str,
) -> None:
    """The ADD COLUMN queued, with no lock_timeout, behind an earlier gateway's open transaction, and
    that corral's usage INSERT waited behind it (14 s). Now it waits `lock_s`, is tried `attempts` times,
    and the start fails with the statement named; nothing is changed, and the next start makes it."""
    _as_an_earlier_corral_made_it(fresh_postgres, "ALTER TABLE corral_usage DROP COLUMN api")
    older, newer = create_engine(fresh_postgres), create_engine(fresh_postgres)
    reader = older.connect()
    reader.execute(text("SELECT count(*) FROM corral_usage"))  # its transaction stays open (a long report)
    with ThreadPoolExecutor(1) as pool:
        try:
            start = pool.submit(bring_forward, newer, waits=QUICK)
            _until(lambda: _waiting(older, "ALTER TABLE corral_usage"))
            began = time.monotonic()
            with older.begin() as gateway:  # (bounded: without the fix the ALTER never stops waiting)
                gateway.execute(text("SET LOCAL lock_timeout = '3s'"))
                gateway.execute(text(OLDER_INSERT))
            assert time.monotonic() - began < 1.5
            with pytest.raises(StoreError, match=r"corral_usage ADD COLUMN api .* 3 times"):
                start.result(timeout=10)
        finally:
            reader.rollback()
            reader.close()
    assert not _has_column(older, "corral_usage", "api")  # nothing changed
    assert not bring_forward(newer, waits=QUICK)  # the next start
    assert _has_column(older, "corral_usage", "api")
    older.dispose()
    newer.dispose()


def test_an_added_column_is_made_at_a_later_try_once_the_older_transaction_ends(
    fresh_postgres: str, caplog: pytest.LogCaptureFixture
) -> None:
    _as_an_earlier_corral_made_it(fresh_postgres, "ALTER TABLE corral_usage DROP COLUMN api")
    older, newer = create_engine(fresh_postgres), create_engine(fresh_postgres)
    reader = older.connect()
    reader.execute(text("SELECT count(*) FROM corral_usage"))
    with caplog.at_level(logging.WARNING, logger="corral.store.schema"), ThreadPoolExecutor(1) as pool:
        try:
            start = pool.submit(bring_forward, newer, waits=LockWaits(lock_s=0.3, attempts=4, backoff_s=0.1))
            _until(lambda: any("rolled back, tried again" in r.getMessage() for r in caplog.records), 5.0)
        finally:
            reader.rollback()  # the earlier gateway's transaction ends between two tries
            reader.close()
        assert start.result(timeout=10) is False
    assert _has_column(older, "corral_usage", "api")
    older.dispose()
    newer.dispose()


def test_the_changes_are_not_cut_by_a_statement_timeout_of_the_stores_sessions(fresh_postgres: str) -> None:
    """A store whose sessions have a statement_timeout (200 ms here): the wait for the schema's advisory
    lock, held by another process making its changes, goes on past it."""
    _as_an_earlier_corral_made_it(fresh_postgres, "ALTER TABLE corral_usage DROP COLUMN api")
    other = create_engine(fresh_postgres)
    newer = create_engine(fresh_postgres, connect_args={"options": "-c statement_timeout=200"})
    holder = other.connect()
    holder.execute(text("SELECT pg_advisory_lock(:key)"), {"key": SCHEMA_LOCK})
    with ThreadPoolExecutor(1) as pool:
        try:
            start = pool.submit(bring_forward, newer, waits=QUICK)
            _until(lambda: _waiting(other, "SELECT pg_advisory_xact_lock", for_s=0.5))
        finally:
            holder.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": SCHEMA_LOCK})
            holder.close()
        assert start.result(timeout=10) is False
    assert _has_column(other, "corral_usage", "api")
    other.dispose()
    newer.dispose()


def test_a_missing_index_is_built_concurrently_while_a_running_gateway_writes(fresh_postgres: str) -> None:
    """A plain CREATE INDEX in the migration's transaction waited for an earlier gateway's open write and
    every later INSERT queued behind it (on 10M rows, writes stopped for the 13 s build). Built
    CONCURRENTLY after the commit, the build waits for that write (past the sessions' statement_timeout)
    while the table takes new ones, and ends valid."""
    _as_an_earlier_corral_made_it(fresh_postgres, f"DROP INDEX {INDEX}")
    older = create_engine(fresh_postgres)
    newer = create_engine(fresh_postgres, connect_args={"options": "-c statement_timeout=200"})
    holder = older.connect()
    holder.execute(text(OLDER_INSERT))  # an earlier gateway's write, its transaction still open
    with ThreadPoolExecutor(1) as pool:
        try:
            start = pool.submit(bring_forward, newer, waits=QUICK)
            build = _until(lambda: _waiting(older, "CREATE INDEX", for_s=0.4))
            began = time.monotonic()
            with older.begin() as gateway:
                gateway.execute(text("SET LOCAL lock_timeout = '3s'"))
                gateway.execute(text(OLDER_INSERT))
            assert time.monotonic() - began < 1.0
        finally:
            holder.commit()
            holder.close()
        assert start.result(timeout=10) is False
    assert "CONCURRENTLY" in build
    assert _index(older, INDEX) == (True, False)  # valid, not unique
    older.dispose()
    newer.dispose()


def test_an_index_a_failed_concurrent_build_left_invalid_is_built_again(fresh_postgres: str) -> None:
    """A concurrent build that fails leaves its index INVALID: never read, kept up on every write, and
    (found by its name) taken for built."""
    engine = _as_an_earlier_corral_made_it(fresh_postgres, f"DROP INDEX {INDEX}", OLDER_INSERT, OLDER_INSERT)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        with pytest.raises(exc.IntegrityError):  # (the two rows share their tenant and time)
            connection.execute(text(f"CREATE UNIQUE INDEX CONCURRENTLY {INDEX} ON corral_usage (tenant, at)"))
    assert _index(engine, INDEX) == (False, True)
    assert not bring_forward(engine, waits=QUICK)
    assert _index(engine, INDEX) == (True, False)
    engine.dispose()


def _as_an_earlier_corral_made_it(url: str, *statements: str) -> Engine:
    engine = open_database(url)
    with engine.begin() as connection:
        for statement in statements:
            connection.execute(text(statement))
    return engine


def _waiting(engine: Engine, query: str, for_s: float = 0.0) -> str | None:
    """Another session's statement starting with `query`, while it waits for a lock (`for_s` at least)."""
    with engine.connect() as connection:
        found = connection.execute(
            text(
                "SELECT query FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock' AND query ILIKE :query"
                " AND now() - query_start > make_interval(secs => :for_s)"
            ),
            {"query": query + "%", "for_s": for_s},
        ).scalar()
        return str(found) if found is not None else None


def _until(check: Callable[[], T | None], within_s: float = 10.0) -> T:
    deadline = time.monotonic() + within_s
    while not (found := check()):
        assert time.monotonic() < deadline, "not seen in time"
        time.sleep(0.02)
    return found


def _has_column(engine: Engine, table: str, name: str) -> bool:
    return any(column["name"] == name for column in inspect(engine).get_columns(table))


def _index(engine: Engine, name: str) -> tuple[bool, bool] | None:
    """Whether the index is valid, and unique; None: no such index."""
    with engine.connect() as connection:
        row = connection.execute(
            text(
                "SELECT i.indisvalid, i.indisunique FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
                " WHERE c.relname = :name"
            ),
            {"name": name},
        ).first()
    return None if row is None else (bool(row[0]), bool(row[1]))
