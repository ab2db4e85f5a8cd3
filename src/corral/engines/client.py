"""corral's HTTP/1.1 client to engines: keep-alive connections, one request at a time on each. The relay
sends every generation request through it, and the supervisor its health probes and metrics scrapes.

Every generation request crosses this client, so it does only what an engine exchange needs: the request
goes out as one buffer; the answer is parsed by llhttp (httptools, the parser uvicorn uses) in the socket's
own callbacks, and its body is handed over as the bytes arrived, with no per-read timer, queue or stream
object. aiohttp's client (still used for the gateway's other calls: tokenizing, the eval gate)
also builds URLs, cookie jars, header multidicts and trace hooks and arms a timer on every read, none of
which an engine on a known address needs; benchmarks/gateway_overhead.py measures what this saves.

Failures, as the relay tells them apart:
- `EngineUnreachable`: no connection could be made (refused, unresolvable, or not accepted within
  `connect_timeout`): the replica is down, and the relay tries another.
- `EngineDisconnected`: the connection closed or broke before the answer ended. A pooled connection that
  the engine closed just as it was reused (llama-server closes idle ones after a few seconds) is sent
  again once on a new connection here, since that says nothing about the replica's health.
- `TimeoutError`: no connection came free within `connect_timeout` (all `limit` of them busy), or the
  engine sent nothing for `read_timeout` seconds while its answer was awaited (time spent waiting on a
  slow client does not count).

A `base_url` may carry a path (an engine behind a proxy at `https://proxy/llama1`): requests go to that
path plus theirs. Idle connections are closed after `keepalive_s`, checked as requests come; so is what the
client knows of an engine's address once nothing has used it for that long (a replica that restarted
listens on another port: the old address is never asked again).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from typing import cast
from urllib.parse import urlsplit

import httptools

__all__ = [
    "AnswerTooLarge",
    "EngineClient",
    "EngineConnectionError",
    "EngineDisconnected",
    "EngineResponse",
    "EngineUnreachable",
]

_PAUSE_AT = 256 * 1024  # bytes of answer buffered before the socket stops being read (a slow client)
_CONTENT_TYPE = b"content-type"
_CONTENT_LENGTH = b"content-length"
_TRANSFER_ENCODING = b"transfer-encoding"
_RETRY_AFTER = b"retry-after"
_NO_BODY = frozenset({204, 304})


class EngineConnectionError(Exception):
    """The exchange with an engine failed below HTTP."""


class AnswerTooLarge(Exception):
    """An answer read whole is larger than its reader takes (`EngineResponse.read`'s limit)."""


class EngineUnreachable(EngineConnectionError):
    """No connection to the engine could be opened."""


class EngineDisconnected(EngineConnectionError):
    """The engine's connection closed or broke before its answer ended."""


class _Origin:
    """An engine's address, its path prefix, its Host header line and its idle connections (most recently
    used last); when a request last used it, and whether the client has forgotten it (its connections
    then close when their answer is done)."""

    __slots__ = ("forgotten", "header", "host", "idle", "port", "prefix", "tls", "url", "used")

    def __init__(self, url: str, now: float) -> None:
        self.url = url
        self.used = now
        self.forgotten = False
        parts = urlsplit(url)
        self.tls = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/").encode()
        name = f"[{self.host}]" if ":" in self.host else self.host.encode("idna").decode()
        authority = f"{name}:{parts.port}" if parts.port else name  # (never the URL's user:password@)
        self.header = b"Host: " + authority.encode() + b"\r\n\r\n"
        self.idle: deque[EngineResponse] = deque()


class EngineResponse(asyncio.Protocol):
    """One keep-alive connection and the answer to the request it carries now (HTTP/1.1 without
    pipelining carries one at a time, so the connection is the response)."""

    def __init__(self, client: EngineClient, origin: _Origin) -> None:
        self._client = client
        self._origin = origin
        self._loop = client.loop
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._watch: asyncio.TimerHandle | None = None
        self._read_timeout = client.read_timeout
        self._last_read = 0.0
        self._error: BaseException | None = None
        self._in_use = False
        self.answered = False  # a byte of the current answer came (a failure then is no stale connection)
        self.closed = False
        self.idle_since = 0.0
        self.status = 0
        self.content_type = "application/octet-stream"
        self.retry_after = b""  # the answer's Retry-After, as sent (a busy engine's 429 or 503)
        self.headers_done = False
        self.done = False
        self._framed = False  # the answer says where its body ends (a length, or chunks)
        self._keep_alive = False  # (llhttp forgets it once a message ends: kept from its headers)
        self._interim = False  # the message being parsed is a 1xx (Early Hints, say): not the answer

    # asyncio.Protocol -------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # (uvloop's is no asyncio.Transport subclass)

    def data_received(self, data: bytes) -> None:
        self._last_read = self._loop.time()
        self.answered = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(EngineDisconnected(f"the engine's answer is not valid HTTP: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._client.closed(self)
        if self.headers_done and not self.done and exc is None and not self._framed:
            self.on_message_complete()  # a body that ends with the connection (no length, not chunked)
        elif not self.done:
            why = f": {exc}" if exc is not None else ""
            self._fail(EngineDisconnected(f"the engine closed the connection{why}"))

    # httptools callbacks ----------------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == _CONTENT_TYPE:
            self.content_type = value.split(b";", 1)[0].strip().lower().decode("latin-1")
        elif name == _CONTENT_LENGTH:
            self._framed = True
        elif name == _TRANSFER_ENCODING:
            self._framed = value.rstrip().lower().endswith(b"chunked")
        elif name == _RETRY_AFTER:
            self.retry_after = value

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:  # an interim answer: the real one follows on the same connection
            self._interim = True
            self.content_type, self._framed, self.retry_after = "application/octet-stream", False, b""
            return
        self.status = status
        self._keep_alive = self._parser.should_keep_alive()
        self._framed = self._framed or status in _NO_BODY
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _PAUSE_AT and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.done = True
        self._unwatch()
        self._wake()

    # the exchange -----------------------------------------------------------------------------------

    def send(self, head: bytes, body: bytes) -> None:
        """Write a request (its head up to the Host line, then the body) and start the read watch."""
        assert self._transport is not None
        self.status, self.headers_done, self.done, self._error = 0, False, False, None
        self._framed = self._keep_alive = self._interim = False
        self.content_type, self.retry_after = "application/octet-stream", b""
        self.answered = False
        self._in_use = True
        self._last_read = self._loop.time()
        self._watch = self._loop.call_at(self._last_read + self._read_timeout, self._check_read)
        self._transport.write(head + self._origin.header + body)

    async def started(self) -> None:
        """Wait for the answer's status line and headers."""
        while not self.headers_done:
            await self._wait()

    def take(self) -> bytes:
        """The answer's bytes received since the last take (b"" if none yet)."""
        chunks = self._chunks
        if not chunks:
            return b""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._paused and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        return data

    async def chunk(self) -> bytes:
        """The next bytes of the answer's body; b"" once it has ended."""
        while not self._chunks:
            if self.done:
                return b""
            await self._wait()
        return self.take()

    async def read(self, limit: int | None = None) -> bytes:
        """The whole (rest of the) answer's body; AnswerTooLarge once it passes `limit` bytes (what came is
        dropped then: `release()` closes the connection)."""
        parts = []
        size = 0
        while True:
            # (a large answer is taken on the way: reading may be paused meanwhile)
            if self.done or self._buffered > _PAUSE_AT // 2:
                part = self.take()
                parts.append(part)
                size += len(part)
            if limit is not None and size + self._buffered > limit:
                parts.clear()
                raise AnswerTooLarge(f"the engine's answer is larger than {limit:,} bytes")
            if self.done:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            await self._wait()

    def release(self) -> None:
        """Done with the answer: the connection goes back to the pool if the answer was read to the end,
        else it closes (a client that went away: the engine sees the close and stops generating). Call it
        once; `close()` first is fine (a pooled connection may already carry another request)."""
        if not self._in_use:
            return
        self._in_use = False
        self._client.freed()
        if (
            self.done
            and not self.closed
            and not self._chunks
            and self._keep_alive
            and not self._origin.forgotten
        ):
            self.idle_since = self._loop.time()
            self._origin.idle.append(self)
        else:
            self.close()

    def close(self) -> None:
        """Close the connection, whatever it carries now."""
        self._unwatch()
        if not self.closed:
            self.closed = True
            self._client.closed(self)
            if self._transport is not None:
                self._transport.close()

    # internals --------------------------------------------------------------------------------------

    async def _wait(self) -> None:
        if self._error is None:
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        if self._error is not None:
            raise self._error

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._unwatch()
        self._wake()

    def _unwatch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def _check_read(self) -> None:
        """The read watch: one timer per request, moved on lazily to `read_timeout` after the last bytes;
        it does not fire while reading is paused for a slow client."""
        self._watch = None
        if self.done or self.closed:
            return
        now = self._loop.time()
        if not self._paused and now - self._last_read >= self._read_timeout:
            self._fail(TimeoutError(f"the engine sent nothing for {self._read_timeout:g} s"))
            self.close()
            return
        start = now if self._paused else self._last_read
        self._watch = self._loop.call_at(start + self._read_timeout, self._check_read)


class EngineClient:
    """Pooled keep-alive connections to engines; at most `limit` requests use one at once (more wait)."""

    def __init__(self, connect_timeout: float, read_timeout: float, limit: int, keepalive_s: float = 30.0):
        self.loop = asyncio.get_running_loop()
        self.read_timeout = read_timeout
        self._connect_timeout = connect_timeout
        self._limit = limit
        self._keepalive = keepalive_s
        self._busy = 0
        self._slots: deque[asyncio.Future[None]] = deque()
        self._origins: dict[str, _Origin] = {}
        self._open: set[EngineResponse] = set()
        self._tls: ssl.SSLContext | None = None
        self._swept = self.loop.time()

    async def post(
        self,
        base_url: str,
        path: str,
        body: bytes,
        authorization: str | None,
        extra: bytes = b"",
    ) -> EngineResponse:
        """POST `body` (JSON) to `base_url + path`: the response once its headers came. The caller reads
        its body and must `release()` it. `extra`: more header lines, whole (the request's id, the
        client's trace context: RequestContext.to_engine)."""
        head = b" HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
        head += b"\r\n"
        if authorization:  # (checked as printable ASCII where the spec is loaded)
            head += b"Authorization: Bearer " + authorization.encode("ascii") + b"\r\n"
        head += extra
        return await self._request(b"POST ", base_url, path, head, body)

    async def get(self, base_url: str, path: str) -> EngineResponse:
        """GET `base_url + path` (a probe: health, metrics), as `post`."""
        return await self._request(b"GET ", base_url, path, b" HTTP/1.1\r\n", b"")

    async def _request(
        self, method: bytes, base_url: str, path: str, head: bytes, body: bytes
    ) -> EngineResponse:
        origin = self._origins.get(base_url) or self._add_origin(base_url)
        head = method + origin.prefix + path.encode() + head
        if self._busy >= self._limit or self._slots:
            await self._slot()
        self._busy += 1
        try:
            idle = self._pooled(origin)
            if idle is not None:
                try:
                    return await self._exchange(idle, head, body)
                except EngineDisconnected:
                    if idle.answered:
                        raise
                # the engine closed that idle connection as it was reused: once more on a new one
            return await self._exchange(await self._connect(origin), head, body)
        except BaseException:
            self.freed()
            raise

    def close(self) -> None:
        """Close every connection (the gateway is stopping)."""
        for response in list(self._open):
            response.close()
        while self._slots:
            waiter = self._slots.popleft()
            if not waiter.done():
                waiter.set_exception(EngineUnreachable("the gateway is shutting down"))

    # told by EngineResponse -------------------------------------------------------------------------

    def freed(self) -> None:
        """A request is done with its connection: one waiting for a slot may go on."""
        self._busy -= 1
        self._wake_next()

    def _wake_next(self) -> None:
        while self._slots:
            waiter = self._slots.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def closed(self, response: EngineResponse) -> None:
        self._open.discard(response)

    # internals --------------------------------------------------------------------------------------

    async def _slot(self) -> None:
        """Wait (in turn, `connect_timeout` at most) for a request to give its connection up."""
        async with asyncio.timeout(self._connect_timeout):
            while self._busy >= self._limit or self._slots:
                waiter = self.loop.create_future()
                self._slots.append(waiter)
                try:
                    await waiter
                except BaseException:  # (cancelled or timed out) a wake-up it was given goes to the next
                    if waiter.done() and not waiter.cancelled():
                        self._wake_next()
                    elif waiter in self._slots:
                        self._slots.remove(waiter)
                    raise
                if self._busy < self._limit:
                    return

    async def _exchange(self, response: EngineResponse, head: bytes, body: bytes) -> EngineResponse:
        """Send on `response`'s connection and wait for the answer's headers (the slot stays the
        caller's: a failure here closes the connection and leaves the slot to `post`)."""
        response.send(head, body)
        try:
            await response.started()
        except BaseException:
            response._in_use = False
            response.close()
            raise
        return response

    def _pooled(self, origin: _Origin) -> EngineResponse | None:
        now = origin.used = self.loop.time()
        if now - self._swept > self._keepalive:
            self._sweep(now - self._keepalive)
        idle = origin.idle
        while idle:
            response = idle.pop()
            if not response.closed and response.idle_since > now - self._keepalive:
                return response
            response.close()
        return None

    def _sweep(self, stale: float) -> None:
        """Close the connections idle since before `stale` (oldest first in each pool), whichever engine;
        forget the engines no request has used since then, with no idle connection left."""
        self._swept = self.loop.time()
        for origin in list(self._origins.values()):
            idle = origin.idle
            while idle and (idle[0].closed or idle[0].idle_since <= stale):
                idle.popleft().close()
            if not idle and origin.used <= stale:
                origin.forgotten = True
                del self._origins[origin.url]

    def _add_origin(self, base_url: str) -> _Origin:
        try:
            origin = _Origin(base_url, self.loop.time())
        except (ValueError, UnicodeError) as exc:
            raise EngineUnreachable(f"{base_url!r} is not an address to connect to: {exc}") from exc
        self._origins[base_url] = origin
        return origin

    async def _connect(self, origin: _Origin) -> EngineResponse:
        response = EngineResponse(self, origin)
        self._open.add(response)
        try:
            async with asyncio.timeout(self._connect_timeout):
                await self.loop.create_connection(
                    lambda: response,
                    origin.host,
                    origin.port,
                    ssl=self._tls_context() if origin.tls else None,
                    server_hostname=origin.host if origin.tls else None,
                )
        except TimeoutError as exc:  # (an OSError too: named first) a dropped SYN, say: try another replica
            self._open.discard(response)
            raise EngineUnreachable(
                f"{origin.host}:{origin.port} accepted no connection within {self._connect_timeout:g} s"
            ) from exc
        except OSError as exc:
            self._open.discard(response)
            raise EngineUnreachable(f"cannot connect to {origin.host}:{origin.port}: {exc}") from exc
        except BaseException:
            self._open.discard(response)
            raise
        return response

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls
