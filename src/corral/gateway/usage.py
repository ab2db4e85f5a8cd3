"""Usage recording: every finished request becomes a record, written to the store in batches off the loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from corral.store import UsageRecord, UsageStore

__all__ = ["UsageRecorder"]

logger = logging.getLogger(__name__)

_BATCH = 500


class UsageRecorder:
    def __init__(self, store: UsageStore, flush_interval: float) -> None:
        self._store = store
        self._interval = flush_interval
        self._pending: list[UsageRecord] = []
        self._task: asyncio.Task[None] | None = None
        self._flushed = asyncio.Event()

    def record(self, record: UsageRecord) -> None:
        self._pending.append(record)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="usage-writer")

    async def stop(self) -> None:
        """Write what is left (shutdown drains usage too)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        while self._pending:
            await self.flush()

    async def flush(self) -> None:
        batch, self._pending = self._pending[:_BATCH], self._pending[_BATCH:]
        if not batch:
            return
        try:
            await asyncio.to_thread(self._store.write, batch)
        except Exception:  # the database is down: keep the records and try again next round
            logger.exception("writing %d usage records failed; will retry", len(batch))
            self._pending[:0] = batch
            raise

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                while self._pending:
                    await self.flush()
            except Exception:  # logged in flush; keep the writer alive
                await asyncio.sleep(self._interval)
