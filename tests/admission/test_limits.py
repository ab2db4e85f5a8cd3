"""Rate limits reserve before work: RPM, TPM (input estimate + max_tokens), concurrency; memory and Redis."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from corral.admission import MemoryLimiter, Principal, RedisLimiter
from corral.protocol import RateLimited

REDIS = "redis://127.0.0.1:6379/0"


@pytest.fixture(params=["memory", "redis"])
async def limiter(request: pytest.FixtureRequest) -> AsyncIterator[MemoryLimiter | RedisLimiter]:
    made = (
        MemoryLimiter(window_s=1.0)
        if request.param == "memory"
        else RedisLimiter("redis://127.0.0.1:6379/0", window_s=1.0, prefix=f"corral-test:{uuid.uuid4().hex}")
    )
    yield made
    await made.close()


def key(**limits: int) -> Principal:
    return Principal(key_id=uuid.uuid4().hex[:12], tenant="t", **limits)  # type: ignore[arg-type]


async def test_rpm_refuses_with_retry_after_and_headers(limiter: MemoryLimiter | RedisLimiter) -> None:
    principal = key(rpm=3, tpm=100)
    for n in range(3):
        granted = await limiter.reserve(principal, 10)
        assert granted is not None  # what an admitted answer says of the limits
        assert granted.headers["x-ratelimit-remaining-requests"] == str(2 - n)
        assert granted.headers["x-ratelimit-remaining-tokens"] == str(90 - 10 * n)
        assert 0 < float(granted.headers["x-ratelimit-reset-tokens"].rstrip("s")) <= 1.0
    with pytest.raises(RateLimited) as info:
        await limiter.reserve(principal, 10)
    error = info.value
    assert error.status == 429 and error.code == "rate_limit_exceeded"
    headers = error.headers()
    assert headers["x-ratelimit-limit-requests"] == "3" and headers["x-ratelimit-remaining-requests"] == "0"
    assert 0 < float(headers["x-ratelimit-reset-requests"].rstrip("s")) <= 1.0
    assert headers["Retry-After"] == "1"
    await asyncio.sleep(1.05)
    assert await limiter.reserve(principal, 10) is not None  # the window moved on


async def test_tpm_counts_the_reservation_and_settling_refunds(limiter: MemoryLimiter | RedisLimiter) -> None:
    principal = key(tpm=1000)
    first = await limiter.reserve(principal, 700)  # e.g. 200 input + max_tokens 500
    assert first is not None
    with pytest.raises(RateLimited, match="tokens per minute"):
        await limiter.reserve(principal, 400)
    await limiter.settle(first, 250)  # it used far less than it reserved
    assert await limiter.reserve(principal, 400) is not None
    with pytest.raises(RateLimited, match="too large"):
        await limiter.reserve(principal, 5000)


async def test_concurrency_cap(limiter: MemoryLimiter | RedisLimiter) -> None:
    principal = key(max_concurrency=2)
    held = [await limiter.reserve(principal, 1) for _ in range(2)]
    with pytest.raises(RateLimited, match="concurrent"):
        await limiter.reserve(principal, 1)
    assert held[0] is not None
    await limiter.settle(held[0], 1)
    assert await limiter.reserve(principal, 1) is not None


async def test_a_check_refuses_as_reserve_would_and_reserves_nothing(
    limiter: MemoryLimiter | RedisLimiter,
) -> None:
    principal = key(rpm=2, tpm=100, max_concurrency=5)
    for _ in range(3):  # checks take no room: two reservations still fit after them
        await limiter.check(principal, 1)
    first = await limiter.reserve(principal, 60)
    await limiter.check(principal, 40)
    with pytest.raises(RateLimited, match="tokens per minute") as tokens:
        await limiter.check(principal, 41)
    assert tokens.value.headers()["x-ratelimit-remaining-tokens"] == "40"
    assert first is not None and await limiter.reserve(principal, 10) is not None
    with pytest.raises(RateLimited, match="requests per minute") as requests:
        await limiter.check(principal, 1)
    assert requests.value.headers()["Retry-After"] == "1"
    await limiter.settle(first, 5)
    await asyncio.sleep(1.05)  # the window moved on: a check passes, and so does a reservation
    await limiter.check(principal, 1)
    assert await limiter.reserve(principal, 90) is not None
    capped = key(max_concurrency=1)
    await limiter.check(capped, 1)
    assert await limiter.reserve(capped, 1) is not None
    with pytest.raises(RateLimited, match="concurrent"):
        await limiter.check(capped, 1)


async def test_redis_keeps_a_keys_log_and_sums_alive_together(limiter: MemoryLimiter | RedisLimiter) -> None:
    """After a check and after a settlement both of a key's Redis keys expire (ten windows on): a sum
    that outlived its log would refuse an empty window; a log re-made by settling must not live forever."""
    if not isinstance(limiter, RedisLimiter):
        return
    principal = key(rpm=5, tpm=100)
    assert principal.key_id is not None
    names = limiter._keys(principal.key_id)[:2]  # (the third holds tokens used past the window: none here)

    async def lives() -> list[int]:  # milliseconds left to each key (-1: no expiry, -2: none)
        return [await limiter._redis.pttl(name) for name in names]

    held = await limiter.reserve(principal, 25)
    assert held is not None
    await limiter.settle(held, 5)  # (the log's only member, removed and added again)
    assert all(0 < left <= 10_000 for left in await lives())
    await limiter._redis.pexpire(names[0], 3_000)  # the log near its end, the sums with more to go
    await limiter.check(principal, 1)
    first, second = await lives()
    assert 9_000 < first <= 10_000 and 9_000 < second <= 10_000


async def test_keys_without_limits_reserve_nothing(limiter: MemoryLimiter | RedisLimiter) -> None:
    assert await limiter.reserve(Principal(key_id=None, tenant="anonymous"), 10**9) is None
    assert await limiter.reserve(key(), 10**9) is None


async def test_concurrency_refusal_carries_only_concurrency_headers(
    limiter: MemoryLimiter | RedisLimiter,
) -> None:
    principal = key(max_concurrency=1, tpm=1000)
    assert await limiter.reserve(principal, 10) is not None
    with pytest.raises(RateLimited) as info:
        await limiter.reserve(principal, 10)
    headers = info.value.headers()
    assert headers["x-ratelimit-limit-concurrency"] == "1"
    assert headers["x-ratelimit-remaining-concurrency"] == "0"
    assert "x-ratelimit-reset-tokens" not in headers and "x-ratelimit-reset-requests" not in headers
    assert "Retry-After" in headers


async def test_concurrent_calls_stay_exact_when_sent_together(limiter: MemoryLimiter | RedisLimiter) -> None:
    """200 reservations at once over 4 keys (Redis: pipelined together, a few round trips in all): each key
    admits exactly its limit, and settling them all at once frees every slot."""
    principals = [key(rpm=1000, max_concurrency=30) for _ in range(4)]
    outcomes = await asyncio.gather(
        *(limiter.reserve(principals[i % 4], 1) for i in range(200)), return_exceptions=True
    )
    admitted = [o for o in outcomes if o is not None and not isinstance(o, BaseException)]
    refused = [o for o in outcomes if isinstance(o, RateLimited)]
    assert len(admitted) == 4 * 30 and len(refused) == 200 - 4 * 30
    assert {sum(1 for o in admitted if o.key_id == p.key_id) for p in principals} == {30}
    await asyncio.gather(*(limiter.settle(o, 1) for o in admitted))
    assert all([await limiter.reserve(p, 1) is not None for p in principals])


async def test_a_caller_that_leaves_mid_reservation_holds_no_slot() -> None:
    """Cancelled while its reservation was on the way to Redis: the slot Redis granted is given back."""
    limiter = RedisLimiter(REDIS, window_s=60.0, prefix=f"corral-test:{uuid.uuid4().hex}")
    principal = key(max_concurrency=1)
    try:
        pending = asyncio.create_task(limiter.reserve(principal, 1))
        await asyncio.sleep(0)  # queued for the next round trip
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        for _ in range(50):
            try:
                held = await limiter.reserve(principal, 1)
                break
            except RateLimited:
                await asyncio.sleep(0.02)  # the release is on its way
        else:
            raise AssertionError("the cancelled reservation kept its concurrency slot")
        assert held is not None
    finally:
        await limiter.close()


async def test_scripts_redis_lost_are_loaded_again() -> None:
    """Redis restarted or flushed its script cache: the next calls load the scripts and go on."""
    limiter = RedisLimiter(REDIS, window_s=60.0, prefix=f"corral-test:{uuid.uuid4().hex}")
    principal = key(rpm=5)
    try:
        assert await limiter.reserve(principal, 1) is not None
        await limiter._redis.script_flush()
        held = await asyncio.gather(*(limiter.reserve(principal, 1) for _ in range(3)))
        assert all(h is not None for h in held)
        with pytest.raises(RateLimited):
            await asyncio.gather(*(limiter.reserve(principal, 1) for _ in range(2)))
    finally:
        await limiter.close()


async def test_a_long_log_is_walked_only_so_far_for_a_refusals_retry_after(
    limiter: MemoryLimiter | RedisLimiter,
) -> None:
    """A refused request's Retry-After is found among the window's oldest 256 requests, else it is the
    window: a key that filled its log with many small requests cannot make each refusal walk all of it."""
    principal = key(tpm=1000)
    for _ in range(300):
        assert await limiter.reserve(principal, 1) is not None
    await asyncio.sleep(0.01)  # (the oldest's reset is then below the window's by that much)
    with pytest.raises(RateLimited) as found:
        await limiter.reserve(principal, 720)  # frees 20 of the oldest: found among them
    assert found.value.headers()["x-ratelimit-reset-tokens"] != "1.000s"
    with pytest.raises(RateLimited) as beyond:
        await limiter.reserve(principal, 990)  # needs 290 of them freed: past the walk, the window
    assert beyond.value.headers()["x-ratelimit-reset-tokens"] == "1.000s"


async def test_what_outlasts_the_window_still_counts_and_slots_never_go_below_none(
    limiter: MemoryLimiter | RedisLimiter,
) -> None:
    """A request that ends after its reservation left the window (a long stream) counts what it used
    beyond it from its end; a key whose counters expired meanwhile (Redis: 10 windows idle) does not gain
    slots when its requests end."""
    principal = key(tpm=1000, max_concurrency=2)
    long = await limiter.reserve(principal, 300)
    assert long is not None
    await asyncio.sleep(1.1)
    await limiter.settle(long, 1000)  # it generated far past its estimate: 700 more count from now
    with pytest.raises(RateLimited, match="tokens per minute"):
        await limiter.reserve(principal, 400)
    await asyncio.sleep(1.1)
    held = [await limiter.reserve(principal, 1) for _ in range(2)]
    if isinstance(limiter, RedisLimiter):  # (its counters expired while the requests ran)
        await limiter._redis.delete(*limiter._keys(principal.key_id or ""))
    for reservation in held:
        assert reservation is not None
        await limiter.settle(reservation, 1)
    assert [await limiter.reserve(principal, 1) for _ in range(2)]
    with pytest.raises(RateLimited, match="concurrent"):
        await limiter.reserve(principal, 1)


async def test_tokens_counted_past_the_window_are_no_request_and_empty_requests_leave_no_entry(
    limiter: MemoryLimiter | RedisLimiter,
) -> None:
    """What a long request used beyond its reservation counts against TPM, not as one more request
    against RPM; requests of no tokens (token counting) on a key without an RPM add nothing to its log."""
    principal = key(rpm=1, tpm=1000)
    long = await limiter.reserve(principal, 300)
    assert long is not None
    await asyncio.sleep(1.1)
    await limiter.settle(long, 1000)  # 700 beyond its reservation, counted from now
    assert await limiter.reserve(principal, 200) is not None  # its one request a minute: not refused
    with pytest.raises(RateLimited, match="tokens per minute"):  # (700 + 200 + 200 > 1000)
        await limiter.reserve(key_of(principal, rpm=None), 200)
    counting = key(tpm=1000)
    for _ in range(5):
        assert await limiter.reserve(counting, 0) is not None
    if isinstance(limiter, RedisLimiter):
        assert await limiter._redis.zcard(limiter._keys(counting.key_id or "")[0]) == 0
    else:
        assert not limiter._keys[counting.key_id or ""].entries


def key_of(principal: Principal, **limits: int | None) -> Principal:
    """The same key with other limits."""
    import dataclasses

    return dataclasses.replace(principal, **limits)  # type: ignore[arg-type]


async def test_what_a_request_uses_beyond_its_reservation_counts_from_its_end(
    limiter: MemoryLimiter | RedisLimiter,
) -> None:
    """A request without max_tokens reserves an estimate; what it used beyond it counts from when it
    ended, not from its admission: a burst of under-estimated requests does not leave the window together
    with their admissions and let the next burst in."""
    principal = key(tpm=1000)
    short = await limiter.reserve(principal, 300)
    assert short is not None
    await asyncio.sleep(0.6)
    await limiter.settle(short, 1000)  # 700 beyond its estimate, used by now
    await asyncio.sleep(0.5)  # its admission has left the window; what it used has not
    with pytest.raises(RateLimited, match="tokens per minute"):
        await limiter.reserve(principal, 400)
    await asyncio.sleep(0.6)
    assert await limiter.reserve(principal, 400) is not None


async def test_a_request_of_huge_counts_breaks_no_limit_of_its_key(
    limiter: MemoryLimiter | RedisLimiter,
) -> None:
    """A request whose count reads as 1e+14 in Redis's Lua (n and max_tokens at their most) left a log
    member no script could parse: every later call of its key failed (served without limits, failing
    open). Counts are kept whole (beyond 2**40 counted as that)."""
    principal = key(rpm=5)
    held = await limiter.reserve(principal, 10**14)
    assert held is not None
    await limiter.settle(held, 10**15)
    await asyncio.sleep(1.1)  # (its entry leaves the window: read by the next call)
    assert await limiter.reserve(principal, 1) is not None
    await limiter.check(principal, 10**14)


async def test_a_gateway_that_dies_frees_its_requests_slots_within_a_lease() -> None:
    """Each request's concurrency slot is a lease its gateway renews while it runs: a request longer than
    the lease keeps its slot; a gateway killed mid-request (no settle) frees it within the lease, where a
    count in Redis stayed taken for good."""
    prefix = f"corral-test:{uuid.uuid4().hex}"
    dying = RedisLimiter(REDIS, window_s=60.0, prefix=prefix, lease_s=0.6)
    other = RedisLimiter(REDIS, window_s=60.0, prefix=prefix, lease_s=0.6)
    principal = key(max_concurrency=1)
    try:
        assert await dying.reserve(principal, 1) is not None
        await asyncio.sleep(1.5)  # past two leases: renewed
        with pytest.raises(RateLimited, match="concurrent"):
            await other.reserve(principal, 1)
        await dying.close()  # (killed: nothing settled)
        await asyncio.sleep(0.7)
        held = await other.reserve(principal, 1)
        assert held is not None
        await other.settle(held, 1)
    finally:
        await dying.close()
        await other.close()
