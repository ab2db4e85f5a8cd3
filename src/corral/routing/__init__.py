"""Replica set, load tracking and routing policies."""

from corral.routing.policy import POLICIES, LeastOutstandingRequests, RoutingPolicy, policy_named
from corral.routing.replicas import EngineLoad, Replica, ReplicaSet, ReplicaState
from corral.routing.router import Router

__all__ = [
    "POLICIES",
    "EngineLoad",
    "LeastOutstandingRequests",
    "Replica",
    "ReplicaSet",
    "ReplicaState",
    "Router",
    "RoutingPolicy",
    "policy_named",
]
