"""Stored responses (the Responses API's `store: true`): each tenant's own, kept until they expire.

A row holds the response object as it was answered and the whole input that produced it (the items of
every earlier turn it continued, then its own), so a turn naming `previous_response_id` is resolved from
here into its full conversation before it is routed: any replica, any gateway, and a restart continue it.
Rows past `expires_at` are gone from reads at once and deleted by `sweep_expired` (the gateway's
retention sweep, at start and hourly: store/retention.py).

Each tenant keeps at most `tenant_max_bytes` of them (`store.response_tenant_max_bytes`): past it, its own
oldest are deleted, never another tenant's (a conversation goes on from its latest response, which holds
all of it). A gateway process sums a tenant's rows each time it has stored a sixteenth of that bound for
it, so the bound holds to within a sixteenth per gateway process writing for the tenant.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson
from sqlalchemy import Engine, Float, Integer, String, Text, delete, func, insert, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from corral.store.schema import Base

__all__ = ["ResponseRow", "ResponseStore", "StoredResponse"]


class ResponseRow(Base):
    __tablename__ = "corral_responses"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    key_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    model: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float] = mapped_column(Float, index=True)
    input_items: Mapped[str] = mapped_column(Text)  # JSON: the conversation's input, earlier turns first
    response: Mapped[str] = mapped_column(Text)  # JSON: the response object
    size: Mapped[int | None] = mapped_column(
        Integer, nullable=True
    )  # the two JSONs' bytes (None: older rows)


@dataclass(frozen=True)
class StoredResponse:
    id: str
    tenant: str
    input_items: list[dict[str, Any]]
    response: dict[str, Any]
    size: int = 0  # the row's bytes (its input's JSON and the response's): what a next turn carries on


class ResponseStore:
    """Blocking calls (run them in a thread from the event loop)."""

    def __init__(self, engine: Engine, ttl_s: float, tenant_max_bytes: int = 1 << 30) -> None:
        self._engine = engine
        self.ttl_s = ttl_s
        self.tenant_max_bytes = tenant_max_bytes
        self._unchecked: dict[str, int] = {}  # per tenant: bytes this process stored since it last summed

    def put(
        self,
        tenant: str,
        key_id: str | None,
        response: dict[str, Any],
        input_items: list[dict[str, Any]],
    ) -> None:
        now = time.time()
        items, answer = orjson.dumps(input_items), orjson.dumps(response)
        size = len(items) + len(answer)
        row = {
            "id": str(response["id"]),
            "tenant": tenant,
            "key_id": key_id,
            "model": str(response.get("model") or ""),
            "created_at": now,
            "expires_at": now + self.ttl_s,
            "input_items": items.decode(),
            "response": answer.decode(),
            "size": size,
        }
        with self._engine.begin() as connection:  # (one INSERT: a response id is new by construction)
            connection.execute(insert(ResponseRow), row)
        unchecked = self._unchecked[tenant] = self._unchecked.get(tenant, 0) + size
        if unchecked >= self.tenant_max_bytes // 16:
            self._unchecked[tenant] = 0
            self.trim(tenant)

    def trim(self, tenant: str) -> int:
        """Delete the tenant's oldest responses past `tenant_max_bytes`; how many."""
        size = func.coalesce(
            ResponseRow.size, func.length(ResponseRow.input_items) + func.length(ResponseRow.response)
        )
        with Session(self._engine) as session, session.begin():
            held = session.scalar(
                select(func.coalesce(func.sum(size), 0)).where(ResponseRow.tenant == tenant)
            )
            over = int(held or 0) - self.tenant_max_bytes
            if over <= 0:
                return 0
            doomed: list[str] = []
            rows = session.execute(
                select(ResponseRow.id, size)
                .where(ResponseRow.tenant == tenant)
                .order_by(ResponseRow.created_at)
            )
            for response_id, bytes_ in rows:
                doomed.append(response_id)
                over -= int(bytes_ or 0)
                if over <= 0:
                    break
            rows.close()
            for at in range(0, len(doomed), 500):
                session.execute(delete(ResponseRow).where(ResponseRow.id.in_(doomed[at : at + 500])))
            return len(doomed)

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's response, None if it has none by that id (another tenant's included) or it expired."""
        found = select(ResponseRow).where(  # (another tenant's row is never read: megabytes, for nothing)
            ResponseRow.id == response_id, ResponseRow.tenant == tenant, ResponseRow.expires_at >= time.time()
        )
        with Session(self._engine) as session:
            row = session.scalars(found).one_or_none()
            if row is None:
                return None
            return StoredResponse(
                row.id,
                row.tenant,
                orjson.loads(row.input_items),
                orjson.loads(row.response),
                # (bytes, as the size check that bounds a conversation counts: characters were 4x fewer)
                row.size if row.size is not None else len(row.input_items.encode() + row.response.encode()),
            )

    def delete(self, tenant: str, response_id: str) -> bool:
        with Session(self._engine) as session, session.begin():
            found = session.execute(
                delete(ResponseRow).where(
                    ResponseRow.id == response_id,
                    ResponseRow.tenant == tenant,
                    ResponseRow.expires_at >= time.time(),
                )
            )
            return bool(getattr(found, "rowcount", 0))

    def sweep_expired(self, batch: int = 50) -> int:
        """Delete every expired response, `batch` at a time, each batch its own transaction (a row may be
        megabytes: a thousand in one held SQLite's write lock for seconds); how many. Blocking: off-loop."""
        deleted, now = 0, time.time()
        while True:
            with self._engine.begin() as connection:
                doomed = connection.scalars(
                    select(ResponseRow.id).where(ResponseRow.expires_at < now).limit(batch)
                ).all()
                if doomed:
                    connection.execute(delete(ResponseRow).where(ResponseRow.id.in_(doomed)))
            deleted += len(doomed)
            if len(doomed) < batch:
                return deleted
