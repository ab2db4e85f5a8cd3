"""The KubeRay render: worker pods on which every replica's placement group can be placed, Redis of this
host refused whatever uses it, and a pod annotation that tells nothing of the spec's secrets."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from corral.config import parse_spec
from corral.deploy import RenderError, render
from tests.conftest import DATA

SPEC = """
store: {{url: "postgresql://corral@pg.corral.svc.cluster.local:5432/corral"}}
models:
  - name: big
    source: {{hf: meta-llama/Llama-3.1-70B-Instruct}}
    deployments:
      - {{{deployment}}}
"""


def documents(text: str, source: str = "spec.yaml") -> list[dict[str, Any]]:
    files = render(parse_spec(text), "kuberay", source, text, Path("/usr/bin/true"))
    return list(yaml.safe_load_all(files["kuberay/corral.yaml"]))


@functools.cache
def raycluster_schema() -> jsonschema.Draft7Validator:
    crd = yaml.safe_load((DATA / "kuberay" / "ray.io_rayclusters.yaml").read_text())
    schema = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]
    return jsonschema.Draft7Validator(schema)


def ray_cluster(text: str) -> dict[str, Any]:
    """The rendered RayCluster, valid under KubeRay's CRD schema."""
    cluster = documents(text)[2]
    assert list(raycluster_schema().iter_errors(cluster)) == []
    return cluster


