"""A monthly budget starts afresh when the calendar month turns: what this gateway read of the store and
settled in the month before is not the new month's use, with budgets counted in this gateway or in Redis.
The month is a clock the tests turn (`BudgetTracker(month=...)`); the store, a stub that answers each
month's use."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest

from corral.admission import BudgetTracker, Principal, SharedBudgets
from corral.protocol import RateLimited
from corral.store import StoreError, UsageRecord

REDIS = "redis://127.0.0.1:6379/0"
BUDGET = 1_000_000


class Calendar:
    """The month now, turned by the test."""

    def __init__(self, month: str) -> None:
        self.month = month

    def __call__(self) -> str:
        return self.month


class MonthlyUsage:
    """The store: each month's tokens of every key, as the usage rows of that month say."""

    def __init__(self, calendar: Calendar, used: dict[str, int]) -> None:
        self._calendar, self._used = calendar, used
        self.down = False

    def month_tokens(self, key_id: str) -> int:
        if self.down:
            raise StoreError("the usage store did not answer")
        return self._used.get(self._calendar.month, 0)


@pytest.fixture(params=["memory", "redis"])
async def shared(request: pytest.FixtureRequest) -> AsyncIterator[SharedBudgets | None]:
    if request.param == "memory":
        yield None
        return
    budgets = SharedBudgets(REDIS, prefix=f"corral-test:{uuid.uuid4().hex}")
    yield budgets
    await budgets.close()


def eve() -> Principal:
    return Principal(key_id=uuid.uuid4().hex[:12], tenant="eve", monthly_token_budget=BUDGET)


async def settled(budget: BudgetTracker) -> None:
    """Until the shared holds settled meanwhile (each in a task of its own) are settled in Redis."""
    for _ in range(100):
        if not budget._settling:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("shared holds were not settled within 1 s")


def record(key: Principal, at: datetime, tokens: int) -> UsageRecord:
    return UsageRecord(at, key.key_id, key.tenant, "m", 0, tokens, None, 10.0, 200, None)


async def test_a_budget_spent_last_month_is_whole_the_moment_the_month_turns(
    shared: SharedBudgets | None,
) -> None:
    """A key that spent November's budget comes back at 00:00:05 on 1 December, within `refresh_s` of the
    gateway's last read of the store: it was refused until the start of January (the cached November use
    taken for December's)."""
    calendar = Calendar("2026-11")
    budget = BudgetTracker(MonthlyUsage(calendar, {"2026-11": BUDGET}), shared=shared, month=calendar)
    key = eve()
    with pytest.raises(RateLimited, match="all 1,000,000"):
        await budget.reserve(key, 1000)
    calendar.month = "2026-12"
    await budget.check(key)
    hold = await budget.reserve(key, 1000)
    assert hold is not None
    budget.settle(key, 1000, hold)
    await budget.close()


async def test_a_new_months_use_in_redis_is_not_seeded_with_the_last_ones(
    shared: SharedBudgets | None,
) -> None:
    """With budgets in Redis the first reservation of a month seeds the month's use there, which every
    gateway then counts from: seeded with November's 900k (cached), the key had 100k for all of December
    however fresh the other gateways' reads. Another gateway, its store read December's, finds it whole."""
    calendar = Calendar("2026-11")
    usage = MonthlyUsage(calendar, {"2026-11": 900_000})
    budget = BudgetTracker(usage, shared=shared, month=calendar)
    key = eve()
    budget.settle(key, 1000, await budget.reserve(key, 1000))  # 23:59:50 on 30 November
    calendar.month = "2026-12"
    budget.settle(key, 1000, await budget.reserve(key, 1000))  # 00:00:05 on 1 December
    await settled(budget)
    other = BudgetTracker(usage, shared=shared, month=calendar) if shared is not None else budget
    assert await other.reserve(key, 900_000) is not None  # (December: 1,000 used)
    await budget.close()
    if shared is not None:
        names = shared._keys(key.key_id or "", "2026-12")
        used = await shared._redis.hget(names[0], "used")
        assert used is not None and int(used) <= 1000


async def test_what_was_settled_last_month_is_not_this_months_use(shared: SharedBudgets | None) -> None:
    """Usage settled in November and not yet written counts in November only: it neither fills December
    nor, once written, takes back what December's requests settled."""
    calendar = Calendar("2026-11")
    budget = BudgetTracker(MonthlyUsage(calendar, {}), shared=shared, month=calendar)
    key = eve()
    budget.settle(key, 600_000, await budget.reserve(key, 600_000))  # not written yet
    calendar.month = "2026-12"
    budget.settle(key, 300_000, await budget.reserve(key, 300_000))  # December's, not written yet
    budget.written([record(key, datetime(2026, 11, 30, 23, 59, 59, tzinfo=UTC), 600_000)])
    await settled(budget)
    with pytest.raises(RateLimited, match="used or reserved 300,000"):  # (not 0, nor 900,000)
        await budget.reserve(key, 800_000)
    assert await budget.reserve(key, 700_000) is not None
    await budget.close()


async def test_a_store_down_as_the_month_turns_leaves_the_new_month_at_what_was_counted_since() -> None:
    """The store does not answer across midnight: the new month's use is what this gateway counted since
    it began (the month's start is none), not the last month's figure it read last."""
    calendar = Calendar("2026-11")
    usage = MonthlyUsage(calendar, {"2026-11": BUDGET})
    budget = BudgetTracker(usage, refresh_s=0, month=calendar)
    key = eve()
    with pytest.raises(RateLimited):
        await budget.reserve(key, 1)
    usage.down = True
    calendar.month = "2026-12"
    budget.settle(key, 400_000, await budget.reserve(key, 400_000))
    with pytest.raises(RateLimited, match="used or reserved 400,000"):
        await budget.reserve(key, 700_000)


class SlowUsage(MonthlyUsage):
    """The store, each read taking a while and counted."""

    def __init__(self, calendar: Calendar, used: dict[str, int]) -> None:
        super().__init__(calendar, used)
        self.reads = 0

    def month_tokens(self, key_id: str) -> int:
        self.reads += 1
        threading.Event().wait(0.2)
        return super().month_tokens(key_id)


async def test_a_burst_of_requests_reads_a_keys_month_once() -> None:
    """Fifty requests of one key (a tenant-admin's keys, as its cached figure expired) read its month
    fifty times at once, each holding one of the store's threads (a family's read took seconds)."""
    calendar = Calendar("2026-11")
    usage = SlowUsage(calendar, {"2026-11": 10})
    budget = BudgetTracker(usage, month=calendar)  # type: ignore[arg-type]
    key = eve()
    await asyncio.gather(*(budget.check(key) for _ in range(50)))
    assert usage.reads == 1
    usage.down = True  # (a failed read is every waiter's: none is known yet of this one's month)
    other = eve()
    refused = await asyncio.gather(*(budget.check(other) for _ in range(5)), return_exceptions=True)
    assert usage.reads == 2 and all(type(r).__name__ == "NoCapacity" for r in refused), refused
