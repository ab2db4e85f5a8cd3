"""The admin API's reports (usage, the keys with their month's tokens, the audit trail, a request's
records): how many are read at once, and the span of time a usage report covers.

A report may scan a table for seconds on a thread of asyncio's default executor; a tenant-admin polling
one from a dozen loops once held every such thread. `ReportTurns` lets a gateway worker read a few at a
time; the others wait their turn, and one that waited too long is answered 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime

from corral.protocol import InvalidRequest, NoCapacity, RateLimited

__all__ = ["ReportTurns", "month_start", "when"]

_EPOCH = re.compile(r"\d+(\.\d*)?")  # a time given as seconds since the epoch


class ReportTurns:
    """At most `at_once` reports read at a time; a caller waits `wait_s` for its turn, then 503. One report
    of a tenant (`who`: a tenant-admin's tenant; the operators' share one) is read or waits at a time, the
    next refused at once (429): a tenant-admin polling from forty loops left another tenant's admin six
    reports a minute, each after a 10 s wait."""

    def __init__(self, at_once: int = 2, wait_s: float = 10.0) -> None:
        self._turns = asyncio.Semaphore(at_once)
        self._wait = wait_s
        self._asking: set[str] = set()

    @contextlib.asynccontextmanager
    async def turn(self, who: str = "") -> AsyncIterator[None]:
        if who in self._asking:
            raise RateLimited(
                "One admin report of this tenant is read at a time; ask again once it is answered.",
                code="reports_busy",
                retry_after=1.0,
            )
        self._asking.add(who)
        try:
            try:
                async with asyncio.timeout(self._wait):
                    await self._turns.acquire()
            except TimeoutError:
                raise NoCapacity(
                    "The gateway is busy reading other admin reports; try again shortly.",
                    code="reports_busy",
                    retry_after=max(1.0, self._wait / 2),
                ) from None
            try:
                yield
            finally:
                self._turns.release()
        finally:
            self._asking.discard(who)


def when(value: str | None, param: str) -> datetime | None:
    """A query's time (`?since=`, `?until=`) in UTC, as rows are written: ISO 8601 (a date, or a time; one
    without a zone is UTC) or seconds since the epoch; None where it is not given."""
    if value is None:
        return None
    try:  # (converted here, not in the store's thread: a time by the ends of the calendar overflows in UTC)
        if _EPOCH.fullmatch(value):
            return datetime.fromtimestamp(float(value), UTC)
        at = datetime.fromisoformat(value)
        return at.astimezone(UTC) if at.tzinfo is not None else at.replace(tzinfo=UTC)
    except (ValueError, OverflowError, OSError):
        raise InvalidRequest(
            f"'{param}' must be an ISO 8601 date or time (2025-01-31, 2025-01-31T09:00:00+00:00) from year "
            "1 to 9999 in UTC, or seconds since the epoch.",
            param=param,
        ) from None


def month_start(now: datetime | None = None) -> datetime:
    """The start of the calendar month (UTC) of `now`: where a usage report without a span begins."""
    now = now or datetime.now(UTC)
    return now.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
