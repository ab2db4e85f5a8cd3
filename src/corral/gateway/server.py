"""Running the gateway app on a socket inside an existing event loop."""

from __future__ import annotations

import logging
from pathlib import Path

from aiohttp import web

from corral.config import GatewaySettings
from corral.gateway.app import build_app
from corral.gateway.services import GatewayServices
from corral.routing import Router

__all__ = ["GatewayServer"]

logger = logging.getLogger(__name__)


class GatewayServer:
    """The gateway listening on host:port; `stop` drains in-flight requests within the grace period."""

    def __init__(
        self,
        settings: GatewaySettings,
        router: Router,
        services: GatewayServices,
        worker: int | None = None,
        metrics_dir: Path | None = None,
    ) -> None:
        """`worker`: this process's index among `gateway.workers` sharing the port (SO_REUSEPORT), whose
        metrics are summed from `metrics_dir`; None for the one gateway of a single-process cluster."""
        self._settings = settings
        self._reuse_port = worker is not None
        self._runner = web.AppRunner(
            build_app(settings, router, services, worker, metrics_dir),
            handler_cancellation=True,  # a client that disconnects cancels its upstream request
            access_log=None,
            shutdown_timeout=settings.shutdown_grace,
        )
        self.port: int | None = None

    async def start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(
            self._runner,
            self._settings.host,
            self._settings.port,
            backlog=1024,
            reuse_port=self._reuse_port or None,
        )
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        logger.info("gateway listening on http://%s:%s", self._settings.host, self.port)

    async def stop(self) -> None:
        await self._runner.cleanup()
