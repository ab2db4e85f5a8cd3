"""Docker Compose: corral (gateway + supervised engines) and the services the spec uses.

corral's supervisor runs the engines inside the corral container, as it does on a host: one service owns
the replicas' lifecycle, probes and restarts, and the engines' metrics reach the router. A spec with vLLM
runs in `deploy.vllm_image` (vLLM preinstalled) with the GPUs reserved for that service (the spec's GPU ids
renumbered as the container sees them: 0, 1, …). Redis and PostgreSQL on this host become services of the
project; Prometheus comes with the `watch` profile. TLS is the NGINX edge's (`gateway.tls` is refused).

The project's network has a fixed subnet: the NGINX edge on this host reaches the gateway through the
published port, so inside the container its connections come from the network's gateway address, not from
127.0.0.1. A spec that trusts the edge on this host (`gateway.trusted_proxies` covering loopback) trusts
that address in the container too; else the gateway would take the whole edge for one client.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from corral.config import ClusterSpec, DeploymentSpec, is_loopback
from corral.deploy.spec_rewrite import (
    SERVICE_PORTS,
    RenderError,
    container_spec,
    gpu_total,
    local_files,
    local_redis_urls,
    local_services,
    spec_yaml,
    stop_allowance_s,
    uses_vllm,
)
from corral.observe import METRICS_TOKEN_FILE, credentials_files, prometheus_config
from corral.observe.rules import rules_yaml

__all__ = ["render_compose"]

_PORT = 8000
_HOME = "/var/lib/corral"
# Outside Docker's default address pools (172.17-31.0.0/16, 192.168.0.0/16), so that the networks Docker
# numbers itself do not take it first. A clash with a network of this host makes `docker compose up` fail,
# naming the pool: then change the subnet in compose.yaml and the address in cluster.yaml's trusted_proxies.
_SUBNET = "172.16.240.0/24"
_HOST_SIDE = "172.16.240.1"  # this host on the project's network: what the container sees the edge as
_PROMETHEUS_HOME = "/etc/prometheus"  # where the Prometheus image reads prometheus.yml
_RULES = "corral.rules.yml"


def render_compose(spec: ClusterSpec, source: str) -> dict[str, str]:
    _refuse(spec)
    services: dict[str, Any] = {}
    here = local_services(spec)
    # The batch queue's lines live in its Redis: that one keeps them on disk (append-only file).
    durable_redis = "batch.redis_url" in local_redis_urls(spec)
    if "redis" in here:
        services["redis"] = _redis(durable_redis)
    if "postgres" in here and spec.store.url:
        services["postgres"] = _postgres(spec.store.url)
    dependencies = {name: {"condition": "service_healthy"} for name in services}
    names = {name: name for name in services}  # each runs as the Compose service of its name
    services = {"corral": _corral(spec, dependencies), **services}
    services["prometheus"] = _prometheus(_prometheus_config(spec))
    volumes: dict[str, Any] = {"corral-home": {}, "huggingface": {}}
    if "postgres" in services:
        volumes["postgres-data"] = {}
    if "redis" in services and durable_redis:
        volumes["redis-data"] = {}
    network = {"ipam": {"config": [{"subnet": _SUBNET, "gateway": _HOST_SIDE}]}}
    document = {"services": services, "volumes": volumes, "networks": {"default": network}}
    header = f"Rendered by `corral deploy render --target compose` from {source}."
    running = header + "\nThe spec corral runs inside its container (services by their Compose names)."
    inner = _gpus_as_seen_inside(spec, container_spec(spec, port=_PORT, services=names))
    if _edge_needs_trust_inside(spec):
        inner.setdefault("gateway", {})["trusted_proxies"] = [*spec.gateway.trusted_proxies, _HOST_SIDE]
        running += (
            f"\n{_HOST_SIDE} in trusted_proxies: the NGINX edge on this host, as the container sees it."
        )
    return {
        "compose/compose.yaml": spec_yaml(document, header + "\nStart: docker compose -p corral up -d"),
        "compose/cluster.yaml": spec_yaml(_store_on_volume(spec, inner), running),
        **_prometheus_files(spec, header),
    }


def _refuse(spec: ClusterSpec) -> None:
    """What the container could not run as the spec says."""
    if spec.gateway.tls is not None:
        raise RenderError(
            "compose: gateway.tls is set, but the container would serve plain HTTP (the certificate and key "
            "are files of this host, and a renewal would never reach the container): remove gateway.tls, "
            "keep gateway.host: 127.0.0.1 (Compose then publishes the gateway's port on 127.0.0.1 only) and "
            "terminate TLS at the NGINX edge on this host (`corral deploy render -t nginx`, deploy.edge)"
        )
    for field, path in local_files(spec):
        if not path.is_absolute():
            raise RenderError(
                f"compose: {field} {path} is not an absolute path: it is mounted into the container at "
                "the same path, and Compose would read a relative one as a volume's name; give it in full"
            )
    ports = {urlsplit(url).port or SERVICE_PORTS["redis"] for url in local_redis_urls(spec).values()}
    if len(ports) > 1:
        fields = ", ".join(local_redis_urls(spec))
        raise RenderError(
            f"compose: {fields} name Redis servers on this host at different ports "
            f"({', '.join(map(str, sorted(ports)))}); the project runs one Redis for them: name one port "
            "(their databases, /0, /1, …, may differ)"
        )


def _gpu_ids(spec: ClusterSpec) -> list[int]:
    """The host's GPU ids the spec's vLLM deployments name, in the order they are reserved."""
    return sorted({g for m in spec.models for d in m.deployments if _pinned(d) for g in d.gpus or []})


def _pinned(deployment: DeploymentSpec) -> bool:
    """vLLM on GPUs the deployment names (`gpus`)."""
    return deployment.engine == "vllm" and deployment.device == "gpu" and bool(deployment.gpus)


def _gpus_as_seen_inside(spec: ClusterSpec, data: dict[str, Any]) -> dict[str, Any]:
    """The container sees its reserved GPUs as 0, 1, … in the order of `device_ids`: the spec's ids are
    renumbered so (a deployment on the host's GPUs 2 and 3 runs on the container's 0 and 1)."""
    inside = {host: index for index, host in enumerate(_gpu_ids(spec))}
    for model, dumped_model in zip(spec.models, data["models"], strict=True):
        for deployment, dumped in zip(model.deployments, dumped_model["deployments"], strict=True):
            if _pinned(deployment):
                dumped["gpus"] = [inside[g] for g in deployment.gpus or []]
    return data


def _edge_needs_trust_inside(spec: ClusterSpec) -> bool:
    """Whether the spec trusts a proxy on this host's loopback (the NGINX edge) but not this host's address
    on the project's network, where the edge's connections to the published port arrive from. Copied as
    it was, the gateway ignored the edge's X-Forwarded-For and X-Request-Id and counted every client as one
    address against `gateway.max_client_connections` (past it, the edge answered 503 "No corral gateway")."""
    trusted = [ipaddress.ip_network(entry, strict=False) for entry in spec.gateway.trusted_proxies]
    loopback = (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"))
    host_side = ipaddress.ip_address(_HOST_SIDE)
    return any(a in n for n in trusted for a in loopback) and not any(host_side in n for n in trusted)


def _store_on_volume(spec: ClusterSpec, data: dict[str, Any]) -> dict[str, Any]:
    """A SQLite store goes on the corral-home volume (its file name kept): a path of the host's means
    nothing in the container, and a file outside the volume is lost with it. Keys are then made inside:
    `docker compose exec corral corral keys create --tenant NAME`, or the admin API."""
    url = spec.store.url or ""
    if url.startswith("sqlite:///") and not url.startswith(f"sqlite:///{_HOME}/"):
        name = url.removeprefix("sqlite:///").rsplit("/", 1)[-1] or "corral.db"
        data.setdefault("store", {})["url"] = f"sqlite:///{_HOME}/{name}"
    return data


def _corral(spec: ClusterSpec, dependencies: dict[str, Any]) -> dict[str, Any]:
    vllm = uses_vllm(spec)
    # As on the host: an open gateway, or one whose gateway.host is loopback (the default), is reachable
    # from this host only (an NGINX edge here is the way in); a closed one on 0.0.0.0 from the network.
    bind = "127.0.0.1:" if spec.auth.open or is_loopback(spec.gateway.host) else ""
    volumes = [
        "./cluster.yaml:/etc/corral/cluster.yaml:ro",
        f"corral-home:{_HOME}",
        "huggingface:/root/.cache/huggingface",
        *(f"{path}:{path}:ro" for path in sorted({path for _, path in local_files(spec)})),
    ]
    service: dict[str, Any] = {
        "image": spec.deploy.vllm_image if vllm else spec.deploy.image,
        "command": ["corral", "up", "-f", "/etc/corral/cluster.yaml"],
        "ports": [f"{bind}{spec.gateway.port}:{_PORT}"],
        "environment": {
            "CORRAL_HOME": _HOME,
            "CORRAL_ADMIN_KEY": "${CORRAL_ADMIN_KEY:-}",
            "HF_TOKEN": "${HF_TOKEN:-}",
        },
        "volumes": volumes,
        "healthcheck": {
            "test": ["CMD", "python3", "-c", _probe(f"http://127.0.0.1:{_PORT}/ready")],
            "interval": "10s",
            "timeout": "5s",
            "retries": 3,
            "start_period": "600s" if vllm else "180s",
        },
        "restart": "unless-stopped",
        "stop_grace_period": f"{stop_allowance_s(spec)}s",
        "init": True,  # an init as PID 1 reaps the engines' orphaned children (corral is not one)
    }
    gpus = gpu_total(spec)
    if gpus:
        service["ipc"] = "host"  # vLLM's tensor-parallel workers share memory
        service["deploy"] = {"resources": {"reservations": {"devices": [_gpu_reservation(spec, gpus)]}}}
    if dependencies:
        service["depends_on"] = dependencies
    return service


def _gpu_reservation(spec: ClusterSpec, count: int) -> dict[str, Any]:
    ids = _gpu_ids(spec)
    device: dict[str, Any] = {"driver": "nvidia", "capabilities": ["gpu"]}
    if len(ids) >= count:
        device["device_ids"] = [str(g) for g in ids]
    else:
        device["count"] = count
    return device


def _probe(url: str) -> str:
    return f"import urllib.request; urllib.request.urlopen('{url}', timeout=4)"


def _redis(durable: bool) -> dict[str, Any]:
    """The project's Redis; `durable`: the batch queue's lines live in it, so it writes an append-only
    file on its volume (as batch.redis_url asks), else it keeps nothing on disk."""
    service: dict[str, Any] = {
        "image": "redis:7",
        "command": ["redis-server", "--save", "", "--appendonly", "yes" if durable else "no"],
        "healthcheck": {
            "test": ["CMD", "redis-cli", "ping"],
            "interval": "5s",
            "timeout": "3s",
            "retries": 5,
        },
        "restart": "unless-stopped",
    }
    if durable:
        service["volumes"] = ["redis-data:/data"]
    return service


def _postgres(url: str) -> dict[str, Any]:
    parts = urlsplit(url)
    database = parts.path.lstrip("/") or "corral"
    user = parts.username or "postgres"
    return {
        "image": "postgres:16",
        "environment": {
            "POSTGRES_DB": database,
            "POSTGRES_USER": user,
            # Reached only on the project's network (no published port); set a password for anything more.
            "POSTGRES_HOST_AUTH_METHOD": "trust",
        },
        "volumes": ["postgres-data:/var/lib/postgresql/data"],
        "healthcheck": {
            "test": ["CMD", "pg_isready", "-U", user, "-d", database],
            "interval": "5s",
            "timeout": "3s",
            "retries": 10,
        },
        "restart": "unless-stopped",
    }


def _prometheus(config: dict[str, Any]) -> dict[str, Any]:
    """Prometheus (the `watch` profile) with its configuration, the rules and the credentials files it
    names, each mounted beside prometheus.yml as in the compose/ folder (which promtool checks as is)."""
    files = ["prometheus.yml", *config["rule_files"], *sorted(credentials_files(config))]
    service: dict[str, Any] = {
        "image": "prom/prometheus:v2.53.0",
        "profiles": ["watch"],
        "volumes": [f"./{name}:{_PROMETHEUS_HOME}/{name}:ro" for name in files],
        "ports": ["127.0.0.1:9090:9090"],
        "depends_on": ["corral"],
    }
    if credentials_files(config):
        # The credentials are the operator's files, readable by their owner only (as cluster.yaml, which
        # corral's container reads as root); the image's user, nobody, could not read them.
        service["user"] = "0:0"
    return service


def _prometheus_config(spec: ClusterSpec) -> dict[str, Any]:
    """`corral observe render`'s configuration as the container sees it: the gateway as the service
    `corral` (the job its rules name, with the scraper's token or the admin key on a closed gateway), no
    engines job (their addresses are the corral container's loopback) and dcgm-exporter on this host."""
    return prometheus_config(
        spec, Path(_RULES), gateway=f"corral:{_PORT}", engines=False, dcgm=f"{_HOST_SIDE}:9400"
    )


def _prometheus_files(spec: ClusterSpec, header: str) -> dict[str, str]:
    """prometheus.yml, the alert rules and the scraper's token (where a job sends it), under compose/."""
    config = _prometheus_config(spec)
    comment = f"# {header}\n"
    files = {
        "compose/prometheus.yml": comment + yaml.safe_dump(config, sort_keys=False),
        f"compose/{_RULES}": comment + yaml.safe_dump(rules_yaml(spec), sort_keys=False, width=200),
    }
    if spec.gateway.metrics_token and METRICS_TOKEN_FILE in credentials_files(config):
        files[f"compose/{METRICS_TOKEN_FILE}"] = spec.gateway.metrics_token
    return files
