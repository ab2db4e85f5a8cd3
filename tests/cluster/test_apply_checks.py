"""What a live apply checks before it changes anything, and what it reads the file with: a tokenizer that
cannot be loaded is refused with its field and path (it was found only while the changes were being made,
leaving cluster settings changed and a model added but never told to the gateway), `corral up --ray`'s
cluster is kept (the file does not say it), and a model's prefix isolation is a live setting (the gateway's
alone: no replica is replaced for it)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from tokenizers import Tokenizer, models

from corral.cli.up import Overrides
from corral.cluster import LocalProcessRuntime, Supervisor
from corral.cluster.capacity import replica_request_rate
from corral.cluster.changes import ApplyError, plan_changes
from corral.cluster.reconcile import Reconciler
from corral.config import ClusterSpec, DeploymentSpec, ModelSpec, SpecError, SupervisorSettings, parse_spec
from corral.engines import EngineAdapter, LaunchPlan, SimEngineAdapter
from corral.routing import ReplicaSet
from tests.cli.test_errors import corral

ALPHA = """
queue: {{max_queued: {queued}}}
models:
  - name: alpha
    arch: llama-3.1-8b
    deployments: [{{engine: sim, gpu: l4, replicas: 1}}]
"""
BETA = """
  - name: org/beta
    arch: llama-3.1-8b
    tokenizer: {tokenizer}
    deployments: [{{engine: sim, gpu: l4, replicas: 2}}]
