"""The alert rules under Prometheus's own tools: `promtool check rules`, and `promtool test rules` with one
case per alert that fires on synthetic series (exact labels and summary) and one that stays quiet."""

from __future__ import annotations

import logging
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from corral.config import DeploySettings, parse_spec
from corral.gateway.metrics import GatewayMetrics
from corral.observe import alert_rules, render_observability
from corral.observe.rules import RUNBOOK, TOP_BUCKET_S, rules_yaml
from corral.routing import ReplicaSet, Router

SPEC = parse_spec(
    "models:\n  - {name: m, arch: llama-3.1-8b, slo: {ttft_p95: 0.5, itl_p95: 0.05},"
    " deployments: [{engine: sim, gpu: l4}]}\n"
)
GPU = 'Hostname="h1", gpu="0", UUID="GPU-1"'
GPU_LABELS = {"Hostname": "h1", "gpu": "0", "UUID": "GPU-1"}


@dataclass
class Case:
    alert: str
    series: dict[str, str]  # series → promtool values
    at: str
    labels: dict[str, str] = field(default_factory=dict)  # expected when it fires; None when quiet
    summary: str | None = None

    @property
    def fires(self) -> bool:
        return self.summary is not None


def requests(ok: str, errors: str | None = None, model: str = "m") -> dict[str, str]:
    series = {f'corral_requests_total{{model="{model}", status="200"}}': ok}
    if errors is not None:
        series[f'corral_requests_total{{model="{model}", status="500"}}'] = errors
    return series


def histogram(metric: str, counts: dict[str, str]) -> dict[str, str]:
    return {f'{metric}_bucket{{model="m", le="{le}"}}': values for le, values in counts.items()}


