"""Tables: API keys (stored hashed), usage records and the audit trail; and bringing a store an earlier
corral made up to them."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Engine,
    Float,
    Index,
    Integer,
    String,
    Table,
    Text,
    exc,
    inspect,
    text,
)
from sqlalchemy.engine import Connection
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = [
    "ApiKeyRow",
    "AuditRow",
    "Base",
    "LockWaits",
    "SessionRow",
    "StoreError",
    "UsageRow",
    "add_missing_columns",
    "bring_forward",
    "store_is_busy",
    "store_is_down",
]

logger = logging.getLogger(__name__)

CORE_TABLES = frozenset({"corral_api_keys", "corral_usage"})  # a store holds these whatever its age
_SCHEMA_LOCK = int.from_bytes(b"corral", "big")  # PostgreSQL's advisory lock held while the schema changes
_SCHEMA_WAIT_MS = 120_000  # SQLite: how long one waits while another makes its changes (an index build)
_WIDEN_WAIT_S = 5.0  # PostgreSQL: how long a column's widening waits for its table's lock
_LOCK_NOT_AVAILABLE = "55P03"  # PostgreSQL's SQLSTATE for a lock_timeout that passed
_QUERY_CANCELED = "57014"  # and for a statement_timeout


class Base(DeclarativeBase):
    pass


class StoreError(Exception):
    """A store that cannot be used: a URL malformed, unreachable, or (read-only) not there; or a query
    the database did not answer."""


# SQLite's errors that are the database not answering now, not a query's fault ("no such table" is a bug)
_SQLITE_DOWN = ("database is locked", "unable to open", "disk i/o error", "database or disk is full")
# PostgreSQL's SQLSTATE classes of a server that cannot answer now: connection exceptions (08), insufficient
# resources (53: too many connections, out of disk), operator intervention (57: shutdown, starting up); and
# 25006, a read-only transaction: a connection still on the old primary after a failover
_POSTGRES_DOWN = ("08", "53", "57")


def store_is_busy(error: BaseException) -> bool:
    """Whether `error` is a statement that ran past its time or waited past its lock (PostgreSQL's
    `statement_timeout`, `lock_timeout`): the store answers, this request asked too much of it now (a
    report over years of rows, an upload behind its tenant's other one). A 503 too, not an outage."""
    state = getattr(getattr(error, "orig", None), "sqlstate", None)
    return state in (_QUERY_CANCELED, _LOCK_NOT_AVAILABLE)


def store_is_down(error: BaseException) -> bool:
    """Whether `error` is the database not answering (down, unreachable, failing over, out of connections,
    locked): the caller answers 503 and tries again. A query's own error (a bug) is not: answered 500."""
    if isinstance(error, (StoreError, exc.InterfaceError, exc.DisconnectionError, exc.TimeoutError)):
        return True
    if not isinstance(error, exc.DBAPIError):
        return False
    if error.connection_invalidated:
        return True
    state = getattr(error.orig, "sqlstate", None)
    if isinstance(state, str):
        # (25006: a read-only standby; 55P03: a lock_timeout passed, the store busy)
        return state[:2] in _POSTGRES_DOWN or state in ("25006", _LOCK_NOT_AVAILABLE)
    if not isinstance(error, exc.OperationalError):
        return False
    if type(error.orig).__module__.startswith("sqlite3"):
        return any(part in str(error.orig).lower() for part in _SQLITE_DOWN)
    return True  # a driver's connection failure, which carries no SQLSTATE (psycopg's "connection failed")


class ApiKeyRow(Base):
    __tablename__ = "corral_api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    prefix: Mapped[str] = mapped_column(String(24))
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    name: Mapped[str] = mapped_column(String(128), default="")
    models: Mapped[list[str]] = mapped_column(JSON, default=list)
    rpm: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tpm: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_concurrency: Mapped[int | None] = mapped_column(Integer, nullable=True)
    priority: Mapped[str] = mapped_column(String(16), default="normal")
    monthly_token_budget: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    max_files: Mapped[int | None] = mapped_column(Integer, nullable=True)  # uploads with it: the tenant's cap
    max_file_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    role: Mapped[str | None] = mapped_column(String(16), nullable=True)  # None: user (inference only)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # a rotated key's former secret, valid until `previous_until` (the grace period)
    previous_hash: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    previous_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # who made it, where a tenant-admin did: its key's id, or `oidc:<tenant>` (that tenant's signed-in
    # people); its requests count against that one's limits too. None: made by an admin (or before parents)
    parent: Mapped[str | None] = mapped_column(String(160), nullable=True, index=True)


class AuditRow(Base):
    """One administrative action: who (and with which role, from where), what, on what, and its outcome.
    Only ever inserted: no route or command updates or deletes a row (rows older than
    `store.audit_retention_days`, where set, are swept: store/retention.py)."""

    __tablename__ = "corral_audit"
    __table_args__ = (Index("ix_corral_audit_at", "at"),)

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    actor: Mapped[str] = mapped_column(String(256))  # "admin-key", "key:<id>", "oidc:<subject>"
    role: Mapped[str] = mapped_column(String(16))
    tenant: Mapped[str | None] = mapped_column(String(128), nullable=True)  # the actor's (tenant-admin)
    source: Mapped[str | None] = mapped_column(String(64), nullable=True)  # the client's address
    action: Mapped[str] = mapped_column(String(64), index=True)
    target: Mapped[str | None] = mapped_column(String(256), nullable=True)
    detail: Mapped[dict[str, object] | None] = mapped_column(JSON, nullable=True)
    status: Mapped[int] = mapped_column(Integer)  # the answer's status: refused actions are kept too
    request_id: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)  # x-request-id


