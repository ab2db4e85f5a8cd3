"""Budget series stay bounded however many budgeted keys a tenant-admin mints, and with several gateway
workers a key, queue or replica that left leaves /metrics (a multiprocess gauge stayed at 0 for the worker's
life). The second worker is a real process publishing into the shared metrics folder, as cluster/workers.py
starts them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from corral.config import parse_spec
from corral.gateway.metrics import GatewayMetrics
from corral.gateway.state_metrics import BUDGET_KEYS_SHOWN, BUDGET_SHOWN_FROM
from corral.observe import alert_rules
from corral.routing import ReplicaSet, Router

SPEC = parse_spec("models:\n  - {name: m, arch: llama-3.1-8b, deployments: [{engine: sim, gpu: l4}]}\n")
KEYS = "corral_key_budget_used_ratio"
TENANTS = "corral_key_budget_used_max_ratio"


def series(metrics: GatewayMetrics, name: str) -> dict[tuple[str, ...], float]:
    """`name`'s samples in /metrics, by their label values."""
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        if family.name == name:
            return {tuple(s.labels.values()): s.value for s in family.samples}
    return {}


def test_only_the_keys_nearest_their_budget_have_series_of_their_own() -> None:
    """A tenant-admin's 5,000 budgeted keys made 5,000 series (384 KB of /metrics), as many dashboard
    lines and as many alerts."""
    spent = [("evil", f"key{i:05d}", i / 5000) for i in range(5000)] + [("acme", "a1", 0.2)]
    metrics = GatewayMetrics(Router(ReplicaSet(["m"])), dict, budgets=lambda: spent)
    keys = series(metrics, KEYS)
    highest = sorted(spent, key=lambda entry: entry[2])[-BUDGET_KEYS_SHOWN:]
    assert keys == {(tenant, key): ratio for tenant, key, ratio in highest}
    assert min(keys.values()) >= BUDGET_SHOWN_FROM
    # every tenant's highest share, whatever the number of its keys
    assert series(metrics, TENANTS) == {("evil",): 4999 / 5000, ("acme",): 0.2}
    assert len(metrics.exposition()) < 20_000
    few = [("acme", "a1", 0.2), ("acme", "a2", 0.55)]
    assert series(GatewayMetrics(Router(ReplicaSet()), dict, budgets=lambda: few), KEYS) == {
        ("acme", "a2"): 0.55
    }


def test_every_key_the_budget_alert_fires_for_has_its_series() -> None:
    """The gateway shows a key from BUDGET_SHOWN_FROM of its budget on: the alert's threshold is past it."""
    [rule] = [r for r in alert_rules(SPEC) if r.name == "CorralTenantBudgetNearlySpent"]
    found = re.fullmatch(rf"{KEYS} >= ([0-9.]+)", rule.expr)
    assert found is not None, rule.expr
    assert float(found.group(1)) >= BUDGET_SHOWN_FROM


def test_one_tenants_spent_keys_do_not_hide_anothers_from_the_alert() -> None:
    """The 50 places went to the highest of all: a tenant-admin's 50 keys with a one-token budget, each
    used once, took them all, and another tenant's key at 0.91 had no series (its alert never fired). Each
    tenant's highest key is shown, then the highest of all."""
    spent = [("noisy", f"k{i}", 1.0 + i) for i in range(5000)] + [("acme", "a1", 0.91), ("acme", "a2", 0.6)]
    keys = series(GatewayMetrics(Router(ReplicaSet(["m"])), dict, budgets=lambda: spent), KEYS)
    assert keys[("acme", "a1")] == 0.91 and ("acme", "a2") not in keys
    assert len(keys) == BUDGET_KEYS_SHOWN + 1


_WORKER = """
import asyncio, json, sys
from pathlib import Path
from corral.gateway.metrics import GatewayMetrics
from corral.routing import ReplicaSet, Router

async def main() -> None:
    spent = []
    metrics = GatewayMetrics(Router(ReplicaSet(["m"])), dict, Path(sys.argv[1]), lambda: list(spent))
    metrics.start()
    while line := await asyncio.to_thread(sys.stdin.readline):  # each line: the budgets it has seen
        spent[:] = [tuple(entry) for entry in json.loads(line)]
    await metrics.stop()

asyncio.run(main())
"""


@pytest.fixture
def other_worker(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    """A gateway worker's metrics in another process, publishing into the shared folder once a second."""
    folder = tmp_path / "metrics"
    folder.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder)}
    process = subprocess.Popen(
        [sys.executable, "-c", _WORKER, str(folder)], stdin=subprocess.PIPE, text=True, env=env
    )
    yield folder, process
    if process.poll() is None:
        process.kill()
    process.wait(timeout=10)


def tell(process: subprocess.Popen[str], spent: list[tuple[str, str, float]]) -> None:
    assert process.stdin is not None
    process.stdin.write(json.dumps(spent) + "\n")
    process.stdin.flush()


def until(condition: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.1)


def test_another_worker_s_budget_series_are_bounded_and_leave_when_its_keys_do(
    other_worker: tuple[Path, subprocess.Popen[str]],
) -> None:
    folder, process = other_worker
    mine = [("acme", "mine", 0.7)]
    metrics = GatewayMetrics(Router(ReplicaSet(["m"])), dict, folder, lambda: mine)
    tell(process, [("evil", f"key{i:05d}", 0.6 + i / 100_000) for i in range(2000)])
    until(lambda: len(series(metrics, KEYS)) > 1, 30)  # (its start: a Python process importing corral)
    keys = series(metrics, KEYS)
    assert len(keys) == BUDGET_KEYS_SHOWN and min(keys.values()) >= 0.6 + 1950 / 100_000
    assert series(metrics, TENANTS) == {("evil",): 0.6 + 1999 / 100_000, ("acme",): 0.7}
    # its keys went quiet (or the month turned): their series leave, they did not stay at 0
    tell(process, [])
    until(lambda: series(metrics, KEYS) == {("acme", "mine"): 0.7}, 10)
    assert series(metrics, TENANTS) == {("acme",): 0.7}
    # a worker that died leaves the sum at once (its queue was counted 5 s more), one that hangs once its
    # last figures are stale
    tell(process, [("evil", "late", 0.8)])
    until(lambda: ("evil", "late") in series(metrics, KEYS), 10)
    process.kill()
    process.wait()
    until(lambda: series(metrics, KEYS) == {("acme", "mine"): 0.7}, 2)
