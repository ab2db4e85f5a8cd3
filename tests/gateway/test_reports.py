"""How many admin reports a gateway worker reads at once, and the times their queries name."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from corral.gateway.reports import ReportTurns, month_start, when
from corral.protocol import InvalidRequest, NoCapacity, RateLimited


async def test_reports_beyond_their_turns_wait_and_one_waiting_too_long_is_a_503_with_retry_after() -> None:
    turns = ReportTurns(at_once=2, wait_s=0.2)
    release, two_reading = asyncio.Event(), asyncio.Event()
    reading = 0

    async def report(who: str) -> None:
        nonlocal reading
        async with turns.turn(who):
            reading += 1
            if reading == 2:
                two_reading.set()
            await release.wait()

    held = [asyncio.create_task(report(f"tenant:{n}")) for n in range(2)]
    await asyncio.wait_for(two_reading.wait(), 5)
    with pytest.raises(NoCapacity) as refused:
        async with turns.turn("tenant:2"):
            pytest.fail("a third report was read beside two")
    assert refused.value.code == "reports_busy" and refused.value.headers()["Retry-After"] == "1"
    waiting = asyncio.create_task(report("tenant:3"))  # (waits its turn: one is given back before it ends)
    await asyncio.sleep(0)
    release.set()
    await asyncio.wait_for(asyncio.gather(*held, waiting), 5)
    assert reading == 3


def test_a_reports_times_are_iso_dates_or_times_or_epoch_seconds_in_utc() -> None:
    assert when("2025-01-31", "since") == datetime(2025, 1, 31, tzinfo=UTC)
    assert when("2025-01-31T09:00:00+02:00", "since") == datetime(2025, 1, 31, 7, tzinfo=UTC)
    assert when("1738314000", "until") == datetime(2025, 1, 31, 9, tzinfo=UTC)
    assert when(None, "since") is None
    for bad in ("yesterday", "1e400", "99999999999999999999"):
        with pytest.raises(InvalidRequest) as refused:
            when(bad, "until")
        assert refused.value.param == "until"
    assert month_start(datetime(2025, 3, 1, 0, 30, tzinfo=UTC)) == datetime(2025, 3, 1, tzinfo=UTC)


async def test_one_report_of_a_tenant_at_a_time_the_next_refused_at_once() -> None:
    """A tenant-admin polling from forty loops held both turns and the queue: another tenant's admin got
    six reports a minute. A tenant's second report while its first is read or waiting is a quick 429."""
    turns = ReportTurns(at_once=2, wait_s=5)
    release, reading = asyncio.Event(), asyncio.Event()

    async def report(who: str) -> None:
        async with turns.turn(who):
            reading.set()
            await release.wait()

    first = asyncio.create_task(report("tenant:evil"))
    await asyncio.wait_for(reading.wait(), 5)
    with pytest.raises(RateLimited) as refused:
        async with turns.turn("tenant:evil"):
            pytest.fail("a second report of one tenant was read beside its first")
    assert refused.value.code == "reports_busy" and refused.value.status == 429
    async with turns.turn("tenant:acme"):  # (another tenant's report has its turn)
        pass
    release.set()
    await asyncio.wait_for(first, 5)
    async with turns.turn("tenant:evil"):  # (its first answered: its next is read)
        pass
