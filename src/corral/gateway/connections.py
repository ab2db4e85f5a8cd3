"""A cap on the connections one client address holds open, enforced where connections are accepted; and
aiohttp's own refusals (a request it could not parse: a header past `gateway.max_header_bytes`, a bad
request line) answered in OpenAI's error shape instead of aiohttp's plain text.

A client that opens connections and sends nothing holds a file descriptor each until the idle timeout;
past `gateway.max_client_connections` from one address, a new connection is closed before aiohttp sees
it. Peers in `gateway.trusted_proxies` are exempt: behind the edge every connection comes from the edge,
whose own per-address limit is the outer layer. With native TLS a connection counts from the moment TCP
accepts it, its handshake included (which it must finish within _HANDSHAKE_TIMEOUT_S): asyncio tells the
application of a TLS connection only once its handshake is done, so a client that never sent a ClientHello
was never counted, and held a descriptor each for asyncio's own 60 s.

A client that stops reading its answer would hold it forever: the answer's writer waits for room in the
connection's buffer, a stream's relay stops reading its engine, and the replica's slot stays taken. When a
connection's write buffer stays full (asyncio paused its writing) and its client takes not one byte of it
for `gateway.send_timeout` seconds, it is closed (as NGINX's `send_timeout`: a client reading however
slowly is not); the request is then a client that left (aiohttp cancels its handler). One timer a pause,
none while the client keeps up: nothing is added to a chunk's way.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import sys
from asyncio import sslproto
from collections import Counter
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from corral.gateway.clients import ClientAddresses
from corral.protocol.errors import error_body

__all__ = ["CappedSite", "ConnectionCaps"]

logger = logging.getLogger(__name__)

_HANDSHAKE_TIMEOUT_S = 10.0  # a TLS client's handshake at most (a TLS 1.3 one takes a round trip)


class ConnectionCaps:
    """Open connections per client address, and the most one may hold."""

    def __init__(self, limit: int, exempt: ClientAddresses, send_timeout: float = 60.0) -> None:
        self._limit = limit
        self._exempt = exempt
        self._open: Counter[str] = Counter()
        self.send_timeout = send_timeout
        self.closed: Counter[str] = Counter()  # connections the gateway closed, by reason
        self.on_close: Callable[[str], None] | None = None  # told of each too (the app's metric)

    def close(self, reason: str) -> None:
        """Count a connection closed for `reason`: address_cap, send_timeout."""
        self.closed[reason] += 1
        if self.on_close is not None:
            self.on_close(reason)

    def acquire(self, address: str) -> bool:
        if self._exempt.trusts(address):
            return True
        if self._open[address] >= self._limit:
            self.close("address_cap")
            return False
        self._open[address] += 1
        return True

    def release(self, address: str) -> None:
        if self._exempt.trusts(address):
            return
        self._open[address] -= 1
        if self._open[address] <= 0:
            del self._open[address]

    def holding(self, address: str) -> int:
        return self._open[address]


class _OpenAIErrors(RequestHandler):
    """aiohttp's connection handler, answering the requests it refuses itself (a parse error is a 400, a
    handler's escape a 500) in OpenAI's error shape; it still logs them its own way."""

    __slots__ = ()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs it; raises if the answer began
        if status >= 500:
            text, kind, code = "the gateway failed on this request", "server_error", "internal_error"
        elif isinstance(exc, LineTooLong):
            text = "a request line or header field longer than the gateway accepts (gateway.max_header_bytes)"
            kind, code = "invalid_request_error", "header_too_long"
        else:
            phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Bad request"
            text, kind, code = (message or phrase)[:200], "invalid_request_error", "bad_http_request"
        body = error_body(text, kind, code)
        response = web.Response(status=status, body=body, content_type="application/json")
        response.force_close()
        return response


def _handlers(server: web.Server) -> Callable[[], RequestHandler]:
    """What `server()` makes, as _OpenAIErrors (aiohttp offers no hook for the handler's class; this
    reads the two attributes its own `Server.__call__` uses)."""
    loop, kwargs = server._loop, server._kwargs
    return lambda: _OpenAIErrors(server, loop=loop, **kwargs)


class _Capped(asyncio.Protocol):
    """Admits a connection under its address's cap, then hands every event to aiohttp's handler; closes
    it when its client takes nothing for the caps' send timeout (see above). `admit` False: the connection
    was admitted already, as TCP accepted it (the application side of a TLS connection: _CappedTLS)."""

    def __init__(self, make: Callable[[], Any], caps: ConnectionCaps, admit: bool = True) -> None:
        self._make, self._caps, self._admit = make, caps, admit
        self._inner: Any = None
        self._address = ""
        self._transport: asyncio.Transport | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._buffered = 0  # the write buffer's size when the deadline was set

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self._address = str(peer[0]) if peer else ""
        self._transport = cast(asyncio.Transport, transport)
        if self._admit and not self._caps.acquire(self._address):
            self._transport.abort()
            return
        self._inner = self._make()
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if self._inner is None:
            return
        if self._admit:
            self._caps.release(self._address)
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            if self._deadline is None and self._transport is not None:
                self._buffered = self._transport.get_write_buffer_size()
                loop = asyncio.get_running_loop()
                self._deadline = loop.call_later(self._caps.send_timeout, self._stalled)
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if self._inner is not None:
            self._inner.resume_writing()

    def _stalled(self) -> None:
        self._deadline = None
        if self._transport is None:
            return
        buffered = self._transport.get_write_buffer_size()
        if buffered != self._buffered:  # the client took some (or the answer's writer added some): wait on
            self._buffered = buffered
            loop = asyncio.get_running_loop()
            self._deadline = loop.call_later(self._caps.send_timeout, self._stalled)
            return
        self._caps.close("send_timeout")
        logger.warning(
            "closing the connection from %s: its client took nothing of the answer for %g s "
            "(gateway.send_timeout)",
            self._address,
            self._caps.send_timeout,
        )
        self._transport.abort()  # (connection_lost follows: aiohttp cancels the request's handler)


class _CappedTLS(asyncio.BufferedProtocol):
    """A TLS connection, admitted under its address's cap as TCP accepts it (before its handshake: see
    above), then handed to the event loop's own TLS protocol (what `create_server(ssl=...)` would have made,
    with a handshake timeout of _HANDSHAKE_TIMEOUT_S), whose application side is a `_Capped` that does not
    count it again. The TCP connection's events pass through to the TLS protocol; what the application
    writes goes from the TLS protocol to the TCP transport directly."""

    def __init__(self, make: Callable[[], Any], caps: ConnectionCaps, context: ssl.SSLContext) -> None:
        self._make, self._caps, self._context = make, caps, context
        self._tls: Any = None  # the TLS protocol, once the connection is admitted
        self._address = ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self._address = str(peer[0]) if peer else ""
        if not self._caps.acquire(self._address):
            cast(asyncio.Transport, transport).abort()  # (aborted: it reads nothing, and is told its loss)
            return
        loop = asyncio.get_running_loop()
        application = _Capped(self._make, self._caps, admit=False)
        self._tls = _tls_protocol(loop)(
            loop,
            application,
            self._context,
            None,  # (no one waits for the handshake: the application is told when it is done)
            server_side=True,
            ssl_handshake_timeout=_HANDSHAKE_TIMEOUT_S,
        )
        self._tls.connection_made(transport)

    def get_buffer(self, sizehint: int) -> Any:
        return self._tls.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self._tls.buffer_updated(nbytes)

    def eof_received(self) -> bool | None:
        return self._tls.eof_received() if self._tls is not None else None

    def pause_writing(self) -> None:
        if self._tls is not None:
            self._tls.pause_writing()

    def resume_writing(self) -> None:
        if self._tls is not None:
            self._tls.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._tls is None:
            return
        self._caps.release(self._address)
        self._tls.connection_lost(exc)


def _tls_protocol(loop: asyncio.AbstractEventLoop) -> Callable[..., Any]:
    """The TLS protocol of `loop`'s kind, as its own `create_server(ssl=...)` makes: uvloop's (compiled: a
    small streamed write through it cost about 0.9 µs less than through asyncio's, on loopback) or
    asyncio's. Both take asyncio's arguments (asyncio's is uvloop's, ported)."""
    uvloop = sys.modules.get("uvloop.loop")  # (imported where the loop is uvloop's)
    if uvloop is not None and isinstance(loop, uvloop.Loop):
        return cast(Callable[..., Any], uvloop.SSLProtocol)
    return sslproto.SSLProtocol


class CappedSite(web.BaseSite):
    """aiohttp's TCP site, with each accepted connection admitted by `caps` first (a TLS one before its
    handshake)."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        caps: ConnectionCaps,
        *,
        ssl_context: ssl.SSLContext | None = None,
        backlog: int = 1024,
        reuse_port: bool | None = None,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self._host, self._port, self._caps, self._reuse_port = host, port, caps, reuse_port

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None  # the runner is set up
        handlers, caps, context = _handlers(server), self._caps, self._ssl_context
        # TLS is layered by _CappedTLS itself (the listener is plain TCP), so that a connection counts
        # from its accept
        capped: Callable[[], asyncio.BaseProtocol] = (
            (lambda: _Capped(handlers, caps))
            if context is None
            else (lambda: _CappedTLS(handlers, caps, context))
        )
        self._server = await asyncio.get_running_loop().create_server(
            capped, self._host, self._port, backlog=self._backlog, reuse_port=self._reuse_port
        )