class SecretRow(Base):
    """A server secret made once per store, at random, and read by every gateway and worker on it."""

    __tablename__ = "corral_secrets"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(128))


class SessionRow(Base):
    """A person signed in to the console through the identity provider: the cookie holds a random
    secret, the row its hash, who they are, the token the console sends with every change (CSRF) and the
    provider's ID token, sealed under the cookie's secret, for the provider's sign-out (id_token_hint)."""

    __tablename__ = "corral_sessions"

    id_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    subject: Mapped[str] = mapped_column(String(256))
    tenant: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(16))
    csrf: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    id_token: Mapped[str | None] = mapped_column(Text, nullable=True)  # (None: a session from before it)


class UsageRow(Base):
    __tablename__ = "corral_usage"
    __table_args__ = (
        Index("ix_corral_usage_key_at", "key_id", "at"),
        Index("ix_corral_usage_tenant_at", "tenant", "at"),  # (a tenant-admin's usage: not every tenant's)
    )

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    key_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    tenant: Mapped[str | None] = mapped_column(String(128), nullable=True)
    model: Mapped[str] = mapped_column(String(128))
    input_tokens: Mapped[int] = mapped_column(Integer, default=0)
    output_tokens: Mapped[int] = mapped_column(Integer, default=0)
    ttft_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    latency_ms: Mapped[float] = mapped_column(Float)
    status: Mapped[int] = mapped_column(Integer)
    replica: Mapped[str | None] = mapped_column(String(128), nullable=True)
    api: Mapped[str | None] = mapped_column(String(16), nullable=True)  # the client API that asked
    # its x-request-id: found by it (`corral requests`, /admin/requests) without scanning every row
    request_id: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)


@dataclass(frozen=True)
class LockWaits:
    """How bring_forward's changes on PostgreSQL wait for the locks of tables an earlier corral's gateways
    are using. `lock_s`: the longest a change waits for its table's lock (every query of the table queues
    behind a waiting ALTER, so this is also the longest a running gateway's write stalls); `attempts`: tries
    before the start fails, `backoff_s` the pause after the first (doubled after each, with jitter);
    `index_s`: the longest a concurrent index build waits for each transaction older than it (nothing
    queues behind that wait)."""

    lock_s: float = 2.0
    attempts: int = 5
    backoff_s: float = 1.0
    index_s: float = 120.0


