"""`corral apply` and a running gateway's adapters (cluster/reconcile.py, through the settings the gateways
are told: cli/gateway_spec.py): an adapter whose files changed where they lie becomes a new revision
(announced, gated as a replaced adapter is, the old one retired), and a removed model's adapters leave the
catalogue with it."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from corral.artifacts import resolve_adapter
from corral.cli.gateway_spec import install_adapters, model_settings
from corral.cluster.changes import ApplyError
from corral.cluster.reconcile import Reconciler
from corral.config import AdapterSpec, ClusterSpec, DeploymentSpec, ModelSpec, Paths, parse_spec
from corral.routing import Replica, ReplicaSet
from corral.routing.adapters import AdapterCatalogue
from tests.conftest import DATA

ADAPTER = DATA / "lora" / "corral-marker"
HEAD = """
auth: {open: true}
models:"""
LLAMA = """
  - name: llama
    arch: llama-3.1-8b
    lora: {{max_loras: 4, max_lora_rank: 16}}
    {golden}
    adapters:
      - {{name: first, source: {{path: {path}}}}}
    deployments: [{{engine: sim, replicas: 1, gpu: h100-sxm}}]
"""
OTHER = """
  - name: other
    arch: llama-3.1-8b
    deployments: [{engine: sim, replicas: 1, gpu: h100-sxm}]
"""


@dataclass
class _Supervisor:
    """The replicas the reconciler sees (one a deployment, never started: these applies start none)."""

    replicas: ReplicaSet = field(default_factory=ReplicaSet)
    drained: list[str] = field(default_factory=list)

    def replica_ids(self, model: str, group: int | None = None) -> list[str]:
        return [f"{model}-0"] if self.replicas.has_model(model) else []

    def members(self, model: str, group: int | None = None) -> list[Replica]:
        return [Replica(f"{model}-0", model, "sim")] if self.replicas.has_model(model) else []

    async def drain(self, replica_id: str, grace_s: float) -> dict[str, object]:
        self.drained.append(replica_id)
        return {}

    def start_added(self) -> None:
        return None


@dataclass
class _Gateway:
    """A gateway's catalogue, told each model's settings as `corral up` tells its gateways."""

    paths: Paths
    catalogue: AdapterCatalogue = field(default_factory=AdapterCatalogue)

    async def tell(self, model: ModelSpec) -> None:
        install_adapters(
            SimpleNamespace(adapters=self.catalogue, cache=None), model_settings(model, self.paths)
        )

    def engine_names(self) -> dict[str, str]:
        return {a.name: a.engine_name for a in self.catalogue.all()}


def _spec(path: Path | None, golden: bool = False, other: bool = False) -> ClusterSpec:
    """llama with an adapter at `path` (None: no llama), and `other` beside it."""
    gate = 'rollout: {golden_eval: [{prompt: "Say something.", regex: "."}]}' if golden else ""
    llama = LLAMA.format(path=path, golden=gate) if path is not None else ""
    return parse_spec(HEAD + llama + (OTHER if other else ""))


async def _running(spec: ClusterSpec) -> tuple[Reconciler, _Gateway, _Supervisor]:
    supervisor = _Supervisor()
    for model in spec.models:
        supervisor.replicas.declare(model.name)
    paths = Paths.from_env()
    gateway = _Gateway(paths)
    for model in spec.models:  # (as the gateway reads the spec when it starts)
        await gateway.tell(model)

    def prepare(model: ModelSpec, deployment: DeploymentSpec) -> tuple[Any, list[Any]]:
        return None, []

    def adapter_path(adapter: AdapterSpec) -> str:
        return str(resolve_adapter(adapter.source, paths))

    reconciler = Reconciler(
        supervisor,  # type: ignore[arg-type]
        spec,
        prepare,
        gateway.tell,
        adapter_path=adapter_path,
    )
    reconciler.start([])
    assert await reconciler.apply(spec, grace_s=1.0) == []  # (once it read the revisions served)
    return reconciler, gateway, supervisor


def _rewrite(folder: Path) -> None:
    """New adapter files where the old ones lie (a retrained adapter copied over the old one)."""
    config = folder / "adapter_config.json"
    data = json.loads(config.read_text())
    config.write_text(json.dumps({**data, "revision_note": "retrained"}, indent=2))
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes() + b" ")


async def test_adapter_files_changed_where_they_lie_are_a_new_revision_on_apply(tmp_path: Path) -> None:
    folder = tmp_path / "first"
    shutil.copytree(ADAPTER, folder)
    spec = _spec(folder)
    reconciler, gateway, _ = await _running(spec)
    try:
        before = gateway.engine_names()["first"]
        _rewrite(folder)
        changes = await reconciler.apply(spec, grace_s=1.0)
        assert [(c["action"], c["detail"]) for c in changes] == [("settings", "adapters first")]
        after = gateway.engine_names()["first"]
        assert after != before and after.startswith("first@")  # the old revision retired
        assert await reconciler.apply(spec, grace_s=1.0) == []  # (and told once)
    finally:
        await reconciler.stop()


async def test_adapter_files_changed_where_they_lie_are_gated_as_a_replaced_adapter(tmp_path: Path) -> None:
    """A model with a golden eval checks a replaced adapter on a ready replica before it serves: so too
    an adapter whose files changed in place (here no replica is ready to check it: refused)."""
    folder = tmp_path / "first"
    shutil.copytree(ADAPTER, folder)
    spec = _spec(folder, golden=True)
    reconciler, gateway, _ = await _running(spec)
    try:
        before = gateway.engine_names()
        _rewrite(folder)
        with pytest.raises(ApplyError, match="check the replaced adapters"):
            await reconciler.apply(spec, grace_s=1.0)
        assert gateway.engine_names() == before  # nothing changed
    finally:
        await reconciler.stop()


async def test_a_removed_models_adapters_leave_the_catalogue_with_it(tmp_path: Path) -> None:
    spec = _spec(ADAPTER, other=True)
    reconciler, gateway, supervisor = await _running(spec)
    try:
        assert gateway.catalogue.has_adapters("llama") and gateway.catalogue.get("first") is not None
        changes = await reconciler.apply(_spec(None, other=True), grace_s=1.0)
        assert [(c["action"], c["model"]) for c in changes] == [("remove_model", "llama")]
        assert supervisor.drained == ["llama-0"] and not supervisor.replicas.has_model("llama")
        assert gateway.catalogue.get("first") is None and not gateway.catalogue.has_adapters("llama")
        assert gateway.catalogue.all() == []
    finally:
        await reconciler.stop()
