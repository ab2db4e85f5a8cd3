"""Monthly token budgets per key, checked and reserved before a request runs, settled to what it used.

On one gateway (`limits.backend: memory`) a key's use this month is the store's (re-read every
`refresh_s`), plus what this gateway settled that the usage recorder has not written yet (it says when it
has: usage is never dropped by a re-read that ran before the write), plus what requests in flight here
reserved; so concurrent requests cannot all pass a check that only one of them fits.

Across gateways (`limits.backend: redis`) the month's use and every gateway's reservations live in Redis:
a hash `{prefix}:{key}:{month}` whose `used` is seeded from the store when missing and grows as requests
settle, and a sorted set of reservations, each expiring after `hold_s` (a gateway that dies does not hold
budget for long). One script checks and reserves, so gateways cannot together run a budget over. While
Redis is unreachable each gateway falls back to its own accounting (logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial

from corral.admission.auth import Principal
from corral.protocol import NoCapacity, RateLimited
from corral.store import StoreError, UsageRecord, UsageStore

__all__ = ["BudgetHold", "BudgetTracker", "SharedBudgets"]

logger = logging.getLogger(__name__)

_QUIET_S = 86400.0  # a budgeted key not seen for a day leaves the budget metric
_MONTH_S = 40 * 86400  # a month's Redis hash outlives the month
_STORE_RETRY_S = 5.0


def _month() -> str:
    return datetime.now(UTC).strftime("%Y-%m")


@dataclass(frozen=True)
class BudgetHold:
    """Tokens a request reserved of its key's budget; `entry`: its reservation in Redis, if shared, in the
    month (`YYYY-MM`) it was made in, which its settlement goes to even past the month's end."""

    tokens: int
    entry: str | None = None
    month: str = ""
    shared: SharedBudgets | None = field(default=None, repr=False, compare=False)  # where `entry` is


_RESERVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSETNX', KEYS[1], 'used', ARGV[5])
if tonumber(ARGV[7]) > tonumber(redis.call('HGET', KEYS[1], 'used')) then
  redis.call('HSET', KEYS[1], 'used', ARGV[7])  -- (settles it never heard of, in the store: the larger holds)
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local held = 0
for _, member in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  held = held + tonumber(string.match(member, ':(%d+)$'))
end
local used = tonumber(redis.call('HGET', KEYS[1], 'used')) + held
if used + tonumber(ARGV[2]) > tonumber(ARGV[1]) then return {0, used, held} end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[4]), ARGV[3] .. ':' .. ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[6])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return {1, used, held}
"""
_SETTLE = """
redis.call('ZREM', KEYS[2], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HINCRBY', KEYS[1], 'used', ARGV[2]) end
return 1
"""


class SharedBudgets:
    """Budgets held in Redis for every gateway that uses it."""

    def __init__(
        self, url: str, prefix: str = "corral:budget", timeout: float = 0.5, hold_s: float = 3600.0
    ) -> None:
        import redis.asyncio as aioredis  # optional dependency, only with the redis backend
        from redis.exceptions import RedisError

        self.errors: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)
        self._redis = aioredis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self._reserve = self._redis.register_script(_RESERVE)
        self._settle = self._redis.register_script(_SETTLE)
        self._prefix, self._hold_ms = prefix, int(hold_s * 1000)
        self._ids = itertools.count()
        self._instance = f"{os.getpid():x}.{time.time_ns():x}"

    def _keys(self, key: str, month: str) -> list[str]:
        return [f"{self._prefix}:{key}:{month}", f"{self._prefix}:{key}:{month}:held"]

    async def reserve(
        self, key: str, month: str, budget: int, tokens: int, seed: int, stored: int = 0
    ) -> tuple[bool, int, str, int]:
        """(granted, tokens used or reserved before this request, the reservation's entry, the part of them
        requests in flight hold); `seed`: the
        month's use as this gateway knows it, taken when Redis has none; `stored`: the part of it in the
        store, taken where Redis knows less (settlements lost while Redis was away are in the store; what
        this gateway settled but has not written yet may still be on its way to Redis)."""
        entry = f"{self._instance}.{next(self._ids)}"
        args: list[int | str] = [budget, tokens, entry, self._hold_ms, seed, _MONTH_S * 1000, stored]
        ok, used, held = await self._reserve(keys=self._keys(key, month), args=args)
        return bool(ok), int(used), f"{entry}:{tokens}", int(held)

    async def settle(self, key: str, month: str, entry: str, used: int) -> None:
        await self._settle(keys=self._keys(key, month), args=[entry, used])

    async def close(self) -> None:
        await self._redis.aclose()


class BudgetTracker:
    def __init__(
        self, usage: UsageStore, refresh_s: float = 30.0, shared: SharedBudgets | None = None
    ) -> None:
        self._usage = usage
        self._refresh = refresh_s
        self._shared = shared
        self._used: dict[str, tuple[int, float]] = {}  # key id → (tokens this month in the store, read at)
        self._unwritten: dict[str, int] = {}  # settled here, not written to the store yet
        self._written_since_read: dict[str, int] = {}  # written since the store was last read
        self._reserved: dict[str, int] = {}  # key id → tokens requests in flight here have reserved
        # key id → (tenant, monthly budget, month "YYYY-MM", last checked (monotonic s))
        self._budgets: dict[str, tuple[str, int, str, float]] = {}
        self._settling: set[asyncio.Task[None]] = set()
        self._retired: list[SharedBudgets] = []  # replaced by `share`: closed with this
        self._redis_down_logged = 0.0

    async def reserve(
        self, principal: Principal, tokens: int, prompt: int = 0, open_ended: bool = False
    ) -> BudgetHold | None:
        """Reserve `tokens` of the key's monthly budget for a request (its `prompt`'s estimate and its
        output: max_tokens, or all the model may generate when `open_ended`); the hold (None for a key
        without a budget) is handed back to `settle`. Raises RateLimited, saying what would fit."""
        budget, key = principal.monthly_token_budget, principal.key_id
        if budget is None or key is None:
            return None
        month = _month()
        self._budgets[key] = (principal.tenant, budget, month, time.monotonic())
        known = await self._month_tokens(key)
        shared = self._shared
        if shared is not None:
            stored = known - self._unwritten.get(key, 0)
            sent = asyncio.ensure_future(shared.reserve(key, month, budget, tokens, known, stored))
            try:
                ok, used, entry, held = await asyncio.shield(sent)
            except asyncio.CancelledError:  # the caller left; Redis may still grant the hold: then release it
                sent.add_done_callback(partial(self._release_orphan, key, month, shared))
                raise
            except shared.errors as exc:
                self._redis_down(exc)
            else:
                if not ok:
                    raise _refusal(used, budget, tokens, prompt, open_ended, held)
                return BudgetHold(tokens, entry, month, shared)
        held = self._reserved.get(key, 0)
        used = known + held  # (no await after this read)
        if used + tokens > budget:
            raise _refusal(used, budget, tokens, prompt, open_ended, held)
        self._reserved[key] = self._reserved.get(key, 0) + tokens
        return BudgetHold(tokens)

    async def check(self, principal: Principal) -> None:
        """Raise RateLimited where the key's budget is already spent as this gateway knows it (the store's
        month, re-read every `refresh_s`, with its own holds; other gateways' Redis holds are not seen, so
        it refuses less than `reserve`, never more), reserving nothing: a long prompt's key is refused
        before the prompt is counted. `reserve` decides exactly."""
        budget, key = principal.monthly_token_budget, principal.key_id
        if budget is None or key is None:
            return
        held = self._reserved.get(key, 0)
        used = await self._month_tokens(key) + held
        if used >= budget:
            raise _refusal(used, budget, 1, 0, False, held)

    def settle(self, principal: Principal, tokens: int, hold: BudgetHold | None = None) -> None:
        """A request ended having used `tokens`: its reservation (`hold`) is released."""
        key = principal.key_id
        if principal.monthly_token_budget is None or key is None:
            return
        self._unwritten[key] = self._unwritten.get(key, 0) + tokens
        if hold is None:
            return
        if hold.entry is not None and hold.shared is not None:
            self._settle_later(key, hold, tokens)
            return
        left = self._reserved.get(key, 0) - hold.tokens
        if left > 0:
            self._reserved[key] = left
        else:
            self._reserved.pop(key, None)

    def _release_orphan(
        self, key: str, month: str, shared: SharedBudgets, sent: asyncio.Future[tuple[bool, int, str, int]]
    ) -> None:
        if sent.cancelled() or sent.exception() is not None or not sent.result()[0]:
            return
        self._settle_later(key, BudgetHold(0, sent.result()[2], month, shared), 0)

    def _settle_later(self, key: str, hold: BudgetHold, tokens: int) -> None:
        """Settles a shared hold in a task of its own, kept until it ends."""
        task = asyncio.get_running_loop().create_task(self._settle_shared(key, hold, tokens))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle_shared(self, key: str, hold: BudgetHold, tokens: int) -> None:
        shared = hold.shared
        assert shared is not None and hold.entry is not None
        try:
            await shared.settle(key, hold.month, hold.entry, tokens)
        except shared.errors as exc:  # its reservation expires in Redis; its use is in the store
            self._redis_down(exc)

    def written(self, records: Sequence[UsageRecord]) -> None:
        """The usage recorder wrote these records to the store."""
        for record in records:
            key = record.key_id
            if key is None or key not in self._unwritten:
                continue
            tokens = record.input_tokens + record.output_tokens
            self._unwritten[key] = max(0, self._unwritten[key] - tokens)
            self._written_since_read[key] = self._written_since_read.get(key, 0) + tokens

    def spent(self) -> list[tuple[str, str, float]]:
        """(tenant, key id, share of the monthly budget used) for each budgeted key that asked this
        gateway this month within the last day; keys of a past month or gone quiet (revoked) drop out."""
        month, now = _month(), time.monotonic()
        for key in [k for k, (_, _, m, seen) in self._budgets.items() if m != month or now - seen > _QUIET_S]:
            del self._budgets[key]
        return [
            (tenant, key, self._known(key) / budget) for key, (tenant, budget, _, _) in self._budgets.items()
        ]

    def share(self, shared: SharedBudgets | None) -> None:
        """Count budgets across gateways in `shared` from now on (a live `corral apply` moved the limits'
        Redis, or to or from one); holds made in the one before settle there."""
        if self._shared is not None:
            self._retired.append(self._shared)
        self._shared = shared

    async def close(self) -> None:
        if self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)
        for shared in (*self._retired, self._shared):
            if shared is not None:
                with contextlib.suppress(*shared.errors):
                    await shared.close()

    def _known(self, key: str) -> int:
        cached = self._used.get(key)
        return (
            (cached[0] if cached else 0) + self._unwritten.get(key, 0) + self._written_since_read.get(key, 0)
        )

    async def _month_tokens(self, key: str) -> int:
        cached = self._used.get(key)
        now = time.monotonic()
        if cached is None or now - cached[1] > self._refresh:
            before = self._written_since_read.pop(key, 0)  # written before the read began: it counts them
            try:
                stored = await asyncio.to_thread(self._usage.month_tokens, key)
            except StoreError as exc:
                self._written_since_read[key] = self._written_since_read.get(key, 0) + before
                if cached is None:  # nothing known of this key's month: it cannot be checked
                    raise NoCapacity(
                        "This key's monthly budget cannot be checked right now; try again shortly.",
                        code="budget_unavailable",
                        retry_after=_STORE_RETRY_S,
                    ) from exc
                logger.warning("budgets: the store did not answer (%s); using what it said last", exc)
                self._used[key] = (cached[0], now)  # asked again after refresh_s, not on every request
                return self._known(key)
            self._used[key] = (stored, now)
        return self._known(key)

    def _redis_down(self, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._redis_down_logged > 60:
            self._redis_down_logged = now
            logger.warning(
                "budgets: Redis unreachable (%s); each gateway counts its own until it is back", exc
            )


_HELD_RETRY_S = 5.0  # a refusal that in-flight holds alone cause: they settle within a request's time


def _refusal(
    used: int, budget: int, tokens: int, prompt: int, open_ended: bool, held: int = 0
) -> RateLimited:
    if held and used - held + tokens <= budget:  # it fits once the key's requests in flight settle
        return RateLimited(
            f"This key's requests in flight hold {held:,} of its {budget:,} tokens this month; this request "
            f"may need {tokens:,}, which fits once they end and give back what they did not use.",
            code="insufficient_quota",
            retry_after=_HELD_RETRY_S,
        )
    now = datetime.now(UTC)
    next_month = (now.replace(day=28) + (now.replace(day=28) - now.replace(day=1))).replace(
        day=1, hour=0, minute=0, second=0, microsecond=0
    )
    left = max(0, budget - used)
    if left == 0:  # (nothing fits, whatever the request)
        return RateLimited(
            f"This key has used or reserved all {budget:,} of its tokens this month ({used:,}).",
            code="insufficient_quota",
            retry_after=(next_month - now).total_seconds(),
        )
    output = "all the model may generate (max_tokens is not set)" if open_ended else "max_tokens"
    advice = (
        f"Set max_tokens to at most {left - prompt:,} for it to fit."
        if left > prompt
        else "Its prompt alone needs more than is left."
    )
    return RateLimited(
        f"This key has used or reserved {used:,} of its {budget:,} tokens this month ({left:,} left); this "
        f"request may need {tokens:,}: its prompt (about {prompt:,}) and {output}. {advice}",
        code="insufficient_quota",
        retry_after=(next_month - now).total_seconds(),
    )
