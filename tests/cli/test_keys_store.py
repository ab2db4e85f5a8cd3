"""The store the keys commands use: named on every run, said to be new where it was, an older corral's brought
forward as a gateway brings it; limits refused as their options before any store is touched; and an expired
key shown as expired."""

from __future__ import annotations

import json
import sqlite3
from datetime import UTC, datetime
from pathlib import Path

import pytest
from click.testing import Result
from sqlalchemy import create_engine, inspect, text
from typer.testing import CliRunner

from corral.cli import app
from corral.store import UsageRecord, UsageStore, open_database

POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "160", **(env or {})})


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'corral.db'}"
    return str(request.getfixturevalue("fresh_postgres"))


def _as_an_older_corral_made_it(store: str) -> None:
    """Drop what later versions added: a rotated key's former secret, the client API of a usage record,
    and the console's sessions table."""
    engine = open_database(store)
    with engine.begin() as db:
        db.execute(text("DROP INDEX ix_corral_api_keys_previous_hash"))
        db.execute(text("ALTER TABLE corral_api_keys DROP COLUMN previous_hash"))
        db.execute(text("ALTER TABLE corral_usage DROP COLUMN api"))
        db.execute(text("DROP TABLE corral_sessions"))
    engine.dispose()


def test_commands_on_an_older_corrals_store_bring_it_forward_as_a_gateway_does(store: str) -> None:
    """`keys list`, `usage` and `keys revoke` against a store an older corral made (no gateway of this
    version has opened it yet) work: they add what it lacks, as the gateway does, instead of failing on a
    missing column as an unexpected error."""
    made = run("keys", "create", "--tenant", "acme", "--store", store, "--json")
    assert made.exit_code == 0, made.output
    key_id = json.loads(made.stdout)["id"]
    engine = open_database(store)
    UsageStore(engine).write(
        [UsageRecord(datetime.now(UTC), key_id, "acme", "m", 1, 2, None, 3.0, 200, None)]
    )
    engine.dispose()
    _as_an_older_corral_made_it(store)
    listed = run("keys", "list", "--store", store)
    assert listed.exit_code == 0 and key_id in listed.stdout, listed.output
    used = run("usage", "--store", store, "--json")
    assert used.exit_code == 0 and json.loads(used.stdout)[0]["key"] == key_id, used.output
    revoked = run("keys", "revoke", key_id, "--store", store, "--json")
    assert revoked.exit_code == 0 and json.loads(revoked.stdout)["revoked_at"], revoked.output
    engine = open_database(store, create=False)
    found = inspect(engine)
    assert "previous_hash" in {c["name"] for c in found.get_columns("corral_api_keys")}
    assert "api" in {c["name"] for c in found.get_columns("corral_usage")}
    assert found.has_table("corral_sessions")
    engine.dispose()


def test_read_only_commands_still_refuse_a_store_that_is_not_there(
    tmp_path: Path, fresh_postgres: str
) -> None:
    missing = tmp_path / "nowhere" / "corral.db"
    listed = run("keys", "list", "--store", f"sqlite:///{missing}")
    assert listed.exit_code == 1 and "no corral store" in listed.output, listed.output
    assert not missing.parent.exists()
    listed = run("keys", "list", "--store", fresh_postgres)
    assert listed.exit_code == 1 and "holds no corral store" in listed.output, listed.output
    engine = create_engine(fresh_postgres.replace("postgresql://", "postgresql+psycopg://"))
    assert inspect(engine).get_table_names() == []  # (nothing made in it)
    engine.dispose()


