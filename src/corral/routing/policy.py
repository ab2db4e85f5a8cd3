"""Routing policies: pick one replica from the ready candidates, and say why.

- round_robin: the next replica in turn.
- least_outstanding_requests: the fewest requests in flight from this gateway.
- least_outstanding_tokens: the fewest estimated tokens (prompt + max output) in flight.
- power_of_two: the less loaded of two random replicas.
- session_affinity: the same replica for the same `user` / `x-session-id` (rendezvous hashing), among
  replicas within a load bound.
- prefix_affinity (the default): the replica where the request costs least by predicted work: the prompt
  tokens it would have to compute (the part not likely in that replica's prefix cache), which also stall
  the requests running there, the prefill already waiting there, and the decode it shares with the
  requests in flight there, among replicas within a load bound and not under KV pressure. With
  `gateway.prefill_coalescing` the router also holds a request whose long prefix is being computed on its
  replica right now until that prefill ends (see router.py).
"""

from __future__ import annotations

import hashlib
import itertools
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from corral.routing.prefix import PrefixIndex
from corral.routing.replicas import Replica
from corral.routing.request import PREFIX_BLOCK_CHARS, PrefixHasher, RouteRequest

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "Decision",
    "LeastOutstandingRequests",
    "LeastOutstandingTokens",
    "PowerOfTwo",
    "PrefixAffinity",
    "RoundRobin",
    "RoutingPolicy",
    "SessionAffinity",
    "policy_named",
]


@dataclass(frozen=True, slots=True)
class Decision:
    replica: Replica
    reason: str
    cached_blocks: int = 0  # leading prompt blocks the replica likely holds in its prefix cache


class RoutingPolicy(Protocol):
    """Chooses a replica for a request; candidates are ready, allowed by their breaker, and non-empty."""

    name: str

    def pick(self, candidates: Sequence[Replica], request: RouteRequest) -> Decision: ...


def load_score(replica: Replica) -> float:
    """In-flight requests from this gateway plus what the engine itself reports queued."""
    engine = replica.load
    waiting = engine.waiting if engine is not None else 0
    return replica.outstanding + waiting


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, candidates: Sequence[Replica], request: RouteRequest) -> Decision:
        return Decision(candidates[next(self._turn) % len(candidates)], "next in turn")


class LeastOutstandingRequests:
    """The replica with the fewest requests in flight from this gateway; ties rotate."""

    name = "least_outstanding_requests"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, candidates: Sequence[Replica], request: RouteRequest) -> Decision:
        start = next(self._turn) % len(candidates)
        best = candidates[start]
        for i in range(1, len(candidates)):
            replica = candidates[(start + i) % len(candidates)]
            if replica.outstanding < best.outstanding:
                best = replica
        return Decision(best, f"{best.outstanding} in flight")


class LeastOutstandingTokens:
    name = "least_outstanding_tokens"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, candidates: Sequence[Replica], request: RouteRequest) -> Decision:
        start = next(self._turn) % len(candidates)
        rotated = [*candidates[start:], *candidates[:start]]
        best = min(rotated, key=lambda r: r.outstanding_tokens)
        return Decision(best, f"{best.outstanding_tokens} tokens in flight")


class PowerOfTwo:
    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def pick(self, candidates: Sequence[Replica], request: RouteRequest) -> Decision:
        if len(candidates) == 1:
            return Decision(candidates[0], "only candidate")
        a, b = self._rng.sample(list(candidates), 2)
        best = a if load_score(a) <= load_score(b) else b
        return Decision(best, f"less loaded of {a.id} and {b.id}")


class SessionAffinity:
    """Rendezvous hashing with bounded load: a session keeps its replica while it is ready and within the
    load bound (`(1 + slack) × mean load + spill`, as prefix_affinity's), and moves minimally otherwise: one
    busy session (a client that sends one `user` for all its traffic) spills to its next replicas instead of
    queueing everything on one."""

    name = "session_affinity"

    def __init__(self, slack: float = 0.5, spill: float = 16) -> None:
        self._fallback = LeastOutstandingRequests()
        self._slack = slack
        self._spill = spill

    def pick(self, candidates: Sequence[Replica], request: RouteRequest) -> Decision:
        if not request.session:
            return self._fallback.pick(candidates, request)
        key = request.session.encode()

        def rank(replica: Replica) -> bytes:
            return hashlib.blake2b(key + replica.id.encode(), digest_size=8).digest()

        best = max(candidates, key=rank)
        bound = (1 + self._slack) * (sum(map(load_score, candidates)) / len(candidates)) + self._spill
        if load_score(best) <= bound:
            return Decision(best, "session affinity")
        best = max((r for r in candidates if load_score(r) <= bound), key=rank)  # (the least loaded is one)
        return Decision(best, "session affinity; its replica past the load bound")


