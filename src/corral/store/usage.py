"""Usage records: written in batches, reported by key, model or day."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import Engine, func, insert, select
from sqlalchemy.orm import Session

from corral.store.schema import Base, UsageRow

__all__ = ["UsageRecord", "UsageStore"]

_INSERT = insert(Base.metadata.tables[UsageRow.__tablename__])


@dataclass
class UsageRecord:  # made once per request: a plain dataclass (a frozen one costs more to build)
    at: datetime
    key_id: str | None
    tenant: str | None
    model: str
    input_tokens: int
    output_tokens: int
    ttft_ms: float | None
    latency_ms: float
    status: int
    replica: str | None


class UsageStore:
    """Blocking SQL access; the gateway calls it from a worker thread, in batches."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def write(self, records: Sequence[UsageRecord]) -> None:
        if not records:
            return
        # A Core insert over the table: the ORM's bulk path costs the gateway several times more CPU per row.
        with self._engine.begin() as connection:
            connection.execute(_INSERT, [vars(r) for r in records])

    def report(self, by: str, since: datetime | None = None) -> list[dict[str, object]]:
        """Totals grouped by `key`, `model`, `tenant` or `day`."""
        columns = {
            "key": (UsageRow.key_id,),
            "tenant": (UsageRow.tenant,),
            "model": (UsageRow.model,),
            "day": (func.date(UsageRow.at),),
        }
        if by not in columns:
            raise ValueError(f"group by one of {', '.join(columns)}")
        group = columns[by]
        query = (
            select(
                *group,
                func.count().label("requests"),
                func.sum(UsageRow.input_tokens).label("input_tokens"),
                func.sum(UsageRow.output_tokens).label("output_tokens"),
                func.sum(func.cast(UsageRow.status >= 400, type_=UsageRow.status.type)).label("errors"),
                func.avg(UsageRow.latency_ms).label("mean_latency_ms"),
            )
            .group_by(*group)
            .order_by(*group)
        )
        if since is not None:
            query = query.where(UsageRow.at >= since)
        with Session(self._engine) as session:
            rows = session.execute(query).all()
        return [
            {
                by: str(r[0]) if r[0] is not None else None,
                "requests": r.requests,
                "input_tokens": int(r.input_tokens or 0),
                "output_tokens": int(r.output_tokens or 0),
                "errors": int(r.errors or 0),
                "mean_latency_ms": round(float(r.mean_latency_ms or 0), 1),
            }
            for r in rows
        ]

    def month_tokens(self, key_id: str, now: datetime | None = None) -> int:
        """Input + output tokens a key used this calendar month (UTC)."""
        now = now or datetime.now(UTC)
        start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        query = select(func.sum(UsageRow.input_tokens + UsageRow.output_tokens)).where(
            UsageRow.key_id == key_id, UsageRow.at >= start
        )
        with Session(self._engine) as session:
            return int(session.scalar(query) or 0)
