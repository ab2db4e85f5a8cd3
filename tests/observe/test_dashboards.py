"""The rendered dashboards are valid Grafana dashboard JSON: typed models accept them, ids are unique,
every panel has a unit and the datasource variable, and no mean is a lifetime average."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from grafana_foundation_sdk.models.dashboard import Dashboard

from corral.config import parse_spec
from corral.deploy import write_rendered
from corral.observe import DASHBOARDS, dashboard_json, panel_queries, render_observability
from tests.conftest import CORRAL

SPEC = """
models:
  - name: m
    slo: {ttft_p95: 0.5}
    source: {hf: org/model}
    deployments: [{engine: vllm}]
"""


@pytest.mark.parametrize("board", DASHBOARDS, ids=[b.uid for b in DASHBOARDS])
def test_dashboard_json_is_valid(board: object) -> None:
    document = json.loads(dashboard_json(board))  # type: ignore[arg-type]
    Dashboard.from_json(document)  # Grafana's typed model of a dashboard
    assert document["schemaVersion"] >= 36 and document["uid"] == board.uid  # type: ignore[attr-defined]
    variables = {v["name"]: v for v in document["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    panels = document["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)) and 0 not in ids
    for panel in (p for p in panels if p["type"] != "row"):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)) and all(refs), panel["title"]
        for target in panel["targets"]:
            # A mean is rate(sum)/rate(count): a bare _sum/_count would average since the process started.
            bare = re.findall(r"(?<!rate\()(?<!increase\()\b\w+_(?:sum|count)\{", target["expr"])
            assert not bare, (panel["title"], target["expr"])
        grid = panel["gridPos"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= 24


def test_panel_queries_cover_every_target() -> None:
    total = sum(
        len(p["targets"])
        for b in DASHBOARDS
        for p in json.loads(dashboard_json(b))["panels"]
        if p["type"] != "row"
    )
    queries = panel_queries()
    assert len(queries) == total
    assert all("$" not in q.expr.replace("${1}", "") for q in queries)


def test_observe_render_writes_dashboards_rules_and_provisioning(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    out = tmp_path / "observe"
    earlier = out / "grafana" / "provisioning" / "datasources" / "corral.yaml"
    earlier.parent.mkdir(parents=True)
    earlier.write_text("as an earlier render left it")
    earlier.chmod(0o600)
    result = subprocess.run(
        [*CORRAL, "observe", "render", "-f", str(spec), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        umask=0o022,
    )
    assert result.returncode == 0, result.stderr
    # Grafana (another user) reads its provisioning files: they were made private, named like
    # kuberay/corral.yaml, which carries the spec and stays so (and a render again left them private)
    for kind in ("datasources", "dashboards"):
        assert (out / "grafana" / "provisioning" / kind / "corral.yaml").stat().st_mode & 0o777 == 0o644
    write_rendered({"kuberay/corral.yaml": "the spec"}, tmp_path / "deploy")
    assert (tmp_path / "deploy" / "kuberay" / "corral.yaml").stat().st_mode & 0o777 == 0o600
    for name in ("corral-cluster", "corral-tenants", "corral-gpu"):
        json.loads((out / "grafana" / "dashboards" / f"{name}.json").read_text())
    rules = (out / "prometheus" / "rules" / "corral.rules.yml").read_text()
    assert "CorralTTFTSLOBreached" in rules and 'model="m"' in rules and "> 0.5" in rules
    config = (out / "prometheus" / "prometheus.yml").read_text()
    assert str((out / "prometheus" / "rules" / "corral.rules.yml").resolve()) in config
    assert "/corral/sd" in config and "dcgm" in config  # a GPU spec also scrapes dcgm-exporter
    provisioning = (out / "grafana" / "provisioning" / "dashboards" / "corral.yaml").read_text()
    assert str((out / "grafana" / "dashboards").resolve()) in provisioning
    gateway = yaml.safe_load(config)["scrape_configs"][0]  # a closed gateway's /metrics: the admin key
    assert gateway["authorization"] == {"type": "Bearer", "credentials_file": "admin.key"}
    assert "put the admin key in" in result.stderr and "/corral/sd and /metrics" in result.stderr
    (out / "prometheus" / "admin.key").write_text("the-admin-key")  # as the operator puts it there
    checked = subprocess.run(
        ["promtool", "check", "config", str(out / "prometheus" / "prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize(
    "settings",
    [
        "auth: {open: true, admin_key: adm-123}\ngateway: {metrics_token: tok-abc}",
        "auth: {open: true, admin_key: adm-123}",
        "gateway: {metrics_token: tok-abc}",
        "gateway: {}",
        "auth: {open: true}",
    ],
    ids=["open-admin-token", "open-admin", "closed-token", "closed", "open"],
)
def test_every_credentials_file_prometheus_reads_is_written(tmp_path: Path, settings: str) -> None:
    """An open gateway with an admin key and a metrics_token got a corral-engines job reading
    metrics.token, which was written for closed gateways only: Prometheus could not discover the engines.
    The admin key alone is never written (the operator puts it in admin.key: the CLI says so)."""
    spec = parse_spec(SPEC + settings + "\n")
    files = render_observability(spec, "spec.yaml", tmp_path)
    config = yaml.safe_load(files["prometheus/prometheus.yml"])
    sections = [s for job in config["scrape_configs"] for s in (job, *job.get("http_sd_configs", []))]
    read = {s["authorization"]["credentials_file"] for s in sections if "authorization" in s}
    for name in read:
        assert f"prometheus/{name}" in files or (name == "admin.key" and not spec.gateway.metrics_token)
    if spec.gateway.metrics_token in files.values():
        write_rendered(files, tmp_path)
        assert (tmp_path / "prometheus" / "metrics.token").stat().st_mode & 0o777 == 0o600


def test_snapshot_titles_say_units_in_words() -> None:
    """The snapshot's panels showed Grafana's unit ids: "(reqps)", "(percentunit)"."""
    from corral.observe.dashboards import DASHBOARDS
    from corral.observe.snapshot import title

    assert title("Requests", "reqps") == "Requests (requests/s)"
    assert title("KV cache", "percentunit") == "KV cache (ratio, 1 = 100%)"
    assert title("Replicas", "short") == "Replicas"
    units = {panel.unit for board in DASHBOARDS for _, row in board.rows for panel in row}
    raw = [unit for unit in units if title("x", unit) == f"x ({unit})"]
    assert raw == [], raw  # every unit the dashboards use is said in words
