"""The waiting room: per model, a bounded queue that lets a request through only when a replica has a free
slot (engine slots or `max_num_seqs`), ordered by priority class and fair between tenants.

A request takes as many slots as the sequences it runs at once (`n` choices, a list of prompts, an
embeddings request's inputs; at most the slots of the model's largest replica, which runs it, or of all of
them for a request fanned out over them): an `n: 16`
request holds 16 of a vLLM replica's `max_num_seqs`, as the engine does. A tenant under its share may
start a request however many slots it takes; when the request next in turn needs more slots than are
free, they are kept for it as they free up (no lighter request overtakes it for ever).

Slots are shared too. Each tenant active on a model (running, waiting, or asking within the last 10 s)
has a share of its slots weighted by priority (high 4, normal 2, low 1). Under its share a tenant may
always take a free slot; over it, only a slot no other active tenant is entitled to and not using, so a
hog never holds an idle tenant's share of the slots, and a tenant alone may use them all. Within a
priority class the waiting tenant with the fewest slots running for its weight goes next (the least
recently served among equals; per-tenant FIFO queues), and a request whose tenant runs fewer than every
waiting tenant starts at once. A full queue refuses at once; a request that cannot start before its
deadline leaves the queue; both get 503 with a Retry-After derived from the measured drain rate.

A tenant holds at most its share of a model's waiting places: the places divided among the tenants
waiting, weighted by priority (high 4, normal 2, low 1). When the queue is full, a tenant below its share
still gets in: the newest waiter of the tenant furthest over its share leaves with a 429
(`queue_share_exceeded`); a tenant at or over its share is refused with that 429 itself. A full queue
gives 503 `queue_full` only to the one tenant waiting (its share is every place): one tenant's burst
never turns into another tenant's 503.

A model scaled to zero (`replicas.on_demand`) holds requests while its first replica starts, for the
autoscaler's `hold_s`, instead of refusing them: the autoscaler sees them waiting and starts one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

from corral.admission.auth import Principal
from corral.protocol import NoCapacity, RateLimited
from corral.store import BATCH_PRIORITY

__all__ = ["Capacity", "FairQueue"]

_TICK_S = 0.25  # re-check capacity this often (replicas come and go)
_RATE_WINDOW_S = 30.0
_RATE_SAMPLES = 4096  # completions the drain rate is measured over, at most
_WEIGHTS = (4, 2, 1)  # a tenant's weight in sharing places and slots, by priority (high, normal, low)
# a tenant that asked within this long keeps its share of a model's slots reserved: all of it while it runs
# or waits, else as many as it ran at once lately (a tenant asking one small request now and then kept
# its whole share idle, which a busy tenant could not use)
_ACTIVE_S = 10.0


def _weight(priority: int) -> int:
    return _WEIGHTS[min(max(priority, 0), len(_WEIGHTS) - 1)]


@dataclass(eq=False)
class _Waiter:
    tenant: str
    priority: int
    sequences: int = 1  # it runs at once
    weight: int = 1  # the slots it takes: its sequences, at most a replica's (worked out again at each wake)
    spread: bool = False  # over several replicas (a fan-out): at most all the model's slots
    since: float = field(default_factory=time.monotonic)
    future: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class _ModelQueue:
    def __init__(self, active_s: float = _ACTIVE_S) -> None:
        self.active_s = active_s  # a tenant that asked within this long is active (see _ACTIVE_S)
        self.classes: dict[int, dict[str, deque[_Waiter]]] = {}
        self.last_served: dict[str, int] = {}
        self.turns = 0
        self.size = 0
        self.held: dict[str, int] = {}  # tenant → its requests waiting
        self.weights: dict[str, int] = {}  # tenant → its weight (its latest waiter's priority)
        self.granted = 0  # slots handed to woken waiters that have not reached a replica yet
        # completion times for the drain rate (Retry-After); bounded, so a queue that never refuses
        # anyone does not keep every completion
        self.finished: deque[float] = deque(maxlen=_RATE_SAMPLES)
        self.arrived = 0  # requests that asked to enter, ever (the autoscaler's arrival rate)
        self.running: dict[str, int] = {}  # tenant → its requests on a replica (or granted a slot)
        # tenant → (when it last asked, its weight), oldest first: kept to the tenants active now, so the
        # share check on each request walks those, not every tenant ever seen
        self.seen: OrderedDict[str, tuple[float, int]] = OrderedDict()
        # tenant → (when, how many it ran at once), each entry more than every later one: its most at once
        # over the last _ACTIVE_S is the first entry of that time (a sliding window's maximum)
        self.peaks: dict[str, deque[tuple[float, int]]] = {}

    def push(self, waiter: _Waiter) -> None:
        tenants = self.classes.setdefault(waiter.priority, {})
        tenants.setdefault(waiter.tenant, deque()).append(waiter)
        self.size += 1
        self.held[waiter.tenant] = self.held.get(waiter.tenant, 0) + 1
        self.weights[waiter.tenant] = _weight(waiter.priority)

    def _left(self, tenant: str) -> None:
        held = self.held[tenant] - 1
        if held:
            self.held[tenant] = held
        else:
            del self.held[tenant], self.weights[tenant]

    def pop(
        self, may_start: Callable[[str, int], bool], free: int, weigh: Callable[[_Waiter], int]
    ) -> _Waiter | None:
        """The next waiter to start: by priority class, then the tenant with the fewest slots running for
        its weight (the least recently served among equals), of those `may_start` lets start (each
        waiter's slots by `weigh`); None when that waiter needs more than the `free` slots (they are kept
        for it)."""
        for priority in sorted(self.classes):
            tenants = self.classes[priority]
            allowed = [t for t in tenants if may_start(t, weigh(tenants[t][0]))]
            if not allowed:
                continue
            tenant = min(allowed, key=lambda t: (self.load(t), self.last_served.get(t, -1)))
            waiters = tenants[tenant]
            if waiters[0].weight > free:
                return None
            waiter = waiters.popleft()
            if not waiters:
                del tenants[tenant]
            self.served(tenant)
            self.size -= 1
            self._left(tenant)
            return waiter
        return None

    def waiting_slots(self) -> int:
        """The slots the waiters would take (each its weight as last worked out)."""
        return sum(w.weight for tenants in self.classes.values() for line in tenants.values() for w in line)

    def load(self, tenant: str) -> float:
        """Slots running per unit of weight."""
        return self.running.get(tenant, 0) / self.seen.get(tenant, (0.0, 1))[1]

    def started(self, tenant: str, delta: int = 1) -> None:
        left = self.running.get(tenant, 0) + delta
        if left > 0:
            self.running[tenant] = left
        else:
            self.running.pop(tenant, None)
        if delta > 0:
            peaks = self.peaks.get(tenant)
            if peaks is None:
                peaks = self.peaks[tenant] = deque()
            while peaks and peaks[-1][1] <= left:
                peaks.pop()
            peaks.append((time.monotonic(), left))

    def arrive(self, tenant: str, priority: int) -> None:
        now = time.monotonic()
        self.seen[tenant] = (now, _weight(priority))
        self.seen.move_to_end(tenant)
        for _ in range(len(self.seen)):  # forget the tenants gone quiet (each looked at once at most)
            oldest, (at, _weight_of) = next(iter(self.seen.items()))
            if now - at < self.active_s:
                break
            if oldest in self.running or oldest in self.held:
                self.seen.move_to_end(oldest)  # still active: kept, its time as it was
            else:
                del self.seen[oldest]
                self.peaks.pop(oldest, None)

    def may_start(self, tenant: str, weight: int, free: int, total: int | None) -> bool:
        """`tenant` may take `weight` of `free` slots (of `total`): while under its weighted share of the
        slots among the tenants active on the model (running, waiting or asking within _ACTIVE_S), as soon
        as they are free (see `pop`), however many; over it, only from slots no other active tenant is
        entitled to and not using (one only asking lately: to as many as it ran at once lately)."""
        if free <= 0:
            return False
        if total is None:  # replicas that do not say their slots: nothing to share
            return True
        now = time.monotonic()
        weights = {
            t: w
            for t, (at, w) in self.seen.items()
            if t == tenant or self.running.get(t) or t in self.held or now - at < self.active_s
        }
        whole = sum(weights.values()) or 1
        share = {t: total * w / whole for t, w in weights.items()}
        if self.running.get(tenant, 0) < share.get(tenant, total):
            return True
        kept = sum(
            max(0.0, self._entitled(t, share[t], now) - self.running.get(t, 0))
            for t in weights
            if t != tenant
        )
        return free - kept >= weight

    def _entitled(self, tenant: str, share: float, now: float) -> float:
        """The slots kept for `tenant`: its share while it runs or waits; one only asking lately, no more
        than it ran at once in the last `active_s`."""
        if self.running.get(tenant) or tenant in self.held:
            return share
        peaks = self.peaks.get(tenant)
        while peaks and now - peaks[0][0] >= self.active_s:
            peaks.popleft()
        return min(share, peaks[0][1]) if peaks else 0.0

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
            self._left(waiter.tenant)
            if not waiters:
                del self.classes[waiter.priority][waiter.tenant]

    def over_share(self, tenant: str, priority: int, places: int) -> str | None:
        """The queue is full and `tenant` asks for a place: None when it is at or over its share (it is
        refused), else the tenant furthest over its share, whose newest waiter makes room."""
        weights = {**self.weights, tenant: _weight(priority)}
        total = sum(weights.values())
        if self.held.get(tenant, 0) >= places * weights[tenant] / total:
            return None
        return max(self.held, key=lambda t: self.held[t] / weights[t])

    def displace(self, tenant: str) -> _Waiter:
        """Take `tenant`'s newest waiter out (of its lowest priority class)."""
        for priority in sorted(self.classes, reverse=True):
            waiters = self.classes[priority].get(tenant)
            if waiters:
                waiter = waiters[-1]
                self.remove(waiter)
                return waiter
        raise KeyError(tenant)

    def oldest_wait(self, below: int | None = None) -> float:
        """Seconds the longest-waiting request has waited (0 with none waiting); of the priority classes
        above `below` only, where given."""
        heads = [
            w[0].since
            for priority, tenants in self.classes.items()
            if below is None or priority < below
            for w in tenants.values()
            if w
        ]
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

    def slots(self, model: str) -> int | None:
        """Sequences `model`'s ready replicas hold in all; None where an engine does not say."""
        ...

    def replica_slots(self, model: str) -> int | None:
        """Sequences the largest of `model`'s ready replicas holds; None where an engine does not say."""
        ...

    def start_hold(self, model: str) -> float | None:
        """Seconds a request may wait for the first replica of a model scaled to zero; None otherwise."""
        ...

    def retry_after(self, model: str) -> float:
        """Seconds until a (re)starting replica of `model` is expected to be ready."""
        ...


