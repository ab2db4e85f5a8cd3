"""A gateway's PostgreSQL store answers within seconds (statement and lock timeouts, TCP keepalives, a short
wait for a pooled connection), while the schema changes made when it opens take what they take."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import OperationalError

from corral.store import StoreTimeouts, open_store, store_is_down
from corral.store.schema import _SCHEMA_LOCK


def _settings(engine: Engine) -> dict[str, Any]:
    with engine.connect() as connection:
        shown = {
            name: connection.execute(text(f"SHOW {name}")).scalar()
            for name in ("statement_timeout", "lock_timeout", "timezone", "search_path")
        }
        shown |= connection.connection.driver_connection.info.get_parameters()  # type: ignore[union-attr]
    return shown


def test_a_gateways_store_bounds_statements_and_locks_and_keeps_its_connections_alive(
    fresh_postgres: str,
) -> None:
    opened = open_store(fresh_postgres, timeouts=StoreTimeouts(statement_s=10, lock_s=5, pool_s=5))
    try:
        shown = _settings(opened.engine)
        assert (shown["statement_timeout"], shown["lock_timeout"], shown["timezone"]) == ("10s", "5s", "UTC")
        assert (shown["keepalives"], shown["keepalives_idle"], shown["tcp_user_timeout"]) == (
            "1",
            "10",
            "20000",
        )
        assert opened.engine.pool.timeout() == 5  # type: ignore[attr-defined]
    finally:
        opened.engine.dispose()
    command = open_store(fresh_postgres)  # a command's (`corral usage`): its reports take what they take
    try:
        assert _settings(command.engine)["statement_timeout"] == "0"
    finally:
        command.engine.dispose()


def test_the_urls_own_options_are_kept_and_win_where_they_name_the_same_setting(fresh_postgres: str) -> None:
    url = fresh_postgres + "?options=-c%20search_path%3Dpublic,other%20-c%20statement_timeout%3D0"
    opened = open_store(url, timeouts=StoreTimeouts())
    try:
        shown = _settings(opened.engine)
        assert shown["search_path"] == "public,other"
        assert (shown["statement_timeout"], shown["lock_timeout"], shown["timezone"]) == ("0", "5s", "UTC")
    finally:
        opened.engine.dispose()


def test_a_statement_past_its_timeout_is_the_store_not_answering(fresh_postgres: str) -> None:
    opened = open_store(fresh_postgres, timeouts=StoreTimeouts(statement_s=0.5))
    began = time.monotonic()
    try:
        with pytest.raises(OperationalError) as raised, opened.engine.connect() as connection:
            connection.execute(text("SELECT pg_sleep(30)"))
        assert time.monotonic() - began < 5
        assert store_is_down(raised.value)  # (57014: a 503 where it reaches the error boundary)
    finally:
        opened.engine.dispose()


def test_schema_changes_at_open_wait_past_the_timeouts_for_another_gateways(fresh_postgres: str) -> None:
    """A gateway that opens a store while another changes its schema (holding the schema's advisory lock:
    an index made on a large table takes minutes) waits for it, past its own lock timeout."""
    holder = create_engine(fresh_postgres)
    server = create_engine(fresh_postgres, isolation_level="AUTOCOMMIT")
    outcome: list[object] = []
    try:
        with holder.connect() as holding:
            holding.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _SCHEMA_LOCK})
            timeouts = StoreTimeouts(statement_s=0.5, lock_s=0.2)
            opening = threading.Thread(target=lambda: outcome.append(_opened(fresh_postgres, timeouts)))
            opening.start()
            _wait_for_a_wait(server, longer_than_s=2.0, outcome=outcome)
            holding.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _SCHEMA_LOCK})
            holding.commit()
        opening.join(30)
        assert outcome == [True], outcome  # made the tables, once the lock was let go
    finally:
        holder.dispose()
        server.dispose()


def _opened(url: str, timeouts: StoreTimeouts) -> object:
    try:
        opened = open_store(url, timeouts=timeouts)
    except Exception as exc:  # (told to the test's thread)
        return exc
    opened.engine.dispose()
    return opened.new


def _wait_for_a_wait(server: Engine, longer_than_s: float, outcome: list[object]) -> None:
    """Until a session has waited on the advisory lock for `longer_than_s` (the opener failing first
    fails the test)."""
    deadline = time.monotonic() + 20
    query = text(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event = 'advisory'"
        " AND now() - query_start > make_interval(secs => :s)"
    )
    while True:
        assert not outcome, f"the opening ended while the lock was held: {outcome}"
        with server.connect() as connection:
            if connection.execute(query, {"s": longer_than_s}).scalar():
                return
        assert time.monotonic() < deadline, "no opening waited on the schema's lock"
        time.sleep(0.05)
