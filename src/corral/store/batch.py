"""Files and batch jobs in the SQL store: the durable queue behind the Batch API.

Every line of a batch is a row. A runner *leases* pending lines (an owner and a deadline, taken with
`FOR UPDATE SKIP LOCKED` on PostgreSQL; SQLite serialises writers), runs them and *commits* each result
only while it still holds the lease, so a line has exactly one result whatever crashes: a runner killed
mid-line leaves a lease that expires and is taken over; a runner that finishes after losing its lease has
its result dropped. Counts are derived from the lines' states, never kept apart, so they cannot drift.
A batch with nothing pending or leased is finalised in one transaction (output and error files written,
status set only if still unfinished), so two runners finalising at once produce one set of files.

No queue library fits both backends and these semantics (procrastinate and pgqueuer are PostgreSQL-only,
saq and arq Redis-only, none gives exactly-one result per line over SQLite), so the SQL is kept small here.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import orjson
from sqlalchemy import (
    JSON,
    CursorResult,
    DateTime,
    Engine,
    Float,
    Index,
    Integer,
    String,
    Text,
    func,
    select,
    update,
)
from sqlalchemy.orm import Mapped, Session, mapped_column

from corral.store.files import FileRow, FileStore, page
from corral.store.schema import Base

__all__ = ["BatchLine", "BatchRecord", "BatchStore", "LineResult", "NewBatch"]

FINISHED = frozenset({"completed", "failed", "expired", "cancelled"})


class BatchRow(Base):
    __tablename__ = "corral_batches"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    key_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    endpoint: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(128))
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


class BatchLineRow(Base):
    __tablename__ = "corral_batch_lines"
    __table_args__ = (Index("ix_corral_batch_lines_state", "state", "lease_until"),)

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


@dataclass(frozen=True)
class BatchRecord:
    id: str
    tenant: str
    endpoint: str
    model: str
    input_file_id: str
    output_file_id: str | None
    error_file_id: str | None
    completion_window: str
    status: str
    created_at: datetime
    expires_at: datetime
    times: dict[str, float]
    meta: dict[str, str] | None
    errors: list[dict[str, Any]] | None
    counts: dict[str, int]

    def to_api(self) -> dict[str, Any]:
        when = {f"{status}_at": int(at) for status, at in self.times.items()}
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": int(self.created_at.timestamp()),
            "expires_at": int(self.expires_at.timestamp()),
            **{
                key: when.get(key)
                for key in (
                    "in_progress_at",
                    "finalizing_at",
                    "completed_at",
                    "failed_at",
                    "expired_at",
                    "cancelling_at",
                    "cancelled_at",
                )
            },
            "request_counts": self.counts,
            "metadata": self.meta,
        }


@dataclass(frozen=True)
class NewBatch:
    """What a client asked for in `POST /v1/batches`, and who."""

    tenant: str
    key_id: str | None
    endpoint: str
    input_file_id: str
    window: timedelta
    window_text: str = "24h"  # as the client wrote it
    meta: dict[str, str] | None = None


@dataclass(frozen=True)
class BatchLine:
    """A leased line: what to run, and for whom."""

    batch_id: str
    line: int
    custom_id: str
    body: bytes
    endpoint: str
    tenant: str
    key_id: str | None
    attempts: int  # this lease included


@dataclass(frozen=True)
class LineResult:
    status_code: int
    body: bytes  # the answer (or an OpenAI error body)
    request_id: str


class BatchStore:
    """Blocking SQL access to files, batches and their lines (the gateway calls it from threads)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._postgres = engine.dialect.name == "postgresql"
        self.files = FileStore(engine)  # inputs, and the output and error files it writes

    # batches

    def create_batch(self, new: NewBatch, model: str, lines: list[tuple[str, bytes]]) -> BatchRecord:
        """A batch of validated lines, in progress at once (validation happened before)."""
        row = _row(new, "in_progress", model, len(lines))
        with Session(self._engine, expire_on_commit=False) as session, session.begin():
            session.add(row)
            session.flush()
            session.add_all(
                BatchLineRow(
                    batch_id=row.id, line=i, custom_id=custom_id, body=body.decode(), state="pending"
                )
                for i, (custom_id, body) in enumerate(lines)
            )
        return self._created(new.tenant, row.id)

    def failed_batch(self, new: NewBatch, errors: list[dict[str, Any]]) -> BatchRecord:
        """A batch whose input did not validate: failed at once, with the errors (OpenAI's behaviour)."""
        row = _row(new, "failed", "", 0, errors)
        with Session(self._engine, expire_on_commit=False) as session, session.begin():
            session.add(row)
        return self._created(new.tenant, row.id)

    def _created(self, tenant: str, batch_id: str) -> BatchRecord:
        found = self.batch(tenant, batch_id)
        assert found is not None
        return found

    def batch(self, tenant: str | None, batch_id: str) -> BatchRecord | None:
        with Session(self._engine, expire_on_commit=False) as session:
            row = session.get(BatchRow, batch_id)
            if row is None or (tenant is not None and row.tenant != tenant):
                return None
            return _batch(row, self._counts(session, [batch_id]).get(batch_id, {}))

    def batches(self, tenant: str, limit: int, after: str | None) -> list[BatchRecord]:
        with Session(self._engine, expire_on_commit=False) as session:
            rows = session.scalars(
                select(BatchRow)
                .where(BatchRow.tenant == tenant)
                .order_by(BatchRow.created_at.desc(), BatchRow.id)
            ).all()
            found = page(list(rows), limit, after)
            counts = self._counts(session, [r.id for r in found])
            return [_batch(r, counts.get(r.id, {})) for r in found]

    def cancel(self, tenant: str, batch_id: str) -> BatchRecord | None:
        """Cancelling: pending lines are cancelled; leased ones finish; finalised as cancelled after."""
        with Session(self._engine, expire_on_commit=False) as session, session.begin():
            row = session.get(BatchRow, batch_id, with_for_update=self._postgres)
            if row is None or row.tenant != tenant:
                return None
            if row.status == "in_progress":
                # conditional: a finalisation that won the race keeps its status (SQLite reads unlocked)
                moved = session.execute(
                    update(BatchRow)
                    .where(BatchRow.id == batch_id, BatchRow.status == "in_progress")
                    .values(status="cancelling", times={**row.times, "cancelling": time.time()})
                )
                if _changed(moved):
                    session.execute(
                        update(BatchLineRow)
                        .where(BatchLineRow.batch_id == batch_id, BatchLineRow.state == "pending")
                        .values(state="cancelled")
                    )
        return self.batch(tenant, batch_id)

    # the runner's side

    def lease(
        self, owner: str, model: str, limit: int, lease_s: float, max_attempts: int = 5
    ) -> list[BatchLine]:
        """Up to `limit` runnable lines of in-progress batches for `model`: pending ones past their backoff,
        or leased ones whose lease ran out (their runner died). A line taken over `max_attempts` times
        (its runner keeps dying on it) fails instead."""
        if limit <= 0:
            return []
        now = time.time()
        runnable_now = ((BatchLineRow.state == "pending") & _due(now)) | (
            (BatchLineRow.state == "leased") & (BatchLineRow.lease_until < now)
        )
        with Session(self._engine, expire_on_commit=False) as session, session.begin():
            runnable = (
                select(BatchLineRow.batch_id, BatchLineRow.line, BatchLineRow.attempts)
                .join(BatchRow, BatchRow.id == BatchLineRow.batch_id)
                .where(BatchRow.status == "in_progress", BatchRow.model == model, runnable_now)
                .order_by(BatchRow.created_at, BatchLineRow.line)
                .limit(limit)
            )
            if self._postgres:
                runnable = runnable.with_for_update(of=BatchLineRow, skip_locked=True)
            picked = session.execute(runnable).all()
            leased: list[BatchLine] = []
            for batch_id, line, attempts in picked:
                where = (BatchLineRow.batch_id == batch_id, BatchLineRow.line == line, runnable_now)
                if attempts >= max_attempts:
                    response = _response(500, _gave_up(attempts))
                    session.execute(
                        update(BatchLineRow)
                        .where(*where)
                        .values(state="failed", status_code=500, response=response, lease_owner=None)
                    )
                    continue
                taken = session.execute(
                    update(BatchLineRow)
                    .where(*where)
                    .values(
                        state="leased",
                        lease_owner=owner,
                        lease_until=now + lease_s,
                        attempts=BatchLineRow.attempts + 1,
                    )
                    .returning(BatchLineRow.custom_id, BatchLineRow.body, BatchLineRow.attempts)
                ).first()
                if taken is None:
                    continue
                batch = session.get(BatchRow, batch_id)
                assert batch is not None
                leased.append(
                    BatchLine(
                        batch_id,
                        line,
                        taken.custom_id,
                        taken.body.encode(),
                        batch.endpoint,
                        batch.tenant,
                        batch.key_id,
                        taken.attempts,
                    )
                )
            return leased

    def commit(self, owner: str, line: BatchLine, result: LineResult) -> bool:
        """The line's result, kept only while `owner` still holds its lease (exactly one result a line)."""
        return bool(self.commit_many(owner, [(line, result)]))

    def commit_many(self, owner: str, results: list[tuple[BatchLine, LineResult]]) -> int:
        """Several lines' results in one transaction (the runner's per-tick flush); how many were kept."""
        kept = 0
        with Session(self._engine, expire_on_commit=False) as session, session.begin():
            for line, result in results:
                ok = 200 <= result.status_code < 300
                done = session.execute(
                    _held(owner, line).values(
                        state="done" if ok else "failed",
                        status_code=result.status_code,
                        response=_response(result.status_code, result.body, result.request_id),
                    )
                )
                kept += _changed(done)
        return kept

    def release(self, owner: str, line: BatchLine, after_s: float = 0.0) -> None:
        """Give a leased line back: pending again, runnable `after_s` from now (a retry's backoff)."""
        with Session(self._engine, expire_on_commit=False) as session, session.begin():
            session.execute(
                _held(owner, line).values(
                    state="pending",
                    lease_owner=None,
                    lease_until=None,
                    not_before=time.time() + after_s if after_s else None,
                )
            )

    def renew(self, owner: str, lines: list[BatchLine], lease_s: float) -> None:
        """Extend the leases of lines still running (so a long line is not taken over)."""
        until = time.time() + lease_s
        with Session(self._engine, expire_on_commit=False) as session, session.begin():
            for line in lines:
                session.execute(_held(owner, line).values(lease_until=until))

    def models_with_work(self) -> list[str]:
        with Session(self._engine, expire_on_commit=False) as session:
            return list(
                session.scalars(
                    select(BatchRow.model).where(BatchRow.status == "in_progress").distinct()
                ).all()
            )

    def housekeeping(self) -> list[str]:
        """Expire batches past their window; finalise those with nothing left to run. The ids finished."""
        finished = []
        with Session(self._engine, expire_on_commit=False) as session:
            open_ids = session.scalars(
                select(BatchRow.id).where(BatchRow.status.in_(("in_progress", "cancelling")))
            ).all()
        for batch_id in open_ids:
            if self._finish(batch_id):
                finished.append(batch_id)
        return finished

    def _finish(self, batch_id: str) -> bool:
        """Finalise the batch if nothing is left to run: its files written and its status set in one
        transaction, the status only if no one changed it meanwhile (else all of it rolls back)."""
        now = time.time()
        try:
            with Session(self._engine, expire_on_commit=False) as session, session.begin():
                row = session.get(BatchRow, batch_id, with_for_update=self._postgres)
                if row is None or row.status in FINISHED:
                    return False
                final = self._settle_lines(session, row, now)
                if final is None:
                    return False
                output_id, error_id = self._write_results(session, row)
                done = session.execute(
                    update(BatchRow)
                    .where(BatchRow.id == batch_id, BatchRow.status == row.status)
                    .values(
                        status=final,
                        output_file_id=output_id,
                        error_file_id=error_id,
                        times={**row.times, "finalizing": now, final: now},
                    )
                )
                if not _changed(done):
                    raise _Raced
        except _Raced:
            return False
        return True

    @staticmethod
    def _settle_lines(session: Session, row: BatchRow, now: float) -> str | None:
        """Expire or cancel what may not run any more; the status to finalise as, or None while lines
        are still to run."""
        lines = update(BatchLineRow).where(BatchLineRow.batch_id == row.id)
        if row.status == "in_progress" and _aware(row.expires_at).timestamp() <= now:
            session.execute(
                lines.where(BatchLineRow.state.in_(("pending", "leased"))).values(state="expired")
            )
            return "expired"
        if row.status == "cancelling":  # lines given back or whose runner died are cancelled too
            session.execute(
                lines.where(
                    (BatchLineRow.state == "pending")
                    | ((BatchLineRow.state == "leased") & (BatchLineRow.lease_until < now))
                ).values(state="cancelled")
            )
        busy = session.scalar(
            select(func.count())
            .select_from(BatchLineRow)
            .where(BatchLineRow.batch_id == row.id, BatchLineRow.state.in_(("pending", "leased")))
        )
        if busy:
            return None
        return "cancelled" if row.status == "cancelling" else "completed"

    @staticmethod
    def _write_results(session: Session, row: BatchRow) -> tuple[str | None, str | None]:
        lines = session.execute(
            select(
                BatchLineRow.custom_id, BatchLineRow.state, BatchLineRow.status_code, BatchLineRow.response
            )
            .where(BatchLineRow.batch_id == row.id)
            .order_by(BatchLineRow.line)
        ).all()
        stamp = datetime.now(UTC)
        ids: list[str | None] = []
        for kind, content in zip(("output", "error"), _result_files(row.id, lines), strict=True):
            if not content:
                ids.append(None)
                continue
            file_id = f"file-{uuid.uuid4().hex[:24]}"
            session.add(
                FileRow(
                    id=file_id,
                    tenant=row.tenant,
                    purpose="batch_output",
                    filename=f"{row.id}_{kind}.jsonl",
                    size=len(content),
                    created_at=stamp,
                    content=content,
                )
            )
            ids.append(file_id)
        return ids[0], ids[1]

    @staticmethod
    def _counts(session: Session, batch_ids: list[str]) -> dict[str, dict[str, int]]:
        if not batch_ids:
            return {}
        rows = session.execute(
            select(BatchLineRow.batch_id, BatchLineRow.state, func.count())
            .where(BatchLineRow.batch_id.in_(batch_ids))
            .group_by(BatchLineRow.batch_id, BatchLineRow.state)
        ).all()
        counts: dict[str, dict[str, int]] = {b: {"total": 0, "completed": 0, "failed": 0} for b in batch_ids}
        for batch_id, state, n in rows:
            counts[batch_id]["total"] += n
            if state == "done":
                counts[batch_id]["completed"] += n
            elif state in ("failed", "expired", "cancelled"):
                counts[batch_id]["failed"] += n
        return counts


