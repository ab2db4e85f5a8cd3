"""A batch as the API tells it (BatchRecord), what a client asked for (NewBatch), and their rows."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from corral.store.batch_rows import BatchRow, aware

__all__ = ["BatchRecord", "NewBatch", "empty_counts", "new_row", "record"]


@dataclass(frozen=True)
class BatchRecord:
    id: str
    tenant: str
    key_id: str | None
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


def empty_counts(row: BatchRow) -> dict[str, int]:
    return {"total": row.total, "completed": 0, "failed": 0}


def record(row: BatchRow, counts: dict[str, int]) -> BatchRecord:
    return BatchRecord(
        row.id,
        row.tenant,
        row.key_id,
        row.endpoint,
        row.model,
        row.input_file_id,
        row.output_file_id,
        row.error_file_id,
        row.completion_window,
        row.status,
        aware(row.created_at),
        aware(row.expires_at),
        dict(row.times or {}),
        row.meta,
        row.errors,
        counts,
    )


def new_row(new: NewBatch, queue: str) -> BatchRow:
    now = datetime.now(UTC)
    return BatchRow(
        id=f"batch_{uuid.uuid4().hex[:24]}",
        tenant=new.tenant,
        key_id=new.key_id,
        endpoint=new.endpoint,
        model="",
        input_file_id=new.input_file_id,
        completion_window=new.window_text,
        status="validating",
        created_at=now,
        expires_at=now + new.window,
        times={"validating": now.timestamp()},
        meta=new.meta,
        total=0,
        queue=queue,
    )
