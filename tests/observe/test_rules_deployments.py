"""The alert rules as real deployments feed them, under promtool: several gateways each with its own
replicas, models scaled to zero, a store that fails one call, a stock dcgm-exporter."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from corral.config import ClusterSpec, parse_spec
from corral.gateway.metrics import GatewayMetrics
from corral.observe.rules import rules_yaml
from corral.routing import ReplicaSet, Router
from tests.conftest import DATA
from tests.observe.test_rules import GPU, GPU_LABELS, Case, promtool, unit_test

# `od.m` may scale to zero (its requests held 90 s for the first replica); `odxm` is always on, and
# would match `od.m` taken as a regex.
ON_DEMAND = parse_spec(
    """
models:
  - {name: m, arch: llama-3.1-8b, deployments: [{engine: sim, gpu: l4}]}
  - name: od.m
    arch: llama-3.1-8b
    deployments:
      - {engine: sim, gpu: l4, replicas: 0, autoscale: {min_replicas: 0, max_replicas: 2, hold_s: 90}}
  - {name: odxm, arch: llama-3.1-8b, deployments: [{engine: sim, gpu: l4}]}
"""
)


def ready(instance: str, model: str, values: str, replica: str = "r0") -> dict[str, str]:
    return {f'corral_replica_ready{{instance="{instance}", model="{model}", replica="{replica}"}}': values}


def assert_promtool_passes(spec: ClusterSpec, cases: list[Case], tmp_path: Path) -> None:
    rules = tmp_path / "corral.rules.yml"
    rules.write_text(yaml.safe_dump(rules_yaml(spec), sort_keys=False))
    tests = tmp_path / "tests.yml"
    tests.write_text(
        yaml.safe_dump(
            {"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": [unit_test(c) for c in cases]},
            sort_keys=False,
            allow_unicode=True,
        )
    )
    result = subprocess.run([promtool(), "test", "rules", str(tests)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_model_unavailable_on_one_gateway_fires_though_another_serves_it(tmp_path: Path) -> None:
    """max by (model) across gateways hid host A's 503s behind host B's ready replica."""
    case = Case(
        "CorralModelUnavailable",
        {**ready("gw-a:8000", "m", "0x10"), **ready("gw-b:8000", "m", "1x10")},
        "5m",
        {"instance": "gw-a:8000", "model": "m", "severity": "critical"},
        "Model m has no ready replica on the gateway gw-a:8000: its requests there are refused with 503.",
    )
    assert_promtool_passes(ON_DEMAND, [case], tmp_path)


def test_a_scale_from_zero_start_within_hold_s_does_not_page(tmp_path: Path) -> None:
    """A replica of a model scaled to zero starting for 2.5 minutes (hold_s 90 s + a minute) is quiet;
    one that takes longer than that pages; an always-on model keeps the 1-minute rule."""
    cases = [
        Case("CorralModelUnavailable", ready("gw:8000", "od.m", "0 0 0 1x10"), "2m"),
        Case(
            "CorralModelUnavailable",
            ready("gw:8000", "od.m", "0x10"),
            "5m",
            {"instance": "gw:8000", "model": "od.m", "severity": "critical"},
            "Model od.m (scaled to zero) has no ready replica on the gateway gw:8000 past its hold_s of 90 "
            "s: requests held for it are refused with 503.",
        ),
        Case(
            "CorralModelUnavailable",
            ready("gw:8000", "odxm", "0x10"),
            "2m",
            {"instance": "gw:8000", "model": "odxm", "severity": "critical"},
            "Model odxm has no ready replica on the gateway gw:8000: its requests there are refused with "
            "503.",
        ),
    ]
    assert_promtool_passes(ON_DEMAND, cases, tmp_path)


def test_one_failed_store_call_does_not_page(tmp_path: Path) -> None:
    """A burst of three failed calls (a connection reset, a busy SQLite lock) paged critical for minutes."""
    blip = {'corral_store_errors_total{instance="gw:8000", use="key_lookup"}': "0x5 3x20"}
    cases = [Case("CorralStoreUnreachable", blip, at) for at in ("7m", "9m", "11m", "14m")]
    assert_promtool_passes(ON_DEMAND, cases, tmp_path)


def test_one_failed_rate_limit_check_does_not_warn(tmp_path: Path) -> None:
    blip = {'corral_limiter_errors_total{instance="gw:8000"}': "0x5 1x20"}
    cases = [Case("CorralRateLimiterUnreachable", blip, at) for at in ("7m", "10m", "12m")]
    assert_promtool_passes(ON_DEMAND, cases, tmp_path)


def test_rate_limiter_alert_says_what_a_closed_limiter_does(tmp_path: Path) -> None:
    closed = ON_DEMAND.model_copy(
        update={"limits": ON_DEMAND.limits.model_copy(update={"on_redis_error": "closed"})}
    )
    case = Case(
        "CorralRateLimiterUnreachable",
        {'corral_limiter_errors_total{instance="gw:8000"}': "0x5 0+20x15"},
        "14m",
        {"instance": "gw:8000", "severity": "warning"},
        "The gateway gw:8000 cannot check rate limits in Redis: its requests are refused with 503 "
        "limits_unavailable (limits.on_redis_error: closed).",
    )
    assert_promtool_passes(closed, [case], tmp_path)


def test_uncorrectable_ecc_fires_from_a_stock_dcgm_exporter(tmp_path: Path) -> None:
    """The stock counters list leaves out DCGM_FI_DEV_ECC_DBE_VOL_TOTAL; it keeps the rows remapped for
    uncorrectable errors (tests/observe/data/dcgm-exporter-default-counters.csv)."""
    case = Case(
        "CorralGPUECCDoubleBit",
        {f"DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS{{{GPU}}}": "0 0 0 1 1 1"},
        "5m",
        {**GPU_LABELS, "severity": "critical"},
        "GPU 0 on h1 had uncorrectable (double-bit) ECC errors.",
    )
    assert_promtool_passes(ON_DEMAND, [case], tmp_path)


ADAPTERS = parse_spec(
    f"""
