"""The line queue behind batches in Redis Streams (`batch.queue: redis`): the lines, their leases and
results live in Redis; the batches and files stay in the SQL store.

Each model has a stream of `(batch, line)` entries per tenant, all read by one consumer group, `runners`;
a runner is a consumer. Leasing deals lines between the tenants as the SQL queue does: the tenant with the
fewest lines running (by any runner) gets the next, so one tenant's 50,000-line batch does not hold
another's for hours. Leasing a line is reading it into the runner's pending entries (XREADGROUP) and
setting its deadline in the tenant's lease set for the model (a sorted set, deadline as score); a runner
that dies leaves its entries pending, and another claims them (XCLAIM) once their deadline passed;
renewing moves the deadline. A result is kept only if its runner still holds the entry (XPENDING names the
consumer) and the line is still leased, in one Lua script with the state change and the count, so a line
has exactly one result as in SQL. Lines retried after a backoff wait in a sorted set and go back into
their stream when due. Per batch, hashes hold each line's state, request, result, attempts, lease deadline
and stream entry, and counts; a finalised batch's entries leave its tenant's stream with them.

Durable as Redis is: run it with `appendonly yes`. A batch whose lines Redis lost (a restart without
persistence, a flush) is noticed by the store, set back to `validating` and queued again from its input
file, so nothing is lost; lines that had finished run again. Keys are named by the script, so this needs
one Redis (or a primary), not Redis Cluster.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import redis
from sqlalchemy.orm import Session

from corral.batch.queue import LOST, RESULTS_AT_ONCE, BatchLine, LineResult, ResultRow, Stop
from corral.store.batch_rows import gave_up, stored_result

__all__ = ["RedisLines"]
_GROUP = "runners"
_CHUNK = 1000  # lines added per script call
_STATES = {"p": "pending", "l": "leased", "d": "done", "f": "failed", "c": "cancelled", "x": "expired"}
_STOPS = {"cancel": "c", "expire": "x"}

# Per-batch keys: {prefix}b:{batch}:s state, :r request ([custom_id, body]), :o result, :a attempts,
# :u lease deadline, :n counts (completed, failed), :x the stop mark (c cancelled, x expired), :t tenant,
# :m model (what `tidy` finds a batch by), :e each line's latest stream entry (what `drop` deletes).
_HELPERS = """
local p = ARGV[1]
local function key(b, suffix) return p .. 'b:' .. b .. ':' .. suffix end
local function finish(b, l, state, result)
  redis.call('HSET', key(b, 's'), l, state)
  redis.call('HDEL', key(b, 'u'), l)
  if result then redis.call('HSET', key(b, 'o'), l, result) end
  redis.call('HINCRBY', key(b, 'n'), state == 'd' and 'completed' or 'failed', 1)
end
"""

# A model's queue: ARGV[2] the model, ARGV[3] the consumer group. Each tenant with lines of the model has
# its own stream ({prefix}q:{model}:{tenant}) and lease set (deadline as score); the set {prefix}qt:{model}
# names those tenants; lines waiting out a backoff are in {prefix}d:{model} as `batch|line`.
_QUEUE = (
    _HELPERS
    + """
local model, group = ARGV[2], ARGV[3]
local tenants, delayed = p .. 'qt:' .. model, p .. 'd:' .. model
local function stream(t) return p .. 'q:' .. model .. ':' .. t end
local function leases(t) return p .. 'leases:' .. model .. ':' .. t end
local function push(b, l)  -- a line (back) into its tenant's stream
  local t = redis.call('GET', key(b, 't')) or ''
  if redis.call('EXISTS', stream(t)) == 0 then
    redis.call('XGROUP', 'CREATE', stream(t), group, '0', 'MKSTREAM')
    redis.call('SADD', tenants, t)
  end
  redis.call('HSET', key(b, 'e'), l, redis.call('XADD', stream(t), '*', 'b', b, 'l', l))
end
local function drop(t, id)
  redis.call('XACK', stream(t), group, id)
  redis.call('XDEL', stream(t), id)
  redis.call('ZREM', leases(t), id)
