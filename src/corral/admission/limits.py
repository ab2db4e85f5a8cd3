"""Rate limits that reserve before work starts: RPM, TPM and concurrent requests per API key.

A request reserves its estimated input tokens plus `max_tokens` against the key's TPM at admission; when it
ends, the reservation is corrected to the real usage. Limits are sliding windows over a log of reservations
(exact: the tokens admitted in any window never exceed the limit), kept in this process (`MemoryLimiter`)
or in Redis by atomic Lua scripts (`RedisLimiter`), so they hold across gateway replicas. A refusal carries
the time until enough of the window expires (Retry-After) and OpenAI-style `x-ratelimit-*` headers.

This module holds what both share and the memory limiter; limits_redis.py the Redis one.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from corral.admission.auth import Principal
from corral.config import LimitsSettings
from corral.protocol import RateLimited

__all__ = [
    "Limiter",
    "LimiterUnavailable",
    "MemoryLimiter",
    "RateLimits",
    "Reservation",
    "granted_headers",
    "is_limited",
    "rate_refusal",
]


class LimiterUnavailable(Exception):
    """The shared limit state (Redis) did not answer; the gateway's policy decides: serve, or 503."""


@dataclass(frozen=True, slots=True)
class Reservation:
    key_id: str
    entry: str
    tokens: int
    headers: dict[str, str] = field(default_factory=dict, compare=False)  # x-ratelimit-* for the answer


def granted_headers(principal: Principal, count: int, tokens: int, reset_s: float) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers for an admitted request: the key's limits, what is left of them in
    the window (this request counted), and when the window's oldest request leaves it."""
    headers = {}
    reset = f"{max(0.0, reset_s):.3f}s"
    if principal.rpm:
        headers["x-ratelimit-limit-requests"] = str(principal.rpm)
        headers["x-ratelimit-remaining-requests"] = str(max(0, principal.rpm - count))
        headers["x-ratelimit-reset-requests"] = reset
    if principal.tpm:
        headers["x-ratelimit-limit-tokens"] = str(principal.tpm)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, principal.tpm - tokens))
        headers["x-ratelimit-reset-tokens"] = reset
    return headers


class Limiter(Protocol):
    async def reserve(self, principal: Principal, tokens: int) -> Reservation | None:
        """Reserve a request and `tokens`; None for keys without limits. Raises RateLimited."""
        ...

    async def check(self, principal: Principal, tokens: int) -> None:
        """Raise RateLimited where `reserve` would refuse a request of `tokens` now, reserving nothing:
        a long prompt is refused before it is counted (a key over its limits cannot make the gateway
        count its prompts for nothing). Another gateway may take the room first: `reserve` decides."""
        ...

    async def settle(self, reservation: Reservation, actual_tokens: int) -> None:
        """The request ended: release its concurrency slot and correct its tokens."""
        ...

    async def close(self) -> None: ...


def is_limited(principal: Principal) -> bool:
    return bool(principal.key_id and (principal.rpm or principal.tpm or principal.max_concurrency))


def rate_refusal(principal: Principal, what: str, retry_after: float, count: int, tokens: int) -> RateLimited:
    headers = {}
    if principal.rpm:
        headers["x-ratelimit-limit-requests"] = str(principal.rpm)
        headers["x-ratelimit-remaining-requests"] = str(max(0, principal.rpm - count))
    if principal.tpm:
        headers["x-ratelimit-limit-tokens"] = str(principal.tpm)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, principal.tpm - tokens))
    reset = f"{max(0.0, retry_after):.3f}s"
    if what == "requests":
        headers["x-ratelimit-reset-requests"] = reset
    elif what == "tokens":
        headers["x-ratelimit-reset-tokens"] = reset
    elif what == "concurrency":  # no window resets: a slot frees when one of the key's requests ends
        headers["x-ratelimit-limit-concurrency"] = str(principal.max_concurrency)
        headers["x-ratelimit-remaining-concurrency"] = "0"
    messages = {
        "requests": f"Rate limit reached: {principal.rpm} requests per minute for this key.",
        "tokens": f"Rate limit reached: {principal.tpm} tokens per minute for this key.",
        "concurrency": f"Too many concurrent requests: at most {principal.max_concurrency} for this key.",
        "too_large": f"Request too large: it needs more tokens than the key's {principal.tpm} per minute.",
    }
    return RateLimited(
        messages[what], retry_after=max(retry_after, 0.001) if what != "too_large" else None, headers=headers
    )


_WALKED = 256  # a refusal's Retry-After is found among the oldest this many of the window's requests


class _Window:
    """One key's log: (time, entry) in admission order, and each entry's tokens as counted now. Settling
    finds its entry by id (not by walking the log: at concurrency c that walk was c steps a request), and
    the log's items are tuples of plain values, which Python's garbage collector stops tracking."""

    __slots__ = ("entries", "extra", "in_flight", "live", "tokens")

    def __init__(self) -> None:
        self.entries: deque[tuple[float, str]] = deque()
        # tokens requests used beyond reservations that had left the window when they ended: (when, tokens),
        # counted against TPM, not as requests
        self.extra: deque[tuple[float, int]] = deque()
        # entry id → its tokens (the reservation, or the real use once settled)
        self.live: dict[str, int] = {}
        self.tokens = 0
        self.in_flight = 0