def bring_forward(
    engine: Engine, widen_wait_s: float = _WIDEN_WAIT_S, waits: LockWaits = LockWaits()
) -> bool:
    """Make what corral's schema has and the store lacks: its tables, and the nullable columns and indexes
    added to them since an earlier corral made the store, and integer columns widened since (the schema
    only ever grows by these, so gateways of that earlier version keep working beside it). Returns whether
    the store was new (none of corral's tables were there). The changes are made by one process at a time,
    under PostgreSQL's advisory lock or SQLite's write lock, in one transaction: gateways and commands
    opening one store at once each find what the one before made. A store with nothing to change is only
    read (no lock taken). `widen_wait_s`: how long a column's widening waits for its table's lock (beyond
    it, skipped until the next start).

    On PostgreSQL the transaction's statements wait `waits.lock_s` at most for a table's lock: one that
    waited longer rolls the transaction back, tried again after a pause (`_retry_later`); this corral reads
    and writes every column its schema has, so where a column still cannot be added the start fails
    (StoreError). A missing index is built after the commit, CONCURRENTLY (`_build_missing_indexes`): the
    running gateways' writes go on meanwhile."""
    if engine.dialect.name != "postgresql":
        if not _behind(engine):
            return False
        with engine.connect() as connection, _schema_lock(connection):
            new = _make_missing(connection, widen_wait_s)
            _create_missing_indexes(connection)
        return new
    new = _change_postgres(engine, widen_wait_s, waits)
    _build_missing_indexes(engine, waits.index_s)
    return new


def _make_missing(connection: Connection, widen_wait_s: float) -> bool:
    """The tables and columns the store lacks, made inside bring_forward's lock; whether it was new."""
    new = not CORE_TABLES <= set(inspect(connection).get_table_names())
    Base.metadata.create_all(connection)
    add_missing_columns(connection, widen_wait_s)
    return new


def _change_postgres(engine: Engine, widen_wait_s: float, waits: LockWaits) -> bool:
    """bring_forward's transaction on PostgreSQL (not its indexes): tried until it had its locks in time,
    or `waits.attempts` times; whether the store was new."""
    attempt = 0
    while _behind(engine, indexes=False):  # (checked again before each try: another may have made them)
        attempt += 1
        try:
            with engine.connect() as connection, _schema_lock(connection, waits.lock_s):
                return _make_missing(connection, widen_wait_s)
        except exc.DBAPIError as error:
            if _sqlstate(error) != _LOCK_NOT_AVAILABLE:
                raise
            _retry_later(error, attempt, waits)
    return False


def _retry_later(error: exc.DBAPIError, attempt: int, waits: LockWaits) -> None:
    """After a try whose statement waited `waits.lock_s` for its table's lock: a pause before the next, or
    (the last) StoreError. A transaction of another process holds the table (an earlier gateway's long
    read or batch finalising); waiting longer would queue every query of the table behind the ALTER."""
    statement = " ".join(str(error.statement or "a change").split())
    if attempt >= waits.attempts:
        raise StoreError(
            f"the store's schema could not be brought forward: `{statement}` waited {waits.lock_s:g} s for "
            f"its table's lock, {attempt} times (a transaction of another process holds the table: see "
            "pg_stat_activity); nothing was changed, and this corral needs the change. Start it again once "
            "that transaction has ended (gateways of the earlier version keep working meanwhile)"
        ) from error
    pause = waits.backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.0)  # (several starting at once)
    logger.warning(
        "store: `%s` waited %g s for its table's lock (a transaction of another process holds the table); "
        "rolled back, tried again in %.1f s (try %d of %d)",
        statement,
        waits.lock_s,
        pause,
        attempt,
        waits.attempts,
    )
    time.sleep(pause)


def _sqlstate(error: exc.DBAPIError) -> str | None:
    state = getattr(error.orig, "sqlstate", None)
    return state if isinstance(state, str) else None


def _behind(engine: Engine, indexes: bool = True) -> bool:
    """Whether the store lacks a table, a nullable column or (`indexes`) an index corral's schema has, or
    keeps a column narrower than it (`_narrower`)."""
    inspector = inspect(engine)
    tables = set(inspector.get_table_names())
    for table in Base.metadata.sorted_tables:
        if table.name not in tables:
            return True
        columns = {column["name"]: column["type"] for column in inspector.get_columns(table.name)}
        if any(c.nullable and c.name not in columns for c in table.columns):
            return True
        if indexes:
            found = {index["name"] for index in inspector.get_indexes(table.name)}
            if any(index.name not in found for index in table.indexes):
                return True
        if _narrower(engine.dialect.name, table, columns):
            return True
    return False