end
local function holds(t, owner, id)  -- false too when Redis lost the stream (a flush)
  local found = redis.pcall('XPENDING', stream(t), group, id, id, 1)
  if type(found) ~= 'table' or found.err or found[1] == nil then return false end
  return found[1][2] == owner
end
"""
)

# LEASE: ARGV owner, limit, max attempts, now, deadline, gave-up format (after prefix, model, group)
_LEASE = (
    _QUEUE
    + """
local owner, limit, maxa = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local now, deadline = tonumber(ARGV[7]), ARGV[8]
for _, m in ipairs(redis.call('ZRANGEBYSCORE', delayed, '-inf', now, 'LIMIT', 0, 1000)) do
  local sep = string.find(m, '|', 1, true)
  local b = string.sub(m, 1, sep - 1)
  if redis.call('EXISTS', key(b, 't')) == 1 then push(b, string.sub(m, sep + 1)) end
  redis.call('ZREM', delayed, m)
end
local out = {}
local function take(t, id, b, l)  -- leased, or dropped when finished, stopped or tried too often
  local state = redis.call('HGET', key(b, 's'), l)
  local stop = redis.call('GET', key(b, 'x'))
  if state ~= 'p' and state ~= 'l' then
    drop(t, id)  -- finished, or its batch is gone
  elseif stop then
    finish(b, l, stop, nil)
    drop(t, id)
  else
    local attempts = tonumber(redis.call('HGET', key(b, 'a'), l) or '0')
    if attempts >= maxa then
      finish(b, l, 'f', string.format(ARGV[9], attempts))
      drop(t, id)
    else
      redis.call('HINCRBY', key(b, 'a'), l, 1)
      redis.call('HSET', key(b, 's'), l, 'l')
      redis.call('HSET', key(b, 'u'), l, deadline)
      redis.call('ZADD', leases(t), deadline, id)
      table.insert(out, {id, b, l, redis.call('HGET', key(b, 'r'), l), attempts + 1, t})
      return true
    end
  end
  return false
end
local names = redis.call('SMEMBERS', tenants)
table.sort(names)
for _, t in ipairs(names) do  -- lines whose runner died (its lease ran out) are taken over first
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', leases(t), '-inf', now, 'LIMIT', 0, limit)) do
    if #out >= limit then break end
    redis.call('ZREM', leases(t), id)
    local claimed = redis.pcall('XCLAIM', stream(t), group, owner, 0, id)
    if type(claimed) == 'table' and not claimed.err and claimed[1] then
      take(t, id, claimed[1][2][2], claimed[1][2][4])
    end
  end
end
local running, open = {}, {}
for _, t in ipairs(names) do
  running[t] = redis.call('ZCOUNT', leases(t), now, '+inf')
  open[t] = true
end
local scanned = 0  -- entries of finished batches are skipped over, a bounded number a call
while #out < limit and scanned < 2000 do
  local pick = nil  -- the tenant with the fewest lines running (by any runner) gets the next line
  for _, t in ipairs(names) do
    if open[t] and (pick == nil or running[t] < running[pick]) then pick = t end
  end
  if pick == nil then break end
  local new = redis.pcall('XREADGROUP', 'GROUP', group, owner, 'COUNT', 1, 'STREAMS', stream(pick), '>')
  if type(new) == 'table' and not new.err and new[1] then
    local e = new[1][2][1]
    scanned = scanned + 1
    take(pick, e[1], e[2][2], e[2][4])
    -- an entry of a finished batch (dropped) counts as a line too: a tenant with a run of them does not
    -- take every read of the call while the others wait
    running[pick] = running[pick] + 1
  else
    open[pick] = false
    if redis.call('XLEN', stream(pick)) == 0 then  -- nothing queued nor held: the tenant leaves
      redis.call('DEL', stream(pick), leases(pick))
      redis.call('SREM', tenants, pick)
    end
  end
end
return out
"""
)

# COMMIT: ARGV owner, then (entry, tenant, batch, line, state, result) per line; the places (from 0) kept
_COMMIT = (
    _QUEUE
    + """
