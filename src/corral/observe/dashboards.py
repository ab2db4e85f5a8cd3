"""Grafana dashboards for a corral cluster, built with Grafana's typed builders (grafana-foundation-sdk).

Three dashboards: *Cluster* (traffic, latency, admission, replicas and engines), *Tenants* and *GPU*
(NVIDIA DCGM exporter fields; the ECC and throttling ones need the counters file of dcgm.py). Every query
reads corral's own series (the gateway exports each replica's engine load as `corral_engine_*`, whatever
the engine), every mean is a ratio of rates, and every query is written to return a series before the
first error or refusal ever happens (`or … * 0`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as model

__all__ = ["DASHBOARDS", "PanelQuery", "concrete_query", "dashboard_json", "panel_queries"]

_DATASOURCE = model.DataSourceRef(type_val="prometheus", uid="${datasource}")
_RATE = "$__rate_interval"
_M = 'model=~"$model"'
_R = 'replica=~"$replica"'
_T = 'tenant=~"$tenant"'


def _quantiles(metric: str, by: str, labels: str) -> list[tuple[str, str]]:
    return [
        (
            f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{{{labels}}}[{_RATE}])))",
            f"p{round(q * 100)} {{{{{by}}}}}",
        )
        for q in (0.5, 0.95, 0.99)
    ]


@dataclass(frozen=True)
class _Panel:
    title: str
    unit: str
    queries: list[tuple[str, str]]  # (PromQL, legend)
    description: str = ""
    kind: str = "timeseries"
    width: int = 12


@dataclass(frozen=True)
class _Dashboard:
    uid: str
    title: str
    description: str
    variables: list[tuple[str, str, str]]  # (name, label, label_values query)
    rows: list[tuple[str, list[_Panel]]] = field(default_factory=list)


_CLUSTER = _Dashboard(
    "corral-cluster",
    "corral / Cluster",
    "Traffic, latency, admission, replicas and engine load of a corral cluster.",
    [
        ("model", "Model", "label_values(corral_requests_total, model)"),
        ("replica", "Replica", 'label_values(corral_replica_ready{model=~"$model"}, replica)'),
    ],
    [
        (
            "Traffic",
            [
                _Panel(
                    "Requests/s by status class",
                    "reqps",
                    [
                        (
                            "sum by (model, class) (label_replace(rate(corral_requests_total{"
                            + _M
                            + f'}}[{_RATE}]), "class", "${{1}}xx", "status", "(.).."))',
                            "{{model}} {{class}}",
                        )
                    ],
                ),
                _Panel(
                    "Error ratio (5xx)",
                    "percentunit",
                    [
                        (
                            f'(sum by (model) (rate(corral_requests_total{{{_M}, status=~"5.."}}[{_RATE}])) '
                            f"or sum by (model) (rate(corral_requests_total{{{_M}}}[{_RATE}])) * 0) "
                            f"/ sum by (model) (rate(corral_requests_total{{{_M}}}[{_RATE}]))",
                            "{{model}}",
                        )
                    ],
                    "Share of finished requests answered with a 5xx status.",
                ),
                _Panel(
                    "Tokens/s",
                    "short",
                    [
                        (
                            f"sum by (model, kind) (rate(corral_tokens_total{{{_M}}}[{_RATE}]))",
                            "{{model}} {{kind}}",
                        )
                    ],
                    "Input and output tokens of answered requests, as engines reported them.",
                ),
                _Panel(
                    "Routing decisions/s by policy",
                    "ops",
                    [
                        (
                            f"sum by (model, policy) (rate(corral_routing_decisions_total{{{_M}}}[{_RATE}]))",
                            "{{model}} {{policy}}",
                        )
                    ],
                ),
            ],
        ),
        (
            "Latency",
            [
                _Panel(
                    "Time to first token",
                    "s",
                    _quantiles("corral_time_to_first_token_seconds", "model", _M),
                    "Streamed requests, measured at the gateway.",
                ),
                _Panel(
                    "Inter-token latency",
                    "s",
                    _quantiles("corral_inter_token_latency_seconds", "model", _M),
                    "Each stream's mean time between output tokens.",
                ),
                _Panel(
                    "Request duration",
                    "s",
                    _quantiles("corral_request_duration_seconds", "model", _M),
                ),
                _Panel(
                    "Mean time to first token",
                    "s",
                    [
                        (
                            f"sum by (model) (rate(corral_time_to_first_token_seconds_sum{{{_M}}}[{_RATE}])) "
                            "/ sum by (model) "
                            f"(rate(corral_time_to_first_token_seconds_count{{{_M}}}[{_RATE}]))",
                            "{{model}}",
                        )
                    ],
                    "Over the rate interval (a ratio of rates, never a lifetime average).",
                ),
            ],
        ),
        (
            "Admission",
            [
                _Panel(
                    "Queue depth", "short", [(f"sum by (model) (corral_queue_depth{{{_M}}})", "{{model}}")]
                ),
                _Panel(
                    "Queue wait",
                    "s",
                    [
                        *_quantiles("corral_queue_wait_seconds", "model", _M)[:2],
                        (
                            f"sum by (model) (rate(corral_queue_wait_seconds_sum{{{_M}}}[{_RATE}])) "
                            f"/ sum by (model) (rate(corral_queue_wait_seconds_count{{{_M}}}[{_RATE}]))",
                            "mean {{model}}",
                        ),
                    ],
                ),
                _Panel(
                    "Refusals/s (429, 503) by reason",
                    "reqps",
                    [
                        (
                            f"sum by (model, reason) (rate(corral_rejections_total{{{_M}}}[{_RATE}]))",
                            "{{model}} {{reason}}",
                        )
                    ],
                    "Rate limits, budgets, full or timed-out queues, models without a ready replica.",
                ),
            ],
        ),
        (
            "Replicas and engines",
            [
                _Panel(
                    "Replicas by state",
                    "short",
                    [(f"sum by (model, state) (corral_replica_state{{{_M}}})", "{{model}} {{state}}")],
                ),
                _Panel(
                    "Restarts (last hour)",
                    "short",
                    [(f"sum by (model) (increase(corral_replica_restarts_total{{{_M}}}[1h]))", "{{model}}")],
                ),
                _Panel(
                    "Running and waiting per replica",
                    "short",
                    [
                        (f"corral_engine_running{{{_M}, {_R}}}", "running {{replica}}"),
                        (f"corral_engine_waiting{{{_M}, {_R}}}", "waiting {{replica}}"),
                    ],
                    "The engines' own figures (vLLM, llama.cpp and the simulator alike).",
                ),
                _Panel(
                    "KV-cache usage per replica",
                    "percentunit",
                    [(f"corral_engine_kv_cache_usage_ratio{{{_M}, {_R}}}", "{{replica}}")],
                ),
                _Panel(
                    "Prefix-cache hit rate",
                    "percentunit",
                    [
                        (
                            f"sum by (model) (rate(corral_engine_prefix_cache_hits_total{{{_M}}}[{_RATE}])) "
                            "/ sum by (model) "
                            f"(rate(corral_engine_prefix_cache_queries_total{{{_M}}}[{_RATE}]))",
                            "{{model}}",
                        )
                    ],
                    "Prompt tokens found in the engines' prefix caches, over tokens looked up.",
                ),
                _Panel(
                    "Preemptions/s",
                    "ops",
                    [
                        (
                            f"sum by (model) (rate(corral_engine_preemptions_total{{{_M}}}[{_RATE}]))",
                            "{{model}}",
                        )
                    ],
                ),
                _Panel(
                    "In flight per replica (gateway)",
                    "short",
                    [(f"corral_replica_outstanding{{{_M}, {_R}}}", "{{replica}}")],
                ),
                _Panel(
                    "Generated tokens/s per replica",
                    "short",
                    [(f"rate(corral_engine_generated_tokens_total{{{_M}, {_R}}}[{_RATE}])", "{{replica}}")],
                ),
            ],
        ),
    ],
)

_TENANTS = _Dashboard(
    "corral-tenants",
    "corral / Tenants",
    "Requests, tokens, refusals and budget use per tenant and key.",
    [("tenant", "Tenant", "label_values(corral_tenant_requests_total, tenant)")],
    [
        (
            "Tenants",
            [
                _Panel(
                    "Requests/s by tenant",
                    "reqps",
                    [
                        (
                            f"sum by (tenant) (rate(corral_tenant_requests_total{{{_T}}}[{_RATE}]))",
                            "{{tenant}}",
                        )
                    ],
                ),
                _Panel(
                    "Refused (429)/s by tenant",
                    "reqps",
                    [
                        (
                            "sum by (tenant) "
                            f'(rate(corral_tenant_requests_total{{{_T}, status="429"}}[{_RATE}])) '
                            f"or sum by (tenant) (rate(corral_tenant_requests_total{{{_T}}}[{_RATE}])) * 0",
                            "{{tenant}}",
                        )
                    ],
                    "Rate limits and budgets: the tenant's own keys asked for more than they may.",
                ),
                _Panel(
                    "Tokens/s by tenant",
                    "short",
                    [
                        (
                            f"sum by (tenant, kind) (rate(corral_tenant_tokens_total{{{_T}}}[{_RATE}]))",
                            "{{tenant}} {{kind}}",
                        )
                    ],
                ),
                _Panel(
                    "Monthly budget used, highest key per tenant",
                    "percentunit",
                    [(f"max by (tenant) (corral_key_budget_used_max_ratio{{{_T}}})", "{{tenant}}")],
                    "The highest share of its monthly token budget any of the tenant's keys has used (keys "
                    "with a budget the gateways served in the last day).",
                ),
                _Panel(
                    "Keys past half their monthly budget",
                    "percentunit",
                    [(f"max by (tenant, key) (corral_key_budget_used_ratio{{{_T}}})", "{{tenant}} {{key}}")],
                    "Each key from half its budget on, at most the 50 highest per gateway (a tenant may have "
                    "thousands of keys); CorralTenantBudgetNearlySpent fires at 90%.",
                ),
            ],
        )
    ],
)

_GPU_LABELS = 'Hostname=~"$host"'
_GPU = _Dashboard(
    "corral-gpu",
    "corral / GPU",
    "NVIDIA GPUs through dcgm-exporter: utilisation, memory, temperature, power, errors, throttling.",
    [("host", "Host", "label_values(DCGM_FI_DEV_GPU_UTIL, Hostname)")],
    [
        (
            "GPUs",
            [
                _Panel(
                    "Utilisation",
                    "percent",
                    [(f"DCGM_FI_DEV_GPU_UTIL{{{_GPU_LABELS}}}", "{{Hostname}} {{gpu}}")],
                ),
                _Panel(
                    "Memory used",
                    "mbytes",  # DCGM reports MiB: Grafana's binary unit, not decmbytes (SI)
                    [(f"DCGM_FI_DEV_FB_USED{{{_GPU_LABELS}}}", "{{Hostname}} {{gpu}}")],
                ),
                _Panel(
                    "Temperature",
                    "celsius",
                    [(f"DCGM_FI_DEV_GPU_TEMP{{{_GPU_LABELS}}}", "{{Hostname}} {{gpu}}")],
                ),
                _Panel(
                    "Power", "watt", [(f"DCGM_FI_DEV_POWER_USAGE{{{_GPU_LABELS}}}", "{{Hostname}} {{gpu}}")]
                ),
                _Panel(
                    "Last XID error",
                    "none",
                    [(f"DCGM_FI_DEV_XID_ERRORS{{{_GPU_LABELS}}}", "{{Hostname}} {{gpu}}")],
                    "The most recent XID code per GPU (0: none). 48, 61-64, 74, 79, 92, 94, 95, 119, 120: "
                    "hardware or driver faults; 13, 31, 43, 45: usually the application.",
                ),
                _Panel(
                    "Uncorrectable ECC errors (last hour)",
                    "short",
                    [
                        (
                            f"increase(DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{{{_GPU_LABELS}}}[1h])",
                            "double-bit {{Hostname}} {{gpu}}",
                        ),
                        (
                            f"increase(DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS{{{_GPU_LABELS}}}[1h])",
                            "rows remapped {{Hostname}} {{gpu}}",
                        ),
                    ],
                    "Double-bit errors need corral's counters file (dcgm-exporter -f "
                    "dcgm/corral-counters.csv); rows remapped for them (Ampere and later) are stock fields.",
                ),
                _Panel(
                    "Row remapping failures",
                    "short",
                    [(f"DCGM_FI_DEV_ROW_REMAP_FAILURE{{{_GPU_LABELS}}}", "{{Hostname}} {{gpu}}")],
                ),
                _Panel(
                    "Time throttled (power, thermal)",
                    "percentunit",
                    [
                        (
                            f"rate(DCGM_FI_DEV_POWER_VIOLATION{{{_GPU_LABELS}}}[{_RATE}]) / 1e6",
                            "power {{Hostname}} {{gpu}}",
                        ),
                        (
                            f"rate(DCGM_FI_DEV_THERMAL_VIOLATION{{{_GPU_LABELS}}}[{_RATE}]) / 1e6",
                            "thermal {{Hostname}} {{gpu}}",
                        ),
                    ],
                    "Share of time the clocks were held down (the violation counters count microseconds). "
                    "dcgm-exporter exports them only with corral's counters file (-f "
                    "dcgm/corral-counters.csv).",
                ),
            ],
        )
    ],
)

DASHBOARDS = (_CLUSTER, _TENANTS, _GPU)


@dataclass(frozen=True)
class PanelQuery:
    """One panel query as Prometheus would run it (Grafana's variables replaced)."""

    dashboard: str
    panel: str
    expr: str


def concrete_query(board: _Dashboard, expr: str, rate_interval: str) -> str:
    """A panel query as Prometheus runs it: `$__rate_interval` set, every variable matching all."""
    concrete = expr.replace(_RATE, rate_interval)
    for name, _, _ in board.variables:
        concrete = concrete.replace(f'"${name}"', '".*"')
    return concrete


def panel_queries(rate_interval: str = "1m") -> list[PanelQuery]:
    """Every panel query of every dashboard, with `$__rate_interval` and the variables set to match all."""
    out = []
    for board in DASHBOARDS:
        for _, panels in board.rows:
            for panel in panels:
                for expr, _legend in panel.queries:
                    out.append(PanelQuery(board.uid, panel.title, concrete_query(board, expr, rate_interval)))
    return out


def dashboard_json(board: _Dashboard) -> str:
    """The dashboard as Grafana's JSON model (provisionable as a file)."""
    builder = (
        dashboard.Dashboard(board.title)
        .uid(board.uid)
        .description(board.description)
        .tags(["corral"])
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .editable()
        .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
    )
    for name, label, query in board.variables:
        builder = builder.with_variable(
            dashboard.QueryVariable(name)
            .label(label)
            .query(query)
            .datasource(_DATASOURCE)
            .multi(True)
            .include_all(True)
            .all_value(".*")
            .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        )
    panel_id, y = 1, 0
    for row_title, panels in board.rows:
        builder = builder.with_row(
            dashboard.Row(row_title).id(panel_id).grid_pos(model.GridPos(h=1, w=24, x=0, y=y))
        )
        panel_id, y, x = panel_id + 1, y + 1, 0
        for panel in panels:
            builder = builder.with_panel(_panel(panel, panel_id, x, y))
            panel_id += 1
            x += panel.width
            if x >= 24:
                x, y = 0, y + 8
        if x:
            y += 8
    encoded = JSONEncoder(sort_keys=True, indent=2).encode(builder.build())
    document: dict[str, Any] = json.loads(encoded)
    document["schemaVersion"] = 39
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def _panel(panel: _Panel, panel_id: int, x: int, y: int) -> Any:
    builder: Any = timeseries.Panel() if panel.kind == "timeseries" else stat.Panel()
    builder = (
        builder.id(panel_id)
        .title(panel.title)
        .description(panel.description)
        .unit(panel.unit)
        .datasource(_DATASOURCE)
        .grid_pos(model.GridPos(h=8, w=panel.width, x=x, y=y))
    )
    for index, (expr, legend) in enumerate(panel.queries):
        builder = builder.with_target(
            prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(chr(ord("A") + index))
        )
    return builder
