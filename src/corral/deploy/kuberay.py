"""KubeRay: a RayCluster sized from the spec, and corral in front of it as a Kubernetes Deployment.

corral's supervisor is the Ray driver: it joins the RayCluster's head through Ray Client and places each
replica as an actor in a placement group (as `corral up --ray ADDRESS` does on hosts), so the replicas'
lifecycle stays corral's, not Ray Serve's. Every pod runs `deploy.vllm_image`, which must hold vLLM, corral
and the Ray version below: nothing is pip-installed at start-up.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import ValidationError

from corral.config import ClusterSpec, DeploymentSpec
from corral.deploy.spec_rewrite import (
    RenderError,
    container_spec,
    dump_yaml,
    local_redis_urls,
    local_services,
    spec_yaml,
    stop_allowance_s,
)

__all__ = ["render_kuberay"]

_PORT = 8000
_CLUSTER = "corral"
_LABELS = {"app.kubernetes.io/name": "corral", "app.kubernetes.io/component": "gateway"}
_NO_ESCALATION = {"allowPrivilegeEscalation": False}  # (no setuid gains in corral's and Ray's containers)
# A Hugging Face token for gated models (Llama's), from the Secret `corral-hf` where there is one: corral's
# pod fetches the weights it prepares, and vLLM on a Ray worker pod reads a repository itself
_HF_TOKEN = {
    "name": "HF_TOKEN",
    "valueFrom": {"secretKeyRef": {"name": "corral-hf", "key": "token", "optional": True}},
}
_FALLBACK_RAY = "2.40.0"
_SECRET_FIELD = re.compile(r"(?:_key|_token|_secret|password)$")  # admin_key, engine_api_key, metrics_token…
_SECRET_FLAG = re.compile(r"^--?[\w-]*(?:key|token|secret|password)$")  # an engine flag such as --api-key
_HIDDEN = "(secret)"


def render_kuberay(spec: ClusterSpec, source: str) -> dict[str, str]:
    _refuse_this_host(spec)
    namespace = spec.deploy.namespace
    address = f"ray://{_CLUSTER}-head-svc.{namespace}.svc.cluster.local:10001"
    inner = container_spec(spec, port=_PORT, services={}, ray_address=address)
    _refuse_files_of_this_pod(inner)
    running = spec_yaml(inner, f"From {source}, for corral on KubeRay.")
    documents = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {
            # A Secret, not a ConfigMap: the spec may hold the admin key, engine keys, store passwords.
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": {"name": "corral-spec", "namespace": namespace},
            "stringData": {"cluster.yaml": running},
        },
        _ray_cluster(spec, namespace),
        _deployment(spec, namespace, hashlib.sha256(dump_yaml(_without_secrets(inner)).encode()).hexdigest()),
        _service(namespace),
        _ray_network_policy(namespace),
    ]
    text = dump_yaml(documents, many=True)
    header = (
        f"# Rendered by `corral deploy render --target kuberay` from {source}.\n"
        "# Needs the KubeRay operator (ray.io/v1) and the NVIDIA device plugin. Apply: kubectl apply -f "
        "corral.yaml\n"
    )
    return {"kuberay/corral.yaml": header + text}


def _without_secrets(value: Any, field: str = "") -> Any:
    """The dumped spec with its secret values hidden: keys, tokens and secrets by their field's name, the
    password of a URL, and the value of an engine flag such as `--api-key` (the pod's annotation is read
    by anyone with the `view` role, who may not read the Secret)."""
    if isinstance(value, dict):
        return {name: _without_secrets(item, name) for name, item in value.items()}
    if isinstance(value, list):
        return _args_without_secrets([_without_secrets(item, field) for item in value])
    if isinstance(value, str) and _SECRET_FIELD.search(field):
        return _HIDDEN
    if isinstance(value, str) and "://" in value:
        parts = urlsplit(value)
        if parts.password is not None:
            host = parts.netloc.rsplit("@", 1)[1]
            return urlunsplit(parts._replace(netloc=f"{parts.username}:{_HIDDEN}@{host}"))
    return value


def _args_without_secrets(items: list[Any]) -> list[Any]:
    hidden = list(items)
    for index, item in enumerate(items):
        if not isinstance(item, str):
            continue
        flag, given, _ = item.partition("=")
        if _SECRET_FLAG.match(flag):
            if given:
                hidden[index] = f"{flag}={_HIDDEN}"
            elif index + 1 < len(hidden):
                hidden[index + 1] = _HIDDEN
    return hidden


def _ray_network_policy(namespace: str) -> dict[str, Any]:
    """Ray's pods take connections only from each other and from corral's pod: Ray's job API (8265) and
    client port run any code a caller sends, and the engines on its workers answer whoever reaches them,
    past corral's keys and limits (KubeRay labels every pod of the cluster `ray.io/cluster`). Enforced
    where the cluster's network plugin enforces NetworkPolicies."""
    ray_pods = {"matchLabels": {"ray.io/cluster": _CLUSTER}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"{_CLUSTER}-ray", "namespace": namespace},
        "spec": {
            "podSelector": ray_pods,
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": ray_pods}, {"podSelector": {"matchLabels": _LABELS}}]}],
        },
    }