"""


class Cluster:
    """A reconciler over a supervisor that is never started (apply declares replicas; none runs), with
    what it prepared, told the gateways and changed in their settings recorded."""

    def __init__(self, running: ClusterSpec, logs: Path, **options: object) -> None:
        self.prepared: list[str] = []
        self.told: list[str] = []
        self.cluster_settings: list[ClusterSpec] = []
        self.engine = SimEngineAdapter()
        self.supervisor = Supervisor(ReplicaSet(), LocalProcessRuntime(logs), SupervisorSettings())
        for model in running.models:
            self.supervisor.add(model.name, self.engine, [LaunchPlan()] * model.deployments[0].replicas)
        self.reconciler = Reconciler(
            self.supervisor,
            running,
            self.prepare,
            self.tell,
            on_cluster=self.cluster_settings.append,
            **options,  # type: ignore[arg-type]
        )

    def prepare(self, model: ModelSpec, deployment: DeploymentSpec) -> tuple[EngineAdapter, list[LaunchPlan]]:
        self.prepared.append(model.name)
        return self.engine, [LaunchPlan()] * deployment.replicas

    async def tell(self, model: ModelSpec) -> None:
        self.told.append(model.name)


def tokenizer_json(path: Path) -> Path:
    Tokenizer(models.WordLevel({"hello": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(path))
    return path


async def test_an_apply_whose_tokenizer_cannot_be_loaded_changes_nothing(tmp_path: Path) -> None:
    running = parse_spec(ALPHA.format(queued=100), source="running")
    cluster = Cluster(running, tmp_path)
    garbage = tmp_path / "garbage.json"
    garbage.write_text("not json")
    for tokenizer, why in ((tmp_path / "typo.json", "no such file"), (garbage, "not a tokenizer.json")):
        wanted = parse_spec(ALPHA.format(queued=50) + BETA.format(tokenizer=tokenizer), source="wanted")
        with pytest.raises(ApplyError, match=r"models\[1\]\.tokenizer") as refused:
            await cluster.reconciler.apply(wanted, grace_s=1.0)
        assert str(tokenizer) in str(refused.value) and why in str(refused.value)
        assert "nothing changed" in str(refused.value)
        assert cluster.prepared == [] and cluster.told == [] and cluster.cluster_settings == []
        assert cluster.supervisor.replica_ids("org/beta") == []
        assert cluster.reconciler.spec is running
    fixed = parse_spec(
        ALPHA.format(queued=50) + BETA.format(tokenizer=tokenizer_json(tmp_path / "tokenizer.json")),
        source="fixed",
    )
    changes = await cluster.reconciler.apply(fixed, grace_s=1.0)
    assert [(c["action"], c["model"]) for c in changes] == [
        ("cluster_settings", "queue"),
        ("add_model", "org/beta"),
    ]
    assert cluster.told == ["org/beta"] and len(cluster.supervisor.replica_ids("org/beta")) == 2


async def test_an_applied_file_keeps_the_ray_cluster_corral_up_was_started_on(tmp_path: Path) -> None:
    """`corral up --ray local -f cluster.yaml`, then `corral apply -f cluster.yaml`: the same file, not a
    change of `ray` (which needs a restart); a change the file itself makes to `ray` still is one."""
    file = parse_spec(ALPHA.format(queued=100), source="cluster.yaml")
    overrides = Overrides(ray="local")
    running = overrides(file)
    assert running.ray is not None and file.ray is None
    cluster = Cluster(running, tmp_path, overrides=overrides)
    assert await cluster.reconciler.apply(file, grace_s=1.0) == []
    scaled = parse_spec(ALPHA.format(queued=100).replace("replicas: 1", "replicas: 2"), source="scaled")
    assert [c["action"] for c in await cluster.reconciler.apply(scaled, grace_s=1.0)] == ["scale_up"]
    placed = parse_spec("ray: {placement_timeout: 5}\n" + ALPHA.format(queued=100), source="placed")
    with pytest.raises(ApplyError, match="changing ray needs a restart"):
        await cluster.reconciler.apply(placed, grace_s=1.0)


def test_a_prefix_isolation_change_is_a_live_setting_not_a_rollout() -> None:
    running = parse_spec(ALPHA.format(queued=100), source="running")
    isolated = parse_spec(
        ALPHA.format(queued=100).replace("    arch:", "    prefix_isolation: tenant\n    arch:"), source="b"
    )
    changes = plan_changes(running, isolated)
    assert [(c.action, c.detail) for c in changes] == [("settings", "prefix_isolation")]


def test_feed_forward_sizes_a_model_the_catalog_knows_by_its_hugging_face_repository() -> None:
    """No arch, a name the catalog does not know, weights from a repository it does: the autoscaler sizes
    with that model (it returned None, and scaled reactively without a word)."""
    spec = parse_spec(
        "models:\n  - name: org/my-llama\n    source: {hf: meta-llama/Llama-3.1-8B-Instruct}\n"
        "    deployments:\n      - {engine: vllm, gpu: h100-sxm, replicas: 1,\n"
        "         autoscale: {min_replicas: 1, max_replicas: 4, mode: feed_forward}}\n",
        source="hf",
    )
    model = spec.models[0]
    rate = replica_request_rate(model, model.deployments[0], (512.0, 128.0), None)
    named = model.model_copy(update={"arch": "llama-3.1-8b"})
    assert rate is not None and rate == replica_request_rate(
        named, named.deployments[0], (512.0, 128.0), None
    )


async def test_a_new_gateway_address_or_deploy_section_is_told_as_changing_nothing_now(
    tmp_path: Path,
) -> None:
    """`corral apply` with another gateway.port printed "nothing to change: the cluster already runs this
    spec", and a changed `deploy` section (which only `corral deploy render` reads) was refused as needing a
    restart. Through the CLI, against an admin endpoint whose reconciler is this one."""
    running = parse_spec(ALPHA.format(queued=100), source="running")
    cluster = Cluster(running, tmp_path)
    applied: list[list[dict[str, object]]] = []

    async def admin_spec(request: web.Request) -> web.Response:  # (the gateway's POST /admin/spec)
        wanted = parse_spec(await request.text(), source="spec")
        applied.append(await cluster.reconciler.apply(wanted, grace_s=1.0))
        return web.json_response({"changes": applied[-1]})

    app = web.Application()
    app.router.add_post("/admin/spec", admin_spec)
    moved = tmp_path / "moved.yaml"
    moved.write_text("gateway: {host: 127.0.0.2, port: 8001}\n" + ALPHA.format(queued=100))
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(
        "deploy: {user: svc}\n" + ALPHA.format(queued=100).replace("replicas: 1", "replicas: 2")
    )
    async with TestServer(app, host="127.0.0.1") as server:
        url = str(server.make_url("")).rstrip("/")
        said = [
            await asyncio.to_thread(corral, "apply", "-f", str(f), "--url", url) for f in (moved, rendered)
        ]
    assert said[0].returncode == 0, said[0].stderr
    assert (
        "gateway.host, gateway.port: taken at the next restart of corral up (the gateway listens where it "
        "did); nothing else to change"
    ) in said[0].stderr
    assert "nothing to change: the cluster already runs" not in said[0].stderr
    assert [c["action"] for c in applied[0]] == ["at_restart"]
    assert (cluster.reconciler.spec.gateway.host, cluster.reconciler.spec.gateway.port) == ("127.0.0.1", 8000)
    assert said[1].returncode == 0, said[1].stderr
    assert "scale_up: alpha (deployment 0: 1 replica added, 2 now)" in said[1].stderr
    assert "deploy: read by `corral deploy render` alone, nothing running uses it\n" in said[1].stderr
    assert [(c["action"], c["detail"]) for c in applied[1]][-1] == ("render_only", "deploy")
    assert cluster.reconciler.spec.deploy.user == "svc"
    with pytest.raises(ApplyError, match=r"changing gateway\.read_timeout needs a restart"):  # (still)
        await cluster.reconciler.apply(
            parse_spec("gateway: {read_timeout: 5}\n" + ALPHA.format(queued=100)), 1
        )


async def test_a_live_apply_of_a_model_whose_files_are_missing_changes_nothing(tmp_path: Path) -> None:
    """Every missing file of the models it would prepare, named at once, before any is prepared."""
    running = parse_spec(ALPHA.format(queued=100), source="running")
    cluster = Cluster(running, tmp_path)
    gone = tmp_path / "gone"
    local = (
        f"  - name: local\n    source: {{path: {gone}/model.gguf}}\n    tokenizer: {gone}/tokenizer.json\n"
        f"    deployments: [{{engine: llamacpp, binary: {gone}/llama-server}}]\n"
    )
    with pytest.raises(ApplyError) as refused:
        await cluster.reconciler.apply(parse_spec(ALPHA.format(queued=50) + local), grace_s=1.0)
    said = str(refused.value)
    for field in ("models[1].source.path", "models[1].deployments[0].binary", "models[1].tokenizer"):
        assert field in said, said
    assert said.endswith("(nothing changed)") and cluster.prepared == [] and cluster.cluster_settings == []


def test_a_live_apply_of_an_unknown_simulated_gpu_is_refused_before_it_is_sent(tmp_path: Path) -> None:
    """It was reported applied, and the replica then failed five starts with `unknown GPU 'h100x'`."""
    spec = tmp_path / "cluster.yaml"
    spec.write_text(ALPHA.format(queued=100).replace("gpu: l4", "gpu: h100x"))
    done = corral("apply", "-f", str(spec), "--url", "http://127.0.0.1:9")  # (nothing listens there)
    assert done.returncode == 2, done.stderr
    assert f"{spec}:6: models.0.deployments.0: gpu: unknown GPU 'h100x'; did you mean h100-sxm" in done.stderr
    with pytest.raises(SpecError, match="unknown GPU 'h100x'"):  # (and the gateway's reading of the body)
        parse_spec(spec.read_text(), source="spec")


VLLM = """
models:
  - name: alpha
    source: {hf: org/alpha}
    deployments: [{engine: vllm, replicas: 1}]
