"""The key and usage store on SQLite and on PostgreSQL (the real server on 127.0.0.1:5432)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import sqlite3
import stat
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, inspect, text
from sqlalchemy.exc import DBAPIError

from corral.store import InvalidKey, KeyStore, KeyUpdate, UsageRecord, UsageStore, hash_key, open_database

from ..gateway.conftest import ScriptedUpstream
from .test_gateway_admission import start

POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@pytest.fixture(params=["sqlite", "postgresql"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    url = f"sqlite:///{tmp_path / 'corral.db'}" if request.param == "sqlite" else POSTGRES
    db = open_database(url)
    yield db
    db.dispose()


def test_keys_are_stored_hashed_and_found_by_hash(engine: Engine) -> None:
    keys = KeyStore(engine)
    tenant = f"acme-{uuid.uuid4().hex[:8]}"
    secret, record = keys.create(
        tenant,
        models=["m"],
        rpm=60,
        tpm=10_000,
        max_concurrency=4,
        priority="high",
        monthly_token_budget=1_000_000,
    )
    assert secret.startswith("sk-corral-") and len(secret) > 40
    with engine.connect() as conn:
        stored = conn.execute(
            text("SELECT key_hash, prefix FROM corral_api_keys WHERE id = :id"), {"id": record.id}
        ).one()
    assert stored.key_hash == hash_key(secret) and secret not in stored.key_hash
    assert len(stored.prefix) < 20  # only a short prefix is kept, for people to recognise the key
    found = keys.by_secret_hash(hash_key(secret))
    assert (
        found is not None and found.tenant == tenant and found.models == ("m",) and found.priority == "high"
    )
    assert keys.by_secret_hash(hash_key(secret + "x")) is None


def test_revoked_keys_leave_the_active_list(engine: Engine) -> None:
    keys = KeyStore(engine)
    _, record = keys.create(f"t-{uuid.uuid4().hex[:8]}")
    assert record.id in {k.id for k in keys.list()}
    revoked = keys.revoke(record.id)
    assert revoked is not None and not revoked.active
    assert record.id not in {k.id for k in keys.list()}
    assert record.id in {k.id for k in keys.list(include_revoked=True)}
    assert keys.revoke("no-such-id") is None
    tenant = record.tenant
    assert {k.tenant for k in keys.list(include_revoked=True, tenant=tenant)} == {tenant}
    assert [k.id for k in keys.list(include_revoked=True, tenant=tenant)] == [record.id]


def test_usage_is_reported_by_key_model_and_day(engine: Engine) -> None:
    usage = UsageStore(engine)
    key = uuid.uuid4().hex[:16]
    now = datetime.now(UTC)
    usage.write(
        [
            UsageRecord(now, key, "t", "m1", 10, 20, 5.0, 100.0, 200, "r0"),
            UsageRecord(now, key, "t", "m1", 5, 5, None, 50.0, 502, "r1"),
        ]
    )
    row = next(r for r in usage.report("key") if r["key"] == key)
    assert (row["requests"], row["input_tokens"], row["output_tokens"], row["errors"]) == (2, 15, 25, 1)
    assert usage.month_tokens(key) == 40
    assert usage.month_tokens_by_key(keys=[key]) == {key: 40}  # (a tenant-admin's list: its keys only)
    assert usage.month_tokens_by_key(keys=["no-such-key"]) == {}
    assert any(r["day"] == now.date().isoformat() for r in usage.report("day"))
    with pytest.raises(ValueError, match="group by one of"):
        usage.report("colour")


def test_usage_by_day_is_the_utc_day_whatever_zone_the_server_counts_in() -> None:
    """A request at 23:30 UTC on 30 November is November's, as budgets count months, on a PostgreSQL
    database whose sessions count in Tokyo's time by default (as a server set up in its host's zone)."""
    admin = create_engine(POSTGRES, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        if conn.execute(text("SELECT 1 FROM pg_database WHERE datname = 'corral_tokyo'")).first() is None:
            try:
                conn.execute(text("CREATE DATABASE corral_tokyo"))
            except DBAPIError:  # (made meanwhile by another test worker)
                pass
        conn.execute(text("ALTER DATABASE corral_tokyo SET timezone = 'Asia/Tokyo'"))
    admin.dispose()
    db = open_database(POSTGRES.rsplit("/", 1)[0] + "/corral_tokyo")
    usage = UsageStore(db)
    tenant = f"tz-{uuid.uuid4().hex[:8]}"
    late = datetime(2026, 11, 30, 23, 30, tzinfo=UTC)
    usage.write([UsageRecord(late, "k", tenant, "m", 1, 1, None, 1.0, 200, "r")])
    assert [r["day"] for r in usage.report("day", tenant=tenant)] == ["2026-11-30"]
    db.dispose()


def test_a_large_batch_reads_back_row_for_row(engine: Engine) -> None:
    """A batch over several multi-row statements (83 rows each) keeps every row and value as written:
    the timestamp as SQLAlchemy stores it (the reports compare and group by it), None where unset."""
    usage = UsageStore(engine)
    key = uuid.uuid4().hex[:16]
    start = datetime(2026, 11, 30, 23, 59, 59, 999_000, tzinfo=UTC)
    records = [
        UsageRecord(
            start,
            key,
            f"t{i % 3}",
            "m",
            i,
            2 * i,
            None if i % 2 else i / 4,
            i + 0.5,
            200,
            None,
            "chat",
            f"req_{i}" if i % 5 else None,
        )
        for i in range(250)
    ]
    if engine.dialect.name == "sqlite":  # connections with the oldest SQLite's bound on parameters (999)
        event.listen(
            engine, "connect", lambda dbapi, _: dbapi.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)
        )
        engine.dispose()
    usage.write(records)
    with engine.connect() as connection:
        rows = connection.execute(
            text(
                "SELECT tenant, input_tokens, output_tokens, ttft_ms, latency_ms, status, replica, request_id"
                " FROM corral_usage WHERE key_id = :key ORDER BY input_tokens"
            ),
            {"key": key},
        ).all()
    assert [tuple(r) for r in rows] == [
        (
            r.tenant,
            r.input_tokens,
            r.output_tokens,
            r.ttft_ms,
            r.latency_ms,
            r.status,
            r.replica,
            r.request_id,
        )
        for r in records
    ]
    assert usage.month_tokens(key, now=start) == sum(3 * i for i in range(250))  # `at` in November
    assert usage.month_tokens(key, now=datetime(2026, 12, 1, tzinfo=UTC)) == 0


def test_a_store_made_before_request_ids_gains_the_column_and_its_index(tmp_path: Path) -> None:
    """A request is found by its id through an index (`corral requests`, /admin/requests: a tenant
    admin's lookups must not scan every usage row), in a store an earlier corral made too."""
    path = tmp_path / "old.db"
    open_database(f"sqlite:///{path}").dispose()
    with sqlite3.connect(path) as db:  # as an earlier corral made it: no column, no index
        db.execute("DROP INDEX IF EXISTS ix_corral_usage_request_id")
        db.execute("DROP INDEX IF EXISTS ix_corral_audit_request_id")
        db.execute("DROP INDEX IF EXISTS ix_corral_usage_tenant_at")
        db.execute("ALTER TABLE corral_usage DROP COLUMN request_id")
    engine = open_database(f"sqlite:///{path}")
    now = datetime.now(UTC)
    UsageStore(engine).write([UsageRecord(now, "k", "t", "m", 1, 2, None, 3.0, 200, None, "chat", "req_7")])
    with engine.connect() as connection:
        assert connection.execute(text("SELECT request_id FROM corral_usage")).scalar_one() == "req_7"
        for table in ("corral_usage", "corral_audit"):
            plan = connection.execute(
                text(f"EXPLAIN QUERY PLAN SELECT * FROM {table} WHERE request_id = 'req_7'")
            ).all()
            assert f"USING INDEX ix_{table}_request_id" in str(plan), plan
        plan = connection.execute(  # a tenant-admin's usage report: its tenant's rows, not every tenant's
            text("EXPLAIN QUERY PLAN SELECT count(*) FROM corral_usage WHERE tenant = 't' GROUP BY date(at)")
        ).all()
        assert "ix_corral_usage_tenant_at" in str(plan), plan


def _open_at_once(url: str, barrier: Any, said: Any) -> None:
    """One gateway starting: open the store the moment the others do; what it met goes to `said`."""
    barrier.wait(timeout=60)
    try:
        open_database(url).dispose()
    except Exception as exc:  # (told to the test, which names it)
        said.put(f"{type(exc).__name__}: {exc}")
    else:
        said.put("ok")


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_gateways_starting_at_once_on_a_new_store_all_open_it(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Four processes opening one new store at the same moment all get its tables: schema changes wait for
    one another (concurrent CREATE TABLEs failed: on PostgreSQL's catalogue, pg_type's unique index; on
    SQLite, "table already exists")."""
    url = (
        f"sqlite:///{tmp_path / 'corral.db'}"
        if kind == "sqlite"
        else request.getfixturevalue("fresh_postgres")
    )
    context = multiprocessing.get_context("spawn")
    barrier, said = context.Barrier(4), context.Queue()
    openers = [context.Process(target=_open_at_once, args=(url, barrier, said)) for _ in range(4)]
    for opener in openers:
        opener.start()
    outcomes = [said.get(timeout=120) for _ in openers]
    for opener in openers:
        opener.join(timeout=60)
    assert outcomes == ["ok"] * 4, outcomes
    engine = open_database(url)
    _, record = KeyStore(engine).create("after-the-race")
    assert record.id in {k.id for k in KeyStore(engine).list()}
    engine.dispose()


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The umask of a login shell outside systemd: files rw-r--r--, folders rwxr-xr-x by default."""
    before = os.umask(0o022)
    yield
    os.umask(before)


def test_a_sqlite_store_is_made_readable_by_its_owner_only(tmp_path: Path, umask_022: None) -> None:
    """Stored responses, files, the audit trail, secrets and session tokens are nobody else's to read:
    the folder corral makes for the store is 0700, the database and its WAL and shared-memory files 0600."""
    path = tmp_path / "state" / "corral.db"
    engine = open_database(f"sqlite:///{path}")
    KeyStore(engine).create("acme")  # (a write: the -wal and -shm files exist while it is open)
    made = [path, path.with_name("corral.db-wal"), path.with_name("corral.db-shm")]
    assert all(p.exists() for p in made), list(path.parent.iterdir())
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in made} == {p.name: 0o600 for p in made}
    engine.dispose()


def test_a_store_file_others_can_read_is_warned_of(
    tmp_path: Path, umask_022: None, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "corral.db"
    open_database(f"sqlite:///{path}").dispose()
    caplog.set_level(logging.WARNING, logger="corral.store")
    open_database(f"sqlite:///{path}").dispose()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # (0600: nothing to say)
    path.chmod(0o644)  # as a store made by an earlier corral under umask 022
    open_database(f"sqlite:///{path}").dispose()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and str(path) in warned[0] and "chmod" in warned[0], warned


@pytest.mark.parametrize(
    "field", ["rpm", "tpm", "max_concurrency", "max_files", "monthly_token_budget", "max_file_bytes"]
)
def test_a_limit_beyond_its_column_is_refused_naming_it(engine: Engine, field: str) -> None:
    """rpm, tpm, concurrency and file counts are 32-bit columns, budgets and byte caps 64-bit: a value
    beyond one is refused, naming the field (PostgreSQL's DataError was an unexpected error, SQLite stored
    a 32-bit column's and failed on a 64-bit one's)."""
    too_big = 2**31 if field in ("rpm", "tpm", "max_concurrency", "max_files") else 2**63
    with pytest.raises(InvalidKey, match=f"less than or equal to {too_big - 1}") as refused:
        KeyStore(engine).create(f"big-{uuid.uuid4().hex[:8]}", **{field: too_big})
    assert refused.value.param == field
    _, record = KeyStore(engine).create(f"big-{uuid.uuid4().hex[:8]}", **{field: too_big - 1})
    assert getattr(KeyStore(engine).get(record.id), field) == too_big - 1
    if field in KeyUpdate.model_fields:
        with pytest.raises(ValueError, match="less than or equal to"):
            KeyUpdate.model_validate({field: too_big})


async def test_the_admin_api_refuses_a_limit_beyond_its_column_with_400(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    server, cluster = await start(tmp_path, upstream)
    try:
        status, refused = await cluster.admin("POST", "/admin/keys", {"tenant": "t", "tpm": 3_000_000_000})
        assert status == 400 and refused["error"]["param"] == "tpm", refused
        status, refused = await cluster.admin("POST", "/admin/keys", {"tenant": "t", "max_files": 2**31})
        assert status == 400 and refused["error"]["param"] == "max_files", refused
        status, made = await cluster.admin("POST", "/admin/keys", {"tenant": "t", "tpm": 2**31 - 1})
        assert status == 201, made
        status, refused = await cluster.admin("PATCH", f"/admin/keys/{made['id']}", {"rpm": 2**31})
        assert status == 400 and refused["error"]["param"] == "rpm", refused
    finally:
        await server.stop()


def test_a_keys_makers_and_the_use_of_the_keys_below_it_are_found(engine: Engine) -> None:
    """Up a key's chain of makers (a revoked one too), and down it for a budget's month: the use of the
    keys a key made and of theirs, not of its tenant's other keys; `oidc:<tenant>` heads a chain too."""
    keys, usage = KeyStore(engine), UsageStore(engine)
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    _, top = keys.create(tenant, role="tenant-admin")
    _, middle = keys.create(tenant, role="tenant-admin", parent=top.id)
    _, below = keys.create(tenant, parent=middle.id)
    _, other = keys.create(tenant)
    _, signed_in = keys.create(tenant, parent=f"oidc:{tenant}")
    keys.revoke(top.id)
    now = datetime.now(UTC)
    used = {top.id: 1, middle.id: 10, below.id: 100, other.id: 1000, signed_in.id: 5, f"oidc:{tenant}": 7}
    usage.write([UsageRecord(now, key, tenant, "m", 0, n, None, 1.0, 200, None) for key, n in used.items()])
    assert [record.id for record in keys.ancestors(below.parent)] == [middle.id, top.id]
    assert keys.ancestors(signed_in.parent) == [] and keys.get(below.id).parent == middle.id  # type: ignore[union-attr]
    assert keys.family_month_tokens(top.id) == 111 and keys.family_month_tokens(middle.id) == 110
    assert keys.family_month_tokens(f"oidc:{tenant}") == 12 and keys.family_month_tokens(other.id) == 1000


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_store_made_before_parents_gains_the_column_and_its_index(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    old_db = f"sqlite:///{tmp_path / 'old.db'}"
    url = old_db if kind == "sqlite" else request.getfixturevalue("fresh_postgres")
    engine = open_database(url)
    _, old = KeyStore(engine).create("acme", rpm=5)
    with engine.begin() as connection:  # as an earlier corral made it: no column, no index
        connection.execute(text("DROP INDEX IF EXISTS ix_corral_api_keys_parent"))
        connection.execute(text("ALTER TABLE corral_api_keys DROP COLUMN parent"))
    engine.dispose()
    engine = open_database(url)
    try:
        keys = KeyStore(engine)
        found = keys.get(old.id)
        assert found is not None and (found.rpm, found.parent) == (5, None)  # (as an admin made it)
        _, made = keys.create("acme", parent=old.id)
        assert keys.get(made.id).parent == old.id  # type: ignore[union-attr]
        indexes = {index["name"] for index in inspect(engine).get_indexes("corral_api_keys")}
        assert "ix_corral_api_keys_parent" in indexes
    finally:
        engine.dispose()
