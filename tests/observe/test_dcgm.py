"""The GPU alerts and dashboard read only fields dcgm-exporter exports: its stock counters list (recorded
from NVIDIA/dcgm-exporter's etc/default-counters.csv in data/) or the counters file `corral observe render`
writes for it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from corral.config import parse_spec
from corral.observe import DASHBOARDS, alert_rules, dashboard_json, panel_queries, render_observability

STOCK = Path(__file__).with_name("data") / "dcgm-exporter-default-counters.csv"
GPU_SPEC = parse_spec(
    "models:\n  - {name: m, source: {hf: org/model}, deployments: [{engine: vllm, gpu: h100-sxm}]}\n"
)
DOCS = Path(__file__).parents[2] / "docs" / "operations" / "watching.md"


def exported(counters: str) -> dict[str, tuple[str, str]]:
    """The fields a counters file enables (dcgm-exporter skips lines starting with #), with type and help."""
    fields = {}
    for line in counters.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        field, kind, help_text = (cell.strip() for cell in line.split(",", 2))
        assert kind in ("gauge", "counter"), line
        fields[field] = (kind, help_text)
    return fields


def dcgm_fields_read() -> set[str]:
    queries = [rule.expr for rule in alert_rules(GPU_SPEC)] + [query.expr for query in panel_queries()]
    return {name for query in queries for name in re.findall(r"DCGM_FI_\w+", query)}


def test_every_dcgm_field_the_alerts_and_dashboard_read_is_in_the_rendered_counters_file(
    tmp_path: Path,
) -> None:
    """Three GPU alerts and two panels read fields the stock list comments out: they could never fire."""
    stock = exported(STOCK.read_text())
    missing = dcgm_fields_read() - set(stock)
    assert {"DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_THERMAL_VIOLATION"} <= missing
    rendered = render_observability(GPU_SPEC, "spec.yaml", tmp_path)
    counters = exported(rendered["dcgm/corral-counters.csv"])
    assert dcgm_fields_read() - set(counters) == set()
    # The stock fields stay, as NVIDIA types them: passing the file loses nothing.
    assert {field: stock[field][0] for field in stock} == {field: counters[field][0] for field in stock}
    page = DOCS.read_text()
    assert "-f /etc/corral/observe/dcgm/corral-counters.csv" in page
    assert all(field in page for field in missing), sorted(missing)


def test_the_counters_file_is_rendered_only_for_gpu_specs(tmp_path: Path) -> None:
    cpu = parse_spec("models:\n  - {name: m, arch: llama-3.1-8b, deployments: [{engine: sim, gpu: l4}]}\n")
    assert "dcgm/corral-counters.csv" not in render_observability(cpu, "spec.yaml", tmp_path)


def test_gpu_memory_panel_is_in_mebibytes() -> None:
    """DCGM reports framebuffer memory in MiB: Grafana's `mbytes`, not `decmbytes` (SI megabytes)."""
    assert "(in MiB)" in exported(STOCK.read_text())["DCGM_FI_DEV_FB_USED"][1]
    board = next(b for b in DASHBOARDS if b.uid == "corral-gpu")
    panels = json.loads(dashboard_json(board))["panels"]
    memory = [p for p in panels if "DCGM_FI_DEV_FB_USED" in json.dumps(p.get("targets", []))]
    assert [p["fieldConfig"]["defaults"]["unit"] for p in memory] == ["mbytes"]
