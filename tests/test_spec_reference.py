"""docs/reference/spec.md is generated from the spec's models: complete, described, and never stale."""

from __future__ import annotations

import subprocess
import typing
from pathlib import Path

import yaml
from pydantic import BaseModel

from corral.config import ClusterSpec, parse_spec
from corral.spec_reference import CLOSED_GATEWAY_EXAMPLE, SECTIONS, spec_reference

from .conftest import CORRAL

ROOT = Path(__file__).parent.parent


def test_docs_spec_md_is_the_generated_reference() -> None:
    assert (ROOT / "docs" / "reference" / "spec.md").read_text() == spec_reference(), (
        "docs/reference/spec.md is stale: run `corral spec explain -o docs/reference/spec.md`"
    )


def _models_in(model: type[BaseModel]) -> set[type[BaseModel]]:
    found = {model}
    for info in model.model_fields.values():
        stack = [info.annotation]
        while stack:
            annotation = stack.pop()
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                if annotation not in found:
                    found |= _models_in(annotation)
            else:
                stack.extend(typing.get_args(annotation))
    return found


def test_reference_covers_every_section_and_describes_every_field() -> None:
    assert _models_in(ClusterSpec) == {model for _, model in SECTIONS}
    undescribed = [
        f"{path}.{name}"
        for path, model in SECTIONS
        for name, info in model.model_fields.items()
        if not (info.description or "").strip()
    ]
    assert undescribed == []


def test_closed_gateway_example_is_valid_and_closed() -> None:
    spec = parse_spec(CLOSED_GATEWAY_EXAMPLE)
    assert not spec.auth.open and spec.auth.admin_key and spec.limits.backend == "redis"
    assert spec.store.url and spec.store.url.startswith("postgresql://")


def test_written_out_default_names_every_setting_of_every_section() -> None:
    written = yaml.safe_load((ROOT / "examples" / "cluster.yaml").read_text())
    for section in ("gateway", "auth", "store", "limits", "queue", "supervisor", "deploy"):
        model = ClusterSpec.model_fields[section].annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        assert set(written[section]) == set(model.model_fields), section


def test_spec_check_validates_a_file_and_explain_prints_the_reference(tmp_path: Path) -> None:
    good = subprocess.run(
        [*CORRAL, "spec", "check", "-f", str(ROOT / "examples" / "cluster.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert good.returncode == 0 and "valid: 2 model(s), 3 replica(s)" in good.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  - name: m\n    deployments: [{engine: llamacpp, replicas: 0}]\n")
    refused = subprocess.run([*CORRAL, "spec", "check", "-f", str(bad)], capture_output=True, text=True)
    assert refused.returncode == 2
    assert refused.stderr.startswith("error: invalid cluster spec") and "[red]" not in refused.stderr
    assert f"{bad}:3: models.0.deployments.0: replicas: 0 needs autoscale" in refused.stderr
    explained = subprocess.run([*CORRAL, "spec", "explain"], capture_output=True, text=True, timeout=60)
    assert explained.stdout == spec_reference()
