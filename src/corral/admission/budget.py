"""Monthly token budgets per key, checked and reserved before a request runs, settled to what it used.

On one gateway (`limits.backend: memory`) a key's use this month is the store's (re-read every
`refresh_s`), plus what this gateway settled that the usage recorder has not written yet (it says when it
has: usage is never dropped by a re-read that ran before the write), plus what requests in flight here
reserved; so concurrent requests cannot all pass a check that only one of them fits.

Across gateways (`limits.backend: redis`) the month's use and every gateway's reservations live in Redis:
a hash `{prefix}:{key}:{month}` whose `used` is seeded from the store when missing and grows as requests
settle, and a sorted set of reservations, each a lease of `hold_s` that its gateway renews while the
request runs (a gateway that dies does not hold budget for long). One script checks and reserves, so
gateways cannot together run a budget over. While Redis is unreachable each gateway falls back to its own
accounting (logged). A reservation or settlement whose reply did not come (Redis away, or answering past
`limits.redis_timeout`) may have been made all the same: its settlement (none used, for a reservation) is
sent again once Redis answers, and Redis takes a hold's settlement once.

A key's figures are of one calendar month (UTC): when the month turns, what was read and settled in the
last one is forgotten, and the new month's use is read from the store.

A key a tenant-admin made spends its makers' budgets too (`Principal.parents`, admission/auth.py): each
request is checked, reserved and settled against the budget of every key above it that has one, under that
key's own figures, so the keys a tenant-admin makes together never spend more than its own budget. A
tenant-admin's month (and a tenant's signed-in people's, `oidc:<tenant>`) is read from the store as the use
of its keys and every key below it (`KeyStore.family_month_tokens`, where the tracker is given the key
store).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import partial

from corral.admission.auth import SIGNED_IN, Principal, whose
from corral.admission.owed import Owed
from corral.protocol import NoCapacity, RateLimited
from corral.store import KeyStore, StoreError, StoreThreads, UsageRecord, UsageStore

__all__ = ["BudgetHold", "BudgetTracker", "SharedBudgets"]

logger = logging.getLogger(__name__)

_QUIET_S = 86400.0  # a budgeted key not seen for a day leaves the budget metric
_MONTH_S = 40 * 86400  # a month's Redis hash outlives the month
_STORE_RETRY_S = 5.0
# A hold in Redis is a lease its gateway renews every third of it while the request runs: one whose reply
# never came, or whose gateway died, frees the budget within it.
_HOLD_S = 60.0
_OWED_RETRY_S = 1.0  # settlements Redis may have missed are sent again this often until it answers
_OWED_MAX = 10_000  # at most this many kept (the oldest dropped: their holds expire by themselves)
_OWED_SENT = 256  # at most this many of a key's sent in one round trip


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
    # the holds of the keys above the request's (their ids), settled with it
    above: tuple[tuple[str, BudgetHold], ...] = field(default=(), repr=False, compare=False)


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
-- (the set outlives its holds; never shortened: an older gateway's hold lasts an hour)
if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[4]) then redis.call('PEXPIRE', KEYS[2], ARGV[4]) end
return {1, used, held}
"""
# (only a hold still held is counted: a settlement sent again, its first reply lost, counts once)
_SETTLE = """
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 and redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HINCRBY', KEYS[1], 'used', ARGV[2])
end
return 1
"""
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local hold = tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now + hold, ARGV[i]) end  -- (a settled hold stays gone)
if redis.call('PTTL', KEYS[1]) < hold then redis.call('PEXPIRE', KEYS[1], hold) end
return 1
"""


class SharedBudgets:
    """Budgets held in Redis for every gateway that uses it."""

    def __init__(
        self, url: str, prefix: str = "corral:budget", timeout: float = 0.5, hold_s: float = _HOLD_S
    ) -> None:
        import redis.asyncio as aioredis  # optional dependency, only with the redis backend
        from redis.exceptions import RedisError

        self.errors: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)
        self._redis = aioredis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self._reserve = self._redis.register_script(_RESERVE)
        self._settle = self._redis.register_script(_SETTLE)
        self._renew = self._redis.register_script(_RENEW)
        self._prefix, self._hold_ms = prefix, math.ceil(hold_s * 1000)
        self._ids = itertools.count()
        self._instance = f"{os.getpid():x}.{time.time_ns():x}"
        self._live: dict[tuple[str, str], set[str]] = {}  # (key, month) → its holds in flight here
        self._renewer: asyncio.Task[None] | None = None
        # (key, month) → hold → (tokens used, when): settlements Redis may not have had, to send again
        self._owed: Owed[tuple[str, str], tuple[int, float]] = Owed(_OWED_MAX)
        self._payer: asyncio.Task[None] | None = None
        self._closed = False

    def _keys(self, key: str, month: str) -> list[str]:
        return [f"{self._prefix}:{key}:{month}", f"{self._prefix}:{key}:{month}:held"]

    async def reserve(
        self, key: str, month: str, budget: int, tokens: int, seed: int, stored: int = 0
    ) -> tuple[bool, int, str, int]:
        """(granted, tokens used or reserved before this request, the reservation's entry, the part of them
        requests in flight hold); `seed`: the
        month's use as this gateway knows it, taken when Redis has none; `stored`: the part of it in the
        store, taken where Redis knows less (settlements lost while Redis was away are in the store; what
        this gateway settled but has not written yet may still be on its way to Redis). A granted hold is
        renewed until it is settled; one whose reply did not come is released once Redis answers."""
        entry = f"{self._instance}.{next(self._ids)}"
        hold = f"{entry}:{tokens}"
        args: list[int | str] = [budget, tokens, entry, self._hold_ms, seed, _MONTH_S * 1000, stored]
        try:
            if (key, month) in self._owed:  # (holds of the key's whose replies did not come: gone first)
                await self._pay((key, month))
            ok, used, held = await self._reserve(keys=self._keys(key, month), args=args)
        except self.errors:  # (a reply past the timeout: Redis may have made the hold all the same)
            self._owe(key, month, hold, 0)
            raise
        if ok:
            self._live.setdefault((key, month), set()).add(hold)
            if self._renewer is None and not self._closed:
                self._renewer = asyncio.create_task(self._renew_holds(), name="redis-budget-holds")
        return bool(ok), int(used), hold, int(held)

    async def settle(self, key: str, month: str, entry: str, used: int) -> None:
        live = self._live.get((key, month))
        if live is not None:
            live.discard(entry)
            if not live:
                del self._live[(key, month)]
        try:
            await self._settle(keys=self._keys(key, month), args=[entry, used])
        except self.errors:  # (Redis may have settled it all the same: it counts a hold once)
            self._owe(key, month, entry, used)
            raise

    async def _renew_holds(self) -> None:
        """Renew the holds of the requests in flight here, every third of a hold, while any are."""
        try:
            while self._live and not self._closed:
                await asyncio.sleep(self._hold_ms / 3000)
                pipe = self._redis.pipeline(transaction=False)
                for (key, month), holds in list(self._live.items()):
                    args: list[int | str] = [self._hold_ms, *holds]
                    await self._renew(keys=self._keys(key, month)[1:], args=args, client=pipe)
                with contextlib.suppress(*self.errors):  # (Redis away: renewed next time)
                    await pipe.execute()
        finally:
            self._renewer = None

    def _owe(self, key: str, month: str, hold: str, used: int) -> None:
        if self._closed:
            return
        self._owed.add((key, month), hold, (used, time.monotonic()))
        if self._payer is None:
            self._payer = asyncio.get_running_loop().create_task(self._pay_owed(), name="redis-budget-owed")

    async def _pay_owed(self) -> None:
        """Send what Redis may have missed every `_OWED_RETRY_S` until it has it all."""
        try:
            while self._owed and not self._closed:
                await asyncio.sleep(_OWED_RETRY_S)
                for key_month in self._owed.keys():
                    try:
                        await self._pay(key_month)
                    except self.errors:
                        break  # (still away: again next time)
        finally:
            self._payer = None

    async def _pay(self, key_month: tuple[str, str]) -> None:
        """Send (the oldest `_OWED_SENT` of) the settlements of `key_month`'s holds Redis may have missed:
        it counts a hold's once, and one it never made is nothing to it; one older than a hold has expired
        in Redis by itself."""
        expired = time.monotonic() - self._hold_ms / 1000
        due = list(itertools.islice(self._owed.of(key_month), _OWED_SENT))
        pipe = self._redis.pipeline(transaction=False)
        for hold, (used, at) in due:
            if at > expired:
                await self._settle(keys=self._keys(*key_month), args=[hold, used], client=pipe)
        results = iter(await pipe.execute(raise_on_error=False) if len(pipe) else [])
        for hold, (_, at) in due:
            if at > expired and isinstance(next(results), BaseException):
                continue  # (sent again next time)
            self._owed.discard(key_month, hold)

    async def close(self) -> None:
        self._closed = True
        for task in (self._renewer, self._payer):
            if task is not None:
                task.cancel()
        await self._redis.aclose()


class BudgetTracker:
    """Each budgeted key's use this calendar month (`month`: now's, `YYYY-MM`), checked and reserved."""

    def __init__(
        self,
        usage: UsageStore,
        refresh_s: float = 30.0,
        shared: SharedBudgets | None = None,
        month: Callable[[], str] | None = None,
        keys: KeyStore | None = None,
        threads: StoreThreads | None = None,
    ) -> None:
        self._usage = usage
        self._threads = threads or StoreThreads.default_executor()  # (the store's reads: not the loop's)
        self._keys = keys  # a tenant-admin's month: its keys' and theirs (without it: its own key's)
        self._refresh = refresh_s
        self._shared = shared
        self._month = month or _month
        self._month_of: dict[str, str] = {}  # key id → the month its figures below are of
        self._used: dict[str, tuple[int, float]] = {}  # key id → (tokens this month in the store, read at)
        self._unwritten: dict[str, int] = {}  # settled here, not written to the store yet
        self._written_since_read: dict[str, int] = {}  # written since the store was last read
        self._reading: dict[str, asyncio.Future[tuple[str, int]]] = {}  # reads of the store under way
        self._reserved: dict[str, int] = {}  # key id → tokens requests in flight here have reserved
        # key id → (tenant, monthly budget, month "YYYY-MM", last checked (monotonic s))
        self._budgets: dict[str, tuple[str, int, str, float]] = {}
        self._parents_of: dict[str, tuple[str, ...]] = {}  # key id → the budgeted keys above it it settled to
        self._settling: set[asyncio.Task[None]] = set()
        self._retired: list[SharedBudgets] = []  # replaced by `share`: closed with this
        self._redis_down_logged = 0.0

    async def reserve(
        self,
        principal: Principal,
        tokens: int,
        prompt: int = 0,
        open_ended: bool = False,
        named: str | None = None,
    ) -> BudgetHold | None:
        """Reserve `tokens` of the key's monthly budget for a request (its `prompt`'s estimate and its
        output: max_tokens, or all the model may generate when `open_ended`), and of each budget above it;
        the hold (None where none has a budget) is handed back to `settle`. Raises RateLimited, saying
        whose budget (`named`: how it names this one, where it is a key above the request's) and what
        would fit."""
        if principal.parents:
            return await self._reserve_above(principal, tokens, prompt, open_ended)
        budget, key = principal.monthly_token_budget, principal.key_id
        if budget is None or key is None:
            return None
        month, known = await self._month_tokens(key, _has_family(principal))
        self._budgets[key] = (principal.tenant, budget, month, time.monotonic())
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
                    raise _refusal(used, budget, tokens, prompt, open_ended, held, named)
                return BudgetHold(tokens, entry, month, shared)
        held = self._reserved.get(key, 0)
        used = known + held  # (no await after this read)
        if used + tokens > budget:
            raise _refusal(used, budget, tokens, prompt, open_ended, held, named)
        self._reserved[key] = self._reserved.get(key, 0) + tokens
        return BudgetHold(tokens)

    async def _reserve_above(
        self, principal: Principal, tokens: int, prompt: int, open_ended: bool
    ) -> BudgetHold | None:
        """`reserve` of the key's budget and of each key's above it; where one refuses (or the store is
        down, or the client leaves), what was reserved before it is released."""
        held: list[tuple[Principal, BudgetHold]] = []
        own = await self.reserve(replace(principal, parents=()), tokens, prompt, open_ended)
        try:
            for parent in principal.parents:
                hold = await self.reserve(parent, tokens, prompt, open_ended, whose(principal, parent))
                if hold is not None:
                    held.append((parent, hold))
        except BaseException:  # (nothing runs)
            for holder, hold in [(principal, own), *held]:
                self._settle(holder, 0, hold)
            raise
        if not held:
            return own
        return replace(own or BudgetHold(0), above=tuple((str(p.key_id), hold) for p, hold in held))

    async def check(self, principal: Principal, named: str | None = None) -> None:
        """Raise RateLimited where the key's budget is already spent as this gateway knows it (the store's
        month, re-read every `refresh_s`, with its own holds; other gateways' Redis holds are not seen, so
        it refuses less than `reserve`, never more), reserving nothing: a long prompt's key is refused
        before the prompt is counted. `reserve` decides exactly. The budgets above it likewise (`named`:
        how a refusal names this one, where it is a key above the request's)."""
        if principal.parents:
            await self.check(replace(principal, parents=()))
            for parent in principal.parents:
                await self.check(parent, whose(principal, parent))
            return
        budget, key = principal.monthly_token_budget, principal.key_id
        if budget is None or key is None:
            return
        _, known = await self._month_tokens(key, _has_family(principal))
        held = self._reserved.get(key, 0)
        used = known + held
        if used >= budget:
            raise _refusal(used, budget, 1, 0, False, held, named)

    def settle(self, principal: Principal, tokens: int, hold: BudgetHold | None = None) -> None:
        """A request ended having used `tokens`: its reservation (`hold`) is released, and the tokens
        counted against each budget above it too."""
        self._settle(principal, tokens, hold)
        if not principal.parents:
            return
        above = dict(hold.above) if hold is not None else {}
        budgeted = []
        for parent in principal.parents:
            if parent.monthly_token_budget is not None and parent.key_id is not None:
                self._settle(parent, tokens, above.get(parent.key_id))
                budgeted.append(parent.key_id)
        if principal.key_id is not None and budgeted:  # (its usage records, once written, are theirs too)
            self._parents_of[principal.key_id] = tuple(budgeted)

    def _settle(self, principal: Principal, tokens: int, hold: BudgetHold | None) -> None:
        key = principal.key_id
        if principal.monthly_token_budget is None or key is None:
            return
        self._in_month(key, self._month())  # (its usage record is of now's month)
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
            return  # (a reservation that failed is released by `shared` once Redis answers)
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
        except shared.errors as exc:  # sent again by `shared` while its hold lasts; its use is in the store
            self._redis_down(exc)

    def written(self, records: Sequence[UsageRecord]) -> None:
        """The usage recorder wrote these records to the store."""
        for record in records:
            if record.key_id is None:
                continue
            tokens = record.input_tokens + record.output_tokens
            for key in (record.key_id, *self._parents_of.get(record.key_id, ())):  # (its makers' too)
                if key not in self._unwritten or self._month_of.get(key) != _month_at(record.at):
                    continue  # (a record of a month past: what this gateway settled then is forgotten)
                self._unwritten[key] = max(0, self._unwritten[key] - tokens)
                self._written_since_read[key] = self._written_since_read.get(key, 0) + tokens

    def spent(self) -> list[tuple[str, str, float]]:
        """(tenant, key id, share of the monthly budget used) for each budgeted key that asked this
        gateway this month within the last day; keys of a past month or gone quiet (revoked) drop out."""
        month, now = self._month(), time.monotonic()
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

    def _in_month(self, key: str, month: str) -> None:
        """Forget the key's figures of another month than `month`: a new month's use starts from none and
        is read from the store at once (if the store does not answer, none is what is known of it)."""
        if self._month_of.get(key) == month:
            return
        self._month_of[key] = month
        self._unwritten.pop(key, None)
        self._written_since_read.pop(key, None)
        if key in self._used:
            self._used[key] = (0, -math.inf)

    async def _month_tokens(self, key: str, family: bool = False) -> tuple[str, int]:
        """(this month, the key's use in it as this gateway knows it); `family`: with the keys below it. A
        read of the store already under way for the key serves every request waiting on it (a burst of a
        tenant-admin's keys as its cached figure expires read its family's month once each)."""
        month = self._month()
        self._in_month(key, month)
        cached = self._used.get(key)
        if cached is not None and time.monotonic() - cached[1] <= self._refresh:
            return month, self._known(key)
        reading = self._reading.get(key)
        if reading is None:
            reading = self._reading[key] = asyncio.ensure_future(self._read(key, month, family))
            reading.add_done_callback(partial(self._read_done, key))
        return await asyncio.shield(reading)

    def _read_done(self, key: str, reading: asyncio.Future[tuple[str, int]]) -> None:
        self._reading.pop(key, None)
        if not reading.cancelled():
            reading.exception()  # (retrieved: a failure every waiter left is not "never retrieved")

    async def _read(self, key: str, month: str, family: bool) -> tuple[str, int]:
        """The key's month read from the store (`_month_tokens`)."""
        cached = self._used.get(key)
        now = time.monotonic()
        before = self._written_since_read.pop(key, 0)  # written before the read began: it counts them
        read = self._keys.family_month_tokens if family and self._keys else self._usage.month_tokens
        try:
            stored = await self._threads.call(read, key)
        except StoreError as exc:
            self._written_since_read[key] = self._written_since_read.get(key, 0) + before
            if self._month() != month:  # (the month turned meanwhile)
                return await self._turned(key, family)
            if cached is None:  # nothing known of this key's month: it cannot be checked
                raise NoCapacity(
                    "This key's monthly budget cannot be checked right now; try again shortly.",
                    code="budget_unavailable",
                    retry_after=_STORE_RETRY_S,
                ) from exc
            logger.warning("budgets: the store did not answer (%s); using what it said last", exc)
            self._used[key] = (cached[0], now)  # asked again after refresh_s, not on every request
            return month, self._known(key)
        if self._month() != month:  # the month turned during the read: which one it counted is unknown
            return await self._turned(key, family)
        self._used[key] = (stored, now)
        return month, self._known(key)

    async def _turned(self, key: str, family: bool) -> tuple[str, int]:
        """The month turned during a read of `key`'s: read the new one's."""
        month = self._month()
        self._in_month(key, month)
        return await self._read(key, month, family)

    def _redis_down(self, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._redis_down_logged > 60:
            self._redis_down_logged = now
            logger.warning(
                "budgets: Redis unreachable (%s); each gateway counts its own until it is back", exc
            )


def _has_family(principal: Principal) -> bool:
    """Whether keys may be below it: a tenant-admin's key, a tenant's signed-in people (`oidc:<tenant>`)."""
    return principal.role == "tenant-admin" or (principal.key_id or "").startswith(SIGNED_IN)


def _month_at(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m") if at.tzinfo is not None else at.strftime("%Y-%m")


_HELD_RETRY_S = 5.0  # a refusal that in-flight holds alone cause: they settle within a request's time


def _refusal(
    used: int,
    budget: int,
    tokens: int,
    prompt: int,
    open_ended: bool,
    held: int = 0,
    whose: str | None = None,
) -> RateLimited:
    """`whose`: the budget's, where it is not the request's key's (a key above it)."""
    holder = "This key" if whose is None else whose[0].upper() + whose[1:]
    if held and used - held + tokens <= budget:  # it fits once the key's requests in flight settle
        flight = "This key's requests in flight" if whose is None else f"The requests in flight under {whose}"
        return RateLimited(
            f"{flight} hold {held:,} of its {budget:,} tokens this month; this request "
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
            f"{holder} has used or reserved all {budget:,} of its tokens this month ({used:,}).",
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
        f"{holder} has used or reserved {used:,} of its {budget:,} tokens this month ({left:,} left); this "
        f"request may need {tokens:,}: its prompt (about {prompt:,}) and {output}. {advice}",
        code="insufficient_quota",
        retry_after=(next_month - now).total_seconds(),
    )