class FairQueue:
    """Admits requests into replicas' free slots; one instance per gateway."""

    def __init__(
        self, capacity: Capacity, max_queued: int, timeout: float, active_s: float = _ACTIVE_S
    ) -> None:
        self._capacity = capacity
        self._active_s = active_s
        self._max = max_queued
        self._timeout = timeout
        self._queues: dict[str, _ModelQueue] = {}
        self._ticker: asyncio.Task[None] | None = None
        self._beside: list[Callable[[], dict[str, dict[str, float]]]] = []  # more of the autoscaler's view

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
        """Per model: the slots the queued requests would take (their sequences, as the replicas and the
        batch runner count theirs), the oldest's wait (s), and arrivals so far (the autoscaler's view),
        with what the sources added by `report_beside` say (the batch runner's lines)."""
        view = {  # (a batch line's wait is no interactive demand's: the autoscaler does not size for them)
            model: {
                "queued": queue.waiting_slots(),
                "oldest_wait_s": queue.oldest_wait(below=BATCH_PRIORITY),
                "arrived": queue.arrived,
            }
            for model, queue in self._queues.items()
        }
        for source in self._beside:
            for model, figures in source().items():
                view.setdefault(model, {}).update(figures)
        return view

    def report_beside(self, source: Callable[[], dict[str, dict[str, float]]]) -> None:
        """Add `source`'s figures per model to `pressure` (keys of its own: the batch runner's)."""
        self._beside.append(source)

    async def enter(
        self, model: str, principal: Principal, sequences: int = 1, spread: bool = False
    ) -> tuple[float, int]:
        """Wait for free slots for a request running `sequences` at once, on one replica or `spread` over
        several (a fan-out); (seconds waited, the slots it took: hand them back to `done`). Raises
        NoCapacity when full or too late."""
        queue = self._queues.get(model)
        if queue is None:
            queue = self._queues[model] = _ModelQueue(self._active_s)
        queue.arrived += 1
        queue.arrive(principal.tenant, principal.priority)
        free = self._capacity.free_slots(model)
        ready = free is not None
        weight = self._slots_for(model, sequences, spread)
        hold = self._capacity.start_hold(model)
        if not ready and hold is None:
            raise NoCapacity(
                f"No replica of model '{model}' is ready.",
                code="no_ready_replica",
                retry_after=self._capacity.retry_after(model),
            )
        if self._goes_first(model, queue, principal.tenant, (free or 0) - queue.granted, weight):
            queue.served(principal.tenant)
            queue.started(principal.tenant, weight)
            return 0.0, weight
        if queue.size >= self._max:
            self._make_room(model, queue, principal)
        waiter = _Waiter(principal.tenant, principal.priority, sequences, weight, spread)
        queue.push(waiter)
        started = time.monotonic()
        timeout = max(self._timeout, hold) if not ready and hold is not None else self._timeout
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
        except TimeoutError:
            queue.remove(waiter)
            if _granted(waiter):  # granted just as the deadline passed: hand the slots on
                queue.granted -= waiter.weight
                queue.started(waiter.tenant, -waiter.weight)
            if queue.size:  # (slots kept for it, or handed back: the next may start)
                self._wake(model, queue)
            raise NoCapacity(
                f"No replica of model '{model}' could take the request within {timeout:g}s.",
                code="queue_timeout",
                retry_after=self._retry_after(queue, queue.size),
            ) from None
        except asyncio.CancelledError:
            queue.remove(waiter)
            if _granted(waiter):
                queue.granted -= waiter.weight
                queue.started(waiter.tenant, -waiter.weight)
            if queue.size:
                self._wake(model, queue)
            raise
        queue.granted -= waiter.weight
        return time.monotonic() - started, waiter.weight

    def done(self, model: str, tenant: str, weight: int = 1) -> None:
        """A request of `tenant` for `model` left its replica: its `weight` slots (what `enter` said it
        took) are free."""
        queue = self._queues.get(model)
        if queue is not None:
            queue.started(tenant, -weight)
            queue.finished.append(time.monotonic())
            if queue.size:  # someone waits for the slot
                self._wake(model, queue)

    def _make_room(self, model: str, queue: _ModelQueue, principal: Principal) -> None:
        """A full queue: refuse `principal` (503 when no other tenant waits, 429 when it holds its share),
        or make room for it: the newest waiter of the tenant furthest over its share leaves with the 429."""
        retry_after = self._retry_after(queue, queue.size)
        if self._max <= 0 or queue.held.keys() <= {principal.tenant}:
            raise NoCapacity(
                f"The queue for model '{model}' is full.", code="queue_full", retry_after=retry_after
            )
        hog = queue.over_share(principal.tenant, principal.priority, self._max)
        if hog is None:
            raise _over_share(model, principal.tenant, queue.held.get(principal.tenant, 0), retry_after)
        waiter = queue.displace(hog)
        if not waiter.future.done():
            waiter.future.set_exception(_over_share(model, hog, queue.held.get(hog, 0) + 1, retry_after))
        self._wake(model, queue)  # (slots kept for the waiter displaced may go to the next)

    def _goes_first(self, model: str, queue: _ModelQueue, tenant: str, free: int, weight: int) -> bool:
        """A request may start at once: its slots are free and its tenant may take them, and no waiting
        tenant would be served before it (none runs fewer slots for its weight)."""
        if weight > free or not queue.may_start(tenant, weight, free, self._capacity.slots(model)):
            return False
        if tenant in queue.held:
            return False
        return all(queue.load(tenant) < queue.load(t) for t in queue.held)

    def _slots_for(self, model: str, sequences: int, spread: bool) -> int:
        """The slots a request running `sequences` at once takes: at most the largest replica's, which runs
        it, or the model's, for one `spread` over its replicas (one that needs more would never start); 1
        while no replica says."""
        if sequences <= 1:
            return 1
        most = self._capacity.slots(model) if spread else self._capacity.replica_slots(model)
        return max(1, min(sequences, most)) if most else 1

    def _weigh(self, model: str, waiter: _Waiter) -> int:
        """A waiter's slots as the replicas are now (they come and go while it waits)."""
        if waiter.sequences > 1:
            waiter.weight = self._slots_for(model, waiter.sequences, waiter.spread)
        return waiter.weight

    def _wake(self, model: str, queue: _ModelQueue) -> None:
        free = (self._capacity.free_slots(model) or 0) - queue.granted
        total = self._capacity.slots(model)
        weigh = partial(self._weigh, model)
        while (
            waiter := queue.pop(partial(queue.may_start, free=free, total=total), free, weigh)
        ) is not None:
            if waiter.future.done():
                continue
            waiter.future.set_result(None)
            queue.granted += waiter.weight
            queue.started(waiter.tenant, waiter.weight)
            free -= waiter.weight

    def _retry_after(self, queue: _ModelQueue, ahead: int) -> float:
        rate = queue.drain_rate()
        return (ahead + 1) / rate if rate > 0 else self._timeout

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(_TICK_S)
            for model, queue in self._queues.items():
                if queue.size:
                    self._wake(model, queue)


def _granted(waiter: _Waiter) -> bool:
    """The waiter was given a slot (not refused to make room for another tenant)."""
    future = waiter.future
    return future.done() and not future.cancelled() and future.exception() is None


def _over_share(model: str, tenant: str, held: int, retry_after: float) -> RateLimited:
    return RateLimited(
        f"Tenant '{tenant}' holds its share of the queue for model '{model}' ({held} waiting) while other "
        "tenants wait too; retry later.",
        code="queue_share_exceeded",
        retry_after=retry_after,
    )
