"""Running the gateway app on a socket inside an existing event loop."""

from __future__ import annotations

import asyncio
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

__all__ = ["CertificateReloader", "GatewayServer", "TLSError", "server_tls_context"]

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
        self._reloader = CertificateReloader(self._tls, settings.tls) if self._tls and settings.tls else None
        self._watch: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self.connections = ConnectionCaps(
            settings.max_client_connections, ClientAddresses(settings.trusted_proxies), settings.send_timeout
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
            build_app(settings, self._router, self._parts, self._worker, self._metrics_dir, self.connections),
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
        if self._reloader is not None:
            self._watch = asyncio.create_task(self._reloader.watch(), name="tls-reload")
        self.port = int(self._runner.addresses[0][1])
        logger.info("gateway listening on %s://%s:%s", self.scheme, self._settings.host, self.port)

    @property
    def scheme(self) -> str:
        return "https" if self._tls is not None else "http"

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
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
    except FileNotFoundError as exc:  # (ssl names no file: say which of the two is missing)
        pair = (("cert", tls.cert), ("key", tls.key))
        said = "; ".join(f"gateway.tls.{name}: {path}" for name, path in pair if not path.is_file())
        said = said or f"gateway.tls: {tls.cert} or {tls.key}"
        raise TLSError(f"{said}: no such file") from exc
    except (ssl.SSLError, OSError) as exc:
        raise TLSError(f"gateway.tls: cannot use {tls.cert} with {tls.key}: {exc}") from exc
    context.set_alpn_protocols(["http/1.1"])
    return context


class CertificateReloader:
    """A renewed certificate without a restart: every `check_interval` the cert and key files are looked at
    (inode, size, modification and change times); when they changed, a fresh context is made from them and,
    if the pair works, every new connection is given it (`sni_callback` runs on each handshake, with or
    without a server name, and hands the connection the current context; those open keep theirs). A fresh
    context, not a reload into the live one: OpenSSL keeps a certificate per key type, so a renewal from
    ECDSA to RSA loaded in place would leave the old ECDSA one served to most clients. A pair that does not
    work (the key of another certificate, a renewal half written) is logged and the certificate loaded
    before stays; it is tried again when the files change again."""

    def __init__(self, context: ssl.SSLContext, tls: TLSSettings) -> None:
        self._tls = tls
        self.current = context
        self._seen = self._stamp()
        context.sni_callback = self._hand_out

    def _hand_out(self, connection: ssl.SSLObject, name: str | None, context: ssl.SSLContext) -> None:
        if context is not self.current:
            connection.context = self.current

    def _stamp(self) -> tuple[tuple[int, int, int, int], ...] | None:
        try:
            files = (self._tls.cert.stat(), self._tls.key.stat())
        except OSError:
            return None  # (gone for a moment while a renewal replaces them)
        return tuple((s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns) for s in files)

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(self._tls.check_interval)
            self.check()

    def check(self) -> bool:
        """Use the files if they changed and work; whether a new pair is now handed out."""
        stamp = self._stamp()
        if stamp is None or stamp == self._seen:
            return False
        self._seen = stamp
        try:
            renewed = server_tls_context(self._tls)
        except TLSError as exc:
            logger.error("%s; new connections keep the certificate loaded before", exc)
            return False
        self.current = renewed
        logger.info("gateway.tls: loaded the renewed certificate %s for new connections", self._tls.cert)
        return True
