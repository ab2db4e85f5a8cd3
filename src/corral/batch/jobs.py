"""Batch jobs in the store: the batches and their files in SQL, their lines in a line queue (SQL rows, or
Redis Streams with `batch.queue: redis`: queue_sql.py, queue_redis.py behind queue.py's LineQueue).

A batch is created `validating`; a runner checks its input file and queues its lines (`in_progress`) or
fails it with an error per bad line. A batch with nothing left to run is finalised: its output and error
files are written unlinked (no read finds them, a few parts a transaction: in one, a 1.5 GiB output held
SQLite's one write lock for 30 s and the other workers' writes failed), then its status, counts and files
are moved in one short transaction, the status only if still unfinished, so two runners finalising at once
produce one set of files. Files a finaliser wrote but never linked (it lost the race, or its gateway died
between) are discarded once their batch is finished (`housekeeping`). Each step is a conditional update
from the status it expects, so a gateway that dies anywhere leaves a batch another one carries on from.
Housekeeping takes each batch on its own: one whose finalising raises is backed off while the others go
on, and failed only after a few permanent errors (retries.py), its results so far written or kept. A
running batch's results are counted in its row as they are kept (`result_bytes`, from nothing at each
start): its tenant's files quota counts them.

No queue library fits both backends and these semantics (procrastinate and pgqueuer are PostgreSQL-only,
saq and arq Redis-only, none gives exactly-one result per line over SQLite), so the SQL is kept small here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

from sqlalchemy import Engine, and_, delete, exists, func, or_, select, update
from sqlalchemy.exc import DBAPIError, IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session

from corral.batch.queue import LOST, BatchLine, LineQueue, LineResult, ResultRow, Stop
from corral.batch.queue_sql import SqlLines
from corral.batch.records import BatchRecord, NewBatch, empty_counts, new_row, record
from corral.batch.results import write_results
from corral.batch.retries import Retries
from corral.store import store_is_down
from corral.store.batch_rows import FINISHED, RESULTS_KEPT, BatchRow, aware, changed, keeps_lines
from corral.store.files import FileRow, FileStore, lock_tenant

__all__ = ["BatchRecord", "BatchStore", "NewBatch", "TooManyBatches"]

logger = logging.getLogger(__name__)


class TooManyBatches(Exception):
    """The tenant has as many unfinished batches as it may."""


_NONE_YET = {"total": 0, "completed": 0, "failed": 0}
_NOT_YET_S = 2.0  # a line leased while its batch was not in progress goes back for this long
_ORPHANS_S = 600.0
_RESULT_WRAPPER = 128  # an output line's bytes around its answer: ids, status, request id


class BatchStore:
    """Blocking access to files, batches and their lines (the gateway calls it from threads)."""

    def __init__(
        self,
        engine: Engine,
        lines: LineQueue | None = None,
        file_expiry: timedelta | None = None,
        retries: Retries | None = None,
    ) -> None:
        """`retries`: how a batch whose finalising (or expiry) raises is backed off and, after its tries,
        failed (housekeeping runs in one process at a time: the first gateway worker)."""
        self._engine = engine
        self._retries = retries or Retries()
        self._file_expiry = file_expiry  # of the output and error files it writes
        self._postgres = engine.dialect.name == "postgresql"
        self.files = FileStore(engine)  # inputs, and the output and error files it writes
        self._orphans_due = 0.0  # (monotonic) when housekeeping next looks for parts whose file is gone
        self._sql = SqlLines(engine)  # also counts the lines of batches finished before `counts` was kept
        self.lines: LineQueue = lines or self._sql
        self._pending = (  # built once: constructing the statement cost as much as running it
            select(BatchRow.status, BatchRow.model)
            .where(BatchRow.status.in_(("validating", "in_progress")), self._mine())
            .distinct()
        )

    def _mine(self) -> Any:
        """The batches this store runs: those created on its queue (rows from before `queue`: SQL)."""
        if self.lines.name == "sql":
            return BatchRow.queue.is_(None) | (BatchRow.queue == "sql")
        return BatchRow.queue == self.lines.name

    # batches

    def create_batch(self, new: NewBatch, max_active: int | None = None) -> BatchRecord:
        """A batch whose input is still to be checked (`validating`): a runner starts or fails it.
        `max_active`: the unfinished batches its tenant may have with it (TooManyBatches past it)."""
        row = new_row(new, self.lines.name)
        with Session(self._engine, expire_on_commit=False) as session, session.begin():
            if max_active is not None:
                lock_tenant(session, new.tenant)
                active = session.scalar(
                    select(func.count())
                    .select_from(BatchRow)
                    .where(BatchRow.tenant == new.tenant, BatchRow.status.not_in(FINISHED))
                )
                if (active or 0) >= max_active:
                    raise TooManyBatches(
                        f"Tenant '{new.tenant}' has {active} unfinished batches, its limit; wait for one to "
                        "finish or cancel one."
                    )
            session.add(row)
        found = self.batch(new.tenant, row.id)
        assert found is not None
        return found

    def forget_finished(self, before: datetime, limit: int = 1000) -> int:
        """Delete finished batches whose window ended before `before` (a window's end plus the files'
        expiry) and whose output and error files are gone (a batch finished late keeps them longer), at
        most `limit`; how many. A tenant making and cancelling batches in a loop would otherwise grow the
        table for good."""
        files = FileRow.id.in_([BatchRow.output_file_id, BatchRow.error_file_id])
        with Session(self._engine) as session, session.begin():
            ids = session.scalars(
                select(BatchRow.id)
                .where(BatchRow.status.in_(FINISHED), BatchRow.expires_at <= before, self._mine())
                .where(~exists().where(files))
                .limit(limit)
            ).all()
            if ids:
                session.execute(delete(BatchRow).where(BatchRow.id.in_(ids)))
        return len(ids)

    def validating(self) -> list[BatchRecord]:
        with Session(self._engine, expire_on_commit=False) as session:
            rows = session.scalars(
                select(BatchRow)
                .where(BatchRow.status == "validating", self._mine())
                .order_by(BatchRow.created_at)
            ).all()
            return [record(row, empty_counts(row)) for row in rows]

    def start(self, batch_id: str, model: str, lines: list[tuple[str, bytes]]) -> bool:
        """Queue a checked batch's lines and set it in progress; False if its status moved meanwhile (it
        was cancelled, or another runner started it)."""
        try:
            with Session(self._engine, expire_on_commit=False) as session, session.begin():
                row = session.get(BatchRow, batch_id, with_for_update=self._postgres)
                if row is None or row.status != "validating":
                    return False
                self.lines.add(session, batch_id, model, row.tenant, lines)
                session.flush()
                # (result_bytes from nothing: a batch queued again after Redis lost its lines runs them all
                # again, and its first run's count made each result count twice)
                self._move(session, row, "in_progress", model=model, total=len(lines), result_bytes=0)
        except (_Raced, IntegrityError):  # another runner queued them first
            return False
        except DBAPIError as exc:  # a value the store cannot hold: it never will, so the batch fails
            if store_is_down(exc):
                raise
            logger.error("batch %s: the store refused its lines; failing it", batch_id, exc_info=True)
            self._not_queued(batch_id)
            return False
        return True

    def _not_queued(self, batch_id: str) -> None:
        """Fail a batch whose lines the store refused (what the line queue holds of them goes)."""
        message = (
            "The batch's requests could not be queued: the store refused them (a value it cannot hold). "
            "Check the input file, or ask the operator: the gateway's log names the error."
        )
        self.fail(batch_id, [{"code": "batch_not_queued", "message": message, "param": None, "line": None}])
        try:
            self.lines.drop(batch_id)
        except Exception:  # (the queue down: `tidy` drops them when a runner starts)
            logger.warning("batch %s: dropping its queued lines failed", batch_id, exc_info=True)

    def fail(self, batch_id: str, errors: list[dict[str, Any]]) -> bool:
        """A batch whose input did not pass fails at once, an error per bad line (OpenAI's behaviour)."""
        return self._unchecked_to(batch_id, "failed", errors=errors)

    def _unchecked_to(self, batch_id: str, status: str, **values: Any) -> bool:
        """A `validating` batch finished without lines (failed, or expired before it was checked)."""
        try:
            with Session(self._engine, expire_on_commit=False) as session, session.begin():
                row = session.get(BatchRow, batch_id, with_for_update=self._postgres)
                if row is None or row.status != "validating":
                    return False
                finalizing = status == "expired"
                self._move(session, row, status, finalizing=finalizing, counts=dict(_NONE_YET), **values)
        except _Raced:
            return False
        return True

    @staticmethod
    def _move(session: Session, row: BatchRow, status: str, finalizing: bool = False, **values: Any) -> None:
        """`row` to `status`, only if no one moved it meanwhile (else the transaction rolls back)."""
        now = time.time()
        times = {**row.times, status: now, **({"finalizing": now} if finalizing else {})}
        moved = session.execute(
            update(BatchRow)
            .where(BatchRow.id == row.id, BatchRow.status == row.status)
            .values(status=status, times=times, **values)
        )
        if not changed(moved):
            raise _Raced

    def batch(self, tenant: str | None, batch_id: str) -> BatchRecord | None:
        with Session(self._engine, expire_on_commit=False) as session:
            row = session.get(BatchRow, batch_id)
            if row is None or (tenant is not None and row.tenant != tenant):
                return None
            return record(row, self._counts(session, [row])[row.id])

    def batches(self, tenant: str, limit: int, after: str | None) -> list[BatchRecord]:
        """A page of the tenant's batches, newest first, after the one named (none after an id it does not
        have), read a page at a time: batches are kept, so a tenant's list only grows."""
        with Session(self._engine, expire_on_commit=False) as session:
            query = select(BatchRow).where(BatchRow.tenant == tenant)
            if after is not None:
                anchor = session.get(BatchRow, after)
                if anchor is None or anchor.tenant != tenant:
                    return []
                query = query.where(
                    or_(
                        BatchRow.created_at < anchor.created_at,
                        and_(BatchRow.created_at == anchor.created_at, BatchRow.id > anchor.id),
                    )
                )
            found = session.scalars(
                query.order_by(BatchRow.created_at.desc(), BatchRow.id).limit(limit)
            ).all()
            counts = self._counts(session, found)
            return [record(r, counts[r.id]) for r in found]

    def _counts(self, session: Session, rows: Sequence[BatchRow]) -> dict[str, dict[str, int]]:
        """Kept in the row once finished; from the lines' states before, in the batch's queue (a queue
        that does not answer: the totals alone, logged)."""
        live: dict[str, dict[str, int]] = {}
        for queue in {self._sql, self.lines}:
            ids = [
                r.id
                for r in rows
                if r.counts is None and r.status != "validating" and _queue(r) == queue.name
            ]
            try:
                live.update(queue.counts(session, ids) if ids else {})
            except Exception:  # Redis is down: reading a batch still answers
                logger.warning("batch counts from the %s queue failed", queue.name, exc_info=True)
        return {r.id: r.counts or live.get(r.id) or empty_counts(r) for r in rows}

    def cancel(self, tenant: str, batch_id: str) -> BatchRecord | None:
        """Cancelling: pending lines are cancelled; leased ones finish; finalised as cancelled after."""
        for _ in range(3):  # a batch that moved on meanwhile (validating → in progress) is cancelled still
            try:
                with Session(self._engine, expire_on_commit=False) as session, session.begin():
                    row = session.get(BatchRow, batch_id, with_for_update=self._postgres)
                    if row is None or row.tenant != tenant:
                        return None
                    moving = row.status in ("validating", "in_progress")
                    if moving:
                        self._move(session, row, "cancelling")
                    mine = _queue(row) == self.lines.name
            except _Raced:
                continue
            if moving and mine:  # after the commit: housekeeping settles it anyway (a crash, Redis down)
                try:
                    self.lines.cancel(batch_id)
                except Exception:
                    logger.warning("batch %s: cancelling its queued lines failed", batch_id, exc_info=True)
            break
        return self.batch(tenant, batch_id)

    # the runner's side

    def lease(
        self, owner: str, model: str, limit: int, lease_s: float, max_attempts: int = 5
    ) -> list[BatchLine]:
        """Up to `limit` runnable lines of in-progress batches for `model` (from the line queue), with their
        batch's endpoint, tenant and key."""
        if limit <= 0:
            return []
        found = self.lines.lease(owner, model, limit, lease_s, max_attempts)
        if not found:
            return []
        with Session(self._engine, expire_on_commit=False) as session:
            ids = {line.batch_id for line in found}
            rows = {r.id: r for r in session.scalars(select(BatchRow).where(BatchRow.id.in_(ids))).all()}
        leased, now = [], time.time()
        for line in found:
            row = rows.get(line.batch_id)
            # settled by housekeeping, queued again, or past its window (housekeeping expires the line)
            if row is None or row.status != "in_progress" or aware(row.expires_at).timestamp() <= now:
                self.lines.release(owner, line, _NOT_YET_S, undo_attempt=True)
                continue
            leased.append(replace(line, endpoint=row.endpoint, tenant=row.tenant, key_id=row.key_id))
        return leased

    def commit(self, owner: str, line: BatchLine, result: LineResult) -> bool:
        """The line's result, kept only while `owner` still holds its lease (exactly one result a line)."""
        return bool(self.commit_many(owner, [(line, result)]))

    def commit_many(self, owner: str, results: list[tuple[BatchLine, LineResult]]) -> int:
        """Several lines' results at once (the runner's per-tick flush); how many were kept. The size of
        those kept (a result whose lease lapsed is not: another runner's is) is added to their batches'
        `result_bytes`, in the commit's transaction where the lines are in SQL: the tenant's files quota
        counts a running batch's results."""
        if not results:
            return 0
        if self.lines is self._sql:
            return len(self._sql.commit_many(owner, results, count=_count_results))
        kept = self.lines.commit_many(owner, results)
        if kept:
            try:
                with Session(self._engine) as session, session.begin():
                    _count_results(session, [results[i] for i in kept])
            except SQLAlchemyError:  # logged and left short: the results are kept all the same
                logger.warning("batches: counting %d results' bytes failed", len(kept), exc_info=True)
        return len(kept)

    def release(self, owner: str, line: BatchLine, after_s: float = 0.0, undo_attempt: bool = False) -> None:
        """Give a leased line back: pending again, runnable `after_s` from now (a retry's backoff);
        `undo_attempt`: the try its lease counted did not happen (the runner is shutting down)."""
        self.lines.release(owner, line, after_s, undo_attempt)

    def renew(self, owner: str, lines: list[BatchLine], lease_s: float) -> None:
        """Extend the leases of lines still running (so a long line is not taken over)."""
        if lines:
            self.lines.renew(owner, lines, lease_s)

    def pending(self) -> tuple[bool, list[str]]:
        """What a runner's tick asks, in one query (the gateway asks it every `poll_s`, mostly of an empty
        table): whether any batch waits to be checked, and the models with batches in progress."""
        with self._engine.connect() as connection:
            rows = connection.execute(self._pending).all()
        models = sorted({model for status, model in rows if status == "in_progress" and model})
        return any(status == "validating" for status, _ in rows), models

    def housekeeping(self) -> list[str]:
        """Expire batches past their window; finalise those with nothing left to run; delete files past
        their expiry, and finished batches whose files have expired. The ids finished."""
        now = datetime.now(UTC)
        if swept := self.files.sweep_expired(now):
            logger.info("files: deleted %d past their expiry", swept)
        if discarded := self._discard_unlinked():
            logger.info("batch files: discarded %d written but never given to their batch", discarded)
        if time.monotonic() >= self._orphans_due and (dropped := self._drop_orphans()):
            logger.info("files: deleted %d parts whose file was gone", dropped)
        if self._file_expiry is not None and (forgotten := self.forget_finished(now - self._file_expiry)):
            logger.info("batches: deleted %d finished ones whose files have expired", forgotten)
        with Session(self._engine, expire_on_commit=False) as session:
            open_ids = session.scalars(
                select(BatchRow.id).where(BatchRow.status.in_(("in_progress", "cancelling")), self._mine())
            ).all()
            stale = session.scalars(  # never checked within its window (its model was never served)
                select(BatchRow.id).where(
                    BatchRow.status == "validating", BatchRow.expires_at <= now, self._mine()
                )
            ).all()
        self._retries.keep([*open_ids, *stale])
        expired = [i for i in stale if self._guarded(i, partial(self._unchecked_to, i, "expired"))]
        return expired + [i for i in open_ids if self._guarded(i, partial(self._finish, i))]

    def _guarded(self, batch_id: str, step: Callable[[], bool]) -> bool:
        """A batch's housekeeping `step` on its own: one that raises is logged and backed off (the other
        batches go on), and a batch whose step keeps failing is failed with an error, not tried for good
        (a result file the store refuses was written again every pass, 2 GB at a time)."""
        if not self._retries.due(batch_id):
            return False
        try:
            done = step()
        except Exception as exc:  # (a housekeeping loop: logged, the batch tried again after a backoff)
            if not self._retries.failed(batch_id, exc):
                logger.warning("batch %s: finalising failed; tried again later", batch_id, exc_info=True)
                return False
            logger.error("batch %s: finalising failed again; failing it", batch_id, exc_info=True)
            return self._give_up(batch_id)
        self._retries.forget(batch_id)
        return done

    def _give_up(self, batch_id: str) -> bool:
        """Fail a batch whose finalising (or expiry) kept failing with a permanent error (retries.py), its
        results so far kept (never dropped unwritten); whether it was failed."""
        try:
            failed = self._unchecked_to(batch_id, "failed", errors=[_error("")])  # (its expiry: no lines)
            failed = failed or self._fail_keeping_results(batch_id)
        except Exception:  # tried again once its backoff is over
            logger.exception("batch %s: failing it failed too", batch_id)
            return False
        self._retries.forget(batch_id)
        return failed

    def _fail_keeping_results(self, batch_id: str) -> bool:
        """An open batch failed with its results so far written as its output and error files (its lines
        then go), or, where they cannot be written, kept in the line queue for the operator (an error
        says so: `tidy` keeps them until the batch is forgotten); whether it was failed."""
        try:
            written = self._fail_open(batch_id, [_error(" Its results so far are in its files.")], True)
        except Exception:
            logger.error(
                "batch %s: its results could not be written; kept in its queue", batch_id, exc_info=True
            )
            kept = self._fail_open(batch_id, [_error(_KEPT_TOLD), _KEPT], write=False)
            if kept:
                try:
                    self.lines.cancel(batch_id)  # (none left to run; those with results stay)
                except Exception:
                    logger.warning("batch %s: cancelling its queued lines failed", batch_id, exc_info=True)
            return kept
        if written:
            try:
                self.lines.drop(batch_id)
            except Exception:  # (`tidy` drops them when a runner starts)
                logger.warning("batch %s: dropping its lines failed", batch_id, exc_info=True)
        return written

    def _fail_open(self, batch_id: str, errors: list[dict[str, Any]], write: bool) -> bool:
        """An in-progress or cancelling batch to `failed`: with its output and error files written from
        the results so far (`write`), or with its counts alone, kept from its lines."""
        if write:
            with Session(self._engine, expire_on_commit=False) as session:
                row = session.get(BatchRow, batch_id)
            return row is not None and row.status in _OPEN and self._finalise(row, "failed", errors=errors)
        try:
            with Session(self._engine, expire_on_commit=False) as session, session.begin():
                row = session.get(BatchRow, batch_id, with_for_update=self._postgres)
                if row is None or row.status not in _OPEN:
                    return False
                counts = self._counts(session, [row])[row.id]
                self._move(session, row, "failed", finalizing=True, errors=errors, counts=counts)
        except _Raced:
            return False
        return True

    def tidy(self) -> int:
        """What the queue holds for batches no longer running (a gateway died between finalising a batch
        and dropping its lines), and file parts whose file is gone; how many batches' lines were dropped.
        A finished batch of a store from before its row kept its counts has them counted from its lines
        first (they go)."""
        self._drop_orphans()
        with Session(self._engine, expire_on_commit=False) as session, session.begin():
            finished = session.execute(
                select(BatchRow.id, BatchRow.counts).where(BatchRow.status.in_(FINISHED), self._mine())
            ).all()
            uncounted = [batch_id for batch_id, counts in finished if counts is None]  # (SQL or JSON null)
            counted = self.lines.counts(session, uncounted) if uncounted else {}
            for batch_id, counts in counted.items():
                session.execute(update(BatchRow).where(BatchRow.id == batch_id).values(counts=counts))
        return self.lines.tidy(self._unfinished)

    def _drop_orphans(self) -> int:
        """The parts of files whose row is gone (a gateway died deleting them), looked for at start-up and
        every `_ORPHANS_S` (a scan of the parts' index: 40 ms for 200,000 parts); how many were deleted."""
        self._orphans_due = time.monotonic() + _ORPHANS_S
        return self.files.drop_orphans()

    def _unfinished(self, batch_ids: list[str]) -> set[str]:
        """Which of these batches are unfinished now (the queue keeps their lines)."""
        with Session(self._engine) as session:
            return set(
                session.scalars(select(BatchRow.id).where(BatchRow.id.in_(batch_ids), keeps_lines())).all()
            )

    def _finish(self, batch_id: str) -> bool:
        """Finalise the batch if nothing is left to run: its lines settled in one short transaction, then
        its files, counts and status (`_finalise`)."""
        now = time.time()
        try:
            with Session(self._engine, expire_on_commit=False) as session, session.begin():
                row = session.get(BatchRow, batch_id, with_for_update=self._postgres)
                if row is None or row.status not in _OPEN:
                    return False
                stop = _stop(row, now)
                busy = self.lines.settle(session, batch_id, row.model, stop, now)
                if busy == LOST and stop is None:  # the queue lost its lines: queued again from the file
                    logger.warning("batch %s: the line queue lost its lines; queuing them again", batch_id)
                    self._move(session, row, "validating")
                    return False
                if busy > 0:
                    return False
        except _Raced:
            return False
        final = {"expire": "expired", "cancel": "cancelled", None: "completed"}[stop]
        if not self._finalise(row, final):
            return False
        self.lines.drop(batch_id)
        return True

    def _finalise(self, row: BatchRow, final: str, **values: Any) -> bool:
        """Write the batch's output and error files unlinked from its results (read apart, before), then in
        one short transaction link them and move the batch from the status `row` has to `final` with its
        counts; whether it moved. A batch moved meanwhile has the files discarded (so has one whose move
        raised); a gateway that dies between leaves them to `_discard_unlinked`."""
        written = write_results(self.files, row, self._results(row.id), self._file_expiry)
        try:
            with Session(self._engine, expire_on_commit=False) as session, session.begin():
                # (the files first: a write takes SQLite's lock, where a read first could not upgrade)
                linked = self.files.link(session, written.file_ids, written.expires_at)
                current = session.get(BatchRow, row.id, with_for_update=self._postgres)
                if not linked or current is None or current.status != row.status:
                    raise _Raced
                files = {"output_file_id": written.output_id, "error_file_id": written.error_id}
                self._move(session, current, final, finalizing=True, counts=written.counts, **files, **values)
        except BaseException as exc:
            self.files.discard_quietly(written.file_ids)
            if isinstance(exc, _Raced):
                return False
            raise
        return True

    def _results(self, batch_id: str) -> Iterator[ResultRow]:
        """The batch's results, in a session of their own, closed once they are read (before the files
        are written: an open read kept SQLite's log from being checkpointed)."""
        with Session(self._engine) as session:
            yield from self.lines.results(session, batch_id)

    def _discard_unlinked(self) -> int:
        """Files written for a batch's finalising but never linked, whose batch is no longer open (their
        gateway died before linking them, or another runner finished the batch first); how many."""
        found = self.files.unlinked()
        if not found:
            return 0
        batch_ids = {_batch_of(name) for _, name in found}
        with Session(self._engine) as session:
            open_ids = set(
                session.scalars(
                    select(BatchRow.id).where(BatchRow.id.in_(batch_ids), BatchRow.status.in_(_OPEN))
                )
            )
        return self.files.discard_unlinked([i for i, name in found if _batch_of(name) not in open_ids])


def _count_results(session: Session, kept: list[tuple[BatchLine, LineResult]]) -> None:
    """Add the kept results' size (about their output lines') to their batches' rows."""
    sizes: dict[str, int] = {}
    for line, result in kept:
        size = len(result.body) + len(line.custom_id.encode()) + _RESULT_WRAPPER
        sizes[line.batch_id] = sizes.get(line.batch_id, 0) + size
    for batch_id in sorted(sizes):  # (rows locked in one order: two runners never deadlock)
        session.execute(
            update(BatchRow)
            .where(BatchRow.id == batch_id)
            .values(result_bytes=func.coalesce(BatchRow.result_bytes, 0) + sizes[batch_id])
        )


def _error(more: str) -> dict[str, Any]:
    message = (
        f"The batch could not be finalised, after several tries; the gateway's log names the error.{more}"
    )
    return {"code": "finalizing_failed", "message": message, "param": None, "line": None}


# a failed batch whose results could not be written: its lines stay in the queue (`tidy` keeps them) until
# the batch is forgotten, its window and its files' expiry past
_KEPT_TOLD = " Its results could not be written to files: the gateway keeps them; ask the operator."
_KEPT = {"code": RESULTS_KEPT, "message": _KEPT_TOLD.strip(), "param": None, "line": None}


_OPEN = ("in_progress", "cancelling")  # a batch's statuses while it has lines, until it is finalised


def _batch_of(file_name: str) -> str:
    """The batch a result file was written for (named `{batch id}_output.jsonl` or `_error.jsonl`)."""
    return file_name.rsplit("_", 1)[0]


def _stop(row: BatchRow, now: float) -> Stop | None:
    if row.status == "cancelling":
        return "cancel"
    return "expire" if aware(row.expires_at).timestamp() <= now else None


class _Raced(Exception):
    """Another runner moved the batch first: roll this step back."""


def _queue(row: BatchRow) -> str:
    return row.queue or "sql"
