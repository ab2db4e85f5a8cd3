"""Console sessions of people signed in through the identity provider, shared by every gateway (the store):
the cookie carries a random secret, the store only its hash. The provider's ID token, which its sign-out
asks for (`id_token_hint`), is kept sealed (AES-GCM) under a key derived from the cookie's secret: the
store alone cannot read it, so its rows give no one a token the API would accept."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from sqlalchemy import Engine, delete
from sqlalchemy.orm import Session

from corral.store.schema import SessionRow
from corral.store.secrets import server_secret

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

    def create(
        self, subject: str, tenant: str, role: str, ttl_s: float, id_token: str | None = None
    ) -> tuple[str, ConsoleSession]:
        """A new session: (the cookie's secret, the session), keeping the ID token the provider signed the
        person in with. Expired sessions are swept out."""
        secret, now = secrets.token_urlsafe(32), datetime.now(UTC)
        id_hash = _digest(secret)
        row = SessionRow(
            id_hash=id_hash,
            subject=subject,
            tenant=tenant,
            role=role,
            csrf=secrets.token_urlsafe(24),
            created_at=now,
            expires_at=now + timedelta(seconds=ttl_s),
            id_token=_seal(secret, id_hash, id_token) if id_token else None,
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

    def end(self, secret: str) -> str | None:
        """Ends the session; the ID token it kept (for the provider's sign-out), None where it kept none."""
        id_hash = _digest(secret)
        with Session(self._engine) as session, session.begin():
            row = session.get(SessionRow, id_hash)
            if row is None:
                return None
            sealed = row.id_token
            session.delete(row)
        return _unseal(secret, id_hash, sealed) if sealed else None

    def signing_secret(self) -> str:
        """The store's secret for signing sign-ins under way: made once, the same on every gateway of it."""
        return server_secret(self._engine, "signin")


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _sealing_key(secret: str) -> bytes:
    """The ID token's key: from the cookie's secret, and not from its hash (which the store holds)."""
    return hmac.new(secret.encode(), b"corral session id token", hashlib.sha256).digest()


def _seal(secret: str, id_hash: str, id_token: str) -> str:
    nonce = os.urandom(12)
    sealed = AESGCM(_sealing_key(secret)).encrypt(nonce, id_token.encode(), id_hash.encode())
    return base64.urlsafe_b64encode(nonce + sealed).decode()


def _unseal(secret: str, id_hash: str, sealed: str) -> str | None:
    try:
        raw = base64.urlsafe_b64decode(sealed)
        return AESGCM(_sealing_key(secret)).decrypt(raw[:12], raw[12:], id_hash.encode()).decode()
    except (ValueError, InvalidTag):  # (a row written otherwise: no hint, the sign-out goes on)
        return None


def _session(row: SessionRow) -> ConsoleSession:
    expires = row.expires_at if row.expires_at.tzinfo else row.expires_at.replace(tzinfo=UTC)
    return ConsoleSession(row.subject, row.tenant, row.role, row.csrf, expires)