FIRING = [
    Case(
        "CorralGatewayDown",
        {'up{job="corral-gateway", instance="gw:8000"}': "0x10"},
        "5m",
        {"job": "corral-gateway", "instance": "gw:8000", "severity": "critical"},
        "The corral gateway gw:8000 does not answer Prometheus's scrapes.",
    ),
    Case(
        "CorralModelUnavailable",
        {
            'corral_replica_ready{instance="gw:8000", model="m", replica="r0"}': "0x10",
            'corral_replica_ready{instance="gw:8000", model="m", replica="r1"}': "0x10",
        },
        "5m",
        {"instance": "gw:8000", "model": "m", "severity": "critical"},
        "Model m has no ready replica on the gateway gw:8000: its requests there are refused with 503.",
    ),
    Case(
        "CorralReplicaDown",
        {
            'corral_replica_ready{model="m", replica="r0"}': "0x10",
            'corral_replica_ready{model="m", replica="r1"}': "1x10",
        },
        "8m",
        {"model": "m", "replica": "r0", "severity": "warning"},
        "Replica r0 of m has been out of service (not starting) for 5 minutes.",
    ),
    Case(  # starting since long past what a start may take: waiting for room on the Ray cluster
        "CorralReplicaStartSlow",
        {
            'corral_replica_ready{model="m", replica="r0"}': "0x15",
            'corral_replica_state{model="m", replica="r0", state="starting"}': "1x15",
        },
        "10m",
        {"model": "m", "replica": "r0", "state": "starting", "severity": "warning"},
        "Replica r0 of m has been starting for longer than a start may take (180 s): it waits for room on "
        "the Ray cluster, or its starts keep failing; see its last_error in /corral/status, and its log.",
    ),
    Case(
        "CorralReplicaRestartLoop",
        {'corral_replica_restarts_total{model="m", replica="r0"}': "0 1 2 3 4 5"},
        "5m",
        {"model": "m", "replica": "r0", "severity": "warning"},
        "Replica r0 of m restarted 3 times or more in 15 minutes: see its log for the cause.",
    ),
    Case(
        "CorralErrorRatioHigh",
        requests("0+9x20", "0+1x20"),
        "12m",
        {"model": "m", "severity": "critical"},
        "m: 10% of requests end in a server error.",
    ),
    Case(
        "CorralQueueWaitHigh",
        histogram("corral_queue_wait_seconds", {"10": "0x20", "30": "0+10x20", "+Inf": "0+10x20"}),
        "12m",
        {"model": "m", "severity": "warning"},
        "m: p95 queue wait 29s (over 15 s, half the queue timeout): add replicas.",
    ),
    Case(
        "CorralKVCacheFull",
        {'corral_engine_kv_cache_usage_ratio{model="m", replica="r0"}': "0.97x20"},
        "15m",
        {"model": "m", "replica": "r0", "severity": "warning"},
        "Replica r0 of m has used ≥ 95% of its KV cache for 10 minutes.",
    ),
    Case(
        "CorralPreemptions",
        {'corral_engine_preemptions_total{model="m", replica="r0"}': "0+60x20"},
        "17m",
        {"model": "m", "severity": "warning"},
        "m: engines preempt more than one sequence every 2 s (KV cache too small for the load).",
    ),
    Case(
        "CorralRateLimitSpike",
        {
            **requests("0+70x20"),
            'corral_requests_total{model="m", status="429"}': "0+30x20",
            'corral_rejections_total{model="m", reason="rate_limit_exceeded"}': "0+30x20",
        },
        "17m",
        {"model": "m", "severity": "warning"},
        "m: 30% of requests are refused by rate limits or budgets.",
    ),
    Case(
        "CorralStoreUnreachable",
        {
            'corral_store_errors_total{instance="gw:8000", use="key_lookup"}': "0x5 1+5x15",
            'corral_store_errors_total{instance="gw:8000", use="usage_write"}': "0x5 0+5x15",
        },
        "14m",
        {"instance": "gw:8000", "severity": "critical"},
        "The gateway gw:8000 gets no answer from corral's store: keys it has not looked up yet, stored "
        "responses and the admin API are refused with 503, usage waits in memory.",
    ),
    Case(
        "CorralUsageRecordsDropped",
        {'corral_usage_dropped_total{instance="gw:8000"}': "0x5 40x10"},
        "7m",
        {"instance": "gw:8000", "severity": "critical"},
        "The gateway gw:8000 dropped usage records (the store was unreachable past store.max_pending): "
        "usage reports and monthly budgets undercount.",
    ),
    Case(
        "CorralRateLimiterUnreachable",
        {'corral_limiter_errors_total{instance="gw:8000"}': "0x5 0+20x15"},
        "14m",
        {"instance": "gw:8000", "severity": "warning"},
        "The gateway gw:8000 cannot check rate limits in Redis: its requests are served without their rate "
        "limits (limits.on_redis_error: open).",
    ),
    Case(
        "CorralTenantBudgetNearlySpent",
        {'corral_key_budget_used_ratio{tenant="acme", key="k1"}': "0.95x5"},
        "2m",
        {"tenant": "acme", "key": "k1", "severity": "info"},
        "Key k1 of tenant acme has used 95% of its monthly token budget.",
    ),
    Case(
        "CorralTTFTSLOBreached",
        histogram("corral_time_to_first_token_seconds", {"0.5": "0x20", "1": "0+10x20", "+Inf": "0+10x20"}),
        "12m",
        {"model": "m", "severity": "warning"},
        "m: TTFT p95 975ms is over its SLO of 0.5 s.",
    ),
    Case(
        "CorralITLSLOBreached",
        histogram(
            "corral_inter_token_latency_seconds", {"0.04": "0x20", "0.06": "0+10x20", "+Inf": "0+10x20"}
        ),
        "12m",
        {"model": "m", "severity": "warning"},
        "m: ITL p95 59ms is over its SLO of 0.05 s.",
    ),
    Case(
        "CorralGPUFatalXID",
        {f"DCGM_FI_DEV_XID_ERRORS{{{GPU}}}": "0 0 79 79 79"},
        "4m",
        {**GPU_LABELS, "severity": "critical"},
        "GPU 0 on h1 reported a fatal XID: drain its replicas and reset it.",
    ),
    Case(
        "CorralGPUApplicationXID",
        {f"DCGM_FI_DEV_XID_ERRORS{{{GPU}}}": "0 0 13 13 13"},
        "4m",
        {**GPU_LABELS, "severity": "info"},
        "GPU 0 on h1 reported an application XID (engine fault, not the hardware).",
    ),
    Case(
        "CorralGPUECCDoubleBit",
        {f"DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{{{GPU}}}": "0 0 0 1 1 1"},
        "5m",
        {**GPU_LABELS, "severity": "critical"},
        "GPU 0 on h1 had uncorrectable (double-bit) ECC errors.",
    ),
    Case(
        "CorralGPURowRemapFailure",
        {f"DCGM_FI_DEV_ROW_REMAP_FAILURE{{{GPU}}}": "1x5"},
        "2m",
        {**GPU_LABELS, "severity": "critical"},
        "GPU 0 on h1 failed to remap a memory row: replace it.",
    ),
    Case(
        "CorralGPUThermalThrottling",
        {f"DCGM_FI_DEV_THERMAL_VIOLATION{{{GPU}}}": "0+30000000x30"},
        "20m",
        {**GPU_LABELS, "severity": "warning"},
        "GPU 0 on h1 is held down by temperature 50% of the time.",
    ),
    Case(
        "CorralGPUPowerThrottling",
        {f"DCGM_FI_DEV_POWER_VIOLATION{{{GPU}}}": "0+30000000x30"},
        "25m",
        {**GPU_LABELS, "severity": "warning"},
        "GPU 0 on h1 is held down by its power limit 50% of the time.",
    ),
    Case(
        "CorralGPUMissing",
        {f"DCGM_FI_DEV_GPU_TEMP{{{GPU}}}": "60x10"},
        "25m",
        {**GPU_LABELS, "severity": "critical"},
        "GPU GPU-1 on h1 stopped reporting (fell off the bus or the exporter lost it); the alert holds for a "
        "day.",
    ),
]

