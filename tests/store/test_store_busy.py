"""A statement cut by the store's own limits (PostgreSQL's statement_timeout, lock_timeout) is a request
that asked too much now, not the store down: it was answered as an outage, logged with its SQL and counted
toward CorralStoreUnreachable (a tenant-admin's long reports added 230 to it in a minute)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from aiohttp.test_utils import make_mocked_request
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import DBAPIError

from corral.gateway.refusals import unexpected
from corral.store import store_is_busy, store_is_down

ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@pytest.fixture
def engine() -> Iterator[Engine]:
    made = create_engine(ADMIN_URL, connect_args={"options": "-c statement_timeout=100 -c lock_timeout=100"})
    yield made
    made.dispose()


def _failure(engine: Engine, sql: str) -> DBAPIError:
    with engine.connect() as connection, pytest.raises(DBAPIError) as failed:
        connection.execute(text(sql))
    return failed.value


def test_a_statement_past_its_time_or_its_lock_is_busy_not_down(engine: Engine) -> None:
    table = f"busy_{uuid.uuid4().hex[:8]}"
    with engine.begin() as connection:
        connection.execute(text(f"CREATE TABLE {table} (x int)"))
    try:
        slow = _failure(engine, "SELECT pg_sleep(2)")
        with engine.connect() as holder:
            holder.execute(text(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"))
            locked = _failure(engine, f"SELECT * FROM {table}")
            holder.rollback()
    finally:
        with engine.begin() as connection:
            connection.execute(text(f"DROP TABLE {table}"))
    counted = []
    for failure in (slow, locked):
        assert store_is_busy(failure) and store_is_down(failure)  # (retried as an outage would be)
        answer = unexpected(make_mocked_request("GET", "/admin/usage"), failure, lambda: counted.append(1))
        assert (answer.status, answer.code) == (503, "store_busy")
    assert counted == []  # (not counted as the store down)
