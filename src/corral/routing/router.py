"""The router: the policy applied to a model's ready replicas, with in-flight accounting."""

from __future__ import annotations

import time
from collections.abc import Collection

from corral.protocol import NoCapacity
from corral.routing.policy import RoutingPolicy
from corral.routing.replicas import Replica, ReplicaSet

__all__ = ["Router"]

_DEFAULT_RETRY_AFTER = 5.0


class Router:
    """Picks a replica for each request and counts what is outstanding on each."""

    def __init__(self, replicas: ReplicaSet, policy: RoutingPolicy) -> None:
        self.replicas = replicas
        self.policy = policy

    def acquire(self, model: str, exclude: Collection[Replica] = ()) -> Replica:
        """A ready replica of `model` not in `exclude`, now counted as outstanding; else NoCapacity."""
        candidates = self.replicas.ready(model)
        if exclude:
            candidates = [r for r in candidates if r not in exclude]
        if not candidates:
            raise NoCapacity(
                f"No ready replica of model '{model}' can take the request now.",
                retry_after=self.retry_after(model),
            )
        replica = self.policy.pick(candidates)
        replica.outstanding += 1
        return replica

    @staticmethod
    def release(replica: Replica) -> None:
        replica.outstanding -= 1
        replica.served += 1

    def retry_after(self, model: str) -> float:
        """Seconds until the soonest replica of `model` is expected to be ready again."""
        now = time.time()
        etas = [r.ready_eta - now for r in self.replicas.of(model) if r.ready_eta is not None]
        return max(1.0, min(etas)) if etas else _DEFAULT_RETRY_AFTER
