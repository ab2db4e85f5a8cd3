"""A Redis reply that comes after `limits.redis_timeout` fails its call, but Redis ran the script: the
reservation it made (a concurrency lease, tokens in the window, a budget hold) was left for nobody to
release. Here a proxy in front of the real Redis holds back one reply past the timeout (or loses one
request); the gateway releases what Redis may have made once Redis answers again, and a settlement Redis
hears twice counts once."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from corral.admission import BudgetTracker, LimiterUnavailable, Principal, RedisLimiter, SharedBudgets
from corral.protocol import RateLimited

REDIS_PORT = 6379
TIMEOUT = 0.2  # limits.redis_timeout here
LATE = 0.5  # a slow reply: past the timeout


class SlowProxy:
    """A TCP proxy to Redis that holds back the next `late` replies by `LATE` s (Redis has run their
    commands), or drops the next `lost` requests (Redis never hears of them)."""

    def __init__(self) -> None:
        self.late = 0
        self.lost = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._connect, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _connect(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        redis_in, redis_out = await asyncio.open_connection("127.0.0.1", REDIS_PORT)
        for task in (self._pipe(client_in, redis_out, requests=True), self._pipe(redis_in, client_out)):
            running = asyncio.create_task(task)
            self._tasks.add(running)
            running.add_done_callback(self._tasks.discard)

    async def _pipe(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, requests: bool = False
    ) -> None:
        try:
            while data := await source.read(65536):
                if requests and self.lost:
                    self.lost -= 1
                    continue
                if not requests and self.late:
                    self.late -= 1
                    await asyncio.sleep(LATE)
                sink.write(data)
                await sink.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            sink.close()


@pytest.fixture
async def proxy() -> AsyncIterator[SlowProxy]:
    made = SlowProxy()
    await made.start()
    yield made
    await made.stop()


async def warm(limiter: RedisLimiter) -> None:
    """A reservation settled: its scripts loaded in Redis (a reply that Redis lacks one would be the one held
    back) and a connection open, so that the next reply is the one held."""
    held = await limiter.reserve(key(rpm=1000), 1)
    assert held is not None
    await limiter.settle(held, 1)


def key(**limits: int) -> Principal:
    return Principal(key_id=uuid.uuid4().hex[:12], tenant="t", **limits)  # type: ignore[arg-type]


async def test_a_reservation_whose_reply_came_late_holds_no_slot_nor_tokens(proxy: SlowProxy) -> None:
    """Redis granted the reservation and its reply came past the timeout: the gateway answered 503 (or
    served without limits), and the lease held the key's one slot for a minute, its tokens the window.
    Both reservations batched in that round trip are released before the keys' next calls."""
    limiter = RedisLimiter(
        proxy.url, window_s=60.0, prefix=f"corral-test:{uuid.uuid4().hex}", timeout=TIMEOUT
    )
    first, second = key(max_concurrency=1, tpm=10_000), key(max_concurrency=1, tpm=10_000)
    try:
        await warm(limiter)
        proxy.late = 1
        failed = await asyncio.gather(
            limiter.reserve(first, 5000), limiter.reserve(second, 5000), return_exceptions=True
        )
        assert all(isinstance(f, LimiterUnavailable) for f in failed), failed
        for principal in (first, second):
            held = await limiter.reserve(principal, 6000)  # (the late one's 5,000 given back)
            assert held is not None
            assert held.headers["x-ratelimit-remaining-tokens"] == "4000"
            await limiter.settle(held, 6000)
    finally:
        await limiter.close()


