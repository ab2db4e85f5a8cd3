"""The alert rules as real deployments feed them, under promtool: several gateways each with its own
replicas, models scaled to zero, a store that fails one call, a stock dcgm-exporter."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from corral.config import ClusterSpec, parse_spec
from corral.observe.rules import rules_yaml
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
