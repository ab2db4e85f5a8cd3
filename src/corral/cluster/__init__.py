"""The control plane: supervisor and replica runtimes."""

from corral.cluster.runtime import (
    AttachedReplica,
    LocalProcessRuntime,
    ReplicaRuntime,
    RunningReplica,
    free_port,
)
from corral.cluster.supervisor import Supervisor

__all__ = [
    "AttachedReplica",
    "LocalProcessRuntime",
    "ReplicaRuntime",
    "RunningReplica",
    "Supervisor",
    "free_port",
]