def _narrower(dialect: str, table: Table, found: dict[str, Any]) -> list[str]:
    """The columns corral's schema keeps as BIGINT that the store made as a narrower integer: on
    PostgreSQL, INTEGER is 4 bytes (`corral_files.bytes` was, and a result file of 2 GiB passed it); SQLite's
    INTEGER holds 8 bytes whatever a column was declared."""
    if dialect != "postgresql":
        return []
    return [
        column.name
        for column in table.columns
        if isinstance(column.type, BigInteger)
        and isinstance(found.get(column.name), Integer)
        and not isinstance(found[column.name], BigInteger)
    ]


def _widen(connection: Connection, table: str, column: str, wait_s: float) -> None:
    """Widen a PostgreSQL integer column to BIGINT. It rewrites the table (a store's files from before
    their parts keep their content in the row: copied too) under ACCESS EXCLUSIVE, which it queues for
    behind any transaction that read the table (an earlier gateway's), and every query of the table queues
    behind it: so it waits `wait_s` at most, and where the lock is not had by then it is skipped (logged)
    and tried at the next start, the rest of the changes committed. In a savepoint: a statement that
    failed would abort the whole transaction."""
    waited = connection.execute(text("SHOW lock_timeout")).scalar()
    try:
        with connection.begin_nested():
            connection.execute(
                text("SELECT set_config('lock_timeout', :wait, true)"), {"wait": f"{int(wait_s * 1000)}ms"}
            )
            connection.execute(text(f"ALTER TABLE {table} ALTER COLUMN {column} TYPE BIGINT"))
    except exc.DBAPIError as error:
        if getattr(error.orig, "sqlstate", None) != _LOCK_NOT_AVAILABLE:
            raise
        logger.warning(
            "store: widening %s.%s to BIGINT waited %.0f s for the table's lock (a transaction of another "
            "process holds it); skipped, tried again at the next start",
            table,
            column,
            wait_s,
        )
    connection.execute(text("SELECT set_config('lock_timeout', :wait, true)"), {"wait": waited})


@contextmanager
def _schema_lock(connection: Connection, lock_wait_s: float | None = None) -> Iterator[None]:
    """A transaction on `connection` beside which no other process changes the schema: committed when the
    block ends (the lock let go with it); where the block raises, the connection's close rolls it back.
    PostgreSQL: no statement_timeout cuts it (the advisory lock's wait, a widening's rewrite), and each
    of its statements waits `lock_wait_s` at most for a table's lock (then raises: SQLSTATE 55P03)."""
    waited = None
    if connection.dialect.name == "postgresql":
        connection.execute(  # (the session's own timeouts, where its URL sets them, do not hold here)
            text("SELECT set_config('statement_timeout', '0', true), set_config('lock_timeout', '0', true)")
        )
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _SCHEMA_LOCK})
        if lock_wait_s is not None:  # (after the advisory lock: waiting for it queues no one's queries)
            wait = f"{max(1, int(lock_wait_s * 1000))}ms"
            connection.execute(text("SELECT set_config('lock_timeout', :wait, true)"), {"wait": wait})
    elif connection.dialect.name == "sqlite":  # its write lock now, not at the first change (checked first)
        waited = connection.exec_driver_sql("PRAGMA busy_timeout").scalar()
        connection.exec_driver_sql(f"PRAGMA busy_timeout={_SCHEMA_WAIT_MS}")
        connection.exec_driver_sql("BEGIN IMMEDIATE")
    yield
    connection.commit()
    if waited is not None:  # (the connection goes back to the pool as it came)
        connection.exec_driver_sql(f"PRAGMA busy_timeout={int(waited)}")
        connection.commit()


def add_missing_columns(connection: Connection, widen_wait_s: float = _WIDEN_WAIT_S) -> None:
    """Nullable columns added to a table after a store made it are added in place, so a store made by an
    earlier corral keeps working (corral's schema only ever grows by nullable columns, and integer columns
    widened to BIGINT, which an earlier corral reads and writes as before). Inside bring_forward's lock:
    another process's changes are already there. (The indexes it lacks: bring_forward.)"""
    inspector = inspect(connection)
    for table in Base.metadata.sorted_tables:
        if not inspector.has_table(table.name):
            continue
        have = {column["name"]: column["type"] for column in inspector.get_columns(table.name)}
        for column in table.columns:
            if column.name in have or not column.nullable:
                continue
            kind = column.type.compile(connection.dialect)
            connection.execute(text(f"ALTER TABLE {table.name} ADD COLUMN {column.name} {kind}"))
        for name in _narrower(connection.dialect.name, table, have):
            _widen(connection, table.name, name, widen_wait_s)


