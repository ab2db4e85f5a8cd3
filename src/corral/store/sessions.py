"""Console sessions of people signed in through the identity provider, shared by every gateway (the store):
the cookie carries a random secret, the store only its hash."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import Engine, delete
from sqlalchemy.orm import Session

from corral.store.schema import SessionRow

__all__ = ["ConsoleSession", "SessionStore"]


@dataclass(frozen=True)
class ConsoleSession:
    subject: str
    tenant: str
    role: str
    csrf: str
    expires_at: datetime


class SessionStore:
    """Blocking: call off-loop."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def create(self, subject: str, tenant: str, role: str, ttl_s: float) -> tuple[str, ConsoleSession]:
        """A new session: (the cookie's secret, the session). Expired sessions are swept out."""
        secret, now = secrets.token_urlsafe(32), datetime.now(UTC)
        row = SessionRow(
            id_hash=_digest(secret),
            subject=subject,
            tenant=tenant,
            role=role,
            csrf=secrets.token_urlsafe(24),
            created_at=now,
            expires_at=now + timedelta(seconds=ttl_s),
        )
        with Session(self._engine) as session, session.begin():
            session.execute(delete(SessionRow).where(SessionRow.expires_at < now))
            session.add(row)
            found = _session(row)
        return secret, found

    def get(self, secret: str) -> ConsoleSession | None:
        with Session(self._engine) as session:
            row = session.get(SessionRow, _digest(secret))
            if row is None:
                return None
            found = _session(row)
        return found if found.expires_at > datetime.now(UTC) else None

    def end(self, secret: str) -> None:
        with Session(self._engine) as session, session.begin():
            session.execute(delete(SessionRow).where(SessionRow.id_hash == _digest(secret)))


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _session(row: SessionRow) -> ConsoleSession:
    expires = row.expires_at if row.expires_at.tzinfo else row.expires_at.replace(tzinfo=UTC)
    return ConsoleSession(row.subject, row.tenant, row.role, row.csrf, expires)
