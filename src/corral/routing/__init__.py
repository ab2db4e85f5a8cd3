"""Replica set, load tracking, routing policies, circuit breakers and the prefix index."""

from corral.routing.circuit import CircuitBreaker, CircuitState, RetryBudget
from corral.routing.policy import (
    DEFAULT_POLICY,
    POLICIES,
    Decision,
    LeastOutstandingRequests,
    LeastOutstandingTokens,
    PowerOfTwo,
    PrefixAffinity,
    RoundRobin,
    RoutingPolicy,
    SessionAffinity,
    policy_named,
)
from corral.routing.prefix import PrefixIndex
from corral.routing.replicas import (
    Replica,
    ReplicaSet,
    ReplicaState,
    TrafficSplit,
)
from corral.routing.request import RouteRequest, prefix_hashes
from corral.routing.router import Router

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "CircuitBreaker",
    "CircuitState",
    "Decision",
    "LeastOutstandingRequests",
    "LeastOutstandingTokens",
    "PowerOfTwo",
    "PrefixAffinity",
    "PrefixIndex",
    "Replica",
    "ReplicaSet",
    "ReplicaState",
    "RetryBudget",
    "RoundRobin",
    "RouteRequest",
    "Router",
    "RoutingPolicy",
    "SessionAffinity",
    "TrafficSplit",
    "policy_named",
    "prefix_hashes",
]