models:
  - name: llama
    arch: llama-3.1-8b
    slo: {{ttft_p95: 0.5, itl_p95: 0.05}}
    lora: {{max_loras: 2, max_lora_rank: 16, max_cpu_loras: 2}}
    adapters: [{{name: support-bot, source: {{path: {DATA / "lora" / "corral-marker"}}}}}]
    deployments: [{{engine: sim, gpu: l4}}]
  - name: qwen
    arch: llama-3.1-8b
    lora: {{max_loras: 2, max_lora_rank: 16, max_cpu_loras: 2}}
    adapters: [{{name: qwen-bot, source: {{path: {DATA / "lora" / "corral-marker"}}}}}]
    deployments: [{{engine: sim, gpu: l4}}]
"""
)


def scraped_per_minute(observed: dict[str, tuple[int, float, int]]) -> dict[str, str]:
    """promtool series of the TTFT and ITL histograms as a gateway's /metrics has them (the model label
    as the gateway sets it: an adapter's requests under the adapter's name) when each minute `model` gets
    `count` streamed requests taking `ttft` seconds to their first token, then `tokens` tokens 60 ms apart."""
    metrics = GatewayMetrics(Router(ReplicaSet()), dict)
    for model, (count, ttft, tokens) in observed.items():
        for _ in range(count):
            metrics.of(model).ttft.observe(ttft)
            if tokens > 1:  # (as the gateway: one gap at least)
                metrics.of(model).itl.observe(0.06)
    series = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            if sample.name.endswith("_bucket") and family.name in (TTFT, ITL):
                labels = f'model="{sample.labels["model"]}", le="{sample.labels["le"]}"'
                per_minute = int(sample.value)
                values = f"0+{per_minute}x20" if per_minute else "0x20"
                series[f"{sample.name}{{{labels}}}"] = values
    return series


TTFT = "corral_time_to_first_token_seconds"
ITL = "corral_inter_token_latency_seconds"


def test_an_adapter_s_requests_count_towards_its_base_model_s_slo(tmp_path: Path) -> None:
    """The gateway labels an adapter's requests with the adapter's name, and the SLO rules selected the
    base model's name only: with 5 of 6 requests through the adapter, a breach on the shared replicas went
    unseen. The alert still names the base model."""
    slow_adapter = scraped_per_minute({"support-bot": (5, 1.0, 8), "llama": (1, 0.1, 8)})
    # p95 of 6 a minute: rank 5.7, in (0.5, 1] holding 5 past 1 below it: 0.5 + 0.5 × 4.7 / 5 = 0.97 s
    fired = Case(
        "CorralTTFTSLOBreached",
        slow_adapter,
        "12m",
        {"model": "llama", "severity": "warning"},
        "llama: TTFT p95 970ms is over its SLO of 0.5 s.",
    )
    # ITL p95 in (0.04, 0.06] for all six: 0.04 + 0.02 × 5.7 / 6 = 0.059 s
    itl = Case(
        "CorralITLSLOBreached",
        slow_adapter,
        "12m",
        {"model": "llama", "severity": "warning"},
        "llama: ITL p95 59ms is over its SLO of 0.05 s.",
    )
    # another model's adapter (no SLO), however slow, is not the SLO model's
    other = Case(
        "CorralTTFTSLOBreached",
        scraped_per_minute({"qwen-bot": (5, 1.0, 1), "llama": (1, 0.1, 1)}),
        "12m",
    )
    assert_promtool_passes(ADAPTERS, [fired, itl, other], tmp_path)
