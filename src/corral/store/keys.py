"""API keys: created with a secret shown once, stored as a SHA-256 hash, revoked by id; each with a role
(`user`: inference only, the default; `tenant-admin`, `viewer`, `operator`, `admin`: see gateway/access.py),
an optional expiry, and rotation (a new secret, the old one still accepted for a grace period). A key a
tenant-admin made names its maker (`parent`): the key's requests count against the maker's limits too, and
the maker's against its own maker's, up to `MAX_GENERATIONS` (admission/auth.py resolves them)."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails
from sqlalchemy import Engine, Integer, func, literal, or_, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from corral.store.schema import ApiKeyRow, StoreError, UsageRow

__all__ = [
    "BATCH_PRIORITY",
    "MAX_GENERATIONS",
    "MAX_LIFETIME_S",
    "PRIORITIES",
    "ROLES",
    "InvalidKey",
    "KeyRecord",
    "KeyStore",
    "KeyUpdate",
    "NewKey",
    "RotationConflict",
    "hash_key",
    "holds_control_characters",
    "new_secret",
]

PRIORITIES = {"high": 0, "normal": 1, "low": 2}
BATCH_PRIORITY = 3  # below every key's class: the batch runner's lines (batch/runner.py)
ROLES = ("admin", "operator", "viewer", "tenant-admin", "user")
_SECRET_PREFIX = "sk-corral-"
_INT32_MAX = 2**31 - 1  # the most a limit in an Integer column holds (PostgreSQL's integer)
_INT64_MAX = 2**63 - 1  # and in a BigInteger one
MAX_LIFETIME_S = 10 * 365 * 86400  # a key that expires: within ten years
_IDS_A_QUERY = 1000  # key ids in one IN (...) of a family's month
MAX_GENERATIONS = 8  # the most makers above a key (a tenant-admin's key made by a tenant-admin's, ...)
# no control characters in a key's tenant, name or model names: PostgreSQL refuses a NUL in a text column
# (a 500 where a 400 belongs), and a line break or escape sequence would forge lines in logs and listings
PLAIN_TEXT = r"^[^\x00-\x1f\x7f-\x9f]*$"  # (C0, DEL and C1: U+009B is a terminal's one-character CSI)


def new_secret() -> str:
    """A key's secret: 256 random bits, URL-safe, after `sk-corral-`. Never "-" first: the prefix `keys
    list` shows (its first six characters) is then passed to `corral keys show` as it is, not taken for
    an option (a 1-in-64 key was)."""
    while True:
        token = secrets.token_urlsafe(32)
        if not token.startswith("-"):
            return _SECRET_PREFIX + token


class NewKey(BaseModel):
    """What a new key may say: one validation for the CLI and the admin API."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant: str = Field(min_length=1, max_length=128, pattern=PLAIN_TEXT)
    name: str = Field(default="", max_length=128, pattern=PLAIN_TEXT)  # (the column's width)
    models: list[Annotated[str, Field(min_length=1, max_length=128, pattern=PLAIN_TEXT)]] = Field(
        default_factory=list,
        max_length=1024,  # (a model's name: <= 128)
    )
    rpm: int | None = Field(default=None, ge=1, le=_INT32_MAX)
    tpm: int | None = Field(default=None, ge=1, le=_INT32_MAX)
    max_concurrency: int | None = Field(default=None, ge=1, le=_INT32_MAX)
    priority: str = Field(default="normal", pattern="^(high|normal|low)$")
    monthly_token_budget: int | None = Field(default=None, ge=1, le=_INT64_MAX)
    # uploads made with the key: its tenant's file cap
    max_files: int | None = Field(default=None, ge=1, le=_INT32_MAX)
    max_file_bytes: int | None = Field(default=None, ge=1, le=_INT64_MAX)
    role: str = Field(default="user", pattern="^(admin|operator|viewer|tenant-admin|user)$")
    expires_in_s: float | None = Field(default=None, gt=0, le=MAX_LIFETIME_S)  # None: never expires


class KeyUpdate(BaseModel):
    """A key's limits and budget changed in place (its secret stays): fields left out stay as they are."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rpm: int | None = Field(default=None, ge=1, le=_INT32_MAX)
    tpm: int | None = Field(default=None, ge=1, le=_INT32_MAX)
    max_concurrency: int | None = Field(default=None, ge=1, le=_INT32_MAX)
    monthly_token_budget: int | None = Field(default=None, ge=1, le=_INT64_MAX)


class RotationConflict(Exception):
    """Two rotations of one key at once: the other committed first, and this one changed nothing (its
    secret would never have worked). The admin API answers 409."""


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
        if holds_control_characters(err):
            return cls(f"must not hold control characters (got {err.get('input')!r})", param)
        return cls(f"{err['msg'].lower()} (got {err.get('input')!r})", param)


def holds_control_characters(error: ErrorDetails) -> bool:
    """Whether a validation error is a text field's refusal of control characters (PLAIN_TEXT)."""
    return error["type"] == "string_pattern_mismatch" and error.get("ctx", {}).get("pattern") == PLAIN_TEXT


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
    role: str = "user"
    expires_at: datetime | None = None
    previous_until: datetime | None = None  # a rotated key's former secret is accepted until then
    parent: str | None = None  # the tenant-admin's key (or `oidc:<tenant>`) that made it; None: an admin

    @property
    def active(self) -> bool:
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > datetime.now(UTC))

    def to_dict(self) -> dict[str, object]:
        data = dict(self.__dict__)
        data["models"] = list(self.models)
        for name in ("created_at", "revoked_at", "expires_at", "previous_until"):
            value = data[name]
            data[name] = value.isoformat() if value is not None else None
        return data


class KeyStore:
    """Keys in a SQL database (SQLite file or PostgreSQL), through SQLAlchemy. Blocking: call off-loop."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def engine(self) -> Engine:
        return self._engine

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
        role: str = "user",
        expires_in_s: float | None = None,
        parent: str | None = None,
    ) -> tuple[str, KeyRecord]:
        """A new key: (the secret, shown only now; its record); `parent`: the tenant-admin's key (its id, or
        `oidc:<tenant>` for a signed-in one) that makes it. Raises InvalidKey."""
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
                role=role,
                expires_in_s=expires_in_s,
            )
        except ValidationError as exc:
            raise InvalidKey.from_validation(exc) from exc
        secret = new_secret()
        now = datetime.now(UTC)
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
            created_at=now,
            revoked_at=None,
            role=None if role == "user" else role,
            expires_at=now + timedelta(seconds=expires_in_s) if expires_in_s else None,
            parent=parent,
        )
        with Session(self._engine) as session, session.begin():
            session.add(row)
            record = _record(row)
        return secret, record

    def by_secret_hash(self, key_hash: str) -> KeyRecord | None:
        """The key whose secret this is: its current one, or (rotated) its former one within the grace
        period (past it, the former secret finds nothing). Found by its former secret, the record expires
        when the grace period ends, so a gateway serving it as last found (the store down) stops then too."""
        with Session(self._engine) as session:
            query = select(ApiKeyRow).where(
                or_(ApiKeyRow.key_hash == key_hash, ApiKeyRow.previous_hash == key_hash)
            )
            for row in session.scalars(query):
                if row.key_hash == key_hash:
                    return _record(row)
                until = _aware(row.previous_until)
                if until is not None and until > datetime.now(UTC):
                    record = _record(row)
                    ends = until if record.expires_at is None else min(until, record.expires_at)
                    return replace(record, expires_at=ends)
            return None

    def rotate(self, key_id: str, grace_s: float) -> tuple[str, KeyRecord] | None:
        """A new secret for the key (shown only now); its former one is still accepted for `grace_s`
        seconds. None: no such key (or revoked). Raises RotationConflict where another rotation of the key
        committed between this one's read and its write (this one then changed nothing)."""
        secret = new_secret()
        with Session(self._engine) as session, session.begin():
            row = session.get(ApiKeyRow, key_id)
            if row is None or row.revoked_at is not None:
                return None
            read_hash = row.key_hash
            # compare and swap: SQLite ignores FOR UPDATE (and pysqlite reads outside a transaction), so
            # the row changes only if its secret is still the one read; on PostgreSQL the loser's UPDATE
            # waits for the winner's commit, then finds its secret changed
            swapped = session.connection().execute(
                update(ApiKeyRow)
                .where(
                    ApiKeyRow.id == key_id,
                    ApiKeyRow.key_hash == read_hash,
                    ApiKeyRow.revoked_at.is_(None),
                )
                .values(
                    previous_hash=read_hash,
                    key_hash=hash_key(secret),
                    previous_until=datetime.now(UTC) + timedelta(seconds=max(0.0, grace_s)),
                    prefix=secret[: len(_SECRET_PREFIX) + 6],
                )
            )
            session.refresh(row)
            if swapped.rowcount == 1:
                return secret, _record(row)
            if row.revoked_at is not None:  # (revoked meanwhile)
                return None
        raise RotationConflict(
            f"The key {key_id} was rotated by another request at the same time: its secret is that "
            "request's, and this one changed nothing. Rotate it again to replace that secret."
        )

    def update(self, key_id: str, changes: KeyUpdate) -> tuple[KeyRecord, dict[str, object]] | None:
        """Change a key's limits or budget: (its record, what it was before, by field). None: no such key."""
        wanted = changes.model_dump(exclude_unset=True)
        with Session(self._engine) as session, session.begin():
            row = session.get(ApiKeyRow, key_id, with_for_update=True)
            if row is None:
                return None
            before = {name: getattr(row, name) for name in wanted}
            for name, value in wanted.items():
                setattr(row, name, value)
            return _record(row), before

    def get(self, key_id: str) -> KeyRecord | None:
        with Session(self._engine) as session:
            row = session.get(ApiKeyRow, key_id)
            return _record(row) if row is not None else None

    def ancestors(self, parent: str | None) -> list[KeyRecord]:
        """The keys above a key whose `parent` this is, nearest first: its maker, that one's maker, and so
        on, `MAX_GENERATIONS` at most; revoked and expired ones too (their limits still hold over the keys
        they made). A parent that is no key (`oidc:<tenant>`) ends the list: it is the last one's parent."""
        found: list[KeyRecord] = []
        with Session(self._engine) as session:
            while parent is not None and len(found) < MAX_GENERATIONS:
                row = session.get(ApiKeyRow, parent)
                if row is None or any(record.id == row.id for record in found):
                    break
                found.append(_record(row))
                parent = row.parent
        return found

    def makers(self, record: KeyRecord) -> list[str]:
        """The ids above `record`, nearest first: its maker's, that one's maker's, ..., ending with a
        signed-in tenant's `oidc:<tenant>` where one is at the top."""
        above = self.ancestors(record.parent)
        ids = [found.id for found in above]
        top = above[-1].parent if above else record.parent
        return [*ids, top] if top is not None and top not in ids else ids

    def adopt(self, key_id: str, parent: str) -> bool:
        """Give a key no one made (an admin's, or one made before keys recorded their maker) `parent` as its
        maker; False where it has one already."""
        query = update(ApiKeyRow).where(ApiKeyRow.id == key_id, ApiKeyRow.parent.is_(None))
        with Session(self._engine) as session, session.begin():
            return bool(session.execute(query.values(parent=parent)).rowcount)  # type: ignore[attr-defined]

    def family_month_tokens(self, key_id: str, now: datetime | None = None) -> int:
        """Input + output tokens the key (an id, or `oidc:<tenant>`) and the keys below it (those it made,
        theirs, `MAX_GENERATIONS` down) used this calendar month (UTC): what its monthly budget counts."""
        now = now or datetime.now(UTC)
        start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        made = select(ApiKeyRow.id, literal(1, Integer).label("depth")).where(ApiKeyRow.parent == key_id)
        below = made.cte("below", recursive=True)
        below = below.union_all(
            select(ApiKeyRow.id, below.c.depth + 1)
            .join(below, ApiKeyRow.parent == below.c.id)
            .where(below.c.depth < MAX_GENERATIONS)
        )
        # (in two steps: the keys below (the parent index), then their use by chunks of ids (the key's and
        # time's index). One query with the keys below as a subquery was read on PostgreSQL as a scan of
        # the whole month's usage, each row tested against them: 199 s at 10k keys below, 1M rows)
        tokens = func.sum(UsageRow.input_tokens + UsageRow.output_tokens)
        try:
            with Session(self._engine) as session:
                family = [key_id, *session.scalars(select(below.c.id))]
                used = 0
                for first in range(0, len(family), _IDS_A_QUERY):
                    chunk = family[first : first + _IDS_A_QUERY]
                    used += (
                        session.scalar(select(tokens).where(UsageRow.key_id.in_(chunk), UsageRow.at >= start))
                        or 0
                    )
                return int(used)
        except SQLAlchemyError as exc:
            raise StoreError(f"the usage store did not answer: {exc}") from exc

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

    def list(self, include_revoked: bool = False, tenant: str | None = None) -> list[KeyRecord]:
        """The keys (`tenant`: its keys only, found by the tenant's index)."""
        with Session(self._engine) as session:
            query = select(ApiKeyRow).order_by(ApiKeyRow.created_at)
            if not include_revoked:
                query = query.where(ApiKeyRow.revoked_at.is_(None))
            if tenant is not None:
                query = query.where(ApiKeyRow.tenant == tenant)
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
        role=row.role or "user",
        expires_at=_aware(row.expires_at),
        previous_until=_aware(row.previous_until),
        parent=row.parent,
    )


def _aware(value: datetime | None) -> datetime | None:
    """A stored time in UTC (SQLite returns it without its zone)."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)
