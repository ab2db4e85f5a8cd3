"""Console sessions keep the provider's ID token for its sign-out, sealed under the cookie's secret; a store
an earlier corral made (no such column) gains it in place, on SQLite and on PostgreSQL (the real server on
127.0.0.1:5432), and its sessions sign out with no hint."""

from __future__ import annotations

import hashlib
import secrets
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, text

from corral.store import SessionStore, open_database


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A store of its own: a fresh SQLite file, or a fresh PostgreSQL database (dropped after)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'corral.db'}"
    return str(request.getfixturevalue("fresh_postgres"))


def test_a_store_from_before_id_tokens_gains_the_column_and_keeps_its_sessions(url: str) -> None:
    made = open_database(url)
    with made.begin() as connection:  # as an earlier corral made it: no id_token column, one session in it
        connection.execute(text("ALTER TABLE corral_sessions DROP COLUMN id_token"))
    old_secret = _create_without_id_token(made)
    made.dispose()

    engine = open_database(url)  # (a gateway of this corral starts on it)
    sessions = SessionStore(engine)
    found = sessions.get(old_secret)
    assert found is not None and found.subject == "old"
    assert sessions.end(old_secret) is None  # (it kept no ID token: the sign-out goes on with no hint)
    secret, _ = sessions.create("bob", "acme", "tenant-admin", 60, "header.payload.signature")
    with engine.connect() as connection:
        sealed = connection.execute(text("SELECT id_token FROM corral_sessions")).scalar_one()
    assert sealed and "payload" not in sealed  # (sealed: the store alone cannot read it)
    assert sessions.end(secret + "x") is None  # (another secret ends nothing)
    assert sessions.end(secret) == "header.payload.signature"
    assert sessions.get(secret) is None
    engine.dispose()


def _create_without_id_token(engine: Engine) -> str:
    """A session as an earlier corral wrote it (its columns only); the cookie's secret."""
    secret, now = secrets.token_urlsafe(32), datetime.now(UTC)
    row: dict[str, Any] = {
        "id_hash": hashlib.sha256(secret.encode()).hexdigest(),
        "subject": "old",
        "tenant": "acme",
    }
    row.update(role="user", csrf="c", created_at=now, expires_at=now + timedelta(hours=1))
    with engine.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO corral_sessions (id_hash, subject, tenant, role, csrf, created_at, expires_at) "
                "VALUES (:id_hash, :subject, :tenant, :role, :csrf, :created_at, :expires_at)"
            ),
            row,
        )
    return secret
