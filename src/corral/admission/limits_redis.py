"""Rate limits kept in Redis (limits.py says what they are): atomic Lua scripts over a log of each key's
reservations and their sums, so they hold across gateway replicas. Calls from all of a gateway's requests
go out together, one pipeline a round trip.

A Redis reply that does not come within `limits.redis_timeout` fails its call, yet Redis may have run the
script: a reservation or settlement that failed is settled again (a reservation as having used nothing)
once Redis answers, and a settlement Redis runs twice counts once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import time
from functools import partial
from typing import Any

from corral.admission.auth import Principal
from corral.admission.limits import LimiterUnavailable, Reservation, granted_headers, is_limited, rate_refusal
from corral.admission.owed import Owed

__all__ = ["RedisLimiter"]


_CHECKS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[1])
local rpm, tpm, maxc = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local tokens, id = tonumber(ARGV[5]), ARGV[6]
local cutoff = now - window
local function counted(m) return tonumber(string.match(m, ':(%-?%d+)$')) or 0 end
local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', cutoff)
local freed = 0
for _, m in ipairs(old) do freed = freed + counted(m) end
if #old > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', cutoff) end
local oldx = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', cutoff)  -- (tokens used beyond reservations)
for _, m in ipairs(oldx) do freed = freed + counted(m) end
if #oldx > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', cutoff) end
local sum = tonumber(redis.call('HGET', KEYS[2], 'tokens') or '0') - freed
if sum < 0 then sum = 0 end
redis.call('HSET', KEYS[2], 'tokens', string.format('%.0f', sum))
local count = redis.call('ZCARD', KEYS[1])
-- requests in flight: each a lease its gateway renews while it runs (one that died frees its slots)
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
local inflight = redis.call('ZCARD', KEYS[4])
if rpm > 0 and count + 1 > rpm then
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {0, 'requests', tonumber(first[2]) + window - now, count, sum}
end
if tpm > 0 and sum + tokens > tpm then
  if tokens > tpm then return {0, 'too_large', 0, count, sum} end
  local entries = redis.call('ZRANGE', KEYS[1], 0, 255, 'WITHSCORES')  -- (the oldest: a bounded walk)
  local need, acc = sum + tokens - tpm, 0
  for i = 1, #entries, 2 do
    acc = acc + counted(entries[i])
    if acc >= need then return {0, 'tokens', tonumber(entries[i + 1]) + window - now, count, sum} end
  end
  return {0, 'tokens', window, count, sum}
end
if maxc > 0 and inflight + 1 > maxc then  -- (a slot frees when a request ends, or its lease does)
  local first = redis.call('ZRANGE', KEYS[4], 0, 0, 'WITHSCORES')
  return {0, 'concurrency', math.min(1000, tonumber(first[2]) - now), count, sum}
end
"""
# (a request's check is the reservation's first part: the same refusals, nothing reserved)
_CHECK = (
    _CHECKS
    + """redis.call('PEXPIRE', KEYS[1], window * 10)
redis.call('PEXPIRE', KEYS[2], window * 10)
redis.call('PEXPIRE', KEYS[3], window * 10)
return {1, 'ok', 0, count, sum}
"""
)  # (both keys' lives renewed together: a sum must not outlive the log it sums)
_RESERVE = (
    _CHECKS
    + """if rpm > 0 or tokens > 0 then redis.call('ZADD', KEYS[1], now, id .. ':' .. ARGV[5]) end
redis.call('HINCRBY', KEYS[2], 'tokens', ARGV[5])
local lease = tonumber(ARGV[7])
redis.call('ZADD', KEYS[4], now + lease, id)
redis.call('PEXPIRE', KEYS[4], lease * 2)
redis.call('PEXPIRE', KEYS[1], window * 10)
redis.call('PEXPIRE', KEYS[2], window * 10)
redis.call('PEXPIRE', KEYS[3], window * 10)
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local reset = window
if first[2] then reset = tonumber(first[2]) + window - now end
return {1, 'ok', reset, count + 1, sum + tokens}
"""
)