def gpu_pods(cluster: dict[str, Any]) -> list[int]:
    """The GPUs of each worker pod the RayCluster asks for."""
    pods = []
    for group in cluster["spec"]["workerGroupSpecs"]:
        gpus = int(group["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0))
        pods += [gpus] * group["replicas"] if gpus else []
    return pods


def all_placed(pods: list[int], bundles: list[int]) -> bool:
    """Whether each replica's STRICT_PACK bundle (all its GPUs on one node, as Ray places it) finds a pod
    with that many GPUs free (first fit, largest first)."""
    free = list(pods)
    for need in sorted(bundles, reverse=True):
        fits = next((i for i, left in enumerate(free) if left >= need), None)
        if fits is None:
            return False
        free[fits] -= need
    return True


@pytest.mark.parametrize(
    ("deployment", "bundles", "nodes"),
    [
        # 4 replicas of 6 GPUs: 24 GPUs are 3 nodes' worth, but one node holds one replica (was 3 pods)
        ("engine: vllm, replicas: 4, tensor_parallel: 2, pipeline_parallel: 3", [6] * 4, 4),
        ("engine: vllm, replicas: 5, tensor_parallel: 4, gpus_per_node: 8", [4] * 5, 3),
        ("engine: vllm, replicas: 3, tensor_parallel: 2, gpus_per_node: 4", [2] * 3, 2),
    ],
    ids=["tp2-pp3-x4-on-8", "tp4-x5-on-8", "tp2-x3-on-4"],
)
def test_every_replica_finds_a_node_for_its_placement_group(
    deployment: str, bundles: list[int], nodes: int
) -> None:
    pods = gpu_pods(ray_cluster(SPEC.format(deployment=deployment)))
    assert all_placed(pods, bundles), pods
    assert len(pods) == nodes
    assert not all_placed(pods[:-1], bundles)  # and no pod more than the replicas need


def test_a_replica_larger_than_a_node_is_refused_unless_its_stages_span_nodes() -> None:
    """TP4×PP2 on 4-GPU nodes rendered a {GPU: 8} STRICT_PACK bundle that no 4-GPU pod could hold."""
    layout = "engine: vllm, replicas: 1, tensor_parallel: 4, pipeline_parallel: 2, gpus_per_node: 4"
    with pytest.raises(RenderError, match=r"8 GPUs per replica .*gpus_per_node: 4.*span_nodes: true"):
        documents(SPEC.format(deployment=layout))
    spanning = layout + ", span_nodes: true, engine_args: [--distributed-executor-backend, ray]"
    pods = gpu_pods(ray_cluster(SPEC.format(deployment=spanning)))
    assert pods == [4, 4]  # one bundle per GPU (PACK): the replica's 8 GPUs over two nodes


@pytest.mark.parametrize(
    "setting",
    [
        "cache: {backend: redis}",
        "batch: {queue: redis, redis_url: 'redis://localhost:6379/3'}",
    ],
    ids=["cache", "batch-queue"],
)
def test_kuberay_refuses_any_redis_of_this_host(setting: str) -> None:
    """Only limits.redis_url was refused: the cache and the batch queue kept the pod's own loopback."""
    field = setting.split(":")[0] + ".redis_url"
    with pytest.raises(RenderError, match=rf"kuberay: {field} redis://.* is this host"):
        documents(SPEC.format(deployment="engine: vllm, replicas: 1") + setting + "\n")


def spec_digest(text: str, source: str = "spec.yaml") -> str:
    deployment = documents(text, source)[3]
    digest: str = deployment["spec"]["template"]["metadata"]["annotations"]["corral.dev/spec-sha256"]
    return digest


def secret_spec(secret: str) -> str:
    deployment = (
        f"engine: vllm, replicas: 1, engine_api_key: engine-{secret}, engine_args: [--hf-token, arg-{secret}]"
    )
    return (
        SPEC.format(deployment=deployment).replace("corral@pg", f"corral:pw-{secret}@pg")
        + f"auth: {{admin_key: admin-{secret}}}\ngateway: {{metrics_token: scrape-{secret}}}\n"
    )


def test_the_pod_annotation_tells_nothing_of_the_specs_secrets() -> None:
    """The annotation (readable with the `view` role, which may not read the Secret) was the SHA-256 of the
    whole spec, secrets included: a short password could be guessed offline against it."""
    first = spec_digest(secret_spec("a1"))
    assert "pw-a1" in documents(secret_spec("a1"))[1]["stringData"]["cluster.yaml"]  # the Secret has them
    assert spec_digest(secret_spec("other-values")) == first  # the same whatever the secret values
    assert spec_digest(secret_spec("a1"), source="elsewhere/spec.yaml") == first  # not the comment either
    # a changed spec still changes the pod, so applying the render replaces it
    assert spec_digest(secret_spec("a1").replace("replicas: 1", "replicas: 2")) != first
    assert spec_digest(secret_spec("a1").replace("--hf-token", "--hf-token-path")) != first


def test_every_pod_that_fetches_weights_reads_the_hugging_face_token_secret() -> None:
    """A gated model (Llama's) needs a Hugging Face token where weights are fetched: corral's pod (what it
    prepares) and every Ray pod (vLLM reads the repository there); from the optional Secret `corral-hf`."""
    text = SPEC.format(deployment="engine: vllm, replicas: 2, tensor_parallel: 4")
    docs = documents(text)
    cluster = ray_cluster(text)
    pods = [cluster["spec"]["headGroupSpec"]["template"]["spec"]]
    pods += [group["template"]["spec"] for group in cluster["spec"]["workerGroupSpecs"]]
    pods += [d["spec"]["template"]["spec"] for d in docs if d.get("kind") == "Deployment"]
    assert len(pods) >= 3
    for pod in pods:
        env = {e["name"]: e for e in pod["containers"][0].get("env", [])}
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": "corral-hf",
            "key": "token",
            "optional": True,
        }


def test_replicas_of_different_models_share_a_pod_sized_to_what_they_need() -> None:
    """Each deployment got pods of gpus_per_node (8) GPUs of its own: two models of one 1-GPU replica each
    asked for 2 pods × 8 GPUs (16 GPUs, 64 CPUs, 256 GiB) for 2 GPUs of work."""
    text = SPEC.format(deployment="engine: vllm, replicas: 1") + (
        "  - name: small\n"
        "    source: {hf: Qwen/Qwen2.5-7B-Instruct}\n"
        "    deployments: [{engine: vllm, replicas: 1}]\n"
    )
    [group] = ray_cluster(text)["spec"]["workerGroupSpecs"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 1
    assert group["rayStartParams"]["num-gpus"] == "2"
    resources = group["template"]["spec"]["containers"][0]["resources"]
    assert (
        resources["limits"] == resources["requests"] == {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "2"}
    )
    # replicas of several sizes: largest first, each on the first pod with room, no pod beyond gpus_per_node
    mixed = SPEC.format(deployment="engine: vllm, replicas: 3, tensor_parallel: 4") + (
        "  - name: small\n"
        "    source: {hf: Qwen/Qwen2.5-7B-Instruct}\n"
        "    deployments: [{engine: vllm, replicas: 5, tensor_parallel: 2}]\n"
    )
    pods = gpu_pods(ray_cluster(mixed))
    assert sorted(pods) == [6, 8, 8] and all_placed(pods, [4] * 3 + [2] * 5)


def test_the_liveness_probe_gives_a_busy_gateway_time_before_restarting_every_model() -> None:
    """Liveness was the readiness probe: 1 s to answer (Kubernetes' default), 3 misses. The pod is the Ray
    driver and every replica its actor: a restart reloads every model, an outage of all of them."""
    pod = documents(SPEC.format(deployment="engine: vllm, replicas: 1"))[3]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    liveness, readiness = container["livenessProbe"], container["readinessProbe"]
    assert liveness["timeoutSeconds"] >= 5 and readiness["timeoutSeconds"] >= 5
    patience = liveness["periodSeconds"] * liveness["failureThreshold"]
    assert patience >= 60 and patience > readiness["periodSeconds"] * readiness["failureThreshold"]