local owner, kept = ARGV[4], {}
for i = 5, #ARGV, 6 do
  local id, t, b, l = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  if holds(t, owner, id) then
    if redis.call('HGET', key(b, 's'), l) == 'l' then
      finish(b, l, ARGV[i + 4], ARGV[i + 5])
      kept[#kept + 1] = (i - 5) / 6
    end
    drop(t, id)
  end
end
return kept
"""
)

# RELEASE: ARGV owner, entry, tenant, batch, line, due (0: now), attempts to give back (0 or 1)
_RELEASE = (
    _QUEUE
    + """
local owner, id, t, b, l = ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8]
if not holds(t, owner, id) then return 0 end
drop(t, id)
if redis.call('HGET', key(b, 's'), l) ~= 'l' then return 0 end
if tonumber(ARGV[10]) > 0 then redis.call('HINCRBY', key(b, 'a'), l, -tonumber(ARGV[10])) end
local stop = redis.call('GET', key(b, 'x'))
redis.call('HDEL', key(b, 'u'), l)
if stop then
  finish(b, l, stop, nil)
elseif tonumber(ARGV[9]) > 0 then
  redis.call('HSET', key(b, 's'), l, 'p')
  redis.call('ZADD', delayed, ARGV[9], b .. '|' .. l)
else
  redis.call('HSET', key(b, 's'), l, 'p')
  push(b, l)
end
return 1
"""
)

# RENEW: ARGV owner, deadline, then (entry, tenant, batch, line) per line
_RENEW = (
    _QUEUE
    + """
local owner = ARGV[4]
for i = 6, #ARGV, 4 do
  local id, t, b, l = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  if holds(t, owner, id) and redis.call('HGET', key(b, 's'), l) == 'l' then
    redis.call('ZADD', leases(t), ARGV[5], id)
    redis.call('HSET', key(b, 'u'), l, ARGV[5])
  end
end
return 0
"""
)

# ADD: ARGV batch, tenant, then (line, request) per line: idempotent (a line is queued once); a batch
# stopped (cancelled) while its lines were being queued gets the rest as cancelled at once
_ADD = (
    _QUEUE
    + """
local b = ARGV[4]
redis.call('SET', key(b, 't'), ARGV[5])
redis.call('SET', key(b, 'm'), model)
local stop = redis.call('GET', key(b, 'x'))
for i = 6, #ARGV, 2 do
  if redis.call('HSETNX', key(b, 's'), ARGV[i], 'p') == 1 then
    redis.call('HSET', key(b, 'r'), ARGV[i], ARGV[i + 1])
    if stop then
      finish(b, ARGV[i], stop, nil)
    else
      push(b, ARGV[i])
    end
  end
end
return 0
"""
)

# SETTLE: ARGV prefix, batch, stop ('' none, 'c' cancel, 'x' expire), now
#   -> {queued (0: Redis does not have the batch), lines, completed, failed}
_SETTLE = (
    _HELPERS
    + """
local b, stop, now = ARGV[2], ARGV[3], tonumber(ARGV[4])
if redis.call('EXISTS', key(b, 's')) == 0 then return {0, 0, 0, 0} end  -- lost (or never queued)
if stop ~= '' then
  if redis.call('SET', key(b, 'x'), stop, 'NX') then  -- from now on no line of it becomes pending
    -- its pending lines finish once, as the mark is set: every line's state is walked this once
    local states = redis.call('HGETALL', key(b, 's'))
    for i = 1, #states, 2 do
      if states[i + 1] == 'p' then finish(b, states[i], stop, nil) end
    end
  end
  -- lines whose runner died finish (those running finish with their results): only the leased are walked
  local leased = redis.call('HGETALL', key(b, 'u'))
  for i = 1, #leased, 2 do
    if tonumber(leased[i + 1]) < now and redis.call('HGET', key(b, 's'), leased[i]) == 'l' then
      finish(b, leased[i], stop, nil)
    end
  end
