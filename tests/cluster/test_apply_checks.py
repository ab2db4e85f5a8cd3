"""What a live apply checks before it changes anything, and what it reads the file with: a tokenizer that
cannot be loaded is refused with its field and path (it was found only while the changes were being made,
leaving cluster settings changed and a model added but never told to the gateway), `corral up --ray`'s
cluster is kept (the file does not say it), and a model's prefix isolation is a live setting (the gateway's
alone: no replica is replaced for it)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from corral.cli.up import Overrides
from corral.cluster import LocalProcessRuntime, Supervisor
from corral.cluster.capacity import replica_request_rate
from corral.cluster.changes import ApplyError, plan_changes
from corral.cluster.reconcile import Reconciler
from corral.config import ClusterSpec, DeploymentSpec, ModelSpec, SupervisorSettings, parse_spec
from corral.engines import EngineAdapter, LaunchPlan, SimEngineAdapter
from corral.routing import ReplicaSet

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
