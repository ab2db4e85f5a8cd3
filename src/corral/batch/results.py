"""A finished batch's output and error files, written from its lines' results as OpenAI's are: a line per
answered request in the output file, a line per request that failed, was cancelled or expired in the error
file."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from tempfile import SpooledTemporaryFile
from typing import IO, Any

import orjson
from sqlalchemy.orm import Session

from corral.batch.queue import ResultRow
from corral.store.batch_rows import BatchRow
from corral.store.files import NewFile, write_file

__all__ = ["write_results"]

_SPOOL_BYTES = 8 * 1024 * 1024  # a result file larger than this is spooled to a temporary file


def write_results(
    session: Session, row: BatchRow, results: Iterable[ResultRow], expiry: timedelta | None
) -> tuple[str | None, str | None, dict[str, int]]:
    """The batch's output and error files (their ids, None for one without lines) and its counts. The
    results come a few at a time and the files are spooled to disk past `_SPOOL_BYTES`: a batch's results
    (an embeddings batch's vectors) may be larger than a gateway's memory."""
    now = datetime.now(UTC)
    expires_at = now + expiry if expiry is not None else None
    ids: list[str | None] = []
    with SpooledTemporaryFile(_SPOOL_BYTES) as output, SpooledTemporaryFile(_SPOOL_BYTES) as errors:
        counts = _result_files(results, output, errors)
        for kind, spool in (("output", output), ("error", errors)):
            size = spool.tell()
            if not size:
                ids.append(None)
                continue
            spool.seek(0)
            name = f"{row.id}_{kind}.jsonl"
            new = NewFile(row.tenant, "batch_output", name, spool, size, expires_at, now)
            ids.append(write_file(session, new).id)
    return ids[0], ids[1], counts


def _result_files(lines: Iterable[ResultRow], output: IO[bytes], errors: IO[bytes]) -> dict[str, int]:
    """Writes OpenAI's output file (a line per answered request: its status and body) and error file (a
    line per request that failed, was cancelled or expired); the batch's counts."""
    counts = {"total": 0, "completed": 0, "failed": 0}
    for custom_id, state, status_code, response in lines:
        counts["total"] += 1
        if state == "done":
            counts["completed"] += 1
        elif state in ("failed", "expired", "cancelled"):
            counts["failed"] += 1
        item: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": custom_id}
        if state in ("done", "failed") and response is not None:
            result = orjson.loads(response)
            item["response"] = {
                "status_code": status_code,
                "request_id": result["request_id"],
                "body": result["body"],
            }
            item["error"] = None
            (output if state == "done" else errors).write(orjson.dumps(item) + b"\n")
        elif state in ("cancelled", "expired"):
            why = "was cancelled" if state == "cancelled" else "expired"
            item["response"] = None
            item["error"] = {"code": f"batch_{state}", "message": f"The batch {why} before this request ran."}
            errors.write(orjson.dumps(item) + b"\n")
    return counts
