"""The data plane: app assembly, pipeline stages, relay."""

from corral.gateway.app import build_app
from corral.gateway.server import GatewayServer
from corral.gateway.services import GatewayServices

__all__ = ["GatewayServer", "GatewayServices", "build_app"]