class PrefixAffinity:
    """Prefix-cache affinity, balanced by predicted work, with bounded load.

    For each replica within the load bound (`(1 + slack) × mean load + spill`, where load is requests in
    flight plus the engine's own queue) and below the KV-pressure mark, the predicted cost of sending it the
    request, in prompt tokens of prefill:
    - the prefill already routed there and not yet done (the request waits behind it);
    - the prompt tokens it would compute itself (the part beyond the longest prefix it served before, which
      its cache likely still holds: the index keeps per replica as many blocks as the replica's KV cache
      has room for, where its engine says, in the engine's tokens per block learnt by `observe`, and
      forgets what the engine evicted where its KV events are followed (`_follow`)), once for
      its own wait and once per request in flight or queued there, each of which that prefill stalls or
      delays;
    - its decode: every step reads the KV of every sequence in the batch, so the request's steps are slower
      by the context in flight there, and it slows each running request's steps by its own context, for
      about its output length (its max_tokens, at most 256: a bound is not a forecast); `decode_weight`
      converts a token of context read per step into prefill tokens (the planner's step model gives 0.0004
      to 0.0024 for dense models on L4 to H100; 0.001);
    - a whole prompt's worth per request it would have to queue beyond the engine's slots.
    With prefill coalescing (`coalescing`, set by the router) a cold prefill counts once more, as the fleet
    work it duplicates: a request whose prefix is being computed on its replica then waits for it there
    rather than computing it again on an idle one.
    The cheapest wins; ties go to the less loaded, then in turn. A cache hit wins while the hit replica's
    queue of prefill is shorter than the cold prefill elsewhere, and while its decode load is not worth more
    than that prefill: a prefix every request shares spreads over the fleet as soon as one replica's batch
    costs more than computing the prefix once elsewhere.
    """

    name = "prefix_affinity"
    needs_prompt = True

    def __init__(
        self,
        slack: float = 0.5,
        spill: float = 16,
        kv_pressure: float = 0.95,
        max_blocks: int = 25_000,
        decode_weight: float = 0.001,
    ) -> None:
        self._turn = itertools.count()
        self.decode_weight = decode_weight
        self.coalescing = False  # set by a router that coalesces prefills
        self._slack = slack
        self._spill = spill
        self._kv_pressure = kv_pressure
        self.index = PrefixIndex(max_blocks)
        self.hasher = PrefixHasher()
        # engine tokens per index block, from the answers' usage (prompt tokens per prompt block): the mean
        # of the latest tenants' own estimates (tenant → [its running mean, its answers]), and their sum
        self.block_tokens = _BLOCK_TOKENS
        self._tenants_learnt: OrderedDict[str, list[float]] = OrderedDict()
        self._learnt_sum = 0.0
        # per replica whose KV events are followed: [its cache's clears, its eviction frontier] last seen
        self._followed: dict[str, list[float]] = {}
        self.clock = time.time  # when requests end, on the clock of the engines' KV events
        # with several gateway workers: this worker's placements and requests' ends, for the others
        # ([replica id, prompt block hashes, None or when the request ended, its mark]); `wake` when it fills
        self.outbox: list[tuple[str, Sequence[int], float | None, float]] | None = None
        self.wake: Callable[[], None] = _nothing
        self._learnt: dict[float, Sequence[int]] = {}  # other workers' running requests' blocks, by mark

    def pick(self, candidates: Sequence[Replica], request: RouteRequest) -> Decision:
        hashes = request.hash_prompt(self.hasher)
        start = next(self._turn) % len(candidates)  # equal candidates take turns
        if not hashes:  # a prompt shorter than one block: nothing to be affine to
            best = candidates[start]
            for i in range(1, len(candidates)):
                replica = candidates[(start + i) % len(candidates)]
                if load_score(replica) < load_score(best):
                    best = replica
            return Decision(best, "short prompt; least loaded")
        for replica in candidates:
            self._follow(replica)
        loads = {r.id: load_score(r) for r in candidates}
        bound = (1 + self._slack) * (sum(loads.values()) / len(candidates)) + self._spill
        rotated = [*candidates[start:], *candidates[:start]]
        within = [r for r in rotated if loads[r.id] <= bound and not self._pressed(r)] or rotated
        depths = self.index.depths(hashes, within)
        blocks = len(hashes)
        prompt = max(request.prompt_tokens, blocks)
        # max_tokens bounds the answer, it does not forecast it: price at most a typical answer's steps
        output = min(max(1, request.tokens - request.prompt_tokens), _PRICED_OUTPUT)
        context = prompt + output
        decode = self.decode_weight * output  # × the context per step

        def cost(replica: Replica) -> tuple[float, float]:
            load = loads[replica.id]
            uncached = prompt * (1 - depths.get(replica.id, 0) / blocks)
            queued = (
                max(0, replica.outstanding + request.sequences - replica.capacity) if replica.capacity else 0
            )
            return (
                replica.pending_prefill
                + uncached * (1 + load + self.coalescing)
                + decode * (replica.outstanding_tokens + load * context)
                + prompt * queued,
                load,
            )

        best = min(within, key=cost)
        depth = depths.get(best.id, 0)
        # a mark of its own on the blocks while it runs: its end frees them unless another uses them since
        request.use = use = -1.0 - random.getrandbits(52)
        self.index.record(hashes, best, self.cache_blocks(best), use)
        if self.outbox is not None:
            self._tell((best.id, hashes, None, use))
        reason = (
            f"prefix match {depth}/{blocks} blocks; {best.pending_prefill} tokens of prefill waiting"
            if depth
            else f"no cached prefix; {best.pending_prefill} tokens of prefill waiting"
        )
        return Decision(best, reason, depth)

    def ended(self, replica: Replica, request: RouteRequest) -> None:
        """A request routed by this policy ended: its engine freed its prompt's blocks now. Noted where the
        replica's KV events are followed, whose evictions are matched against these times."""
        if request.hashes and _followed(replica):
            when = self.clock()
            self.index.ended(request.hashes, replica, when, request.use)
            if self.outbox is not None:  # (the others know its blocks by its mark, from its placement)
                self._tell((replica.id, (), when, request.use))

    def learn(self, replica: Replica, hashes: Sequence[int], ended: float | None, use: float) -> None:
        """Another gateway worker sent a request with these prompt blocks to `replica` (`ended` None),
        or such a request ended then (`use`: its mark)."""
        learnt = self._learnt
        if ended is None:
            self.index.record(hashes, replica, self.cache_blocks(replica), use)
            if _followed(replica):  # its end will come by its mark alone
                learnt[use] = hashes
                if len(learnt) > _LEARNT_KEPT:  # ends that never came (a worker that died)
                    del learnt[next(iter(learnt))]
        else:
            hashes = learnt.pop(use, hashes)
            if _followed(replica):
                self.index.ended(hashes, replica, ended, use)

    def _tell(self, entry: tuple[str, Sequence[int], float | None, float]) -> None:
        assert self.outbox is not None
        self.outbox.append(entry)
        if len(self.outbox) == 1:
            self.wake()

    def observe(self, request: RouteRequest, prompt_tokens: int) -> None:
        """A request ended with the engine's count of its prompt tokens: the engine's tokens per prompt
        block, which turns a replica's KV cache (in tokens) into the index's blocks, are learnt from it.

        Only from prompts of text as the engine reads it: not one whose tokens per byte no text gives (1 per
        32 bytes to 1 per 2), nor a chat with content parts (routing reads them as their Python text: an
        image's base64 is many characters and few tokens). Looking for those is a scan of the prompt (about
        1 µs a KB), made only for an answer far from its tenant's estimate: one near it moves little. Each
        tenant's answers make its own estimate, and the policy's is the mean of the latest tenants': one
        tenant's prompts (emoji, images) move it for the others by their share at most."""
        prompt = request.prompt
        blocks = (len(prompt) if prompt.isascii() else len(prompt.encode())) / PREFIX_BLOCK_CHARS
        if blocks < _LEARN_BLOCKS or prompt_tokens <= 0:  # (a short prompt's template tokens would skew it)
            return
        per_block = prompt_tokens / blocks
        if not _BLOCK_TOKENS_RANGE[0] <= per_block <= _BLOCK_TOKENS_RANGE[1]:
            return
        mine = self._tenants_learnt.get(request.tenant)
        expected = mine[0] if mine is not None else self.block_tokens
        if abs(per_block - expected) > _NEAR * expected and _CONTENT_PARTS in prompt:
            return
        self._learn(request.tenant, per_block, mine)

    def _learn(self, tenant: str, per_block: float, mine: list[float] | None) -> None:
        learnt = self._tenants_learnt
        if mine is None:
            learnt[tenant] = [per_block, 1.0]
            self._learnt_sum += per_block
            if len(learnt) > _TENANTS_LEARNT:
                self._learnt_sum -= learnt.popitem(last=False)[1][0]
        else:
            learnt.move_to_end(tenant)
            mine[1] += 1
            step = max(_LEARNING, 1 / mine[1]) * (per_block - mine[0])  # the plain mean of its first answers
            mine[0] += step
            self._learnt_sum += step
        self.block_tokens = self._learnt_sum / len(learnt)

    def keep(self, replica_ids: set[str]) -> None:
        """Forget the replicas not among these (they left the cluster)."""
        self.index.keep(replica_ids)
        for rid in [rid for rid in self._followed if rid not in replica_ids]:
            del self._followed[rid]

    def _follow(self, replica: Replica) -> None:
        """Bring `replica`'s index in line with its engine's KV events, where they are followed: forget the
        blocks the engine must have evicted (those freed before a block it evicted was cached), and all of
        them when its cache was emptied (a reset, a restart)."""
        load = replica.load
        if load is None or load.kv_cached_tokens is None:
            return
        seen = self._followed.get(replica.id)
        if seen is None:
            self._followed[replica.id] = [load.kv_cleared_total, load.kv_evicted_through]
            return
        if load.kv_cleared_total != seen[0]:
            self.index.forget(replica.id)
        elif load.kv_evicted_through > seen[1]:
            self.index.evict_through(replica.id, load.kv_evicted_through)
        seen[0], seen[1] = load.kv_cleared_total, load.kv_evicted_through

    def describe(self, replicas: Sequence[Replica]) -> dict[str, object]:
        """What the index believes, for the admin view: tokens per block, and per replica the blocks it
        holds against the blocks of the replica's KV cache (None: its engine does not say)."""
        for replica in replicas:
            self._follow(replica)
        held = self.index.held()
        return {
            "tokens_per_block": round(self.block_tokens, 2),
            "replicas": {
                r.id: {
                    "blocks": held.get(r.id, 0),
                    "cache_blocks": self.cache_blocks(r),
                    # what the engine's KV events say it holds, in the index's blocks (None: not followed)
                    "engine_cached_blocks": round(r.load.kv_cached_tokens / self.block_tokens)
                    if r.load is not None and r.load.kv_cached_tokens is not None
                    else None,
                }
                for r in replicas
            },
        }

    def cache_blocks(self, replica: Replica) -> int | None:
        """The blocks of `replica`'s KV cache, in the index's blocks; None where its engine does not say."""
        load = replica.load
        tokens = load.kv_capacity_tokens if load is not None else None
        return min(max(1, round(tokens / self.block_tokens)), _MAX_CACHE_BLOCKS) if tokens else None

    def _pressed(self, replica: Replica) -> bool:
        load = replica.load
        return load is not None and load.kv_usage is not None and load.kv_usage >= self._kv_pressure


