"""A finished batch's output and error files, written from its lines' results as OpenAI's are: a line per
answered request in the output file, a line per request that failed, was cancelled or expired in the error
file.

They are written unlinked (store/files.py: no read finds them, a few parts a transaction, so SQLite's one
write lock is never held for long), then linked in the transaction that moves the batch's status."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from tempfile import SpooledTemporaryFile
from typing import IO, Any

import orjson

from corral.batch.queue import ResultRow
from corral.store.batch_rows import BatchRow
from corral.store.files import FileStore, NewFile

__all__ = ["Results", "write_results"]

_SPOOL_BYTES = 8 * 1024 * 1024  # a result file larger than this is spooled to a temporary file


@dataclass(frozen=True)
class Results:
    """A batch's output and error files, written unlinked (None for one without lines), and its counts."""

    output_id: str | None
    error_id: str | None
    counts: dict[str, int]
    expires_at: datetime | None  # what `link` sets

    @property
    def file_ids(self) -> list[str]:
        return [file_id for file_id in (self.output_id, self.error_id) if file_id is not None]


def write_results(
    files: FileStore, row: BatchRow, results: Iterable[ResultRow], expiry: timedelta | None
) -> Results:
    """The batch's output and error files, written unlinked, and its counts. The results are read to the
    end first (a few at a time) and the files are spooled to disk past `_SPOOL_BYTES`: a batch's results
    (an embeddings batch's vectors) may be larger than a gateway's memory. A failure part-way discards
    what was written."""
    now = datetime.now(UTC)
    expires_at = now + expiry if expiry is not None else None
    ids: list[str | None] = []
    with SpooledTemporaryFile(_SPOOL_BYTES) as output, SpooledTemporaryFile(_SPOOL_BYTES) as errors:
        counts = _result_files(results, output, errors)
        try:
            for kind, spool in (("output", output), ("error", errors)):
                size = spool.tell()
                if not size:
                    ids.append(None)
                    continue
                spool.seek(0)
                name = f"{row.id}_{kind}.jsonl"
                ids.append(
                    files.write_unlinked(NewFile(row.tenant, "batch_output", name, spool, size, None, now))
                )
        except BaseException:
            files.discard_quietly([file_id for file_id in ids if file_id is not None])
            raise
    return Results(ids[0], ids[1], counts, expires_at)


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
