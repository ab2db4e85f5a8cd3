"""API keys: created with a secret shown once, stored as a SHA-256 hash, revoked by id."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from corral.store.schema import ApiKeyRow

__all__ = ["PRIORITIES", "InvalidKey", "KeyRecord", "KeyStore", "NewKey", "hash_key"]

PRIORITIES = {"high": 0, "normal": 1, "low": 2}
_SECRET_PREFIX = "sk-corral-"


class NewKey(BaseModel):
    """What a new key may say: one validation for the CLI and the admin API."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant: str = Field(min_length=1, max_length=128)
    name: str = Field(default="", max_length=256)
    models: list[str] = Field(default_factory=list)
    rpm: int | None = Field(default=None, ge=1)
    tpm: int | None = Field(default=None, ge=1)
    max_concurrency: int | None = Field(default=None, ge=1)
    priority: str = Field(default="normal", pattern="^(high|normal|low)$")
    monthly_token_budget: int | None = Field(default=None, ge=1)
    max_files: int | None = Field(default=None, ge=1)  # uploads made with the key: its tenant's file cap
    max_file_bytes: int | None = Field(default=None, ge=1)


class InvalidKey(ValueError):
    """A new key's settings are out of range; `param` names the field."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param

    @classmethod
    def from_validation(cls, exc: ValidationError) -> InvalidKey:
        err = exc.errors(include_url=False)[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        if err["type"] == "string_pattern_mismatch" and param == "priority":
            return cls("priority must be one of high, normal, low", param)
        return cls(f"{err['msg'].lower()} (got {err.get('input')!r})", param)


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
    max_files: int | None = None
    max_file_bytes: int | None = None

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
        max_files: int | None = None,
        max_file_bytes: int | None = None,
    ) -> tuple[str, KeyRecord]:
        """A new key: (the secret, shown only now; its record). Raises InvalidKey."""
        try:
            NewKey(
                tenant=tenant,
                name=name,
                models=models or [],
                rpm=rpm,
                tpm=tpm,
                max_concurrency=max_concurrency,
                priority=priority,
                monthly_token_budget=monthly_token_budget,
                max_files=max_files,
                max_file_bytes=max_file_bytes,
            )
        except ValidationError as exc:
            raise InvalidKey.from_validation(exc) from exc
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
            max_files=max_files,
            max_file_bytes=max_file_bytes,
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

    def find(self, ref: str) -> list[KeyRecord]:
        """The keys `ref` names: its id, else ids starting with it, else keys whose secret starts with it
        as `keys list` shows it (`sk-corral-W3nhr2`, `W3nhr2…`). One match is the key; several: ambiguous."""
        if (exact := self.get(ref)) is not None:
            return [exact]
        ref = ref.strip().removesuffix("…")
        if len(ref) < 4:  # too short to name a key
            return []
        secret = ref if ref.startswith(_SECRET_PREFIX) else _SECRET_PREFIX + ref
        with Session(self._engine) as session:
            rows = (
                session.scalars(
                    select(ApiKeyRow).where(ApiKeyRow.id.startswith(ref, autoescape=True)).limit(10)
                ).all()
                or session.scalars(
                    select(ApiKeyRow)
                    .where(ApiKeyRow.prefix.startswith(secret[: len(_SECRET_PREFIX) + 6], autoescape=True))
                    .limit(10)
                ).all()
            )
            return [_record(row) for row in rows]

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
        max_files=row.max_files,
        max_file_bytes=row.max_file_bytes,
    )
