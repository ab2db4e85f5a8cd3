"""The batch queue's tables and the small helpers its SQL and Redis halves share."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any, cast

import orjson
from sqlalchemy import JSON, BigInteger, CursorResult, DateTime, Float, Index, Integer, String, Text
from sqlalchemy import cast as sql_cast
from sqlalchemy.orm import Mapped, mapped_column

from corral.store.schema import Base

__all__ = [
    "FINISHED",
    "RESULTS_KEPT",
    "BatchLineRow",
    "BatchRow",
    "aware",
    "changed",
    "gave_up",
    "keeps_lines",
    "stored_result",
]

FINISHED = frozenset({"completed", "failed", "expired", "cancelled"})  # a batch's last statuses
RESULTS_KEPT = "results_kept"  # the error of a failed batch whose results could not be written to files


class BatchRow(Base):
    __tablename__ = "corral_batches"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    key_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    endpoint: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(128))  # "" while validating
    input_file_id: Mapped[str] = mapped_column(String(40))
    output_file_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    times: Mapped[dict[str, float]] = mapped_column(JSON, default=dict)  # status → when it was reached
    meta: Mapped[dict[str, str] | None] = mapped_column(JSON, nullable=True)
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    total: Mapped[int] = mapped_column(Integer, default=0)
    counts: Mapped[dict[str, int] | None] = mapped_column(JSON, nullable=True)  # kept when finalised
    queue: Mapped[str | None] = mapped_column(String(8), nullable=True)  # its lines' queue (None: sql)
    # the size of the results committed so far (about its output lines'): its tenant's files quota counts
    # them while it runs (None: none yet, or a batch from before the column)
    result_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class BatchLineRow(Base):
    """A line of a batch queued in SQL (`batch.queue: sql`)."""

    __tablename__ = "corral_batch_lines"
    __table_args__ = (
        Index("ix_corral_batch_lines_state", "state", "lease_until"),
        Index("ix_corral_batch_lines_runnable", "batch_id", "state", "line"),  # a batch's next lines
    )

    batch_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    line: Mapped[int] = mapped_column(Integer, primary_key=True)
    custom_id: Mapped[str] = mapped_column(String(512))
    body: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(12))  # pending leased done failed cancelled expired
    lease_owner: Mapped[str | None] = mapped_column(String(80), nullable=True)
    lease_until: Mapped[float | None] = mapped_column(Float, nullable=True)
    not_before: Mapped[float | None] = mapped_column(Float, nullable=True)  # retried after a backoff
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    response: Mapped[str | None] = mapped_column(Text, nullable=True)


def keeps_lines() -> Any:
    """The batches whose lines the queue keeps: those unfinished, and those failed whose results could not
    be written to files (RESULTS_KEPT among their errors: kept until the batch is forgotten)."""
    kept = (BatchRow.status == "failed") & sql_cast(BatchRow.errors, Text).contains(RESULTS_KEPT)
    return BatchRow.status.not_in(FINISHED) | kept


def changed(result: Any) -> bool:
    return bool(cast(CursorResult[Any], result).rowcount)


def aware(at: datetime) -> datetime:
    """SQLite gives datetimes back without their zone; they were stored in UTC."""
    return at if at.tzinfo else at.replace(tzinfo=UTC)


def stored_result(status_code: int, body: bytes, request_id: str | None = None) -> tuple[int, str]:
    """A line's result as the queue stores it: its status, and the status, request id and answer (or OpenAI
    error body) as JSON. Never raises, so one line cannot roll back its tick's other results: an answer that
    is not JSON (a proxy's HTML page, NaN, a byte-order mark) is stored as a 502 `upstream_error`, and a
    result that cannot be written at all as a 500."""
    try:
        answer = orjson.loads(body or b"null")
    except orjson.JSONDecodeError:
        message = f"The engine answered {status_code} with a body that is not JSON ({len(body)} bytes)."
        status_code, answer = 502, _error(message, "upstream_error", "invalid_upstream_body")
    try:
        return status_code, _result(status_code, answer, request_id)
    except TypeError:  # (orjson.JSONEncodeError) a request id orjson cannot write: a lone surrogate
        message = "The request's result could not be stored."
        return 500, _result(500, _error(message, "server_error", "result_not_stored"), None)


def gave_up(attempts: int | str) -> str:
    """The result of a line whose runner kept dying on it."""
    message = f"The request was started {attempts} times and never finished (its gateway stopped each time)."
    return _result(500, _error(message, "server_error", "line_failed"), None)


def _result(status_code: int, answer: Any, request_id: str | None) -> str:
    return orjson.dumps(
        {
            "status_code": status_code,
            "request_id": request_id or f"req_{uuid.uuid4().hex[:24]}",
            "body": answer,
        }
    ).decode()


def _error(message: str, type_: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}