QUIET = [
    Case("CorralGatewayDown", {'up{job="corral-gateway", instance="gw:8000"}': "1x10"}, "5m"),
    Case(
        "CorralModelUnavailable",
        {
            'corral_replica_ready{model="m", replica="r0"}': "0x10",
            'corral_replica_ready{model="m", replica="r1"}': "1x10",
        },
        "5m",
    ),
    Case("CorralReplicaDown", {'corral_replica_ready{model="m", replica="r0"}': "0 0 0 1 1 1 1 1 1 1"}, "8m"),
    # a vLLM start takes minutes: not ready, but starting (it paged on every slow start)
    Case(
        "CorralReplicaDown",
        {
            'corral_replica_ready{model="m", replica="r0"}': "0x10",
            'corral_replica_state{model="m", replica="r0", state="starting"}': "1x10",
        },
        "8m",
    ),
    Case(
        "CorralReplicaStartSlow",
        {'corral_replica_state{model="m", replica="r0", state="starting"}': "1x7 stale"},
        "10m",
    ),
    Case(
        "CorralReplicaRestartLoop",
        {'corral_replica_restarts_total{model="m", replica="r0"}': "0 0 1 1 1 1"},
        "5m",
    ),
    # No 5xx has ever happened: the series does not exist, and the rule still evaluates (to 0).
    Case("CorralErrorRatioHigh", requests("0+10x20"), "12m"),
    Case(
        "CorralQueueWaitHigh",
        histogram("corral_queue_wait_seconds", {"1": "0+10x20", "30": "0+10x20", "+Inf": "0+10x20"}),
        "12m",
    ),
    Case(
        "CorralKVCacheFull", {'corral_engine_kv_cache_usage_ratio{model="m", replica="r0"}': "0.9x20"}, "15m"
    ),
    Case("CorralPreemptions", {'corral_engine_preemptions_total{model="m", replica="r0"}': "0+6x20"}, "17m"),
    Case("CorralRateLimitSpike", requests("0+100x20"), "17m"),
    # The series exist from the start at 0; an outage that ended 10 minutes ago no longer fires.
    Case(
        "CorralStoreUnreachable",
        {'corral_store_errors_total{instance="gw:8000", use="request"}': "0x20"},
        "12m",
    ),
    Case(
        "CorralStoreUnreachable",
        {'corral_store_errors_total{instance="gw:8000", use="key_lookup"}': "0 5 10 15x20"},
        "15m",
    ),
    Case("CorralUsageRecordsDropped", {'corral_usage_dropped_total{instance="gw:8000"}': "0x20"}, "12m"),
    Case("CorralRateLimiterUnreachable", {'corral_limiter_errors_total{instance="gw:8000"}': "0x20"}, "12m"),
    Case("CorralUsageRecordsDropped", {'corral_usage_dropped_total{instance="gw:8000"}': "0 40x30"}, "25m"),
    Case(
        "CorralTenantBudgetNearlySpent",
        {'corral_key_budget_used_ratio{tenant="acme", key="k1"}': "0.5x5"},
        "2m",
    ),
    Case(
        "CorralTTFTSLOBreached",
        histogram(
            "corral_time_to_first_token_seconds", {"0.25": "0+10x20", "0.5": "0+10x20", "+Inf": "0+10x20"}
        ),
        "12m",
    ),
    Case(
        "CorralITLSLOBreached",
        histogram(
            "corral_inter_token_latency_seconds", {"0.02": "0+10x20", "0.06": "0+10x20", "+Inf": "0+10x20"}
        ),
        "12m",
    ),
    Case("CorralGPUFatalXID", {f"DCGM_FI_DEV_XID_ERRORS{{{GPU}}}": "0 0 13 13 13"}, "4m"),
    # The field keeps the last XID for good: an event 20 minutes ago no longer fires.
    Case("CorralGPUFatalXID", {f"DCGM_FI_DEV_XID_ERRORS{{{GPU}}}": "0 0 79x30"}, "25m"),
    Case("CorralGPUApplicationXID", {f"DCGM_FI_DEV_XID_ERRORS{{{GPU}}}": "0 0 79 79 79"}, "4m"),
    Case("CorralGPUECCDoubleBit", {f"DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{{{GPU}}}": "3x5"}, "5m"),
    Case("CorralGPURowRemapFailure", {f"DCGM_FI_DEV_ROW_REMAP_FAILURE{{{GPU}}}": "0x5"}, "2m"),
    Case("CorralGPUThermalThrottling", {f"DCGM_FI_DEV_THERMAL_VIOLATION{{{GPU}}}": "0+1000000x30"}, "20m"),
    Case("CorralGPUPowerThrottling", {f"DCGM_FI_DEV_POWER_VIOLATION{{{GPU}}}": "0+1000000x30"}, "25m"),
    Case("CorralGPUMissing", {f"DCGM_FI_DEV_GPU_TEMP{{{GPU}}}": "60x40"}, "25m"),
]