async def test_a_settlement_whose_reply_came_late_or_never_is_sent_again_and_counts_once(
    proxy: SlowProxy,
) -> None:
    """A settlement Redis ran but whose reply came late, and one Redis never heard: each key's slot is
    free and its tokens corrected to what it used, the first counted once."""
    limiter = RedisLimiter(
        proxy.url, window_s=60.0, prefix=f"corral-test:{uuid.uuid4().hex}", timeout=TIMEOUT
    )
    late, lost = key(max_concurrency=1, tpm=10_000), key(max_concurrency=1, tpm=10_000)
    try:
        await warm(limiter)
        for principal, failure in ((late, "late"), (lost, "lost")):
            held = await limiter.reserve(principal, 1000)
            assert held is not None
            setattr(proxy, failure, 1)
            with pytest.raises(LimiterUnavailable):
                await limiter.settle(held, 3000)  # 2,000 beyond its reservation
            again = await limiter.reserve(principal, 100)
            assert again is not None
            assert again.headers["x-ratelimit-remaining-tokens"] == str(10_000 - 3000 - 100)
            await limiter.settle(again, 100)
    finally:
        await limiter.close()


async def test_released_without_another_call_once_redis_answers(proxy: SlowProxy) -> None:
    """No call of the key's follows: what Redis may have made is released within seconds all the same,
    for another gateway's requests."""
    prefix = f"corral-test:{uuid.uuid4().hex}"
    limiter = RedisLimiter(proxy.url, window_s=60.0, prefix=prefix, timeout=TIMEOUT)
    other = RedisLimiter(f"redis://127.0.0.1:{REDIS_PORT}/0", window_s=60.0, prefix=prefix)
    principal = key(max_concurrency=1)
    try:
        await warm(limiter)
        proxy.late = 1
        with pytest.raises(LimiterUnavailable):
            await limiter.reserve(principal, 1)
        for _ in range(50):  # 5 s
            try:
                held = await other.reserve(principal, 1)
                break
            except RateLimited:
                await asyncio.sleep(0.1)
        else:
            raise AssertionError("the late reservation kept its slot")
        assert held is not None
    finally:
        await limiter.close()
        await other.close()


async def test_a_concurrency_refusal_retries_no_later_than_the_earliest_lease_ends() -> None:
    """A key's slots held by leases that end sooner than a second: Retry-After says when, not 1 s."""
    limiter = RedisLimiter(
        f"redis://127.0.0.1:{REDIS_PORT}/0", prefix=f"corral-test:{uuid.uuid4().hex}", lease_s=0.5
    )
    principal = key(max_concurrency=1)
    try:
        held = await limiter.reserve(principal, 1)
        with pytest.raises(RateLimited, match="concurrent") as refused:
            await limiter.reserve(principal, 1)
        assert refused.value.retry_after is not None and 0 < refused.value.retry_after <= 0.5
        assert held is not None
        await limiter.settle(held, 1)
    finally:
        await limiter.close()


class NoUse:
    """The store: nothing used this month."""

    def month_tokens(self, key_id: str) -> int:
        return 0


async def settled(budget: BudgetTracker) -> None:
    """Until the shared holds settled meanwhile (each in a task of its own) are settled, or failed to."""
    for _ in range(100):
        if not budget._settling:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("shared holds were not settled within 1 s")


def budgeted() -> Principal:
    return Principal(key_id=uuid.uuid4().hex[:12], tenant="t", monthly_token_budget=1_000_000)


async def test_a_budget_hold_whose_reply_came_late_is_released(proxy: SlowProxy) -> None:
    """Redis made a 900k hold whose reply came late: the gateway counted the request itself, and the hold
    refused every request of the key for an hour."""
    shared = SharedBudgets(proxy.url, prefix=f"corral-test:{uuid.uuid4().hex}", timeout=TIMEOUT)
    budget = BudgetTracker(NoUse(), shared=shared)  # type: ignore[arg-type]
    principal = budgeted()
    try:
        budget.settle(principal, 10, await budget.reserve(principal, 10))
        await settled(budget)
        proxy.late = 1
        hold = await budget.reserve(principal, 900_000)
        assert hold is not None and hold.entry is None  # (counted here)
        budget.settle(principal, 500, hold)
        later = await budget.reserve(principal, 200_000)
        assert later is not None and later.entry is not None  # (held in Redis)
        held = await shared._redis.zrange(shared._keys(principal.key_id or "", later.month)[1], 0, -1)
        assert [h.decode() for h in held] == [later.entry]
    finally:
        await budget.close()


