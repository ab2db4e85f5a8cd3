"""The router: each model's policy applied to its routable replicas, with in-flight accounting,
circuit breakers, a retry budget, and a log of recent decisions for the admin view."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection, Mapping

from corral.protocol import NoCapacity
from corral.routing.circuit import RetryBudget
from corral.routing.policy import DEFAULT_POLICY, RoutingPolicy, policy_named
from corral.routing.replicas import Replica, ReplicaSet
from corral.routing.request import RouteRequest

__all__ = ["Router"]


class Router:
    """Picks a replica for each request and counts what is outstanding on each."""

    def __init__(
        self,
        replicas: ReplicaSet,
        policies: Mapping[str, str] | None = None,
        default_policy: str = DEFAULT_POLICY,
        decisions_kept: int = 200,
    ) -> None:
        self.replicas = replicas
        self._default = default_policy
        self._policies: dict[str, RoutingPolicy] = {m: policy_named(p) for m, p in (policies or {}).items()}
        self.retry_budget = RetryBudget()
        self._decisions: deque[tuple[float, str, str, str, str, bool]] = deque(maxlen=decisions_kept)

    def policy_for(self, model: str) -> RoutingPolicy:
        policy = self._policies.get(model)
        if policy is None:
            policy = self._policies[model] = policy_named(self._default)
        return policy

    def acquire(self, request: RouteRequest, exclude: Collection[Replica] = ()) -> Replica:
        """A routable replica for the request, now counted as outstanding; else NoCapacity."""
        candidates = [
            r for r in self.replicas.ready(request.model) if r.breaker.allows() and r not in exclude
        ]
        if not candidates:
            raise NoCapacity(
                f"No ready replica of model '{request.model}' can take the request now.",
                retry_after=self.replicas.retry_after(request.model),
            )
        policy = self.policy_for(request.model)
        decision = policy.pick(candidates, request)
        replica = decision.replica
        replica.breaker.on_dispatch()
        replica.outstanding += 1
        replica.outstanding_tokens += request.tokens
        self._decisions.append(
            (time.time(), request.model, replica.id, policy.name, decision.reason, bool(exclude))
        )
        return replica

    @property
    def decisions(self) -> list[dict[str, object]]:
        """The latest routing decisions, oldest first."""
        keys = ("at", "model", "replica", "policy", "reason", "retry")
        return [dict(zip(keys, d, strict=True)) for d in self._decisions]

    @staticmethod
    def release(replica: Replica, request: RouteRequest, ok: bool | None) -> None:
        """The request is done with `replica`: ok=True success, False replica failure, None not its fault."""
        replica.outstanding -= 1
        replica.outstanding_tokens -= request.tokens
        replica.served += 1
        if ok is True:
            replica.breaker.on_success()
        elif ok is False:
            replica.breaker.on_failure()
