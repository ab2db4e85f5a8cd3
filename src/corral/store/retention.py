"""How long records are kept: usage and audit rows older than their retention (store.usage_retention_days,
store.audit_retention_days; unset: kept) and stored responses past their expiry (store.response_ttl_days)
are deleted by a sweep the gateway runs at start and hourly, off the requests' path."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import Engine, delete, select

from corral.store.responses import ResponseStore
from corral.store.schema import AuditRow, UsageRow

__all__ = ["Retention"]


@dataclass(frozen=True)
class Retention:
    engine: Engine
    usage_days: int | None
    audit_days: int | None
    responses: ResponseStore | None = None

    def sweep(self, now: datetime | None = None) -> tuple[int, int, int]:
        """Delete what has outlived its retention; (usage rows, audit rows, stored responses) deleted.
        Blocking: off-loop."""
        now = now or datetime.now(UTC)
        usage = audit = 0
        if self.usage_days is not None:
            usage = delete_before(self.engine, UsageRow, now - timedelta(days=self.usage_days))
        if self.audit_days is not None:
            audit = delete_before(self.engine, AuditRow, now - timedelta(days=self.audit_days))
        responses = self.responses.sweep_expired() if self.responses is not None else 0
        return usage, audit, responses


def delete_before(
    engine: Engine, row: type[UsageRow] | type[AuditRow], before: datetime, batch: int = 5000
) -> int:
    """Delete the rows of `row`'s table written before `before`, `batch` at a time (each its own
    transaction, found by the `at` index: a long sweep holds no lock for long); how many."""
    deleted = 0
    while True:
        with engine.begin() as connection:
            ids = connection.scalars(select(row.id).where(row.at < before).limit(batch)).all()
            if ids:
                connection.execute(delete(row).where(row.id.in_(ids)))
        deleted += len(ids)
        if len(ids) < batch:
            return deleted
