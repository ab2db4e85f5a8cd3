"""How long the gateway's /metrics takes to render for a large cluster: 8 models × 64 replicas.

The gateway's real metrics objects (`GatewayMetrics` over a real `Router` and `ReplicaSet`) with every
replica carrying an engine load (running, waiting, KV usage, five engine counters, state, restarts), every
model with traffic in all its histograms (TTFT, ITL, duration, queue wait), 7 statuses, 4 refusal reasons,
50 tenants and 100 budgeted keys. The baseline, measured in the same run: prometheus_client rendering a
registry holding the same series as plain stored Gauges/Counters/Histograms (the floor for any
prometheus_client exporter; corral's replica and engine series are collected at scrape time instead).

Long-lived objects are frozen out of the garbage collector's generations before timing, as `corral up`
does once it serves (without it a full collection every ~50 renders put p99 at ~60 ms). Printed JSON:
render time p50/p99 in ms (the issue's bound: 20 ms), bytes and series counts, and the ratio
to the baseline.

    .venv/bin/python benchmarks/metrics_render.py [--models 8] [--replicas 64] [--runs 200]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from corral.engines import EngineLoad
from corral.gateway.metrics import GatewayMetrics
from corral.routing import Replica, ReplicaSet, ReplicaState, Router


def corral_metrics(models: int, replicas: int) -> GatewayMetrics:
    replica_set = ReplicaSet()
    for m in range(models):
        for r in range(replicas):
            replica = Replica(
                id=f"model-{m}-{r}", model=f"model-{m}", engine="vllm", url=f"http://10.0.{m}.{r}:8000"
            )
            replica.state = ReplicaState.READY
            replica.restarts = r % 3
            replica.load = EngineLoad(
                running=r % 17,
                waiting=r % 5,
                kv_usage=0.01 * (r % 100),
                prompt_tokens_total=1e6 + r,
                generated_tokens_total=2e6 + r,
                prefix_cache_queries_total=1e6,
                prefix_cache_hits_total=4e5,
                preemptions_total=float(r),
            )
            replica_set.add(replica)
    router = Router(replica_set, {}, default_policy="prefix_affinity")
    budgets = [(f"tenant-{k % 50}", f"key-{k}", k / 100) for k in range(100)]
    metrics = GatewayMetrics(router, lambda: {f"model-{m}": m for m in range(models)}, None, lambda: budgets)
    for m in range(models):
        model = metrics.of(f"model-{m}")
        for i in range(500):
            model.finished((200, 200, 200, 400, 429, 499, 503)[i % 7], 0.05 * (i % 40))
            model.ttft.observe(0.01 * (i % 50))
            model.itl.observe(0.002 * (i % 50))
            model.queue_wait.observe(0.001 * (i % 100))
            model.decided("prefix_affinity")
        for reason in ("rate_limit_exceeded", "insufficient_quota", "queue_full", "queue_timeout"):
            model.rejected(reason)
    for t in range(50):
        metrics.tenant(f"tenant-{t}").finished(200, 100, 200)
        metrics.tenant(f"tenant-{t}").finished(429, 0, 0)
    return metrics


def baseline_registry(models: int, replicas: int) -> CollectorRegistry:
    """The same series stored in plain prometheus_client metrics (nothing collected at scrape time)."""
    r = CollectorRegistry()
    per_replica = ["model", "replica"]
    gauges = [
        Gauge(name, name, per_replica, registry=r)
        for name in (
            "corral_replica_outstanding",
            "corral_replica_ready",
            "corral_circuit_state",
            "corral_engine_running",
            "corral_engine_waiting",
            "corral_engine_kv_cache_usage_ratio",
        )
    ]
    counters = [
        Counter(name, name, per_replica, registry=r)
        for name in (
            "corral_replica_restarts",
            "corral_engine_prompt_tokens",
            "corral_engine_generated_tokens",
            "corral_engine_prefix_cache_queries",
            "corral_engine_prefix_cache_hits",
            "corral_engine_preemptions",
        )
    ]
    state = Gauge("corral_replica_state", "state", [*per_replica, "state"], registry=r)
    histograms = [
        Histogram(name, name, ["model"], registry=r) for name in ("ttft", "itl", "duration", "queue_wait")
    ]
    for m in range(models):
        for rep in range(replicas):
            labels = (f"model-{m}", f"model-{m}-{rep}")
            for g in gauges:
                g.labels(*labels).set(rep)
            for c in counters:
                c.labels(*labels).inc(rep)
            for s in ReplicaState:
                state.labels(*labels, str(s)).set(1)
        for h in histograms:
            h.labels(f"model-{m}").observe(0.1)
    return r


def timed(render: Any, runs: int) -> dict[str, float]:
    render()  # warm
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        render()
        samples.append(1000 * (time.perf_counter() - started))
    samples.sort()
    return {
        "p50_ms": round(statistics.median(samples), 2),
        "p99_ms": round(samples[min(len(samples) - 1, int(0.99 * len(samples)))], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=8)
    parser.add_argument("--replicas", type=int, default=64, help="replicas per model")
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    metrics = corral_metrics(args.models, args.replicas)
    baseline = baseline_registry(args.models, args.replicas)
    text = metrics.exposition()
    gc.freeze()  # as `corral up` does once serving: long-lived objects out of the collector's generations
    corral = timed(metrics.exposition, args.runs)
    floor = timed(lambda: generate_latest(baseline), args.runs)
    result = {
        "benchmark": "metrics_render",
        "models": args.models,
        "replicas": args.models * args.replicas,
        "bytes": len(text),
        "series": sum(1 for line in text.splitlines() if line and not line.startswith(b"#")),
        "corral": corral,
        "baseline_stored_metrics": floor,
        "ratio_to_baseline_p50": round(corral["p50_ms"] / floor["p50_ms"], 2),
        "within_20ms": corral["p99_ms"] <= 20,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