def _refuse_this_host(spec: ClusterSpec) -> None:
    """In a pod, 127.0.0.1 is the pod itself: services the spec finds on this host must be named anew."""
    here = local_services(spec)
    local_redis = local_redis_urls(spec)
    if local_redis:
        field, url = next(iter(local_redis.items()))
        raise RenderError(
            f"kuberay: {field} {url} is this host; in Kubernetes give the Redis service's address, e.g. "
            "redis://redis.corral.svc.cluster.local:6379/0"
        )
    if spec.auth.open:
        raise RenderError(
            "kuberay: an open gateway (auth.open: true) would serve every pod in the cluster without a key: "
            "close it (auth.open: false, an admin key, keys from `corral keys create`)"
        )
    if not spec.store.url:
        raise RenderError(
            "kuberay: keys and usage need a database that outlives the pod: set store.url (PostgreSQL, "
            "e.g. postgresql://corral@postgres.corral.svc.cluster.local:5432/corral)"
        )
    if spec.store.url.startswith("sqlite"):
        raise RenderError(
            f"kuberay: store.url {spec.store.url} is a SQLite file in the pod's own filesystem: lost with "
            "the pod, and keys made anywhere else never reach it (every request a 401). Set a PostgreSQL "
            "URL, e.g. postgresql://corral@postgres.corral.svc.cluster.local:5432/corral"
        )
    if "postgres" in here:
        raise RenderError(
            f"kuberay: store.url {spec.store.url} is this host; in Kubernetes give the database service's "
            "address, e.g. postgresql://corral@postgres.corral.svc.cluster.local:5432/corral"
        )


def ray_version() -> str:
    """The Ray version corral runs with: the image's Ray must be the same (Ray refuses other drivers)."""
    try:
        return importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        return _FALLBACK_RAY


def _ray_cluster(spec: ClusterSpec, namespace: str) -> dict[str, Any]:
    image = spec.deploy.vllm_image
    head = {
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-gpus": "0"},
        "template": {
            "spec": {
                "automountServiceAccountToken": False,
                "containers": [
                    {
                        "name": "ray-head",
                        "image": image,
                        "env": [_HF_TOKEN],
                        "securityContext": _NO_ESCALATION,
                        "resources": _resources(cpu=2, memory_gib=8),
                        "ports": [
                            {"containerPort": 6379, "name": "gcs-server"},
                            {"containerPort": 8265, "name": "dashboard"},
                            {"containerPort": 10001, "name": "client"},
                        ],
                    }
                ],
            }
        },
    }
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": _CLUSTER, "namespace": namespace},
        "spec": {
            "rayVersion": ray_version(),
            "headGroupSpec": head,
            "workerGroupSpecs": _worker_groups(spec, image),
        },
    }