end
local n = redis.call('HMGET', key(b, 'n'), 'completed', 'failed')
return {1, redis.call('HLEN', key(b, 's')), tonumber(n[1] or '0'), tonumber(n[2] or '0')}
"""
)


class RedisLines:
    """The line queue in Redis Streams; blocking calls (the store is used from threads)."""

    name = "redis"

    def __init__(self, url: str, prefix: str = "corral:batch:", timeout: float = 5.0) -> None:
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self._prefix = prefix
        scripts = (_LEASE, _COMMIT, _RELEASE, _RENEW, _ADD, _SETTLE)
        self._lease, self._commit, self._release, self._renew, self._add, self._settle = (
            self._redis.register_script(s) for s in scripts
        )

    def _key(self, batch_id: str, suffix: str) -> str:
        """A batch's key (the scripts name them alike: `key(b, suffix)`)."""
        return f"{self._prefix}b:{batch_id}:{suffix}"

    def _call(self, script: Any, model: str, args: list[Any]) -> Any:
        """Run a script on the model's queue (the scripts name their keys: one Redis, not a cluster)."""
        return script(keys=[], args=[self._prefix, model, _GROUP, *args])

    def add(
        self, session: Session, batch_id: str, model: str, tenant: str, lines: list[tuple[str, bytes]]
    ) -> None:
        """Queued before the store's transaction commits; queuing the same batch again adds nothing."""
        for start in range(0, len(lines), _CHUNK):
            args: list[Any] = [batch_id, tenant]
            for i, (custom_id, body) in enumerate(lines[start : start + _CHUNK], start=start):
                args += [i, orjson.dumps([custom_id, body.decode()])]
            self._call(self._add, model, args)

    def lease(self, owner: str, model: str, limit: int, lease_s: float, max_attempts: int) -> list[BatchLine]:
        """Lines dealt fairly between tenants, as in SQL: the one with the fewest lines running next."""
        now = time.time()
        # a Lua format string: the attempts go in (a request id per call, not per process)
        args = [owner, limit, max_attempts, now, now + lease_s, gave_up("%d")]
        leased = []
        for entry, batch_id, line, request, attempts, tenant in self._call(self._lease, model, args):
            custom_id, body = orjson.loads(request)
            leased.append(
                BatchLine(
                    batch_id.decode(),
                    int(line),
                    custom_id,
                    body.encode(),
                    "",
                    tenant.decode(),
                    None,
                    int(attempts),
                    entry.decode(),
                    model,
                )
            )
        return leased

    def commit_many(self, owner: str, results: list[tuple[BatchLine, LineResult]]) -> list[int]:
        by_model: dict[str, list[Any]] = defaultdict(list)
        indices: dict[str, list[int]] = defaultdict(list)  # a model's results' places in `results`
        for index, (line, result) in enumerate(results):
            status, stored = stored_result(result.status_code, result.body, result.request_id)
            state = "d" if 200 <= status < 300 else "f"
            by_model[line.model] += [line.token, line.tenant, line.batch_id, line.line, state, stored]
            indices[line.model].append(index)
        kept: list[int] = []
        for model, args in by_model.items():
            kept += [indices[model][int(i)] for i in self._call(self._commit, model, [owner, *args])]
        return sorted(kept)

    def release(self, owner: str, line: BatchLine, after_s: float, undo_attempt: bool = False) -> None:
        due = time.time() + after_s if after_s else 0
        args = [owner, line.token, line.tenant, line.batch_id, line.line, due, int(undo_attempt)]
        self._call(self._release, line.model, args)

    def renew(self, owner: str, lines: list[BatchLine], lease_s: float) -> None:
        by_model: dict[str, list[Any]] = defaultdict(list)
        for line in lines:
            by_model[line.model] += [line.token, line.tenant, line.batch_id, line.line]
        for model, args in by_model.items():
            self._call(self._renew, model, [owner, time.time() + lease_s, *args])

    def cancel(self, batch_id: str) -> None:
        self._settle(keys=[], args=[self._prefix, batch_id, "c", time.time()])

    def settle(self, session: Session, batch_id: str, model: str, stop: Stop | None, now: float) -> int:
        mark = _STOPS[stop] if stop else ""
        queued, lines, completed, failed = self._settle(keys=[], args=[self._prefix, batch_id, mark, now])
        return LOST if not queued else max(0, int(lines) - int(completed) - int(failed))

    def results(self, session: Session, batch_id: str) -> Iterator[ResultRow]:
        base = self._key(batch_id, "")
        lines = sorted(self._redis.hkeys(base + "r"), key=int)  # (the line numbers only, then in slices)
        for at in range(0, len(lines), RESULTS_AT_ONCE):
            some = lines[at : at + RESULTS_AT_ONCE]
            with self._redis.pipeline(transaction=False) as pipe:
                pipe.hmget(base + "r", some)
                pipe.hmget(base + "s", some)
                pipe.hmget(base + "o", some)
                requests, states, outputs = pipe.execute()
            for request, state, output in zip(requests, states, outputs, strict=True):
                status = orjson.loads(output)["status_code"] if output else None
                yield (
                    orjson.loads(request)[0],
                    _STATES[(state or b"x").decode()],
                    status,
                    output.decode() if output else None,
                )

    def counts(self, session: Session, batch_ids: list[str]) -> dict[str, dict[str, int]]:
        with self._redis.pipeline(transaction=False) as pipe:
            for batch_id in batch_ids:
                pipe.hlen(self._key(batch_id, "s"))
                pipe.hmget(self._key(batch_id, "n"), "completed", "failed")
            found = pipe.execute()
        counts = {}
        for i, batch_id in enumerate(batch_ids):
            total, (completed, failed) = found[2 * i], found[2 * i + 1]
            if total:
                counts[batch_id] = {
                    "total": total,
                    "completed": int(completed or 0),
                    "failed": int(failed or 0),
                }
        return counts

    def drop(self, batch_id: str) -> None:
        """A finalised batch's lines (its results are in its files, its counts in its row), and what its
        tenant's stream, lease set and backoff set still hold of them (a cancelled or expired batch's pending
        lines: left there, each was read and skipped ahead of the tenant's other lines, and kept in Redis
        while no batch of the model ran)."""
        model, tenant = self._redis.mget(self._key(batch_id, "m"), self._key(batch_id, "t"))
        if isinstance(model, bytes) and isinstance(tenant, bytes):
            self._drop_entries(batch_id, model.decode(), tenant.decode())
        self._redis.delete(*(self._key(batch_id, suffix) for suffix in "sroaunxmte"))

    def _drop_entries(self, batch_id: str, model: str, tenant: str) -> None:
        stream = f"{self._prefix}q:{model}:{tenant}"
        leases, delayed = f"{self._prefix}leases:{model}:{tenant}", f"{self._prefix}d:{model}"
        entries = self._redis.hscan_iter(self._key(batch_id, "e"), count=_CHUNK)
        while chunk := list(itertools.islice(entries, _CHUNK)):
            ids = [entry for _, entry in chunk]
            with self._redis.pipeline(transaction=False) as pipe:
                pipe.xack(stream, _GROUP, *ids)
                pipe.xdel(stream, *ids)
                pipe.zrem(leases, *ids)
                pipe.zrem(delayed, *(f"{batch_id}|{int(line)}" for line, _ in chunk))
                pipe.execute(raise_on_error=False)  # (the stream may be gone: its tenant left the queue)

    def tidy(self, unfinished: Callable[[list[str]], set[str]], idle_ms: int = 3_600_000) -> int:
        """Drop the keys of batches that are finished or gone (a gateway died between finalising and
        dropping), each batch's status read after its keys were found (a batch whose lines are being
        queued has its row already: it is kept), and the consumers of runners gone for an hour with
        nothing pending. How many batches."""
        dropped = 0
        found = (
            key.decode().removeprefix(f"{self._prefix}b:").removesuffix(":m")
            for key in self._redis.scan_iter(self._key("*", "m"), count=500)
        )
        while some := list(itertools.islice(found, 500)):
            running = unfinished(some)
            for batch_id in some:
                if batch_id not in running:
                    self.drop(batch_id)
                    dropped += 1
        for stream in self._redis.scan_iter(f"{self._prefix}q:*", count=500):
            with contextlib.suppress(redis.ResponseError):  # no group yet
                for consumer in self._redis.xinfo_consumers(stream, _GROUP):
                    if consumer["pending"] == 0 and consumer["idle"] > idle_ms:
                        self._redis.xgroup_delconsumer(stream, _GROUP, consumer["name"])
        return dropped