def _batch(row: BatchRow, counts: dict[str, int]) -> BatchRecord:
    return BatchRecord(
        row.id,
        row.tenant,
        row.endpoint,
        row.model,
        row.input_file_id,
        row.output_file_id,
        row.error_file_id,
        row.completion_window,
        row.status,
        _aware(row.created_at),
        _aware(row.expires_at),
        dict(row.times or {}),
        row.meta,
        row.errors,
        counts or {"total": row.total, "completed": 0, "failed": 0},
    )


def _result_files(batch_id: str, lines: Sequence[Any]) -> tuple[bytes, bytes]:
    """OpenAI's output file (a line per answered request: its status and body) and error file (a line
    per request that failed, was cancelled or expired)."""
    output: list[bytes] = []
    errors: list[bytes] = []
    for custom_id, state, status_code, response in lines:
        if state in ("done", "failed") and response is not None:
            result = orjson.loads(response)
            item = {
                "id": f"batch_req_{uuid.uuid4().hex[:24]}",
                "custom_id": custom_id,
                "response": {
                    "status_code": status_code,
                    "request_id": result["request_id"],
                    "body": result["body"],
                },
                "error": None,
            }
            (output if state == "done" else errors).append(orjson.dumps(item))
        elif state in ("cancelled", "expired"):
            code = "batch_cancelled" if state == "cancelled" else "batch_expired"
            message = (
                "The batch was cancelled before this request ran."
                if state == "cancelled"
                else ("The batch expired before this request ran.")
            )
            item = {
                "id": f"batch_req_{uuid.uuid4().hex[:24]}",
                "custom_id": custom_id,
                "response": None,
                "error": {"code": code, "message": message},
            }
            errors.append(orjson.dumps(item))
    return _jsonl(output), _jsonl(errors)