_SETTLE = """
local member = ARGV[1] .. ':' .. ARGV[2]
redis.call('ZREM', KEYS[4], ARGV[1])  -- (its slot: the lease ends)
local reserved, window = tonumber(ARGV[2]), tonumber(ARGV[4])
local excess = tonumber(ARGV[3]) - reserved
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local score = redis.call('ZSCORE', KEYS[1], member)
if score and tonumber(score) > now - window then
  if excess < 0 then  -- in the window: what it did not use is given back
    redis.call('ZREM', KEYS[1], member)
    redis.call('ZADD', KEYS[1], score, ARGV[1] .. ':' .. ARGV[3])
    redis.call('HINCRBY', KEYS[2], 'tokens', ARGV[5])
  end
elseif score then  -- it outlasted the window: its reservation leaves
  redis.call('ZREM', KEYS[1], member)
  redis.call('HINCRBY', KEYS[2], 'tokens', -reserved)
end
-- what it used beyond its reservation counts from now (tokens, not another request), once: a settlement
-- sent again, its first reply lost, finds its entries changed already
if excess > 0 and redis.call('ZADD', KEYS[3], 'NX', now, ARGV[1] .. ':x:' .. ARGV[5]) == 1 then
  redis.call('HINCRBY', KEYS[2], 'tokens', ARGV[5])
end
redis.call('PEXPIRE', KEYS[1], window * 10)
redis.call('PEXPIRE', KEYS[2], window * 10)
redis.call('PEXPIRE', KEYS[3], window * 10)
return 1
"""