async def test_a_budget_settlement_whose_reply_came_late_or_never_is_sent_again_and_counts_once(
    proxy: SlowProxy,
) -> None:
    """A settlement Redis ran but whose reply came late counts once; one Redis never heard is sent again:
    its 900k hold does not stay for an hour."""
    shared = SharedBudgets(proxy.url, prefix=f"corral-test:{uuid.uuid4().hex}", timeout=TIMEOUT)
    for failure in ("late", "lost"):
        budget = BudgetTracker(NoUse(), shared=shared)  # type: ignore[arg-type]
        principal = budgeted()
        hold = await budget.reserve(principal, 900_000)
        assert hold is not None and hold.entry is not None
        setattr(proxy, failure, 1)
        budget.settle(principal, 300_000, hold)
        await settled(budget)  # (it fails)
        again = await budget.reserve(principal, 700_000)  # 300,000 used, counted once
        assert again is not None and again.entry is not None
        budget.settle(principal, 0, again)
        await settled(budget)
        with pytest.raises(RateLimited, match="used or reserved 300,000"):
            await budget.reserve(principal, 800_000)
    await shared.close()


async def test_a_long_requests_budget_hold_is_renewed_past_its_lease() -> None:
    """A budget hold is a lease its gateway renews while the request runs: a request longer than the
    lease keeps its budget held in Redis; once settled, nothing is renewed."""
    prefix = f"corral-test:{uuid.uuid4().hex}"
    redis = f"redis://127.0.0.1:{REDIS_PORT}/0"
    running, other = SharedBudgets(redis, prefix=prefix, hold_s=0.6), SharedBudgets(redis, prefix=prefix)
    ok, _, hold, _ = await running.reserve("k", "2026-12", 1000, 800, 0)
    assert ok
    try:
        for _ in range(15):  # 1.5 s: past two leases
            granted, *_ = await other.reserve("k", "2026-12", 1000, 800, 0)
            assert not granted, "the running request's hold expired"
            await asyncio.sleep(0.1)
        await running.settle("k", "2026-12", hold, 800)
        refused, used, _, held = await other.reserve("k", "2026-12", 1000, 800, 0)
        assert (refused, used, held) == (False, 800, 0)
    finally:
        await running.close()
        await other.close()


async def test_settlements_owed_meanwhile_are_kept_when_two_sendings_overlap() -> None:
    """Two sendings of a key's owed settlements overlap (the key's next call and the background resender);
    a settlement owed while the later one waits for Redis is kept for the next sending (the later one
    took away the key's new list of them, and its count of owed ones drifted)."""
    budgets = SharedBudgets(f"redis://127.0.0.1:{REDIS_PORT}/0", prefix=f"corral-test:{uuid.uuid4().hex}")
    month = ("k", "2026-12")
    budgets._owe(*month, "h1:10", 0)
    late, sent = asyncio.Event(), [0]
    pipeline = budgets._redis.pipeline

    def held_pipeline(*args: object, **kwargs: object) -> object:  # (the second sending's reply waits)
        made = pipeline(*args, **kwargs)  # type: ignore[arg-type]
        execute, sent[0] = made.execute, sent[0] + 1
        second = sent[0] == 2

        async def answered(*a: object, **k: object) -> object:
            replies = await execute(*a, **k)  # type: ignore[arg-type]
            if second:
                await late.wait()
            return replies

        made.execute = answered  # type: ignore[method-assign]
        return made

    budgets._redis.pipeline = held_pipeline  # type: ignore[method-assign]
    try:
        first, second = asyncio.create_task(budgets._pay(month)), asyncio.create_task(budgets._pay(month))
        await first
        budgets._owe(*month, "h3:10", 0)  # a settlement owed meanwhile
        late.set()
        await second
        assert [entry for entry, _ in budgets._owed.of(month)] == ["h3:10"] and budgets._owed.count == 1
    finally:
        await budgets.close()
