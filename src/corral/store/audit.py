"""The audit trail: every administrative action, written once, never changed through corral.

A row says who acted (the admin key, an API key with a role, or a person signed in through the identity
provider), with which role and tenant, from which address, what they did to what, with what detail, how it
ended (the answer's status: refused attempts are on record too), and the request's id. Secrets never enter
it (a new key's secret is not its detail).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from corral.store.schema import AuditRow

__all__ = ["AuditEntry", "AuditLog"]

_MOST = 1000  # rows one listing returns at most


@dataclass(frozen=True)
class AuditEntry:
    actor: str
    role: str
    action: str
    status: int
    tenant: str | None = None
    source: str | None = None
    target: str | None = None
    detail: dict[str, Any] | None = None
    request_id: str | None = None  # the request's x-request-id


class AuditLog:
    """Audit rows in the store. Blocking: call off-loop."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def record(self, entry: AuditEntry) -> None:
        with Session(self._engine) as session, session.begin():
            session.add(AuditRow(at=datetime.now(UTC), **entry.__dict__))

    def list(
        self,
        *,
        action: str | None = None,
        actor: str | None = None,
        tenant: str | None = None,
        since: datetime | None = None,
        request_id: str | None = None,
        limit: int = 100,
    ) -> list[dict[str, Any]]:
        """The latest rows first, filtered (`action` may end with `*`: a prefix)."""
        query = select(AuditRow).order_by(AuditRow.id.desc()).limit(max(1, min(limit, _MOST)))
        if action:
            prefix = action.removesuffix("*")
            query = query.where(
                AuditRow.action.startswith(prefix, autoescape=True)
                if action.endswith("*")
                else AuditRow.action == action
            )
        if actor:
            query = query.where(AuditRow.actor == actor)
        if tenant:
            query = query.where(AuditRow.tenant == tenant)
        if since is not None:  # (in UTC, as rows are written: SQLite compares the times as text)
            since = since.astimezone(UTC) if since.tzinfo is not None else since.replace(tzinfo=UTC)
            query = query.where(AuditRow.at >= since)
        if request_id:
            query = query.where(AuditRow.request_id == request_id)
        with Session(self._engine) as session:
            return [_row(row) for row in session.scalars(query)]


def _row(row: AuditRow) -> dict[str, Any]:
    at = row.at if row.at.tzinfo is not None else row.at.replace(tzinfo=UTC)  # (SQLite keeps no zone)
    return {
        "id": row.id,
        "at": at.isoformat(),
        "actor": row.actor,
        "role": row.role,
        "tenant": row.tenant,
        "source": row.source,
        "action": row.action,
        "target": row.target,
        "detail": row.detail,
        "status": row.status,
        "request_id": row.request_id,
    }
