"""A request whose reservations above its key are given back while its client leaves gives every one back:
one left held stayed in the Redis limiter's renewed leases, a maker's concurrency slot lost until the
gateway restarted (every key it made locked out one slot at a time)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from corral.admission import Principal
from corral.admission.limits_redis import RedisLimiter
from corral.gateway.above import reserve_above
from corral.protocol import RateLimited

URL = "redis://127.0.0.1:6379/14"
PREFIX = "test-above-release"


@pytest.fixture
async def limiter() -> AsyncIterator[RedisLimiter]:
    made = RedisLimiter(URL, lease_s=1.0, prefix=PREFIX)
    try:
        yield made
    finally:
        await made.close()
        client = aioredis.from_url(URL)
        async for name in client.scan_iter(match=f"{PREFIX}:*"):
            await client.delete(name)
        await client.aclose()


async def test_a_refusal_above_while_the_client_leaves_gives_back_the_middle_makers_slot(
    limiter: RedisLimiter,
) -> None:
    top = Principal(key_id="A", tenant="t", rpm=1)
    middle = Principal(key_id="B", tenant="t", max_concurrency=1, parents=(top,))
    child = Principal(key_id="C", tenant="t", max_concurrency=5, parents=(middle, top))
    first = await limiter.reserve(top, 0)  # (A's one request a minute: taken)
    assert first is not None
    await limiter.settle(first, 0)

    async def admit() -> None:
        own = await limiter.reserve(child, 0)
        await reserve_above(limiter, child, (middle, top), 0, own)

    task = asyncio.create_task(admit())
    deadline = time.monotonic() + 5
    # (the limiter's live leases are the only way to see the moment: B reserved, A refused, C's release
    # begun; the client leaves then)
    while "B" not in limiter._live:
        assert time.monotonic() < deadline
        await asyncio.sleep(0)
    while "C" in limiter._live and "B" in limiter._live and not task.done():
        assert time.monotonic() < deadline
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises((asyncio.CancelledError, RateLimited)):
        await task
    client = aioredis.from_url(URL)
    try:
        deadline = time.monotonic() + 10
        while await client.zcard(f"{PREFIX}:B:inflight"):  # (a lease not renewed ends within 1 s)
            assert time.monotonic() < deadline, "B's slot is still held: its lease is renewed for good"
            await asyncio.sleep(0.2)
    finally:
        await client.aclose()
    assert "B" not in limiter._live