def _jsonl(lines: list[bytes]) -> bytes:
    return b"\n".join(lines) + b"\n" if lines else b""


class _Raced(Exception):
    """Another runner finalised the batch first: roll this finalisation back."""


def _changed(result: Any) -> bool:
    return bool(cast(CursorResult[Any], result).rowcount)


def _held(owner: str, line: BatchLine) -> Any:
    """An update of `line` that takes effect only while `owner` holds its lease."""
    return update(BatchLineRow).where(
        BatchLineRow.batch_id == line.batch_id,
        BatchLineRow.line == line.line,
        BatchLineRow.state == "leased",
        BatchLineRow.lease_owner == owner,
    )


def _due(now: float) -> Any:
    return BatchLineRow.not_before.is_(None) | (BatchLineRow.not_before <= now)


def _aware(at: datetime) -> datetime:
    """SQLite gives datetimes back without their zone; they were stored in UTC."""
    return at if at.tzinfo else at.replace(tzinfo=UTC)


def _response(status_code: int, body: bytes, request_id: str | None = None) -> str:
    return orjson.dumps(
        {
            "status_code": status_code,
            "request_id": request_id or f"req_{uuid.uuid4().hex[:24]}",
            "body": orjson.loads(body or b"null"),
        }
    ).decode()


def _gave_up(attempts: int) -> bytes:
    message = f"The request was started {attempts} times and never finished (its gateway stopped each time)."
    return orjson.dumps(
        {"error": {"message": message, "type": "server_error", "param": None, "code": "line_failed"}}
    )


def _row(
    new: NewBatch, status: str, model: str, total: int, errors: list[dict[str, Any]] | None = None
) -> BatchRow:
    now = datetime.now(UTC)
    return BatchRow(
        id=f"batch_{uuid.uuid4().hex[:24]}",
        tenant=new.tenant,
        key_id=new.key_id,
        endpoint=new.endpoint,
        model=model,
        input_file_id=new.input_file_id,
        completion_window=new.window_text,
        status=status,
        created_at=now,
        expires_at=now + new.window,
        times={status: now.timestamp()},
        meta=new.meta,
        errors=errors,
        total=total,
    )