def _worker_groups(spec: ClusterSpec, image: str) -> list[dict[str, Any]]:
    """GPU worker pods, the replicas of every deployment packed onto them per node size (`gpus_per_node`),
    each pod asking for the GPUs its replicas fill (`_gpu_pods`); one group per pod size; and a CPU group
    for engines without GPUs."""
    placements: dict[int, list[int]] = {}  # node size → GPUs each placement group needs on one node
    cpu_need = 0
    for model in spec.models:
        for deployment in model.deployments:
            if deployment.engine == "external":
                continue
            if _on_gpu(deployment):
                needs = placements.setdefault(deployment.gpus_per_node, [])
                needs += _placements(model.name, deployment)
            else:
                cpu_need += (deployment.threads or 1) * deployment.most_replicas
    pods: dict[int, int] = {}  # GPUs of a pod → pods of that size
    for per_node, needs in placements.items():
        for gpus in _gpu_pods(needs, per_node):
            pods[gpus] = pods.get(gpus, 0) + 1
    groups = [
        _group(f"gpu-{gpus}", image, count, cpu=4 * gpus, gpus=gpus) for gpus, count in sorted(pods.items())
    ]
    if cpu_need:
        groups.append(_group("cpu", image, 1, cpu=cpu_need + 1, gpus=0))
    return groups


def _placements(model: str, deployment: DeploymentSpec) -> list[int]:
    """The GPUs each of the deployment's placement groups needs on one node. A replica's GPUs are one
    placement group packed onto one node (STRICT_PACK), so a node holds whole replicas only (two 6-GPU
    replicas need two 8-GPU nodes, not 12/8); with `span_nodes` its per-GPU bundles may spread (PACK)."""
    per_replica, per_node = deployment.gpus_per_replica, deployment.gpus_per_node
    if deployment.span_nodes:
        return [1] * (per_replica * deployment.most_replicas)
    if per_replica > per_node:
        raise RenderError(
            f"kuberay: model {model!r} needs {per_replica} GPUs per replica (tensor_parallel "
            f"{deployment.tensor_parallel} × pipeline_parallel {deployment.pipeline_parallel}), more than "
            f"one node has (gpus_per_node: {per_node}), and a replica's GPUs are placed on one node: lower "
            "pipeline_parallel, set gpus_per_node to a larger node, or let the pipeline stages span nodes "
            "(span_nodes: true, with engine_args [--distributed-executor-backend, ray])"
        )
    return [per_replica] * deployment.most_replicas


def _gpu_pods(needs: list[int], per_node: int) -> list[int]:
    """The GPUs of each pod that holds the placement groups `needs` on nodes of `per_node` GPUs: first fit,
    largest first, whatever deployment each belongs to (two models of one 1-GPU replica share one 2-GPU
    pod, where pods of `per_node` GPUs per deployment asked for 16 GPUs for 2 GPUs of work). Ray places
    the groups in the order the supervisor starts the replicas: where their sizes do not divide each other
    (3 and 5 GPUs), an order that splits a pod's room otherwise than this packing can leave a replica
    waiting for room."""
    pods: list[int] = []
    for need in sorted(needs, reverse=True):
        fits = next((i for i, used in enumerate(pods) if used + need <= per_node), None)
        if fits is None:
            pods.append(need)
        else:
            pods[fits] += need
    return pods


def _on_gpu(deployment: DeploymentSpec) -> bool:
    return deployment.engine == "vllm" and deployment.device == "gpu"


def _group(name: str, image: str, nodes: int, cpu: int, gpus: int) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "ray-worker",
        "image": image,
        "env": [_HF_TOKEN],
        "resources": _resources(cpu=cpu, memory_gib=max(8, 16 * gpus), gpus=gpus),
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
        "securityContext": _NO_ESCALATION,
    }
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,  # (nothing in it talks to the Kubernetes API)
        "containers": [container],
        "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
    }
    if gpus:
        pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return {
        "groupName": name,
        "replicas": nodes,
        "minReplicas": nodes,
        "maxReplicas": nodes,
        "rayStartParams": {"num-gpus": str(gpus)},
        "template": {"spec": pod},
    }


