"""The control plane: supervisor and replica runtimes."""

from corral.cluster.runtime import (
    AttachedReplica,
    LocalProcessRuntime,
    ReplicaRuntime,
    RunningReplica,
    free_port,
)
from corral.cluster.supervisor import Supervisor
from corral.cluster.workers import WorkerError, WorkerPool

__all__ = [
    "AttachedReplica",
    "LocalProcessRuntime",
    "ReplicaRuntime",
    "RunningReplica",
    "Supervisor",
    "WorkerError",
    "WorkerPool",
    "free_port",
]
