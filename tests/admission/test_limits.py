"""Rate limits reserve before work: RPM, TPM (input estimate + max_tokens), concurrency; memory and Redis."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from corral.admission import MemoryLimiter, Principal, RedisLimiter
from corral.protocol import RateLimited


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
    principal = key(rpm=3)
    for _ in range(3):
        assert await limiter.reserve(principal, 10) is not None
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
