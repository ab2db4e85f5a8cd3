"""Who the client is: its address through trusted proxies, its request's id, and the access log that names
both.

Behind an NGINX edge every connection comes from the edge. The edge sets `X-Forwarded-For` to the address
it saw; the gateway believes that header only from peers listed in `gateway.trusted_proxies`, and walks it
from the right, skipping trusted hops, so a client cannot choose its own address by sending the header.

Every request has an id, told back in the `x-request-id` header (as OpenAI's API does; the official clients
show it as `_request_id`) and written in the access log and beside any error logged for it: the edge's own
(`X-Request-Id` from a trusted proxy: NGINX's `$request_id`, so both logs name one id), else a random one
(96 bits: not a counter, which would tell a tenant how many requests others sent between two of its own).
"""

from __future__ import annotations

import functools
import ipaddress
import os
import re
import socket
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import StreamResponse

__all__ = ["PROXY_HEADERS", "REQUEST_ID", "ClientAddresses", "RequestIds", "access_logger", "trace_context"]

PROXY_HEADERS = ("Forwarded", "X-Forwarded-For", "X-Real-IP")
REQUEST_ID = web.RequestKey("request_id", str)  # where a request keeps its id
_GIVEN_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # an edge's id, taken as it is (nothing breaks a log line)

_Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class ClientAddresses:
    """Resolves a request's client address given the trusted proxies (addresses or CIDR networks)."""

    def __init__(self, trusted: list[str]) -> None:
        self._trusted: tuple[_Network, ...] = tuple(ipaddress.ip_network(t, strict=False) for t in trusted)

    def trusts(self, address: str | None) -> bool:
        if not self._trusted or not address:
            return False
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in network for network in self._trusted)

    def of(self, request: BaseRequest) -> str:
        """The peer, or, when the peer is a trusted proxy, the nearest untrusted X-Forwarded-For hop (the
        proxy itself where the header names no address there)."""
        return self._client(request) or request.remote or ""

    def _client(self, request: BaseRequest) -> str | None:
        """As `of`; None where a trusted proxy's X-Forwarded-For holds something that is no address."""
        peer = request.remote or ""
        if not self.trusts(peer):
            return peer
        # every X-Forwarded-For line (a proxy may add a line of its own rather than extend the last one)
        told = ",".join(request.headers.getall("X-Forwarded-For", ()))
        hops = [_address(h.strip()) for h in told.split(",") if h.strip()]
        for hop in reversed(hops):
            if hop is None:  # (not an address: nothing left of it can be believed)
                return None
            if not any(hop in network for network in self._trusted):
                return str(hop)
        return str(hops[0]) if hops else peer

    def scheme(self, request: BaseRequest) -> str:
        """The scheme the client used: the connection's, or (from a trusted proxy that ends TLS) its
        X-Forwarded-Proto."""
        if self.trusts(request.remote):
            told = request.headers.get("X-Forwarded-Proto", "").split(",")[0].strip().lower()
            if told in ("http", "https"):
                return told
        return request.scheme

    def is_local(self, request: BaseRequest) -> bool:
        """The client is on this machine: a loopback peer with no proxy in between, or a loopback client
        named by a trusted proxy that is itself on this machine (a proxy elsewhere saying 127.0.0.1 means
        its own host). A proxy the gateway does not trust makes every client remote."""
        peer = request.remote or ""
        if not _loopback(peer):
            return False
        if self.trusts(peer):
            client = self._client(request)
            return client is not None and _loopback(client)
        return not any(h in request.headers for h in PROXY_HEADERS)


def _address(hop: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """A hop's address (without the port some proxies add: `203.0.113.9:52000`, `[2001:db8::1]:443`);
    None where it is none."""
    for text in (hop, hop.strip("[]"), hop.rsplit(":", 1)[0].strip("[]")):
        try:
            return ipaddress.ip_address(text)
        except ValueError:
            continue
    return None


class RequestIds:
    """Gives each request its id (see the module's docstring)."""

    def __init__(self, addresses: ClientAddresses) -> None:
        self._addresses = addresses

    def assign(self, request: BaseRequest) -> str:
        given = request.headers.get("X-Request-Id")
        if given is not None and _GIVEN_ID.fullmatch(given) and self._addresses.trusts(request.remote):
            request[REQUEST_ID] = given
        else:
            request[REQUEST_ID] = given = "req_" + os.urandom(12).hex()  # (about 0.6 µs)
        return given


_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_TRACESTATE = re.compile(r"[\x20-\x7e]{1,512}")  # (printable: nothing that ends a header line)


def trace_context(request: BaseRequest) -> bytes:
    """The client's W3C trace context (`traceparent`, and `tracestate` with it) as header lines for the
    engine, so that an engine tracing with OpenTelemetry (vLLM's --otlp-traces-endpoint) puts its spans
    in the client's trace; b"" where there is none or it is malformed."""
    parent = request.headers.get("traceparent")
    if parent is None or not _TRACEPARENT.fullmatch(parent):
        return b""
    lines = b"traceparent: " + parent.encode() + b"\r\n"
    state = request.headers.get("tracestate")
    if state is not None and _TRACESTATE.fullmatch(state):
        lines += b"tracestate: " + state.encode() + b"\r\n"
    return lines


def from_this_machine_s_pages(request: BaseRequest) -> bool:
    """The request is no other site's: not a page on another origin (a browser's `Sec-Fetch-Site`, an
    `Origin` other than the request's own), and addressed to this machine by name (its `Host` a loopback
    address, `localhost` or the machine's own name; a page on a name that rebinds to 127.0.0.1 sends its
    own). A request a program sends (curl, the CLI, an SDK) names no site and passes."""
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None and site not in ("none", "same-origin"):
        return False
    host = request.headers.get("Host") or ""
    origin = request.headers.get("Origin")
    if origin is not None and urlsplit(origin).netloc.lower() != host.lower():
        return False
    if not host:  # (HTTP/1.0 sends none; no browser does)
        return True
    name = (urlsplit("//" + host).hostname or "").lower()
    return _loopback(name) or name in _local_names()


@functools.cache
def _local_names() -> frozenset[str]:
    names = {"localhost", socket.gethostname().lower()}  # (no getfqdn: a DNS lookup, on the event loop)
    return frozenset(names | {f"{n}." for n in names})


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def access_logger(addresses: ClientAddresses) -> type[AbstractAccessLogger]:
    """An aiohttp access-logger class that writes one line per request under `corral.access`."""

    class _AccessLogger(AbstractAccessLogger):
        def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
            client, request_id = addresses.of(request), request.get(REQUEST_ID, "-")
            self.logger.info(
                '%s "%s %s" %s %s %.3fs %s',
                client,
                request.method,
                request.rel_url.raw_path,  # (as sent, encoded: a decoded newline would forge a line)
                response.status,
                response.body_length,
                time,
                request_id,
                extra={  # (the JSON log's fields: --log-format json)
                    "client": client,
                    "method": request.method,
                    "path": request.path,
                    "status": response.status,
                    "bytes": response.body_length,
                    "seconds": round(time, 6),
                    "request_id": request_id,
                },
            )

    return _AccessLogger
