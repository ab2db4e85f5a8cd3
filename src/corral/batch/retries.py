"""Per-batch tries of a step that raised (checking a new batch's input, finalising one): each batch's
failures are backed off on their own, doubling up to a cap, while the other batches go on. Only an error
known to be permanent counts toward giving up on the batch (failing it with an error): a value the store
can never hold (SQLSTATE classes 22 and 54, a 2 GiB result in a 4-byte column). Anything else (the store or
line queue down or failing over, a full temporary disk, memory short) is backed off and tried again for
good: failing a batch on a passing outage threw away results already run and paid for."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import redis
from sqlalchemy import exc

from corral.store import store_is_down

__all__ = ["Retries", "permanent", "unavailable"]

_REFUSED_FOR_GOOD = ("22", "54")  # SQLSTATE classes: data exception, program limit exceeded


def unavailable(error: BaseException) -> bool:
    """Whether `error` is the store or the line queue not answering (down, failing over, a timeout, a
    replica not yet promoted, a Redis out of memory)."""
    return store_is_down(error) or isinstance(
        error,
        (
            redis.exceptions.ConnectionError,
            redis.exceptions.TimeoutError,
            redis.exceptions.ReadOnlyError,
            redis.exceptions.OutOfMemoryError,
        ),
    )


def permanent(error: BaseException) -> bool:
    """Whether `error` will be raised again however long the step waits: the store refused a value it can
    never hold (a DataError: SQLSTATE class 22, or a program limit, class 54). Nothing else is: an error
    not known to be permanent is tried again."""
    if unavailable(error) or not isinstance(error, exc.DBAPIError):
        return False
    state = getattr(error.orig, "sqlstate", None)
    if isinstance(state, str):
        return state[:2] in _REFUSED_FOR_GOOD
    return isinstance(error, exc.DataError)


@dataclass
class _Failures:
    counted: int  # permanent failures: the batch's own
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
        """Note a failure and back the batch off; True when it has failed `tries` times with a permanent
        error (give up on it: fail it). Any other error backs it off (at most `most_s`) and never gives up."""
        failures = self._failed.setdefault(batch_id, _Failures(0, 0, 0.0))
        failures.counted += permanent(error)
        failures.seen += 1
        doubled = self._first_s * 2 ** min(failures.seen - 1, 40)  # (tried for good: no float overflow)
        failures.due = self._clock() + min(self._most_s, doubled)
        return failures.counted >= self.tries

    def forget(self, batch_id: str) -> None:
        """The step passed (or the batch was given up on)."""
        self._failed.pop(batch_id, None)

    def keep(self, batch_ids: Collection[str]) -> None:
        """Forget every batch but these (the ones still waiting for the step): the count stays bounded."""
        for gone in self._failed.keys() - set(batch_ids):
            del self._failed[gone]
