"""The waiting room: per model, a bounded queue that lets a request through only when a replica has a free
slot (engine slots or `max_num_seqs`), ordered by priority class and fair between tenants.

Within a priority class, the tenant served least recently goes next (per-tenant FIFO queues), so one
tenant's burst cannot starve another's trickle: a request of a tenant with nothing running waits at most for
the slots already taken. A full queue refuses at once; a request that cannot start before
its deadline leaves the queue; both get 503 with a Retry-After derived from the measured drain rate.

A model scaled to zero (`replicas.on_demand`) holds requests while its first replica starts, for the
autoscaler's `hold_s`, instead of refusing them: the autoscaler sees them waiting and starts one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from corral.admission.auth import Principal
from corral.protocol import NoCapacity

__all__ = ["Capacity", "FairQueue"]

_TICK_S = 0.25  # re-check capacity this often (replicas come and go)
_RATE_WINDOW_S = 30.0
_RATE_SAMPLES = 4096  # completions the drain rate is measured over, at most


@dataclass(eq=False)
class _Waiter:
    tenant: str
    priority: int
    since: float = field(default_factory=time.monotonic)
    future: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class _ModelQueue:
    def __init__(self) -> None:
        self.classes: dict[int, dict[str, deque[_Waiter]]] = {}
        self.last_served: dict[str, int] = {}
        self.turns = 0
        self.size = 0
        self.granted = 0  # slots handed to woken waiters that have not reached a replica yet
        # completion times for the drain rate (Retry-After); bounded, so a queue that never refuses
        # anyone does not keep every completion
        self.finished: deque[float] = deque(maxlen=_RATE_SAMPLES)
        self.arrived = 0  # requests that asked to enter, ever (the autoscaler's arrival rate)

    def push(self, waiter: _Waiter) -> None:
        tenants = self.classes.setdefault(waiter.priority, {})
        tenants.setdefault(waiter.tenant, deque()).append(waiter)
        self.size += 1

    def pop(self) -> _Waiter | None:
        for priority in sorted(self.classes):
            tenants = self.classes[priority]
            if not tenants:
                continue
            tenant = min(tenants, key=lambda t: self.last_served.get(t, -1))
            waiters = tenants[tenant]
            waiter = waiters.popleft()
            if not waiters:
                del tenants[tenant]
            self.served(tenant)
            self.size -= 1
            return waiter
        return None

    def served(self, tenant: str) -> None:
        self.turns += 1
        self.last_served[tenant] = self.turns
        if len(self.last_served) > 100_000:  # forget long-idle tenants
            waiting = {t for tenants in self.classes.values() for t in tenants}
            self.last_served = {t: n for t, n in self.last_served.items() if t in waiting}

    def remove(self, waiter: _Waiter) -> None:
        tenants = self.classes.get(waiter.priority)
        waiters = tenants.get(waiter.tenant) if tenants is not None else None
        if waiters is not None and waiter in waiters:
            waiters.remove(waiter)
            self.size -= 1
            if not waiters:
                del self.classes[waiter.priority][waiter.tenant]

    def oldest_wait(self) -> float:
        """Seconds the longest-waiting request has waited (0 with none waiting)."""
        heads = [w[0].since for tenants in self.classes.values() for w in tenants.values() if w]
        return time.monotonic() - min(heads) if heads else 0.0

    def drain_rate(self) -> float:
        now = time.monotonic()
        while self.finished and self.finished[0] < now - _RATE_WINDOW_S:
            self.finished.popleft()
        if len(self.finished) < 2:
            return 0.0
        return len(self.finished) / max(now - self.finished[0], 1e-3)


class Capacity(Protocol):
    """What the queue needs to know of the replicas (routing's ReplicaSet answers it). The queue wakes its
    waiters when a request ends (`done`) and re-checks every tick, as replicas come and go."""

    def free_slots(self, model: str) -> int | None:
        """Sequences `model`'s ready replicas can still take (a very large number where an engine does not
        say); None while no replica of it is ready."""
        ...

    def start_hold(self, model: str) -> float | None:
        """Seconds a request may wait for the first replica of a model scaled to zero; None otherwise."""
        ...

    def retry_after(self, model: str) -> float:
        """Seconds until a (re)starting replica of `model` is expected to be ready."""
        ...


class FairQueue:
    """Admits requests into replicas' free slots; one instance per gateway."""

    def __init__(self, capacity: Capacity, max_queued: int, timeout: float) -> None:
        self._capacity = capacity
        self._max = max_queued
        self._timeout = timeout
        self._queues: dict[str, _ModelQueue] = {}
        self._ticker: asyncio.Task[None] | None = None

    def configure(self, max_queued: int, timeout: float) -> None:
        """New bounds (a live `corral apply`): requests already waiting keep their place."""
        self._max, self._timeout = max_queued, timeout

    def start(self) -> None:
        self._ticker = asyncio.create_task(self._tick(), name="queue-ticker")

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker

    def depth(self, model: str) -> int:
        queue = self._queues.get(model)
        return queue.size if queue else 0

    def depths(self) -> dict[str, int]:
        return {model: queue.size for model, queue in self._queues.items()}

    def pressure(self) -> dict[str, dict[str, float]]:
        """Per model: requests queued, the oldest's wait (s), and arrivals so far (the autoscaler's view)."""
        return {
            model: {"queued": queue.size, "oldest_wait_s": queue.oldest_wait(), "arrived": queue.arrived}
            for model, queue in self._queues.items()
        }

    async def enter(self, model: str, principal: Principal) -> float:
        """Wait for a free slot; seconds waited. Raises NoCapacity when full or too late."""
        queue = self._queues.get(model)
        if queue is None:
            queue = self._queues[model] = _ModelQueue()
        queue.arrived += 1
        free = self._capacity.free_slots(model)
        ready = free is not None
        hold = self._capacity.start_hold(model)
        if not ready and hold is None:
            raise NoCapacity(
                f"No replica of model '{model}' is ready.",
                code="no_ready_replica",
                retry_after=self._capacity.retry_after(model),
            )
        if queue.size == 0 and (free or 0) - queue.granted > 0:
            queue.served(principal.tenant)
            return 0.0
        if queue.size >= self._max:
            raise NoCapacity(
                f"The queue for model '{model}' is full.",
                code="queue_full",
                retry_after=self._retry_after(queue, queue.size),
            )
        waiter = _Waiter(principal.tenant, principal.priority)
        queue.push(waiter)
        started = time.monotonic()
        timeout = max(self._timeout, hold) if not ready and hold is not None else self._timeout
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
        except TimeoutError:
            queue.remove(waiter)
            if waiter.future.done():  # granted just as the deadline passed: hand the slot on
                queue.granted -= 1
                self._wake(model, queue)
            raise NoCapacity(
                f"No replica of model '{model}' could take the request within {timeout:g}s.",
                code="queue_timeout",
                retry_after=self._retry_after(queue, queue.size),
            ) from None
        except asyncio.CancelledError:
            queue.remove(waiter)
            if waiter.future.done():
                queue.granted -= 1
                self._wake(model, queue)
            raise
        queue.granted -= 1
        return time.monotonic() - started

    def done(self, model: str) -> None:
        """A request of `model` left its replica: a slot is free."""
        queue = self._queues.get(model)
        if queue is not None:
            queue.finished.append(time.monotonic())
            if queue.size:  # someone waits for the slot
                self._wake(model, queue)

    def _wake(self, model: str, queue: _ModelQueue) -> None:
        free = (self._capacity.free_slots(model) or 0) - queue.granted
        while free > 0 and (waiter := queue.pop()) is not None:
            if waiter.future.done():
                continue
            waiter.future.set_result(None)
            queue.granted += 1
            free -= 1

    def _retry_after(self, queue: _ModelQueue, ahead: int) -> float:
        rate = queue.drain_rate()
        return (ahead + 1) / rate if rate > 0 else self._timeout

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(_TICK_S)
            for model, queue in self._queues.items():
                if queue.size:
                    self._wake(model, queue)
