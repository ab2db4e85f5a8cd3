"""Per-replica circuit breakers and a retry budget.

A breaker opens after `failures` consecutive failed requests (the replica leaves routing), lets one trial
request through after `cooldown` seconds (half-open), and closes on its success or reopens, with the
cool-down doubled, on its failure. A failure the engine answered (its 5xx to a request it read, or a stream it
cut while it served others) may be the request's doing: a streak of only such failures opens the breaker
only when they came from two tenants or more, so one tenant's poisoned inputs cannot take a replica away
from everyone. Nor can they keep an open breaker shut: a trial failing so, when its tenant is the only one
whose requests the streak failed, lets the next request try instead of reopening it (another tenant's
failure, or one not answered, reopens it as before). The retry budget caps retries to a fraction of recent
requests, so a sick fleet is not hit with a retry storm.
"""

from __future__ import annotations

import time
from enum import StrEnum

__all__ = ["CircuitBreaker", "CircuitState", "RetryBudget"]


class CircuitState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(self, failures: int = 3, cooldown: float = 5.0, max_cooldown: float = 60.0) -> None:
        self._threshold = failures
        self._base_cooldown = cooldown
        self._max_cooldown = max_cooldown
        self._cooldown = cooldown
        self.consecutive_failures = 0
        self._replica_faults = 0  # of the streak: failures that were the replica's beyond doubt
        # of the streak: tenants whose requests the engine failed (a 5xx answer, a cut stream)
        self._tenants: set[str] = set()
        self._opened_at: float | None = None
        self._trial_out = False

    @property
    def state(self) -> CircuitState:
        if self._opened_at is None:
            return CircuitState.CLOSED
        if time.monotonic() - self._opened_at >= self._cooldown:
            return CircuitState.HALF_OPEN
        return CircuitState.OPEN

    def allows(self) -> bool:
        """Whether a request may go to this replica now."""
        if self._opened_at is None:  # the common case, without a clock read
            return True
        state = self.state
        return state is CircuitState.CLOSED or (state is CircuitState.HALF_OPEN and not self._trial_out)

    def on_dispatch(self) -> bool:
        """A request goes to the replica; whether it is the half-open breaker's one trial."""
        if self._opened_at is not None and self.state is CircuitState.HALF_OPEN:
            self._trial_out = True
            return True
        return False

    def on_release(self) -> None:
        """The half-open trial ended with no word on the replica (a full engine's 429, an adapter it
        refused, a client gone): the next request tries instead, rather than the replica shut out for
        good."""
        self._trial_out = False

    def on_success(self) -> None:
        if self._opened_at is None and not self.consecutive_failures:
            return
        self.consecutive_failures = 0
        self._replica_faults = 0
        self._tenants.clear()
        self._opened_at = None
        self._trial_out = False
        self._cooldown = self._base_cooldown

    def on_failure(self, tenant: str | None = None) -> None:
        """A failed request: the replica's (`tenant` None: no connection, a timeout, a stream gone silent or
        cut with no one served meanwhile), or one the engine answered with a 5xx or cut while serving
        others, which `tenant` sent."""
        self.consecutive_failures += 1
        if tenant is None:
            self._replica_faults += 1
        elif len(self._tenants) < 2:
            self._tenants.add(tenant)
        if self.state is CircuitState.HALF_OPEN:
            if tenant is not None and self._tenants == {tenant}:
                # the trial's input may be what failed, as it may while closed: one tenant alone cannot
                # keep the replica shut out (the next request tries; a second tenant's failure reopens it)
                self._trial_out = False
                return
            self._cooldown = min(self._cooldown * 2, self._max_cooldown)
            self._opened_at = time.monotonic()
        elif (
            self.consecutive_failures >= self._threshold
            and self._opened_at is None
            and (self._replica_faults or len(self._tenants) >= 2)
        ):
            self._opened_at = time.monotonic()
        self._trial_out = False


class RetryBudget:
    """Retries allowed: `ratio` of requests, plus `floor` per second so low traffic can still retry."""

    def __init__(self, ratio: float = 0.2, floor_per_s: float = 5.0, cap: float = 100.0) -> None:
        self._ratio = ratio
        self._floor = floor_per_s
        self._cap = cap
        self._tokens = cap
        self._at = time.monotonic()

    def on_request(self) -> None:
        self._refill()
        self._tokens = min(self._cap, self._tokens + self._ratio)

    def try_spend(self) -> bool:
        self._refill()
        if self._tokens >= 1:
            self._tokens -= 1
            return True
        return False

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self._cap, self._tokens + (now - self._at) * self._floor)
        self._at = now
