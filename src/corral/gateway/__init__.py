"""The data plane: app assembly, pipeline stages, relay."""

from corral.gateway.app import build_app
from corral.gateway.server import GatewayServer

__all__ = ["GatewayServer", "build_app"]
