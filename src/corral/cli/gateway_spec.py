"""What a gateway (this process's, or a worker's) is made of and told from the spec: its router and parts,
and the settings of models and of the cluster a running cluster's gateways take live (`corral apply`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from corral.cli.app import CliError
from corral.config import ClusterSpec, Paths, admin_key_from_env

__all__ = [
    "adapter_settings",
    "apply_cluster_settings",
    "apply_model_settings",
    "cluster_settings",
    "gateway_parts_for",
    "install_adapters",
    "model_settings",
    "router_for",
]

logger = logging.getLogger(__name__)


def model_settings(model: Any, paths: Paths) -> dict[str, Any]:
    """What a gateway needs to know of a model added to (or changed in) a running cluster, as JSON."""
    from corral.cluster.changes import deployed_digest

    tokenizer = str(model.tokenizer) if model.tokenizer is not None else None
    return {
        "name": model.name,
        "routing": model.routing_policy,
        "failover": model.mid_stream_failover,
        "isolation": model.prefix_isolation,
        "tokenizer": tokenizer,
        "cache": model.cache.model_dump(mode="json"),
        "version": deployed_digest(model),
        "adapters": adapter_settings(model, paths),
    }


def adapter_settings(model: Any, paths: Paths) -> list[dict[str, Any]]:
    """A model's LoRA adapters as a gateway serves them: each revision's engine name (`name@digest` of its
    source) and the folder its engines load (fetched when the deployment was prepared: found in the cache)."""
    from corral.artifacts import resolve_adapter
    from corral.cluster.changes import adapter_digest

    loads = any(d.engine in ("vllm", "sim") for d in model.deployments)
    found = {a.name: str(resolve_adapter(a.source, paths)) if loads else "" for a in model.adapters}
    return [
        {
            "name": adapter.name,
            "base": model.name,
            "engine_name": f"{adapter.name}@{adapter_digest(adapter, found[adapter.name])}",
            "path": found[adapter.name],
            "tenants": adapter.tenants,
            "rpm": adapter.rpm,
            "tpm": adapter.tpm,
            "placement": model.lora.placement,
        }
        for adapter in model.adapters
    ]


def cluster_settings(spec: ClusterSpec) -> dict[str, Any]:
    """What every gateway takes live from a new spec: queue bounds, rate limits, routing policies."""
    return {
        "queue": spec.queue.model_dump(mode="json"),
        "limits": spec.limits.model_dump(mode="json"),
        "routing": spec.gateway.routing,
        "models": {m.name: m.routing_policy for m in spec.models},
    }


def apply_cluster_settings(router: Any, parts: Any, settings: dict[str, Any]) -> None:
    """Take a new spec's live cluster settings in a gateway (this process's, or a worker's)."""
    from corral.config import LimitsSettings, QueueSettings

    queue = QueueSettings.model_validate(settings["queue"])
    parts.reconfigure(queue, LimitsSettings.model_validate(settings["limits"]))
    router.set_default(settings["routing"])
    for name, policy in settings["models"].items():
        router.set_policy(name, policy)


def apply_model_settings(router: Any, parts: Any, settings: dict[str, Any]) -> None:
    """Tell a gateway (this process's, or a worker's) a new model's routing policy, failover mode and
    tokenizer before it is served."""
    from corral.admission import TokenCounter
    from corral.config import ModelCacheSpec

    name = settings["name"]
    router.set_policy(name, settings["routing"])
    from corral.gateway.parts import isolates

    parts.failover_modes[name] = settings["failover"]
    if isolates(settings["isolation"], parts.access.open_access):
        parts.isolated.add(name)
    else:
        parts.isolated.discard(name)
    if parts.cache is not None:
        parts.cache.policies[name] = ModelCacheSpec.model_validate(settings["cache"])
        parts.cache.versions[name] = settings["version"]
    if settings["tokenizer"] is not None:
        parts.sizing.counters[name] = TokenCounter(Path(settings["tokenizer"]))
    install_adapters(parts, settings)


def install_adapters(parts: Any, settings: dict[str, Any]) -> None:
    """A model's adapters, served from now on (an adapter's answers are cached apart from its base's and
    each other's, under its revision); replaced or removed revisions leave the engines once idle."""
    from corral.routing.adapters import Adapter

    adapters = [Adapter(**{**a, "tenants": frozenset(a["tenants"])}) for a in settings["adapters"]]
    parts.adapters.replace(settings["name"], adapters)
    if parts.cache is not None:
        for adapter in adapters:
            parts.cache.policies[adapter.name] = parts.cache.policies[settings["name"]]
            parts.cache.versions[adapter.name] = f"{settings['version']}:{adapter.engine_name}"


def router_for(spec: ClusterSpec, replicas: Any) -> Any:
    """The router over `replicas` with the spec's policies (also each gateway worker's)."""
    from corral.routing import Router

    policies = {m.name: m.routing_policy for m in spec.models if m.routing_policy is not None}
    return Router(
        replicas,
        policies,
        default_policy=spec.gateway.routing,
        coalesce_prefills=spec.gateway.prefill_coalescing,
    )


def gateway_parts_for(spec: ClusterSpec, paths: Paths, replicas: Any) -> Any:
    """The gateway's parts for `spec` (also each gateway worker's)."""
    from corral.artifacts import ArtifactError
    from corral.cluster.changes import deployed_digest
    from corral.config.auth import sendable_token
    from corral.gateway import GatewayParts
    from corral.store import StoreError

    admin_key = admin_key_from_env(spec.auth.admin_key)
    if admin_key is not None and not sendable_token(admin_key):  # (the spec's is checked when read)
        raise CliError("CORRAL_ADMIN_KEY must be visible ASCII characters, without spaces.")
    try:
        parts = GatewayParts.build(
            replicas,
            paths.database_url,
            spec.auth,
            spec.store,
            spec.limits,
            spec.queue,
            admin_key,
            {m.name: m.tokenizer for m in spec.models if m.tokenizer is not None},
            {m.name: m.mid_stream_failover for m in spec.models},
            {m.name: m.prefix_isolation for m in spec.models},
            spec.cache,
            {m.name: m.cache for m in spec.models},
            {m.name: deployed_digest(m) for m in spec.models},
            spec.batch,
        )
    except StoreError as exc:
        raise CliError(str(exc)) from None
    for model in spec.models:
        if not model.adapters:
            continue
        try:
            adapters = adapter_settings(model, paths)
        except ArtifactError as exc:  # (a worker restarted after a live apply: the announcements follow)
            logger.warning("%s: its adapters are not served until they can be had: %s", model.name, exc)
            continue
        settings = {"name": model.name, "version": deployed_digest(model)}
        install_adapters(parts, {**settings, "adapters": adapters})
    return parts
