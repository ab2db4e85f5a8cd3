"""Per-batch tries of a step that raised (checking a new batch's input, finalising one): each batch's
failures are backed off on their own, doubling, and after a few the batch is given up on (failed with an
error) instead of being tried forever, while the other batches go on. A store or line queue that does not
answer is waited out, not counted: that is not the batch's fault."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import redis

from corral.store import store_is_down

__all__ = ["Retries", "unavailable"]


def unavailable(error: BaseException) -> bool:
    """Whether `error` is the store or the line queue not answering (down, failing over, a timeout)."""
    return store_is_down(error) or isinstance(
        error, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
    )


@dataclass
class _Failures:
    counted: int  # failures that were the batch's (not an outage)
    seen: int  # every failure: the backoff doubles with each
    due: float


class Retries:
    """When each batch whose step failed may be tried again, and when to give up on it. Kept in memory by
    the one process that runs the step (a restart starts the count again)."""

    def __init__(
        self,
        tries: int = 5,
        first_s: float = 5.0,
        most_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tries = tries
        self._first_s = first_s
        self._most_s = most_s
        self._clock = clock
        self._failed: dict[str, _Failures] = {}

    def due(self, batch_id: str) -> bool:
        """Whether the batch may be tried now (never failed, or its backoff is over)."""
        failures = self._failed.get(batch_id)
        return failures is None or failures.due <= self._clock()

    def failed(self, batch_id: str, error: BaseException) -> bool:
        """Note a failure and back the batch off; True when it has failed `tries` times of its own (give
        up on it: fail it)."""
        failures = self._failed.setdefault(batch_id, _Failures(0, 0, 0.0))
        failures.counted += not unavailable(error)
        failures.seen += 1
        failures.due = self._clock() + min(self._most_s, self._first_s * 2 ** (failures.seen - 1))
        return failures.counted >= self.tries

    def forget(self, batch_id: str) -> None:
        """The step passed (or the batch was given up on)."""
        self._failed.pop(batch_id, None)

    def keep(self, batch_ids: Collection[str]) -> None:
        """Forget every batch but these (the ones still waiting for the step): the count stays bounded."""
        for gone in self._failed.keys() - set(batch_ids):
            del self._failed[gone]