def _create_missing_indexes(connection: Connection) -> None:
    """SQLite: the indexes the store lacks, in bring_forward's transaction (an added column's index: a
    lookup by it must not scan the table)."""
    for table in Base.metadata.sorted_tables:
        for index in table.indexes:
            index.create(bind=connection, checkfirst=True)


def _build_missing_indexes(engine: Engine, wait_s: float) -> None:
    """PostgreSQL: the indexes the store lacks (or holds INVALID: a concurrent build that failed or was cut
    leaves one, which is maintained on every write and never read), built after bring_forward's commit with
    CREATE INDEX CONCURRENTLY: the table's writes go on while it is built (a plain CREATE INDEX holds its
    SHARE lock, and every INSERT waits, for the whole build). Under the schema's advisory lock, held for the
    session; where another process holds it, the indexes are left to it (or to the next start)."""
    with engine.connect() as probe:
        if not _unbuilt(_index_states(probe)):
            return
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        if not connection.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": _SCHEMA_LOCK}).scalar():
            logger.info(
                "store: another process changes the schema: missing indexes left to it (or the next start)"
            )
            return
        before = _session_settings(
            connection, statement_timeout="0", lock_timeout=f"{max(1, int(wait_s * 1000))}ms"
        )
        try:
            states = _index_states(connection)  # (again, under the lock)
            for index in _unbuilt(states):
                _build_index(connection, index, states.get(str(index.name)))
        finally:
            _session_settings(connection, **before)
            connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _SCHEMA_LOCK})


def _index_states(connection: Connection) -> dict[str, bool]:
    """The indexes of the store's schema (its PostgreSQL schema: the search path's first), by name: whether
    each is valid."""
    rows = connection.execute(
        text(
            "SELECT c.relname, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
            " WHERE c.relnamespace = current_schema()::regnamespace"
        )
    )
    return {str(name): bool(valid) for name, valid in rows}


def _unbuilt(states: dict[str, bool]) -> list[Index]:
    """corral's indexes that `states` lacks or holds INVALID."""
    return [i for t in Base.metadata.sorted_tables for i in t.indexes if not states.get(str(i.name), False)]


def _session_settings(connection: Connection, **settings: str) -> dict[str, str]:
    """Set a PostgreSQL session's `settings`; what they were (to set back: the pool keeps the session)."""
    before = {}
    for name, value in settings.items():
        before[name] = str(connection.execute(text(f"SHOW {name}")).scalar())
        connection.execute(text("SELECT set_config(:name, :value, false)"), {"name": name, "value": value})
    return before


def _build_index(connection: Connection, index: Index, valid: bool | None) -> None:
    """Build one index CONCURRENTLY (`valid` False: an INVALID one of its name is dropped first). One that
    fails (it waited too long for an older transaction, say) is dropped and left for the next start: corral
    works without it, reading more of its table."""
    preparer = connection.dialect.identifier_preparer
    name, table = preparer.quote(str(index.name)), preparer.quote(str(index.table))
    columns = ", ".join(preparer.quote(column.name) for column in index.columns)
    unique = "UNIQUE " if index.unique else ""
    try:
        if valid is False:
            logger.warning("store: dropping the index %s, left INVALID by a build that failed", index.name)
            connection.execute(text(f"DROP INDEX CONCURRENTLY IF EXISTS {name}"))
        logger.info("store: building the index %s on %s concurrently (its writes go on)", index.name, table)
        connection.execute(
            text(f"CREATE {unique}INDEX CONCURRENTLY IF NOT EXISTS {name} ON {table} ({columns})")
        )
    except exc.DBAPIError as error:
        if store_is_down(error):
            raise
        logger.warning(
            "store: building the index %s failed (%s); left for the next start", index.name, _line(error)
        )
        if _index_states(connection).get(str(index.name)) is False:  # (maintained on every write, never read)
            try:
                connection.execute(text(f"DROP INDEX CONCURRENTLY IF EXISTS {name}"))
            except exc.DBAPIError as failed:
                if store_is_down(failed):
                    raise
                logger.warning(
                    "store: the INVALID index %s stays until the next start (%s)", index.name, _line(failed)
                )


def _line(error: exc.DBAPIError) -> str:
    return str(error.orig or error).strip().splitlines()[0]
