"""The replica set as the supervisor publishes it to gateway worker processes, and its mirror in each.

With `gateway.workers: N` one supervisor owns the replicas; each worker keeps a mirror of the replica set
(membership, state, address, engine facts, the engine's own load) made from the snapshots the supervisor
sends over a local socket (`cluster/workers.py`). What a worker learns by itself stays its own: requests in
flight from it, and its circuit breakers. A replica's `capacity` is split between the workers, so that
their queues together admit what the engine runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson

from corral.engines import EngineFeatures, EngineLoad
from corral.routing.replicas import Replica, ReplicaSet, ReplicaState, TrafficSplit

__all__ = ["apply_snapshot", "capacity_share", "replica_snapshot"]

_SHARED = (
    "engine",
    "url",
    "context_length",
    "api_key",
    "pid",
    "node",
    "gpus",
    "restarts",
    "started_at",
    "last_error",
    "ready_eta",
    "revision",
    "admitted",
    "adapter_slots",
    "max_loras",
)


def replica_snapshot(replicas: ReplicaSet) -> bytes:
    """The replica set as one JSON document: models (in order) and each replica's published fields."""
    members = []
    for replica in replicas:
        entry: dict[str, Any] = {name: getattr(replica, name) for name in _SHARED}
        entry.update(
            id=replica.id,
            model=replica.model,
            state=str(replica.state),
            capacity=replica.capacity,
            features=dataclasses.asdict(replica.features),
            load=dataclasses.asdict(replica.load) if replica.load is not None else None,
            log_tail=list(replica.log_tail),
            adapters=list(replica.adapters),
        )
        members.append(entry)
    return orjson.dumps(
        {
            "models": replicas.models(),
            "replicas": members,
            "splits": {m: [s.revision, s.share] for m, s in replicas.splits.items()},
            "on_demand": replicas.on_demand,
            "declared": {m: [dataclasses.asdict(f), c] for m, (f, c) in replicas.declared.items()},
            "rollouts": replicas.rollouts,
            "events": list(replicas.events),
        }
    )


def capacity_share(capacity: int | None, worker: int, workers: int) -> int | None:
    """Worker `worker`'s part of a replica's `capacity` (parts differ by at most one and add up)."""
    if capacity is None or workers <= 1:
        return capacity
    return max(1, capacity // workers + (1 if worker < capacity % workers else 0))


def apply_snapshot(replicas: ReplicaSet, snapshot: bytes, worker: int = 0, workers: int = 1) -> None:
    """Make the mirror `replicas` match a published snapshot; local counters and breakers are kept."""
    data = orjson.loads(snapshot)
    for model in set(replicas.models()) - set(data["models"]):
        replicas.forget(model)  # removed from the running cluster (`corral apply`)
    for model in data["models"]:
        replicas.declare(model)
    known = {r.id: r for r in replicas}
    published = set()
    for entry in data["replicas"]:
        published.add(entry["id"])
        replica = known.get(entry["id"])
        features = EngineFeatures(**entry["features"])
        if replica is None:
            replica = Replica(id=entry["id"], model=entry["model"], engine=entry["engine"], features=features)
            replicas.add(replica)
        elif replica.features != features or replica.context_length != entry["context_length"]:
            replica.features = features
            replicas.changed(replica.model)
        for name in _SHARED:
            setattr(replica, name, entry[name])
        replica.adapters = tuple(entry["adapters"])
        replica.state = ReplicaState(entry["state"])
        replica.capacity = capacity_share(entry["capacity"], worker, workers)
        replica.load = EngineLoad(**entry["load"]) if entry["load"] is not None else None
        replica.log_tail = tuple(entry["log_tail"])
    for rid, replica in known.items():
        if rid not in published:
            replicas.remove(replica)
    replicas.splits = {m: TrafficSplit(rev, share) for m, (rev, share) in data["splits"].items()}
    replicas.on_demand = data["on_demand"]
    declared = {m: (EngineFeatures(**f), c) for m, (f, c) in data["declared"].items()}
    if declared != replicas.declared:
        replicas.declared = declared
        for model in declared:
            replicas.changed(model)
    replicas.rollouts = data["rollouts"]
    replicas.events.clear()
    replicas.events.extend(data["events"])
