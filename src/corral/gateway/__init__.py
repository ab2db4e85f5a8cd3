"""The data plane: app assembly, pipeline stages, relay."""

from corral.gateway.app import build_app
from corral.gateway.parts import AdminAccess, GatewayParts, ReplicaControl
from corral.gateway.server import GatewayServer

__all__ = ["AdminAccess", "GatewayParts", "GatewayServer", "ReplicaControl", "build_app"]
