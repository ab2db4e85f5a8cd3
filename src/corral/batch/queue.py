"""The line queue's contract: what a runner leases and commits, and the queue behind it (SQL rows in
queue_sql.py, the default; Redis Streams in queue_redis.py with `batch.queue: redis`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, Protocol

from sqlalchemy.orm import Session

__all__ = ["LOST", "RESULTS_AT_ONCE", "BatchLine", "LineQueue", "LineResult", "ResultRow", "Stop"]

LOST = -1  # settle's answer for a batch whose lines the queue no longer has

Stop = Literal["cancel", "expire"]
ResultRow = tuple[str, str, int | None, str | None]  # custom_id, state, status code, stored response
RESULTS_AT_ONCE = 500  # lines' results read from the queue's store at a time


@dataclass(frozen=True)
class BatchLine:
    """A leased line: what to run, and for whom. The queue fills the line's own fields; the store adds
    the batch's (endpoint, tenant, key)."""

    batch_id: str
    line: int
    custom_id: str
    body: bytes
    endpoint: str
    tenant: str
    key_id: str | None
    attempts: int  # this lease included
    token: str = ""  # the queue's handle on the lease (a Redis stream entry id)
    model: str = ""


@dataclass(frozen=True)
class LineResult:
    status_code: int
    body: bytes  # the answer (or an OpenAI error body)
    request_id: str


class LineQueue(Protocol):
    """Lines of in-progress batches: leased, committed under the lease, released, settled. Methods that
    take a session run inside the store's transaction on the batch row; `settle` answers how many lines
    are still to run, or LOST (-1) when the queue no longer has the batch's lines."""

    name: str  # "sql" or "redis": a batch is run by the gateways on the queue it was created on

    def add(
        self, session: Session, batch_id: str, model: str, tenant: str, lines: list[tuple[str, bytes]]
    ) -> None: ...

    def lease(
        self, owner: str, model: str, limit: int, lease_s: float, max_attempts: int
    ) -> list[BatchLine]: ...

    def commit_many(self, owner: str, results: list[tuple[BatchLine, LineResult]]) -> list[int]:
        """Keep each result whose line `owner` still holds; the indices (in `results`) of those kept."""
        ...

    def release(self, owner: str, line: BatchLine, after_s: float, undo_attempt: bool = False) -> None: ...

    def renew(self, owner: str, lines: list[BatchLine], lease_s: float) -> None: ...

    def cancel(self, batch_id: str) -> None: ...

    def settle(self, session: Session, batch_id: str, model: str, stop: Stop | None, now: float) -> int: ...

    def results(self, session: Session, batch_id: str) -> Iterator[ResultRow]:
        """Each line's result in line order, a few at a time (a batch's results may outgrow memory)."""
        ...

    def counts(self, session: Session, batch_ids: list[str]) -> dict[str, dict[str, int]]: ...

    def drop(self, batch_id: str) -> None: ...

    def tidy(self, unfinished: Callable[[list[str]], set[str]]) -> int:
        """Drop what the queue holds for batches finished or gone; how many batches. `unfinished(ids)`:
        which of those batches are unfinished, read now (a snapshot read before the queue is scanned misses
        the batches created since, whose lines are being queued)."""
        ...
