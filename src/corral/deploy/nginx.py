"""The NGINX edge: `corral.conf` (an http-block include) and a self-contained `nginx.conf` around it."""

from __future__ import annotations

import ipaddress
import math
from urllib.parse import urlsplit

from corral.config import ClusterSpec
from corral.deploy.spec_rewrite import RenderError
from corral.deploy.templates import render_template

__all__ = ["render_nginx"]

_FORM_BYTES = 64 * 1024  # an upload's form around its file: boundaries, part headers, purpose, expiry


def render_nginx(spec: ClusterSpec, source: str) -> dict[str, str]:
    """Files for the edge in front of the spec's gateway(s), keyed by their path under the output folder.
    RenderError for gateways that serve TLS themselves: the edge terminates TLS and proxies plain HTTP."""
    edge = spec.deploy.edge
    gateway = spec.gateway
    if gateway.tls is not None:
        raise RenderError(
            "nginx: gateway.tls is set, but the edge terminates TLS itself and talks plain HTTP to the "
            "gateways behind it (no CA in the spec to verify theirs): remove gateway.tls from the spec the "
            "gateways run, keep them on 127.0.0.1 or a private network (gateway.host), and give the edge "
            "the certificate (deploy.edge.cert and key)"
        )
    gateways = edge.gateways or [gateway.address_from_here()]
    _refuse_untrusted_edge(spec, gateways, source)
    context = {
        "source": source,
        "gateways": gateways,
        "port": edge.port,
        "server_name": edge.server_name,
        "cert": edge.cert,
        "key": edge.key,
        "hsts_max_age": edge.hsts_max_age,
        "rate": _rate(edge.requests_per_second),
        "requests_per_second": f"{edge.requests_per_second:g}",
        "burst": edge.burst,
        "connections_per_client": edge.connections_per_client,
        "retry_after": max(1, math.ceil(1 / edge.requests_per_second)),
        "fail_timeout": _seconds(edge.fail_timeout),
        "cors_origins": gateway.cors_origins,  # the edge's own answers readable by the same pages
        "max_body_bytes": gateway.max_body_bytes,
        "max_file_bytes": spec.batch.max_file_bytes + _FORM_BYTES,
        "body_timeout": _seconds(gateway.body_timeout),
        "send_timeout": _seconds(gateway.send_timeout),
        "connect_timeout": _seconds(gateway.connect_timeout),
        "read_timeout": _seconds(_first_byte_s(spec) + 5),
    }
    return {
        "nginx/corral.conf": render_template("corral.conf.j2", context),
        "nginx/nginx.conf": render_template("nginx.conf.j2", context),
    }


def _refuse_untrusted_edge(spec: ClusterSpec, gateways: list[str], source: str) -> None:
    """A gateway on this host sees the edge's connections come from loopback: unless trusted_proxies covers
    that address, the gateway ignores the edge's X-Forwarded-For and X-Request-Id, and counts every client
    as one address against `gateway.max_client_connections` (past it, it resets the edge's connections and
    the edge answers its own 503 "No corral gateway is reachable"). Gateways on other hosts see the edge
    at an address this host cannot tell. (`source`: where the spec came from, its file or the embedded
    default.)"""
    trusted = [ipaddress.ip_network(entry, strict=False) for entry in spec.gateway.trusted_proxies]
    for address in gateways:
        untrusted = [p for p in _loopback_peers(address) if not any(p in network for network in trusted)]
        if untrusted:
            peers = " and ".join(str(peer) for peer in untrusted)
            raise RenderError(
                f"nginx: the edge proxies to the gateway at {address} on this host, which sees every "
                f"connection of the edge come from {peers}, but gateway.trusted_proxies in {source} does "
                f"not cover it: the gateway would take all clients for one (their X-Forwarded-For and the "
                "edge's X-Request-Id ignored, gateway.max_client_connections shared by all, then the edge's "
                f'503 "No corral gateway is reachable"). Add {peers} to gateway.trusted_proxies in a spec '
                "file (-f), the one each gateway behind the edge runs"
            )


def _loopback_peers(address: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses a gateway at `address` (host:port) sees the edge's connections come from, where it is
    on this host's loopback (Linux answers a connection to any of 127.0.0.0/8 from 127.0.0.1; NGINX
    resolves `localhost` to both 127.0.0.1 and ::1 and uses either)."""
    host = urlsplit(f"//{address}").hostname or ""
    if host == "localhost":
        return [ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return []
    if not ip.is_loopback:
        return []
    return [ipaddress.ip_address("127.0.0.1") if ip.version == 4 else ip]


def _first_byte_s(spec: ClusterSpec) -> float:
    """The longest the gateway may take before an answer's first byte: a request waits for a replica slot
    (`queue.timeout`; a model scaled to zero, for its first replica: its `autoscale.hold_s` where longer),
    a replica that could not be connected to may be retried on another (`retries` × `connect_timeout`),
    and each try's engine may stay silent for `gateway.read_timeout` (one that fails late, a long prompt's
    prefill cut by a crash, is retried on another: `retries` + 1 of them) before the gateway answers 504
    itself. The edge
    waits a little longer, so that the gateway's own answer (a 503 queue_timeout, a 504) reaches the client
    rather than the edge's 504 turned into its 'no gateway reachable' page."""
    holds = [
        deployment.autoscale.hold_s
        for model in spec.models
        for deployment in model.deployments
        if deployment.autoscale is not None and deployment.autoscale.min_replicas == 0
    ]
    gateway = spec.gateway
    tries = gateway.retries + 1
    return (
        max([spec.queue.timeout, *holds])
        + gateway.retries * gateway.connect_timeout
        + (tries * gateway.read_timeout)
    )


def _rate(per_second: float) -> str:
    """NGINX takes whole requests per second or per minute."""
    if per_second >= 1 and per_second == int(per_second):
        return f"{int(per_second)}r/s"
    return f"{max(1, round(per_second * 60))}r/m"


def _seconds(value: float) -> int:
    return max(1, math.ceil(value))
