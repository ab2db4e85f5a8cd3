"""Routing policies: pick one replica from the ready candidates, and say why.

- round_robin: the next replica in turn.
- least_outstanding_requests: the fewest requests in flight from this gateway.
- least_outstanding_tokens: the fewest estimated tokens (prompt + max output) in flight.
- power_of_two: the less loaded of two random replicas.
- session_affinity: the same replica for the same `user` / `x-session-id` (rendezvous hashing).
- prefix_affinity (the default): the replica most likely to hold the prompt's prefix in its KV cache,
  unless it is loaded past the bound; load counts the engine's own queue and KV pressure too.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from corral.routing.prefix import PrefixIndex
from corral.routing.replicas import Replica
from corral.routing.request import RouteRequest

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
    """Rendezvous hashing: a session keeps its replica while it is ready, and moves minimally otherwise."""

    name = "session_affinity"

    def __init__(self) -> None:
        self._fallback = LeastOutstandingRequests()

    def pick(self, candidates: Sequence[Replica], request: RouteRequest) -> Decision:
        if not request.session:
            return self._fallback.pick(candidates, request)
        key = request.session.encode()
        best = max(candidates, key=lambda r: hashlib.blake2b(key + r.id.encode(), digest_size=8).digest())
        return Decision(best, "session affinity")


class PrefixAffinity:
    """Prefix-cache affinity with bounded load.

    The replica that served the longest prefix of this prompt most likely still has it in its KV cache;
    prefer it unless its load exceeds `(1 + slack) × mean load + 1` or its KV cache is nearly full, then
    take the best-matching replica within the bound, ties and misses going to the least loaded.
    """

    name = "prefix_affinity"
    needs_prompt = True

    def __init__(self, slack: float = 0.5, kv_pressure: float = 0.95, max_blocks: int = 200_000) -> None:
        self._turn = itertools.count()
        self._slack = slack
        self._kv_pressure = kv_pressure
        self.index = PrefixIndex(max_blocks)

    def pick(self, candidates: Sequence[Replica], request: RouteRequest) -> Decision:
        hashes = request.hashes
        start = next(self._turn) % len(candidates)  # equal candidates take turns
        if not hashes:  # a prompt shorter than one block: nothing to be affine to
            best = candidates[start]
            for i in range(1, len(candidates)):
                replica = candidates[(start + i) % len(candidates)]
                if load_score(replica) < load_score(best):
                    best = replica
            return Decision(best, "short prompt; least loaded")
        loads = {r.id: load_score(r) for r in candidates}
        bound = (1 + self._slack) * (sum(loads.values()) / len(candidates)) + 1
        rotated = [*candidates[start:], *candidates[:start]]
        within = [r for r in rotated if loads[r.id] <= bound and not self._pressed(r)] or rotated
        depths = self.index.depths(hashes, within)
        best = max(within, key=lambda r: (depths.get(r.id, 0), -loads[r.id], -r.outstanding_tokens))
        depth = depths.get(best.id, 0)
        self.index.record(hashes, best)
        reason = f"prefix match {depth} blocks" if depth else f"no cached prefix; load {loads[best.id]:g}"
        return Decision(best, reason)

    def _pressed(self, replica: Replica) -> bool:
        load = replica.load
        return load is not None and load.kv_usage is not None and load.kv_usage >= self._kv_pressure


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
