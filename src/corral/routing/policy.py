"""Routing policies: pick one replica from the ready candidates."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Protocol

from corral.routing.replicas import Replica

__all__ = ["POLICIES", "LeastOutstandingRequests", "RoutingPolicy", "policy_named"]


class RoutingPolicy(Protocol):
    """Chooses a replica for a request; candidates are ready and non-empty."""

    name: str

    def pick(self, candidates: Sequence[Replica]) -> Replica: ...


class LeastOutstandingRequests:
    """The replica with the fewest requests in flight from this gateway; ties rotate."""

    name = "least_outstanding_requests"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, candidates: Sequence[Replica]) -> Replica:
        start = next(self._turn) % len(candidates)
        best = candidates[start]
        for i in range(1, len(candidates)):
            replica = candidates[(start + i) % len(candidates)]
            if replica.outstanding < best.outstanding:
                best = replica
        return best


POLICIES: dict[str, Callable[[], RoutingPolicy]] = {
    LeastOutstandingRequests.name: LeastOutstandingRequests,
}


def policy_named(name: str) -> RoutingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
