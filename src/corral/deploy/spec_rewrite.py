"""The spec as corral sees it inside a container: services by their names, vLLM from the image."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

from corral.config import ClusterSpec, LocalSource

__all__ = [
    "SERVICE_PORTS",
    "RenderError",
    "container_spec",
    "dump_yaml",
    "gpu_total",
    "is_local_url",
    "local_files",
    "local_redis_urls",
    "local_services",
    "spec_yaml",
    "stop_allowance_s",
    "uses_vllm",
]

SERVICE_PORTS = {"redis": 6379, "postgres": 5432}  # where the project's (or the cluster's) services listen


def stop_allowance_s(spec: ClusterSpec) -> int:
    """Seconds a service manager (systemd, Compose, Kubernetes) should wait after SIGTERM before SIGKILL:
    the gateway's drain (`gateway.shutdown_grace`; gateway workers get 5 s beyond it), then each replica's
    stop (`supervisor.stop_timeout`; a Ray replica's actor 5 s beyond it and its process 5 more), and a
    margin, so that the kill never lands on engines still stopping (GPU memory left held, a model half
    written to its cache)."""
    return math.ceil(spec.gateway.shutdown_grace + spec.supervisor.stop_timeout + 20)


class RenderError(ValueError):
    """The spec cannot be rendered for this target as it is; the message says what to change."""


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (a spec inside a ConfigMap) as readable literal blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump_yaml(data: Any, *, many: bool = False) -> str:
    if many:
        return yaml.dump_all(data, Dumper=_Dumper, sort_keys=False)
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False)


def is_local_url(url: str) -> bool:
    return (urlsplit(url).hostname or "") in {"localhost", "127.0.0.1", "::1"}


def _with_host(url: str, host: str, port: int) -> str:
    """`url` at `host:port` (its credentials, path and query kept)."""
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)
    credentials = netloc[0] + "@" if len(netloc) == 2 else ""
    return urlunsplit(parts._replace(netloc=f"{credentials}{host}:{port}"))


def redis_urls(spec: ClusterSpec) -> dict[str, str]:
    """The Redis URLs the spec uses, by the field naming each: the rate limits, the answer cache and the
    batch queue."""
    used = {}
    if spec.limits.backend == "redis":
        used["limits.redis_url"] = spec.limits.redis_url
    if spec.cache.backend == "redis":
        used["cache.redis_url"] = spec.cache.redis_url
    if spec.batch.enabled and spec.batch.queue == "redis":
        used["batch.redis_url"] = spec.batch.redis_url
    return used


def local_redis_urls(spec: ClusterSpec) -> dict[str, str]:
    """Those of `redis_urls` on this host (which a container or a pod reaches at another name)."""
    return {field: url for field, url in redis_urls(spec).items() if is_local_url(url)}


def local_services(spec: ClusterSpec) -> set[str]:
    """Which of the spec's shared services run on this host: "redis" (limits, cache, batch queue),
    "postgres" (the store; a SQLite URL names no host)."""
    found = set()
    if local_redis_urls(spec):
        found.add("redis")
    if spec.store.url and is_local_url(spec.store.url):
        found.add("postgres")
    return found


def uses_vllm(spec: ClusterSpec) -> bool:
    return any(d.engine == "vllm" for m in spec.models for d in m.deployments)


def gpu_total(spec: ClusterSpec) -> int:
    return sum(
        d.gpus_per_replica * d.most_replicas
        for m in spec.models
        for d in m.deployments
        if d.engine == "vllm" and d.device == "gpu"
    )


def local_files(spec: ClusterSpec) -> list[tuple[str, Path]]:
    """The files of this host the spec names for its models, each with the field that names it: model
    weights, tokenizers and LoRA adapters (engine binaries aside)."""
    found = []
    for model in spec.models:
        if isinstance(model.source, LocalSource):
            found.append((f"model {model.name!r}'s source.path", model.source.path))
        if model.tokenizer is not None:
            found.append((f"model {model.name!r}'s tokenizer", model.tokenizer))
        for adapter in model.adapters:
            if isinstance(adapter.source, LocalSource):
                found.append((f"adapter {adapter.name!r}'s source.path", adapter.source.path))
    return found


def container_spec(
    spec: ClusterSpec, *, port: int, services: dict[str, str], ray_address: str | None = None
) -> dict[str, Any]:
    """The spec for corral in a container: listening on all addresses (an open gateway says so: only the
    port mapping exposes it), this host's Redis/PostgreSQL replaced by `services` (kind → host name), vLLM
    run by the image's interpreter (never installed at start-up), and the Ray cluster's address."""
    data = spec.model_dump(mode="json", exclude_defaults=True)
    gateway = data.setdefault("gateway", {})
    gateway.update(host="0.0.0.0", port=port)
    gateway.pop("tls", None)  # TLS ends at the edge or the platform's ingress
    if spec.auth.open:
        data.setdefault("auth", {}).update(open=True, open_to_network=True)
    here = local_services(spec)
    if "redis" in services:  # every Redis URL of this host's: limits, cache, batch queue alike
        for field, url in local_redis_urls(spec).items():
            section, name = field.split(".")
            data.setdefault(section, {})[name] = _with_host(url, services["redis"], SERVICE_PORTS["redis"])
    if "postgres" in services and "postgres" in here and spec.store.url:
        data.setdefault("store", {})["url"] = _with_host(
            spec.store.url, services["postgres"], SERVICE_PORTS["postgres"]
        )
    for model, dumped_model in zip(spec.models, data["models"], strict=True):
        for deployment, dumped in zip(model.deployments, dumped_model["deployments"], strict=True):
            if deployment.engine == "vllm":
                dumped["binary"] = str(spec.deploy.vllm_python)
                dumped.pop("vllm_package", None)
    if ray_address is not None:  # (Ray's nodes are other pods: they see none of this one's files)
        data["ray"] = {**data.get("ray", {}), "address": ray_address, "shared_files": False}
    data.pop("deploy", None)
    return data


def spec_yaml(data: dict[str, Any], header: str) -> str:
    body = dump_yaml(data)
    return "".join(f"# {line}\n" for line in header.splitlines()) + body