class MemoryLimiter:
    """Limits within one gateway process."""

    def __init__(self, window_s: float = 60.0) -> None:
        self._window = window_s
        self._keys: dict[str, _Window] = {}
        self._ids = itertools.count()

    async def reserve(self, principal: Principal, tokens: int) -> Reservation | None:
        if not is_limited(principal):
            return None
        assert principal.key_id is not None
        now = time.monotonic()
        w = self._keys.get(principal.key_id)
        if w is None:
            w = self._keys[principal.key_id] = _Window()
        self._refuse(principal, w, tokens, now)
        entries, live = w.entries, w.live
        count = len(entries)
        entry = str(next(self._ids))
        if principal.rpm or tokens:  # (a request of no tokens, without an rpm, has nothing to count)
            entries.append((now, entry))
            live[entry] = tokens
            w.tokens += tokens
        w.in_flight += 1
        reset = entries[0][0] + self._window - now if entries else self._window
        headers = granted_headers(principal, count + 1, w.tokens, reset)
        return Reservation(principal.key_id, entry, tokens, headers)

    async def check(self, principal: Principal, tokens: int) -> None:
        w = self._keys.get(principal.key_id or "") if is_limited(principal) else None
        if w is not None:
            self._refuse(principal, w, tokens, time.monotonic())

    def _drop(self, w: _Window, now: float) -> None:
        """Drop what left the window."""
        entries, live, cutoff = w.entries, w.live, now - self._window
        while entries and entries[0][0] <= cutoff:
            w.tokens -= live.pop(entries.popleft()[1])
        extra = w.extra
        while extra and extra[0][0] <= cutoff:
            w.tokens -= extra.popleft()[1]

    def _refuse(self, principal: Principal, w: _Window, tokens: int, now: float) -> None:
        """Drop what left the window; raise the refusal a request of `tokens` would get now."""
        self._drop(w, now)
        entries, live = w.entries, w.live
        count = len(entries)
        if principal.rpm and count + 1 > principal.rpm:
            raise rate_refusal(principal, "requests", entries[0][0] + self._window - now, count, w.tokens)
        if principal.tpm and w.tokens + tokens > principal.tpm:
            if tokens > principal.tpm:
                raise rate_refusal(principal, "too_large", 0, count, w.tokens)
            need, freed = w.tokens + tokens - principal.tpm, 0
            for at, entry_id in itertools.islice(entries, _WALKED):  # (the oldest: a bounded walk)
                freed += live[entry_id]
                if freed >= need:
                    raise rate_refusal(principal, "tokens", at + self._window - now, count, w.tokens)
            raise rate_refusal(principal, "tokens", self._window, count, w.tokens)
        if principal.max_concurrency and w.in_flight + 1 > principal.max_concurrency:
            raise rate_refusal(principal, "concurrency", 1.0, count, w.tokens)

    async def settle(self, reservation: Reservation, actual_tokens: int) -> None:
        w = self._keys.get(reservation.key_id)
        if w is None:
            return
        w.in_flight = max(0, w.in_flight - 1)
        now = time.monotonic()
        self._drop(w, now)  # (a reservation that left the window is counted no more)
        counted = w.live.get(reservation.entry)
        if (
            counted is not None and actual_tokens < counted
        ):  # in the window: what it did not use is given back
            w.tokens += actual_tokens - counted
            w.live[reservation.entry] = actual_tokens
        elif actual_tokens > reservation.tokens:  # what it used beyond its reservation counts from now
            w.extra.append((now, actual_tokens - reservation.tokens))
            w.tokens += actual_tokens - reservation.tokens

    async def close(self) -> None:
        return None


class RateLimits:
    """The gateway's rate limiter as the spec's `limits` section makes it (in memory, or in Redis), and
    whether to serve when its store does not answer. A live `corral apply` that changes the section gets a
    new limiter (counts start afresh); requests the old one admitted settle with it, and every limiter
    made is closed with `close`."""

    def __init__(self, settings: LimitsSettings) -> None:
        self.settings = settings
        self.limiter: Limiter = _limiter(settings)
        self._retired: list[Limiter] = []

    @property
    def fail_open(self) -> bool:
        """Serve a request without its limits while the shared store is down (`on_redis_error: open`)."""
        return self.settings.on_redis_error == "open"

    def reconfigure(self, settings: LimitsSettings) -> None:
        if settings == self.settings:
            return
        self._retired.append(self.limiter)  # requests it admitted may still settle with it
        self.limiter, self.settings = _limiter(settings), settings

    async def close(self) -> None:
        for limiter in (*self._retired, self.limiter):
            await limiter.close()


def _limiter(settings: LimitsSettings) -> Limiter:
    if settings.backend == "redis":
        from corral.admission.limits_redis import RedisLimiter  # (redis is imported where it is used)

        return RedisLimiter(settings.redis_url, settings.window_s, timeout=settings.redis_timeout)
    return MemoryLimiter(settings.window_s)
