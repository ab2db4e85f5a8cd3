"""API keys: created with a secret shown once, stored as a SHA-256 hash, revoked by id."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from corral.store.schema import ApiKeyRow

__all__ = ["PRIORITIES", "KeyRecord", "KeyStore", "hash_key"]

PRIORITIES = {"high": 0, "normal": 1, "low": 2}
_SECRET_PREFIX = "sk-corral-"


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class KeyRecord:
    """A key as the gateway and the admin API see it (never the secret)."""

    id: str
    prefix: str
    tenant: str
    name: str
    models: tuple[str, ...]
    rpm: int | None
    tpm: int | None
    max_concurrency: int | None
    priority: str
    monthly_token_budget: int | None
    created_at: datetime
    revoked_at: datetime | None

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    def to_dict(self) -> dict[str, object]:
        data = dict(self.__dict__)
        data["models"] = list(self.models)
        data["created_at"] = self.created_at.isoformat()
        data["revoked_at"] = self.revoked_at.isoformat() if self.revoked_at else None
        return data


class KeyStore:
    """Keys in a SQL database (SQLite file or PostgreSQL), through SQLAlchemy. Blocking: call off-loop."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def create(
        self,
        tenant: str,
        *,
        name: str = "",
        models: list[str] | None = None,
        rpm: int | None = None,
        tpm: int | None = None,
        max_concurrency: int | None = None,
        priority: str = "normal",
        monthly_token_budget: int | None = None,
    ) -> tuple[str, KeyRecord]:
        """A new key: (the secret, shown only now; its record)."""
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}")
        if not tenant:
            raise ValueError("a key needs a tenant")
        secret = _SECRET_PREFIX + secrets.token_urlsafe(32)
        row = ApiKeyRow(
            id=secrets.token_hex(8),
            key_hash=hash_key(secret),
            prefix=secret[: len(_SECRET_PREFIX) + 6],
            tenant=tenant,
            name=name,
            models=sorted(models or []),
            rpm=rpm,
            tpm=tpm,
            max_concurrency=max_concurrency,
            priority=priority,
            monthly_token_budget=monthly_token_budget,
            created_at=datetime.now(UTC),
            revoked_at=None,
        )
        with Session(self._engine) as session, session.begin():
            session.add(row)
            record = _record(row)
        return secret, record

    def by_secret_hash(self, key_hash: str) -> KeyRecord | None:
        with Session(self._engine) as session:
            row = session.scalar(select(ApiKeyRow).where(ApiKeyRow.key_hash == key_hash))
            return _record(row) if row is not None else None

    def get(self, key_id: str) -> KeyRecord | None:
        with Session(self._engine) as session:
            row = session.get(ApiKeyRow, key_id)
            return _record(row) if row is not None else None

    def list(self, include_revoked: bool = False) -> list[KeyRecord]:
        with Session(self._engine) as session:
            query = select(ApiKeyRow).order_by(ApiKeyRow.created_at)
            if not include_revoked:
                query = query.where(ApiKeyRow.revoked_at.is_(None))
            return [_record(row) for row in session.scalars(query)]

    def revoke(self, key_id: str) -> KeyRecord | None:
        with Session(self._engine) as session, session.begin():
            row = session.get(ApiKeyRow, key_id)
            if row is None:
                return None
            if row.revoked_at is None:
                row.revoked_at = datetime.now(UTC)
            return _record(row)


def _record(row: ApiKeyRow) -> KeyRecord:
    return KeyRecord(
        id=row.id,
        prefix=row.prefix,
        tenant=row.tenant,
        name=row.name,
        models=tuple(row.models or ()),
        rpm=row.rpm,
        tpm=row.tpm,
        max_concurrency=row.max_concurrency,
        priority=row.priority,
        monthly_token_budget=row.monthly_token_budget,
        created_at=row.created_at,
        revoked_at=row.revoked_at,
    )
