"""Running the gateway app on a socket inside an existing event loop."""

from __future__ import annotations

import logging
import ssl
from pathlib import Path
from typing import Any

from aiohttp import web

from corral.config import GatewaySettings, TLSSettings
from corral.gateway.app import build_app
from corral.gateway.clients import ClientAddresses, access_logger
from corral.gateway.connections import CappedSite, ConnectionCaps
from corral.gateway.parts import GatewayParts
from corral.routing import Router

__all__ = ["GatewayServer", "TLSError", "server_tls_context"]

logger = logging.getLogger(__name__)


class GatewayServer:
    """The gateway listening on host:port; `stop` drains in-flight requests within the grace period."""

    def __init__(
        self,
        settings: GatewaySettings,
        router: Router,
        parts: GatewayParts,
        worker: int | None = None,
        metrics_dir: Path | None = None,
    ) -> None:
        """`worker`: this process's index among `gateway.workers` sharing the port (SO_REUSEPORT), whose
        metrics are summed from `metrics_dir`; None for the one gateway of a single-process cluster."""
        self._settings = settings
        self._router, self._parts, self._worker, self._metrics_dir = router, parts, worker, metrics_dir
        self._reuse_port = worker is not None
        self._tls = server_tls_context(settings.tls) if settings.tls is not None else None
        self._runner: web.AppRunner | None = None
        self.connections = ConnectionCaps(
            settings.max_client_connections, ClientAddresses(settings.trusted_proxies)
        )
        self.port: int | None = None

    async def start(self) -> None:
        """Build the app in this event loop (its engine clients live here) and listen."""
        settings = self._settings
        logs: dict[str, Any] = {"access_log": None}
        if settings.access_log:
            log_class = access_logger(ClientAddresses(settings.trusted_proxies))
            logs = {"access_log": logging.getLogger("corral.access"), "access_log_class": log_class}
        self._runner = web.AppRunner(
            build_app(settings, self._router, self._parts, self._worker, self._metrics_dir),
            handler_cancellation=True,  # a client that disconnects cancels its upstream request
            shutdown_timeout=settings.shutdown_grace,
            # aiohttp closes a connection idle this long, also one that never completes a request
            keepalive_timeout=settings.idle_timeout,
            max_line_size=settings.max_header_bytes,
            max_field_size=settings.max_header_bytes,
            **logs,
        )
        await self._runner.setup()
        site = CappedSite(
            self._runner,
            self._settings.host,
            self._settings.port,
            self.connections,
            backlog=1024,
            reuse_port=self._reuse_port or None,
            ssl_context=self._tls,
        )
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        logger.info("gateway listening on %s://%s:%s", self.scheme, self._settings.host, self.port)

    @property
    def scheme(self) -> str:
        return "https" if self._tls is not None else "http"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


class TLSError(ValueError):
    """The configured certificate or key cannot be used; the message says which file and why."""


def server_tls_context(tls: TLSSettings) -> ssl.SSLContext:
    """A server context for TLS 1.2 and 1.3 with the spec's certificate chain and key (HTTP/1.1: aiohttp
    speaks no HTTP/2; an NGINX edge adds it)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(tls.cert, tls.key)
    except FileNotFoundError as exc:
        raise TLSError(f"gateway.tls: {exc.filename} does not exist") from exc
    except (ssl.SSLError, OSError) as exc:
        raise TLSError(f"gateway.tls: cannot use {tls.cert} with {tls.key}: {exc}") from exc
    context.set_alpn_protocols(["http/1.1"])
    return context