def _nothing() -> None:
    pass


def _followed(replica: Replica) -> bool:
    """Whether the replica's engine's KV events are followed (engines/kv_events.py)."""
    return replica.load is not None and replica.load.kv_cached_tokens is not None


_LEARNT_KEPT = 65_536  # other workers' requests in flight whose blocks are kept for their ends
_PRICED_OUTPUT = 256  # output tokens a request's decode is priced for at most (the default estimate)
_BLOCK_TOKENS = 32.0  # engine tokens per index block until answers say: about 4 bytes a token
_LEARNING = 0.05  # each answer's weight in a tenant's running mean of tokens per block, after its first 20
_LEARN_BLOCKS = 8  # prompts this long (about 1 KB) tell the tokens per block
_BLOCK_TOKENS_RANGE = (4.0, 64.0)  # what text gives: 1 token per 32 bytes to 1 per 2
_TENANTS_LEARNT = 64  # the latest tenants whose estimates of tokens per block are averaged
_NEAR = 0.25  # an answer this close to its tenant's estimate of tokens per block is learnt unexamined
_CONTENT_PARTS = "[{'"  # how a chat's list of content parts starts in routing's text (intake.prompt_text)
_MAX_CACHE_BLOCKS = 100_000  # a replica's bound at most (about 14 MB): 400 prompts' 32 KB the index reads

DEFAULT_POLICY = PrefixAffinity.name

POLICIES: dict[str, Callable[[], RoutingPolicy]] = {
    RoundRobin.name: RoundRobin,
    LeastOutstandingRequests.name: LeastOutstandingRequests,
    LeastOutstandingTokens.name: LeastOutstandingTokens,
    PowerOfTwo.name: PowerOfTwo,
    SessionAffinity.name: SessionAffinity,
    PrefixAffinity.name: PrefixAffinity,
}


def policy_named(name: str) -> RoutingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