def test_keys_commands_name_their_store_and_say_when_it_is_new(tmp_path: Path, fresh_postgres: str) -> None:
    """A key made in a store no gateway reads is never accepted: each keys command names the store it used
    (any password masked), and one that made a new store says so, on stderr (stdout stays the JSON)."""
    home = tmp_path / "home"
    made = run("keys", "create", "--tenant", "acme", "--json", env={"CORRAL_HOME": str(home)})
    assert made.exit_code == 0, made.output
    assert json.loads(made.stdout)["tenant"] == "acme"  # (stdout: the JSON alone)
    assert f"store: sqlite:///{home / 'corral.db'}" in made.stderr, made.stderr
    assert f"created a new, empty store at sqlite:///{home / 'corral.db'}" in made.stderr, made.stderr
    assert "is this the store your gateway uses?" in made.stderr
    again = run("keys", "create", "--tenant", "acme", env={"CORRAL_HOME": str(home)})
    assert again.exit_code == 0 and "store: sqlite:///" in again.stderr and "new" not in again.stderr
    listed = run("keys", "list", env={"CORRAL_HOME": str(home)})
    assert listed.exit_code == 0 and f"store: sqlite:///{home / 'corral.db'}" in listed.stderr
    plain = fresh_postgres.replace("postgresql+psycopg://", "postgresql://")  # (as psql's docs spell it)
    with_password = plain.replace("postgres@", "postgres:hunter2@")  # (trust: not asked for)
    made = run("keys", "create", "--tenant", "acme", "--store", with_password)
    assert made.exit_code == 0, made.output
    shown = plain.replace("postgresql://postgres@", "postgresql+psycopg://postgres:***@")
    assert f"store: {shown}" in made.stderr and "hunter2" not in made.output, made.output
    assert f"created a new, empty store at {shown}" in made.stderr, made.stderr
    listed = run("keys", "list", "--store", with_password)
    assert listed.exit_code == 0 and f"store: {shown}" in listed.stderr and "new" not in listed.stderr


def test_limits_beyond_their_columns_and_a_bad_lifetime_are_refused_as_their_options(tmp_path: Path) -> None:
    """rpm, tpm, concurrency and file counts are 32-bit columns (PostgreSQL refused 3e9 as an unexpected
    error); a lifetime is told in days, as it was given. Refused before the store is opened: none is made."""
    path = tmp_path / "corral.db"
    for option in ("--tpm", "--rpm", "--max-concurrency", "--max-files"):
        refused = run("keys", "create", "--tenant", "t", option, "3000000000", "--store", f"sqlite:///{path}")
        assert refused.exit_code == 2, refused.output
        assert f"error: {option}: " in refused.stderr and "2147483647" in refused.stderr, refused.stderr
    for days in ("nan", "inf", "4000", "0"):
        refused = run(
            "keys", "create", "--tenant", "t", "--expires-in-days", days, "--store", f"sqlite:///{path}"
        )
        assert refused.exit_code == 2, refused.output
        assert "error: --expires-in-days: must be more than 0 and at most 3650 days" in refused.stderr, days
        assert "315360000" not in refused.output
    assert not path.exists()
    made = run(
        "keys", "create", "--tenant", "t", "--tpm", str(2**31 - 1), "--store", f"sqlite:///{path}", "--json"
    )
    assert made.exit_code == 0 and json.loads(made.stdout)["tpm"] == 2**31 - 1, made.output


def test_keys_list_shows_an_expired_key_as_expired(tmp_path: Path) -> None:
    path = tmp_path / "corral.db"
    store = f"sqlite:///{path}"
    ids = [
        json.loads(run("keys", "create", "--tenant", t, "--store", store, "--json").stdout)["id"]
        for t in "ab"
    ]
    with sqlite3.connect(path) as db:  # the first one's day is past
        db.execute(
            "UPDATE corral_api_keys SET expires_at = '2020-01-01 00:00:00.000000' WHERE id = ?", ids[:1]
        )
    listed = run("keys", "list", "--store", store)
    assert listed.exit_code == 0, listed.output
    states = {line.split()[0]: line.split()[-1] for line in listed.stdout.splitlines() if line[:16] in ids}
    assert states == {ids[0]: "expired", ids[1]: "active"}, listed.stdout
