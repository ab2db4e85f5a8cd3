"""The batch runner: leases lines from the durable queue and runs them on spare capacity only.

Each tick it looks at every model with batches in progress and takes as many lines as its ready replicas
have free slots, less what interactive requests hold or wait for and a headroom (`batch.headroom` slots a
model), so an interactive request never queues behind a batch line. A line goes through the gateway's
own pipeline (parse, authorize, queue at the lowest priority, route, relay, settle: usage is recorded per
line) and its result is committed under its lease (store/batch.py). A line the cluster could not take
now (429, 5xx, a timeout) goes back to pending and is tried again, up to `batch.max_attempts`; a line
the engine refused (its 4xx) is an error line. Stopping hands leased lines back at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Callable
from typing import Protocol

import orjson

from corral.admission import Principal
from corral.config import BatchSettings
from corral.routing import ReplicaSet
from corral.store import KeyStore
from corral.store.batch import BatchLine, BatchStore, LineResult

__all__ = ["BatchRunner", "LineExecutor"]

logger = logging.getLogger(__name__)

_RETRY = frozenset({408, 429, 500, 502, 503, 504})  # the cluster's state, not the line's fault
_HOUSEKEEPING_S = 2.0


class LineExecutor(Protocol):
    """Runs one request as the gateway would (the pipeline)."""

    async def run_line(self, principal: Principal, path: str, body: bytes) -> tuple[int, bytes]: ...


class BatchRunner:
    """Owns the leases it takes; one per gateway that runs batches."""

    def __init__(
        self,
        store: BatchStore,
        executor: LineExecutor,
        keys: KeyStore,
        replicas: ReplicaSet,
        waiting: Callable[[], dict[str, int]],
        settings: BatchSettings,
    ) -> None:
        self._store = store
        self._executor = executor
        self._keys = keys
        self._replicas = replicas
        self._waiting = waiting
        self._settings = settings
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._running: dict[str, set[asyncio.Task[None]]] = {}
        self._leased: dict[tuple[str, int], BatchLine] = {}
        self._wake = asyncio.Event()

    def spare(self, model: str) -> int:
        """Lines this runner may start now for `model`: free slots beyond interactive work and headroom."""
        ready = self._replicas.ready(model)
        slots = sum(r.capacity or 1 for r in ready)
        busy = sum(r.outstanding for r in ready)
        allowed = slots - self._settings.headroom
        mine = len(self._running.get(model, ()))
        return max(0, min(allowed - busy - self._waiting().get(model, 0), allowed - mine))

    async def run(self) -> None:
        """Until cancelled; then the lines in hand are given back."""
        since_housekeeping = _HOUSEKEEPING_S
        try:
            while True:
                if since_housekeeping >= _HOUSEKEEPING_S:
                    since_housekeeping = 0.0
                    finished = await asyncio.to_thread(self._store.housekeeping)
                    for batch_id in finished:
                        logger.info("batch %s finished", batch_id)
                for model in await asyncio.to_thread(self._store.models_with_work):
                    await self._start(model)
                self._wake.clear()
                try:
                    async with asyncio.timeout(self._settings.poll_s):
                        await self._wake.wait()
                except TimeoutError:
                    pass
                since_housekeeping += self._settings.poll_s
        finally:
            await self._stop()

    async def _start(self, model: str) -> None:
        spare = self.spare(model)
        if not spare:
            return
        lines = await asyncio.to_thread(self._store.lease, self.owner, model, spare, self._settings.lease_s)
        for line in lines:
            self._leased[(line.batch_id, line.line)] = line
            task = asyncio.create_task(self._run(line), name=f"batch-line:{line.batch_id}:{line.line}")
            running = self._running.setdefault(model, set())
            running.add(task)
            task.add_done_callback(running.discard)

    async def _run(self, line: BatchLine) -> None:
        try:
            principal = await self._principal(line)
            if principal is None:
                error = _error("The API key that submitted this batch has been revoked.", "invalid_api_key")
                status, body = 401, error
            else:
                status, body = await self._executor.run_line(principal, line.endpoint, line.body)
            if status in _RETRY and line.attempts < self._settings.max_attempts:
                await asyncio.to_thread(self._store.release, self.owner, line)  # tried again later
            else:
                result = LineResult(status, body, f"req_{uuid.uuid4().hex[:24]}")
                await asyncio.to_thread(self._store.commit, self.owner, line, result)
        except asyncio.CancelledError:
            raise
        except Exception:  # a runner loop: logged, and the line's lease runs out (another runner retries)
            logger.exception("batch line %s:%d failed unexpectedly", line.batch_id, line.line)
        finally:
            self._leased.pop((line.batch_id, line.line), None)
            self._wake.set()

    async def _principal(self, line: BatchLine) -> Principal | None:
        if line.key_id is None:
            return Principal(key_id=None, tenant=line.tenant, priority=_BATCH_PRIORITY)
        record = await asyncio.to_thread(self._keys.get, line.key_id)
        if record is None or not record.active:
            return None
        principal = Principal.of(record)
        return Principal(
            principal.key_id,
            principal.tenant,
            principal.models,
            max_concurrency=None,
            priority=_BATCH_PRIORITY,
            monthly_token_budget=principal.monthly_token_budget,
        )

    async def _stop(self) -> None:
        tasks = [t for running in self._running.values() for t in running]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for line in list(self._leased.values()):
            try:
                await asyncio.to_thread(self._store.release, self.owner, line)
            except Exception:  # the store is gone too: the lease runs out instead
                logger.exception("could not hand back batch line %s:%d", line.batch_id, line.line)
        self._leased.clear()


_BATCH_PRIORITY = 3  # below every key's priority class (high 0, normal 1, low 2)


def _error(message: str, code: str) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    )