def _refuse_files_of_this_pod(inner: dict[str, Any]) -> None:
    """Replicas run on Ray's worker pods, which see none of what corral prepares in its own pod (its
    CORRAL_HOME is the pod's emptyDir): the spec corral runs there (`inner`) says so
    (`ray.shared_files: false`), and is checked here as it will be in the pod, and by a live apply there."""
    try:
        ClusterSpec.model_validate(inner)
    except ValidationError as exc:
        problem = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise RenderError(f"kuberay: {problem}") from None


def _resources(cpu: int, memory_gib: int, gpus: int = 0) -> dict[str, Any]:
    amounts: dict[str, Any] = {"cpu": str(cpu), "memory": f"{memory_gib}Gi"}
    if gpus:
        amounts["nvidia.com/gpu"] = str(gpus)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _deployment(spec: ClusterSpec, namespace: str, spec_digest: str) -> dict[str, Any]:
    """The gateway's Deployment; `spec_digest` (the SHA-256 of the running spec with its secret values
    hidden, not of its comment naming the file it came from) annotates its pod, so applying a render of a
    changed spec replaces the pod (a Secret's new content alone restarts nothing, and would be picked up by
    whatever next restarted it). Secrets are left out because the annotation is readable where the Secret
    is not, and a digest lets a short password be guessed offline: a change of a secret value alone keeps
    the pod (`kubectl rollout restart deployment/corral` takes it up)."""
    # One gateway pod: taking it out of the Service because one model has no ready replica would refuse
    # every model's requests. Readiness is the gateway answering (a model without a replica answers 503
    # with Retry-After itself); start-up allows an hour, as `corral up` fetches the models before it
    # listens (a kill would start the download again). Liveness is slower to give up than readiness: the
    # pod is the Ray driver and every replica its actor, so a restart is an outage of every model until
    # each has loaded again; a gateway busy for a few seconds (Kubernetes' default probe timeout is 1 s)
    # is not a dead one.
    probe = {"httpGet": {"path": "/health", "port": _PORT}, "periodSeconds": 10, "timeoutSeconds": 5}
    container = {
        "name": "corral",
        "image": spec.deploy.vllm_image,
        "command": ["corral", "up", "-f", "/etc/corral/cluster.yaml"],
        "ports": [{"containerPort": _PORT, "name": "http"}],
        "env": [
            {"name": "CORRAL_HOME", "value": "/var/lib/corral"},
            {
                "name": "CORRAL_ADMIN_KEY",
                "valueFrom": {"secretKeyRef": {"name": "corral-admin", "key": "key", "optional": True}},
            },
            _HF_TOKEN,
        ],
        "readinessProbe": {**probe, "failureThreshold": 3},
        "startupProbe": {**probe, "failureThreshold": 360},
        "livenessProbe": {**probe, "failureThreshold": 6},
        "volumeMounts": [
            {"name": "spec", "mountPath": "/etc/corral"},
            {"name": "home", "mountPath": "/var/lib/corral"},
        ],
        "resources": _resources(cpu=2, memory_gib=4),
        "securityContext": _NO_ESCALATION,
    }
    grace = stop_allowance_s(spec)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "corral", "namespace": namespace, "labels": _LABELS},
        "spec": {
            # One supervisor owns the replicas: a second would start them twice.
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": _LABELS},
            "template": {
                "metadata": {"labels": _LABELS, "annotations": {"corral.dev/spec-sha256": spec_digest}},
                "spec": {
                    "automountServiceAccountToken": False,  # (corral reaches Ray, never the Kubernetes API)
                    "terminationGracePeriodSeconds": grace,
                    "containers": [container],
                    "volumes": [
                        {"name": "spec", "secret": {"secretName": "corral-spec", "defaultMode": 0o400}},
                        {"name": "home", "emptyDir": {}},
                    ],
                },
            },
        },
    }


def _service(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "corral", "namespace": namespace, "labels": _LABELS},
        "spec": {"selector": _LABELS, "ports": [{"name": "http", "port": _PORT, "targetPort": _PORT}]},
    }