def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool is missing: scripts/test-services.sh installs Debian's prometheus package"
    return found


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rules") / "corral.rules.yml"
    path.write_text(yaml.safe_dump(rules_yaml(SPEC), sort_keys=False))
    return path


def test_promtool_check_rules_is_clean(rules_file: Path) -> None:
    result = subprocess.run([promtool(), "check", "rules", str(rules_file)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules(SPEC))} rules found" in result.stdout


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    names = {rule.name for rule in alert_rules(SPEC)}
    assert {c.alert for c in FIRING} == names
    assert {c.alert for c in QUIET} == names


def unit_test(case: Case) -> dict[str, object]:
    expected = []
    if case.fires:
        expected = [
            {
                "exp_labels": case.labels,
                "exp_annotations": {
                    "summary": case.summary,
                    "runbook_url": f"{RUNBOOK.resolve().as_uri()}#{case.alert.lower()}",
                },
            }
        ]
    return {
        "name": f"{case.alert} {'fires' if case.fires else 'stays quiet'}",
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in case.series.items()],
        "alert_rule_test": [{"eval_time": case.at, "alertname": case.alert, "exp_alerts": expected}],
    }


@pytest.mark.parametrize("cases", [FIRING, QUIET], ids=["firing", "quiet"])
def test_promtool_unit_tests(rules_file: Path, tmp_path: Path, cases: list[Case]) -> None:
    tests = tmp_path / "tests.yml"
    tests.write_text(
        yaml.safe_dump(
            {
                "rule_files": [str(rules_file)],
                "evaluation_interval": "1m",
                "tests": [unit_test(c) for c in cases],
            },
            sort_keys=False,
            allow_unicode=True,
        )
    )
    result = subprocess.run([promtool(), "test", "rules", str(tests)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_error_and_refusal_ratios_evaluate_before_the_first_error(rules_file: Path, tmp_path: Path) -> None:
    """The ratio rules return 0, not nothing, while no 5xx or refusal series exists yet."""
    rules = {rule.name: rule.expr for rule in alert_rules(SPEC)}
    expressions = [
        rules[name].rsplit(" > ", 1)[0] for name in ("CorralErrorRatioHigh", "CorralRateLimitSpike")
    ]
    tests = tmp_path / "tests.yml"
    tests.write_text(
        yaml.safe_dump(
            {
                "rule_files": [str(rules_file)],
                "evaluation_interval": "1m",
                "tests": [
                    {
                        "interval": "1m",
                        "input_series": [{"series": s, "values": v} for s, v in requests("0+10x20").items()],
                        "promql_expr_test": [
                            {
                                "expr": expr,
                                "eval_time": "10m",
                                "exp_samples": [{"labels": '{model="m"}', "value": 0}],
                            }
                            for expr in expressions
                        ],
                    }
                ],
            },
            sort_keys=False,
        )
    )
    result = subprocess.run([promtool(), "test", "rules", str(tests)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_alerts_link_to_their_runbook_section_by_an_absolute_url(tmp_path: Path) -> None:
    """Relative links (docs/reference/alerts.md#…) were broken in Alertmanager and Grafana."""
    files = render_observability(SPEC, "spec.yaml", tmp_path)
    rules = yaml.safe_load(files["prometheus/rules/corral.rules.yml"].split("\n", 1)[1])
    written = (tmp_path / "prometheus" / "runbook.md").resolve().as_uri()
    links = {r["annotations"]["runbook_url"] for g in rules["groups"] for r in g["rules"]}
    assert f"{written}#corralgatewaydown" in links and all(link.startswith(written + "#") for link in links)
    assert files["prometheus/runbook.md"] == RUNBOOK.read_text()
    wiki = SPEC.model_copy(
        update={"deploy": DeploySettings(runbook_url="https://wiki.example/corral-alerts")}
    )
    links = {r["annotations"]["runbook_url"] for g in rules_yaml(wiki)["groups"] for r in g["rules"]}  # type: ignore[index,union-attr]
    assert "https://wiki.example/corral-alerts#corralgatewaydown" in links
    with pytest.raises(ValueError, match="absolute"):
        DeploySettings(runbook_url="docs/reference/alerts.md")


def test_every_alert_has_a_runbook_section() -> None:
    runbook = (Path(__file__).parents[2] / "docs" / "reference" / "alerts.md").read_text()
    for rule in alert_rules(SPEC):
        assert f"## {rule.name.lower()}\n**{rule.name}** ({rule.severity})" in runbook, rule.name


def gateway_buckets(metric: str, seconds: float) -> dict[str, str]:
    """promtool series of `metric` as a gateway's /metrics has it (its own buckets) when each minute ten
    requests take `seconds`."""
    metrics = GatewayMetrics(Router(ReplicaSet()), dict)
    observed = {
        "corral_time_to_first_token_seconds": metrics.ttft,
        "corral_inter_token_latency_seconds": metrics.itl,
        "corral_queue_wait_seconds": metrics.queue_wait,
    }[metric]
    for _ in range(10):
        observed.labels("m").observe(seconds)
    family = next(
        f for f in text_string_to_metric_families(metrics.exposition().decode()) if f.name == metric
    )
    counts = {s.labels["le"]: int(s.value) for s in family.samples if s.name == f"{metric}_bucket"}
    return histogram(metric, {le: f"0+{n}x20" if n else "0x20" for le, n in counts.items()})


@pytest.mark.parametrize(
    ("settings", "alert", "metric", "seconds", "clamped"),
    [
        ("queue: {timeout: 600}", "CorralQueueWaitHigh", "corral_queue_wait_seconds", 450.0, False),
        ("slo: {ttft_p95: 180}", "CorralTTFTSLOBreached", "corral_time_to_first_token_seconds", 250.0, False),
        ("slo: {itl_p95: 1.5}", "CorralITLSLOBreached", "corral_inter_token_latency_seconds", 3.0, False),
        ("queue: {timeout: 2000}", "CorralQueueWaitHigh", "corral_queue_wait_seconds", 1500.0, True),
        ("slo: {ttft_p95: 900}", "CorralTTFTSLOBreached", "corral_time_to_first_token_seconds", 1000.0, True),
        ("slo: {itl_p95: 8}", "CorralITLSLOBreached", "corral_inter_token_latency_seconds", 10.0, True),
    ],
    ids=["queue-600", "ttft-180", "itl-1.5", "queue-2000-clamped", "ttft-900-clamped", "itl-8-clamped"],
)
def test_latency_alerts_fire_on_what_the_gateways_histograms_can_tell(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    settings: str,
    alert: str,
    metric: str,
    seconds: float,
    clamped: bool,
) -> None:
    """With the top buckets at 120 s (TTFT, queue wait) and 1 s (ITL), histogram_quantile never read more:
    queue.timeout 600, ttft_p95 180 and itl_p95 1.5 made alerts that could never fire. A threshold at or
    past the top bucket fires once the p95 is past it, and the render says so."""
    model_settings = settings if settings.startswith("slo") else ""
    spec = parse_spec(
        f"models:\n  - {{name: m, arch: llama-3.1-8b, {model_settings + ', ' if model_settings else ''}"
        "deployments: [{engine: sim, gpu: l4}]}\n" + ("" if model_settings else settings + "\n")
    )
    with caplog.at_level(logging.WARNING, logger="corral.observe.rules"):
        rules = rules_yaml(spec)
    assert ("past which the p95 cannot be told" in caplog.text) is clamped
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(yaml.safe_dump(rules, sort_keys=False))
    firing = f'{{__name__="ALERTS", alertname="{alert}", alertstate="firing", model="m", severity="warning"}}'
    tests = tmp_path / "tests.yml"
    tests.write_text(
        yaml.safe_dump(
            {
                "rule_files": [str(rules_file)],
                "evaluation_interval": "1m",
                "tests": [
                    {
                        "interval": "1m",
                        "input_series": [
                            {"series": s, "values": v} for s, v in gateway_buckets(metric, seconds).items()
                        ],
                        "promql_expr_test": [
                            {
                                "expr": f'ALERTS{{alertname="{alert}"}}',
                                "eval_time": "12m",
                                "exp_samples": [{"labels": firing, "value": 1}],
                            }
                        ],
                    }
                ],
            },
            sort_keys=False,
        )
    )
    result = subprocess.run([promtool(), "test", "rules", str(tests)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_rules_know_the_gateways_top_buckets() -> None:
    """rules.py keeps its own copy of the top finite buckets (observe imports nothing of the gateway)."""
    for metric, top in TOP_BUCKET_S.items():
        buckets = gateway_buckets(metric, 0.001)
        finite = [float(s.split('le="')[1].split('"')[0]) for s in buckets if 'le="+Inf"' not in s]
        assert max(finite) == top, metric