_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], now + lease, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], lease * 2)
return 1
"""
# A request's concurrency slot is a lease in Redis that its gateway renews every third of it while the
# request runs: a gateway that dies (or loses Redis for longer) frees its requests' slots within a lease.
_LEASE_S = 60.0
_OWED_RETRY_S = 1.0  # settlements Redis may have missed are sent again this often until it answers
_OWED_MAX = 10_000  # at most this many kept (the oldest dropped: their leases and windows end by themselves)
_OWED_SENT = 256  # at most this many sent in one round trip (each with its script's text)
_MAX_TOKENS = 2**40  # counts beyond any window's (a crafted request's 10**14 is counted as this)


class RedisLimiter:
    """Limits shared by every gateway using the same Redis; clock and counting happen inside Redis.

    Calls made while a round trip to Redis is under way go out together in the next one (a pipeline, not
    a transaction: each script is atomic on its own, as when sent alone). A busy gateway then pays one
    round trip for many requests' reservations and settlements instead of one each; the client's cost
    per command, not Redis, was what a keyed request spent most on."""

    def __init__(
        self,
        url: str,
        window_s: float = 60.0,
        prefix: str = "corral:rl",
        timeout: float = 0.5,
        lease_s: float = _LEASE_S,
    ) -> None:
        import redis.asyncio as aioredis  # optional dependency, only with the redis backend
        from redis.exceptions import NoScriptError, RedisError

        self._errors: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)
        self._no_script = NoScriptError
        self._redis = aioredis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self._scripts = {name: self._redis.register_script(body) for name, body in _SCRIPTS.items()}
        self._window_ms = math.ceil(window_s * 1000)
        self._lease_ms = math.ceil(lease_s * 1000)
        self._prefix = prefix
        self._ids = itertools.count()
        self._instance = f"{os.getpid():x}.{time.time_ns():x}"  # one per gateway process
        self._waiting: list[_Call] = []
        self._sender: asyncio.Task[None] | None = None
        self._live: dict[str, set[str]] = {}  # key id → its requests in flight here (their leases renewed)
        self._renewer: asyncio.Task[None] | None = None
        # a key's log → entry → (its keys, the settle script's arguments, when): settlements (a failed
        # reservation's: none used) that Redis may not have had, sent again
        self._owed: Owed[str, tuple[list[str], list[int | str], float]] = Owed(_OWED_MAX)
        self._payer: asyncio.Task[None] | None = None
        self._closed = False

    def _keys(self, key_id: str) -> list[str]:
        return [
            f"{self._prefix}:{key_id}:log",
            f"{self._prefix}:{key_id}:sums",
            f"{self._prefix}:{key_id}:extra",
            f"{self._prefix}:{key_id}:inflight",
        ]

    async def reserve(self, principal: Principal, tokens: int) -> Reservation | None:
        if not is_limited(principal):
            return None
        assert principal.key_id is not None
        entry = f"{self._instance}.{next(self._ids)}"
        tokens = min(tokens, _MAX_TOKENS)
        args: list[int | str] = [
            self._window_ms,
            principal.rpm or 0,
            principal.tpm or 0,
            principal.max_concurrency or 0,
            tokens,
            entry,
            self._lease_ms,
        ]
        reservation = Reservation(principal.key_id, entry, tokens)
        sent = self._send("reserve", self._keys(principal.key_id), args)
        try:
            ok, what, retry_ms, count, held = await asyncio.shield(sent)
        except asyncio.CancelledError:  # the caller left; Redis may still admit it: then release it
            sent.add_done_callback(partial(self._release_orphan, reservation))
            raise
        if not ok:
            what = what.decode() if isinstance(what, bytes) else what
            raise rate_refusal(principal, what, int(retry_ms) / 1000, int(count), int(held))
        self._live.setdefault(principal.key_id, set()).add(entry)
        if self._renewer is None and not self._closed:
            self._renewer = asyncio.create_task(self._renew(), name="redis-limits-leases")
        reservation.headers.update(granted_headers(principal, int(count), int(held), int(retry_ms) / 1000))
        return reservation

    async def check(self, principal: Principal, tokens: int) -> None:
        if not is_limited(principal):
            return
        assert principal.key_id is not None
        limits = [principal.rpm or 0, principal.tpm or 0, principal.max_concurrency or 0]
        args: list[int | str] = [self._window_ms, *limits, min(tokens, _MAX_TOKENS), ""]
        ok, what, retry_ms, count, held = await self._send("check", self._keys(principal.key_id), args)
        if not ok:
            what = what.decode() if isinstance(what, bytes) else what
            raise rate_refusal(principal, what, int(retry_ms) / 1000, int(count), int(held))

    async def settle(self, reservation: Reservation, actual_tokens: int) -> None:
        live = self._live.get(reservation.key_id)
        if live is not None:
            live.discard(reservation.entry)
            if not live:
                del self._live[reservation.key_id]
        await self._send(
            "settle", self._keys(reservation.key_id), _settling(reservation, actual_tokens, self._window_ms)
        )

    async def _renew(self) -> None:
        """Renew the leases of the requests in flight here, every third of a lease, while any are."""
        while self._live and not self._closed:
            await asyncio.sleep(self._lease_ms / 3000)
            renewals = [
                self._send("renew", [self._keys(key_id)[3]], [self._lease_ms, *entries])
                for key_id, entries in self._live.items()
            ]
            await asyncio.gather(*renewals, return_exceptions=True)  # (Redis away: renewed next time)
        self._renewer = None

    def _release_orphan(self, reservation: Reservation, sent: asyncio.Future[Any]) -> None:
        if self._closed:
            return
        # (one that failed is settled again by `_owe_failed`)
        if not sent.cancelled() and sent.exception() is None and sent.result()[0]:
            released = self._send(
                "settle", self._keys(reservation.key_id), _settling(reservation, 0, self._window_ms)
            )
            released.add_done_callback(lambda done: done.cancelled() or done.exception())

    def _send(self, script: str, keys: list[str], args: list[int | str]) -> asyncio.Future[Any]:
        """The script's reply, in the next round trip (starting one if none is under way)."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((script, keys, args, future))
        if self._sender is None:
            self._sender = asyncio.create_task(self._send_waiting(), name="redis-limits")
        return future

    async def _send_waiting(self) -> None:
        try:
            while self._waiting:
                batch, self._waiting = self._waiting, []
                calls = [(s, k, a) for s, k, a, _ in batch]
                # what the batch's keys owe goes first (a lease Redis granted past its reply's timeout is
                # released before the key's next reservation is decided)
                owed = self._owed_calls({k[0] for _, k, _ in calls}) if self._owed else []
                try:
                    replies = await self._round_trip(owed + calls, whole=len(owed))
                except BaseException as exc:  # every caller hears of it, whatever it was
                    self._owe_failed(calls, [exc] * len(calls))
                    _answer(batch, [_unavailable(exc) for _ in batch])
                    if not isinstance(exc, self._errors):
                        raise
                    continue
                self._paid(owed, replies[: len(owed)])
                self._owe_failed(calls, replies[len(owed) :])
                _answer(batch, replies[len(owed) :])
        finally:
            self._sender = None
            waiting, self._waiting = self._waiting, []  # cancelled (shutdown) with calls still waiting
            _answer(waiting, [LimiterUnavailable("the gateway is shutting down") for _ in waiting])

    async def _round_trip(
        self, calls: list[tuple[str, list[str], list[int | str]]], whole: int = 0
    ) -> list[Any]:
        """Each call's reply (or its error) from one pipeline; scripts Redis lacks (restarted, flushed)
        are loaded and their calls sent again. A failure on that second try fails only those calls (the
        others' replies stand: a granted reservation must reach its caller, to be settled). The first
        `whole` calls are sent with their script's text: never sent again, they run before the others."""
        replies: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        for attempt in range(2):
            try:
                if attempt:
                    for script in {calls[i][0] for i in todo}:
                        await self._redis.script_load(_SCRIPTS[script])
                pipe = self._redis.pipeline(transaction=False)
                for i in todo:
                    script, keys, args = calls[i]
                    if i < whole:
                        pipe.eval(_SCRIPTS[script], len(keys), *keys, *args)
                    else:
                        pipe.evalsha(self._scripts[script].sha, len(keys), *keys, *args)
                results = await pipe.execute(raise_on_error=False)
            except self._errors as exc:
                if not attempt:
                    raise
                for i in todo:
                    replies[i] = _unavailable(exc)
                break
            missing = []
            for i, result in zip(todo, results, strict=True):
                if isinstance(result, self._no_script) and not attempt:
                    missing.append(i)
                elif isinstance(result, BaseException):
                    replies[i] = LimiterUnavailable(f"Redis refused the call: {result}")
                else:
                    replies[i] = result
            if not missing:
                break
            todo = missing
        return replies

    def _owe_failed(self, calls: list[tuple[str, list[str], list[int | str]]], replies: list[Any]) -> None:
        """Keep for sending again the settlements among `calls` whose reply is an error, and a settlement
        of none used for each such reservation: Redis may have run them all the same."""
        for (script, keys, args), reply in zip(calls, replies, strict=True):
            if not isinstance(reply, BaseException) or self._closed:
                continue
            if script == "reserve":  # (its entry, its tokens: none used)
                args = [args[5], args[4], 0, self._window_ms, -int(args[4])]
            elif script != "settle":
                continue
            # (one sent again keeps its first time: it is dropped in time)
            self._owed.add(keys[0], str(args[0]), (keys, args, time.monotonic()), keep_first=True)
            if self._payer is None:
                self._payer = asyncio.create_task(self._pay_owed(), name="redis-limits-owed")

    def _owed_calls(self, logs: set[str] | None) -> list[tuple[str, list[str], list[int | str]]]:
        """Up to `_OWED_SENT` of the settlements the keys of `logs` (all, for None) owe, the oldest
        first; those whose leases and window ended, which they can no longer change, are dropped."""
        expired = time.monotonic() - max(self._window_ms, self._lease_ms) / 1000
        calls: list[tuple[str, list[str], list[int | str]]] = []
        for log in self._owed.keys() if logs is None else [log for log in logs if log in self._owed]:
            for entry, (keys, args, at) in self._owed.of(log):
                if len(calls) == _OWED_SENT:
                    return calls
                if at > expired:
                    calls.append(("settle", keys, args))
                else:
                    self._owed.discard(log, entry)
        return calls

    def _paid(self, calls: list[tuple[str, list[str], list[int | str]]], replies: list[Any]) -> None:
        for (_, keys, args), reply in zip(calls, replies, strict=True):
            if not isinstance(reply, BaseException):
                self._owed.discard(keys[0], str(args[0]))

    async def _pay_owed(self) -> None:
        """Send what Redis may have missed every `_OWED_RETRY_S` until it has it all (a key's next call
        takes its own along sooner)."""
        try:
            while self._owed and not self._closed:
                await asyncio.sleep(_OWED_RETRY_S)
                with contextlib.suppress(*self._errors):  # (still away: again next time)
                    while owed := self._owed_calls(None):
                        replies = await self._round_trip(owed, whole=len(owed))
                        self._paid(owed, replies)
                        if any(isinstance(reply, BaseException) for reply in replies):
                            break
        finally:
            self._payer = None

    async def close(self) -> None:
        self._closed = True
        for task in (self._renewer, self._payer):
            if task is not None:
                task.cancel()
        if self._sender is not None:
            await asyncio.wait([self._sender])  # (not cancelled with close: its callers are answered)
        await self._redis.aclose()


_SCRIPTS = {"check": _CHECK, "reserve": _RESERVE, "settle": _SETTLE, "renew": _RENEW}
_Call = tuple[str, list[str], list[int | str], "asyncio.Future[Any]"]


def _settling(reservation: Reservation, actual_tokens: int, window_ms: int) -> list[int | str]:
    """The settle script's arguments: the entry, its reserved and used tokens, the window, the difference."""
    used = min(actual_tokens, _MAX_TOKENS)
    return [reservation.entry, reservation.tokens, used, window_ms, used - reservation.tokens]


def _unavailable(exc: BaseException) -> LimiterUnavailable:
    failure = LimiterUnavailable(f"Redis did not answer: {type(exc).__name__}: {exc}")
    failure.__cause__ = exc
    return failure


def _answer(calls: list[_Call], replies: list[Any]) -> None:
    for (_, _, _, future), reply in zip(calls, replies, strict=True):
        if future.done():
            continue
        if isinstance(reply, BaseException):
            future.set_exception(reply)
        else:
            future.set_result(reply)
