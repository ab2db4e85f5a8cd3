"""Usage recording: every finished request becomes a record, written to the store in batches off the loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from corral.store import UsageRecord, UsageStore, store_is_down

if TYPE_CHECKING:
    from corral.gateway.metrics import UsageMetrics

__all__ = ["UsageRecorder"]

logger = logging.getLogger(__name__)

_BATCH = 500


class UsageRecorder:
    """Buffers records for the store, at most `max_pending` of them: while the store is down the oldest are
    dropped (counted in `dropped` and logged) rather than growing the gateway's memory without bound. An
    outage is logged when it starts and when the store answers again, not on every retry; `metrics`
    (corral_usage_pending, corral_usage_dropped_total, corral_store_errors_total{use="usage_write"}) let
    an alert say so."""

    def __init__(
        self,
        store: UsageStore,
        flush_interval: float,
        max_pending: int = 100_000,
        on_written: Callable[[list[UsageRecord]], None] | None = None,
        metrics: UsageMetrics | None = None,
    ) -> None:
        self._store = store
        self._on_written = on_written  # told which records reached the store (budgets stop counting them)
        self._interval = flush_interval
        self._max = max_pending
        self._pending: deque[UsageRecord] = deque()
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._metrics = metrics
        self._failing = False
        self.dropped = 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    def record(self, record: UsageRecord) -> None:
        self._pending.append(record)
        if len(self._pending) > self._max:
            self._drop(len(self._pending) - self._max)

    def _drop(self, count: int) -> None:
        for _ in range(count):
            self._pending.popleft()
        if self.dropped // 1000 != (self.dropped + count) // 1000 or not self.dropped:
            logger.error("the usage store is unreachable and %d records wait: dropping the oldest", self._max)
        self._lost(count)

    def _lost(self, count: int) -> None:
        """Records that will never be written: counted here and in corral_usage_dropped_total."""
        self.dropped += count
        if self._metrics is not None:
            self._metrics.dropped.inc(count)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="usage-writer")

    async def stop(self) -> None:
        """Write what is left (shutdown drains usage too). A store that is down by then cannot be waited for:
        what it could not take is counted in `dropped` and logged, and shutdown goes on."""
        if self._task is not None:  # (not cancelled: a write under way would end in its thread after this)
            self._stopping.set()
            await self._task
        try:
            while self._pending:
                await self.flush()
        except Exception:  # logged in flush
            logger.error("usage store unreachable at shutdown: %d records not written", self.pending)
            self._lost(self.pending)
            self._pending.clear()

    async def flush(self) -> None:
        batch = [self._pending.popleft() for _ in range(min(_BATCH, len(self._pending)))]
        if not batch:
            return
        try:
            await asyncio.to_thread(self._store.write, batch)
        except Exception as exc:
            if not store_is_down(exc):  # the store refuses a record (a bug): the others must not wait on it
                logger.exception(
                    "the usage store refused a batch of %d records: writing each alone", len(batch)
                )
                batch = await asyncio.to_thread(self._each_alone, batch)
                if self._on_written is not None:
                    self._on_written(batch)
                return
            # the database is down: keep the records and try again next round
            if self._metrics is not None:
                self._metrics.failed_writes.inc()
            if not self._failing:  # (once an outage: the writer retries every flush interval)
                self._failing = True
                logger.error("writing usage records failed, retrying every %gs: %s", self._interval, exc)
            self._pending.extendleft(reversed(batch))
            if len(self._pending) > self._max:
                self._drop(len(self._pending) - self._max)
            raise
        if self._failing:
            self._failing = False
            logger.warning("the usage store answers again: %d records still to write", len(self._pending))
        if self._on_written is not None:
            self._on_written(batch)

    def _each_alone(self, batch: list[UsageRecord]) -> list[UsageRecord]:
        """Write each record of a refused batch alone; those refused again are dropped (logged, counted).
        The ones written."""
        written = []
        for record in batch:
            try:
                self._store.write([record])
            except Exception as exc:
                logger.error("usage record dropped, the store refuses it (%s): %r", exc, record)
                self._lost(1)
            else:
                written.append(record)
        return written

    async def _run(self) -> None:
        while not await self._stopped_within(self._interval):
            try:
                while self._pending:
                    await self.flush()
            except Exception:  # logged in flush; keep the writer alive
                if await self._stopped_within(self._interval):
                    return
            if self._metrics is not None:
                self._metrics.pending.set(len(self._pending))

    async def _stopped_within(self, seconds: float) -> bool:
        """Wait `seconds`, or less where `stop` is called meanwhile: whether it was."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)
        return self._stopping.is_set()
