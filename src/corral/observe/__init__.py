"""Watching a cluster: Grafana dashboards, Prometheus alert rules and scrape configuration, rendered from
a spec (`corral observe render`). Tools: nothing here imports the gateway."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from corral.config import ClusterSpec
from corral.observe.dashboards import DASHBOARDS, PanelQuery, dashboard_json, panel_queries
from corral.observe.dcgm import COUNTERS_FILE, counters_csv
from corral.observe.rules import RUNBOOK, AlertRule, alert_rules, rules_yaml

__all__ = [
    "DASHBOARDS",
    "GATEWAY_JOB",
    "METRICS_TOKEN_FILE",
    "AlertRule",
    "PanelQuery",
    "alert_rules",
    "credentials_files",
    "dashboard_json",
    "panel_queries",
    "prometheus_config",
    "render_observability",
]

GATEWAY_JOB = "corral-gateway"
RULES_FILE = "prometheus/rules/corral.rules.yml"
RUNBOOK_FILE = "prometheus/runbook.md"  # the alerts' runbook, linked from each rule unless deploy.runbook_url
METRICS_TOKEN_FILE = "metrics.token"  # beside prometheus.yml: the gateway's `metrics_token`


def _on_gpus(spec: ClusterSpec) -> bool:
    return any(d.engine == "vllm" and d.device == "gpu" for m in spec.models for d in m.deployments)


def prometheus_config(
    spec: ClusterSpec,
    rules: Path,
    scrape_interval: str = "15s",
    *,
    gateway: str | None = None,
    engines: bool = True,
    dcgm: str = "127.0.0.1:9400",
) -> dict[str, Any]:
    """Scrape the gateway (its /metrics carries every replica's engine load as corral series), the engines
    directly through the gateway's HTTP service discovery, and dcgm-exporter on GPU deployments.

    `gateway`: its address as Prometheus reaches it (default: from this host); `engines`: False where the
    replicas' addresses, loopback ones of the gateway's host, are out of Prometheus's reach (a container);
    `dcgm`: dcgm-exporter's address. Credentials files are named relative to prometheus.yml."""
    gateway = gateway or spec.gateway.address_from_here()
    scheme = "https" if spec.gateway.tls is not None else "http"
    discovery: dict[str, Any] = {"url": f"{scheme}://{gateway}/corral/sd", "refresh_interval": "30s"}
    if not spec.auth.open or spec.auth.admin_key:
        # The replica list is the admin's or the scraper's: its token where the spec has one (the admin
        # key never leaves for the monitoring host then), else the admin key in admin.key beside
        # prometheus.yml (also when CORRAL_ADMIN_KEY gives an open gateway one). The type is written out:
        # Prometheus 2.42 (Debian 12) sends the bare key without it.
        credentials = METRICS_TOKEN_FILE if spec.gateway.metrics_token else "admin.key"
        discovery["authorization"] = {"type": "Bearer", "credentials_file": credentials}
    gateway_job: dict[str, Any] = {
        "job_name": GATEWAY_JOB,
        "scheme": scheme,
        "static_configs": [{"targets": [gateway]}],
    }
    if not spec.auth.open:
        # A closed gateway's /metrics answers the scraper's token (written beside prometheus.yml by
        # render_observability) or, without one in the spec, the admin key (admin.key, as above).
        credentials = METRICS_TOKEN_FILE if spec.gateway.metrics_token else "admin.key"
        gateway_job["authorization"] = {"type": "Bearer", "credentials_file": credentials}
    if spec.gateway.tls is not None:
        # A private CA (`corral deploy certs`): its ca.crt beside prometheus.yml; a public one needs none.
        gateway_job["tls_config"] = {"ca_file": "ca.crt"}
        discovery["tls_config"] = {"ca_file": "ca.crt"}
    jobs: list[dict[str, Any]] = [gateway_job]
    if engines:
        jobs.append({"job_name": "corral-engines", "http_sd_configs": [discovery]})
    if _on_gpus(spec):
        # dcgm-exporter on each GPU node (default port 9400, run with `-f` COUNTERS_FILE); list every
        # node's address here.
        jobs.append({"job_name": "dcgm", "static_configs": [{"targets": [dcgm]}]})
    return {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
        "rule_files": [str(rules)],
        "scrape_configs": jobs,
    }


def credentials_files(config: dict[str, Any]) -> set[str]:
    """The files the scrape jobs of a Prometheus configuration read their bearer credentials from."""
    found = set()
    for job in config["scrape_configs"]:
        for section in (job, *job.get("http_sd_configs", [])):
            if "authorization" in section:
                found.add(section["authorization"]["credentials_file"])
    return found


def render_observability(
    spec: ClusterSpec, source: str, output: Path, scrape_interval: str = "15s"
) -> dict[str, str]:
    """Dashboards, rules, Prometheus configuration, Grafana provisioning and, on GPU specs, dcgm-exporter's
    counters file, keyed by path under `output`."""
    header = f"# Rendered by `corral observe render` from {source}; render again after editing the spec.\n"
    prometheus = prometheus_config(spec, (output / RULES_FILE).resolve(), scrape_interval)
    files = {
        RULES_FILE: header
        + yaml.safe_dump(
            rules_yaml(spec, (output / RUNBOOK_FILE).resolve().as_uri()), sort_keys=False, width=200
        ),
        RUNBOOK_FILE: RUNBOOK.read_text(),
        "prometheus/prometheus.yml": header + yaml.safe_dump(prometheus, sort_keys=False),
        "grafana/provisioning/datasources/corral.yaml": header
        + yaml.safe_dump(
            {
                "apiVersion": 1,
                "datasources": [
                    {
                        "name": "Prometheus",
                        "type": "prometheus",
                        "uid": "prometheus",
                        "access": "proxy",
                        "url": "http://127.0.0.1:9090",
                        "isDefault": True,
                    }
                ],
            },
            sort_keys=False,
        ),
        "grafana/provisioning/dashboards/corral.yaml": header
        + yaml.safe_dump(
            {
                "apiVersion": 1,
                "providers": [
                    {
                        "name": "corral",
                        "folder": "corral",
                        "type": "file",
                        "options": {"path": str((output / "grafana" / "dashboards").resolve())},
                    }
                ],
            },
            sort_keys=False,
        ),
    }
    if _on_gpus(spec):
        files[COUNTERS_FILE] = counters_csv()  # dcgm-exporter's stock fields lack the ECC and throttling ones
    if spec.gateway.metrics_token and METRICS_TOKEN_FILE in credentials_files(prometheus):
        # (also for an open gateway with an admin key: its replica list, /corral/sd, asks for the token)
        files[f"prometheus/{METRICS_TOKEN_FILE}"] = spec.gateway.metrics_token
    for board in DASHBOARDS:
        files[f"grafana/dashboards/{board.uid}.json"] = dashboard_json(board)
    return files