"""
VLLM_BETA = """
  - name: beta
    source: {hf: org/beta}
    deployments: [{engine: vllm, replicas: 1%s}]
"""


async def test_a_live_apply_makes_the_gpu_checks_corral_up_makes(tmp_path: Path) -> None:
    """A second vLLM model with no `gpus:` lands on GPU 0 beside the first (0.9 + 0.9 of its memory), and
    one that needs more GPUs than the machine has never starts: `corral up` refuses both; an apply reported
    them applied, and their replicas then failed every start. Refused now, changing nothing."""
    running = parse_spec(VLLM, source="running")
    cluster = Cluster(running, tmp_path, gpu_count=lambda: 2)
    for extra, why in (("", "GPU 0 is given to models[alpha]"), (", gpus: [2]", "needs 3 GPU(s)")):
        wanted = parse_spec(VLLM + VLLM_BETA % extra, source="wanted")
        with pytest.raises(ApplyError, match=re.escape(why)) as refused:
            await cluster.reconciler.apply(wanted, grace_s=1.0)
        assert str(refused.value).endswith("(nothing changed)")
        assert cluster.prepared == [] and cluster.supervisor.replica_ids("beta") == []
    placed = parse_spec(VLLM + VLLM_BETA % ", gpus: [1]", source="placed")
    assert [c["action"] for c in await cluster.reconciler.apply(placed, grace_s=1.0)] == ["add_model"]
    assert cluster.prepared == ["beta"]


async def test_a_live_apply_on_a_machine_without_gpus_refuses_only_vllm_on_gpus(tmp_path: Path) -> None:
    """Simulated and llama.cpp models need no GPU here (nor does vLLM on the CPU); vLLM on GPUs does."""
    running = parse_spec(ALPHA.format(queued=100), source="running")
    cluster = Cluster(running, tmp_path, gpu_count=lambda: 0)
    simulated = parse_spec(ALPHA.format(queued=100).replace("replicas: 1", "replicas: 2"), source="sim")
    assert [c["action"] for c in await cluster.reconciler.apply(simulated, grace_s=1.0)] == ["scale_up"]
    on_gpus = parse_spec(ALPHA.format(queued=100).replace("replicas: 1", "replicas: 2") + VLLM_BETA % "")
    with pytest.raises(ApplyError, match=r"model 'beta' runs vLLM on GPUs and needs 1 GPU\(s\).*none can"):
        await cluster.reconciler.apply(on_gpus, grace_s=1.0)
    on_cpu = parse_spec(
        ALPHA.format(queued=100).replace("replicas: 1", "replicas: 2") + VLLM_BETA % ", device: cpu"
    )
    assert [c["action"] for c in await cluster.reconciler.apply(on_cpu, grace_s=1.0)] == ["add_model"]
