"""Usage recording: every finished request becomes a record, written to the store in batches off the loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable

from corral.store import UsageRecord, UsageStore

__all__ = ["UsageRecorder"]

logger = logging.getLogger(__name__)

_BATCH = 500


class UsageRecorder:
    """Buffers records for the store, at most `max_pending` of them: while the store is down the oldest are
    dropped (counted in `dropped` and logged) rather than growing the gateway's memory without bound."""

    def __init__(
        self,
        store: UsageStore,
        flush_interval: float,
        max_pending: int = 100_000,
        on_written: Callable[[list[UsageRecord]], None] | None = None,
    ) -> None:
        self._store = store
        self._on_written = on_written  # told which records reached the store (budgets stop counting them)
        self._interval = flush_interval
        self._max = max_pending
        self._pending: deque[UsageRecord] = deque()
        self._task: asyncio.Task[None] | None = None
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
        self.dropped += count

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="usage-writer")

    async def stop(self) -> None:
        """Write what is left (shutdown drains usage too). A store that is down by then cannot be waited for:
        what it could not take is counted in `dropped` and logged, and shutdown goes on."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            while self._pending:
                await self.flush()
        except Exception:  # logged in flush
            logger.error("usage store unreachable at shutdown: %d records not written", self.pending)
            self.dropped += self.pending
            self._pending.clear()

    async def flush(self) -> None:
        batch = [self._pending.popleft() for _ in range(min(_BATCH, len(self._pending)))]
        if not batch:
            return
        try:
            await asyncio.to_thread(self._store.write, batch)
        except Exception:  # the database is down: keep the records and try again next round
            logger.exception("writing %d usage records failed; will retry", len(batch))
            self._pending.extendleft(reversed(batch))
            if len(self._pending) > self._max:
                self._drop(len(self._pending) - self._max)
            raise
        if self._on_written is not None:
            self._on_written(batch)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                while self._pending:
                    await self.flush()
            except Exception:  # logged in flush; keep the writer alive
                await asyncio.sleep(self._interval)
