"""Autoscaling on a simulated fleet: SLO-violation minutes and replica-minutes, reactive vs feed-forward,
against fixed fleets (the smallest, and one sized for the peak) measured in the same run.

Set-up, all on this machine: `corral up` serving one model on simulated L4 replicas of Llama-3.1-8B
(`engine: sim`, `time_scale` 10: the simulator's step times from the performance model, ten times faster
than the GPU's, so a ten-minute day fits in a minute), `max_num_seqs` 4 so the gateway queues beyond four
requests per replica. A client (aiohttp on uvloop) sends streamed chat requests as a Poisson process whose
rate follows a profile, and times the first content chunk:
- `step`: 1× for 20 s, 8× for 60 s, 1× for 40 s;
- `diurnal`: one period of a sine from 1× to 8× and back over 120 s.
1× is `--base-rate` requests/s. Every 0.5 s the replica count (starting and ready) is read from
`/corral/status`. Fleets: `reactive` and `feed_forward` autoscaling (1–8 replicas, 2 s cooldown; the
feed-forward mode with the model's TTFT objective in `slo`), `fixed_min` (1 replica) and `fixed_peak`
(8 replicas).

Printed JSON, per profile and fleet: SLO-violation minutes (10 s windows whose TTFT p95 exceeds
`--slo-ms`, wall clock as the client sees it, counted in minutes of this compressed run), replica-minutes
(the integral of the replica count), TTFT p50/p95, requests, failed requests, most replicas; and each
autoscaled fleet's ratios against `fixed_peak` (replica-minutes) and `fixed_min` (violation minutes).

    .venv/bin/python benchmarks/autoscale.py [--base-rate 3] [--slo-ms 300] [--profiles step,diurnal]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvloop
from _harness import free_port, spawn, stop, wait_http

ROOT = Path(__file__).resolve().parent.parent
WINDOW_S = 10.0
DURATION_S = 120.0
SPEC = """
auth: {{open: true}}
queue: {{timeout: 120, max_queued: 4096}}
supervisor: {{probe_interval: 0.5}}
models:
  - name: bench
    arch: llama-3.1-8b
    slo: {{ttft_p95: {slo_sim}}}
    deployments:
      - engine: sim
        gpu: l4
        time_scale: 10
        max_num_seqs: 4
        replicas: {replicas}{autoscale}
"""
AUTOSCALE = """
        autoscale:
          min_replicas: 1
          max_replicas: 8
          mode: {mode}
          interval_s: 0.5
          queue_wait_s: 0.2
          down_cooldown_s: 2"""
BODY = {"model": "bench", "max_tokens": 64, "stream": True}
HEADERS = {"Content-Type": "application/json"}
Samples = list[tuple[float, float | None]]  # (when it ended, TTFT or None when it failed)


def rate_at(profile: str, t: float, base: float) -> float:
    if profile == "step":
        return base * (8 if 20 <= t < 80 else 1)
    return base * (1 + 7 * (1 - math.cos(2 * math.pi * t / 120)) / 2)


async def one(session: aiohttp.ClientSession, url: str, out: Samples) -> None:
    started = time.perf_counter()
    body = {**BODY, "messages": [{"role": "user", "content": f"request {random.random()} " * 8}]}
    first: float | None = None
    try:
        async with session.post(url, data=orjson.dumps(body), headers=HEADERS) as r:
            if r.status != 200:
                raise aiohttp.ClientError(f"status {r.status}")
            async for line in r.content:
                if first is None and b'"content"' in line:
                    first = time.perf_counter() - started
    except (aiohttp.ClientError, TimeoutError):
        first = None
    out.append((time.perf_counter(), first))


async def sample(base: str, stop_at: float, counts: list[tuple[float, int]]) -> None:
    async with aiohttp.ClientSession() as session:
        while time.perf_counter() < stop_at:
            async with session.get(base + "/corral/status") as response:
                replicas = (await response.json())["replicas"]
            live = sum(r["state"] in ("starting", "ready", "restarting") for r in replicas)
            counts.append((time.perf_counter(), live))
            await asyncio.sleep(0.5)


async def drive(base: str, profile: str, rate: float) -> tuple[Samples, list[tuple[float, int]], float]:
    out: Samples = []
    counts: list[tuple[float, int]] = []
    began = time.perf_counter()
    end = began + DURATION_S
    sampler = asyncio.create_task(sample(base, end, counts))
    rng = random.Random(7)
    tasks = []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        now = began
        while now < end:
            now += rng.expovariate(rate_at(profile, now - began, rate))
            await asyncio.sleep(max(0.0, now - time.perf_counter()))
            tasks.append(asyncio.create_task(one(session, base + "/v1/chat/completions", out)))
        await asyncio.gather(*tasks)
    await sampler
    return out, counts, began


def summarise(out: Samples, counts: list[tuple[float, int]], began: float, slo_s: float) -> dict[str, Any]:
    ok = [(t - began, ttft) for t, ttft in out if ttft is not None]
    windows: dict[int, list[float]] = {}
    for t, ttft in ok:
        windows.setdefault(int(t // WINDOW_S), []).append(ttft)
    violated = sum(1 for w in windows.values() if sorted(w)[int(0.95 * (len(w) - 1))] > slo_s)
    replica_seconds = sum(count * (counts[i + 1][0] - at) for i, (at, count) in enumerate(counts[:-1]))
    ttfts = sorted(ttft for _, ttft in ok)
    return {
        "slo_violation_minutes": round(violated * WINDOW_S / 60, 2),
        "replica_minutes": round(replica_seconds / 60, 2),
        "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1) if ttfts else None,
        "ttft_p95_ms": round(ttfts[int(0.95 * (len(ttfts) - 1))] * 1000, 1) if ttfts else None,
        "requests": len(out),
        "failed": len(out) - len(ok),
        "most_replicas": max((c for _, c in counts), default=0),
    }


def run_fleet(fleet: str, profile: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    replicas = {"fixed_min": 1, "fixed_peak": 8}.get(fleet, 1)
    autoscale = AUTOSCALE.format(mode=fleet) if fleet in ("reactive", "feed_forward") else ""
    spec = tmp / f"{fleet}.yaml"
    spec.write_text(SPEC.format(replicas=replicas, autoscale=autoscale, slo_sim=args.slo_ms / 1000 * 10))
    port = free_port()
    proc = spawn([sys.executable, "-m", "corral.cli", "up", "-f", str(spec), "--port", str(port)])
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/ready", timeout=120)
        out, counts, began = uvloop.run(drive(base, profile, args.base_rate))
    finally:
        stop(proc)
    return summarise(out, counts, began, args.slo_ms / 1000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-rate", type=float, default=3.0, help="1× load, requests/s")
    parser.add_argument("--slo-ms", type=float, default=300.0, help="TTFT p95 objective, wall-clock ms")
    parser.add_argument("--profiles", default="step,diurnal")
    parser.add_argument("--fleets", default="fixed_min,fixed_peak,reactive,feed_forward")
    args = parser.parse_args()
    results: dict[str, Any] = {"setup": {"base_rate": args.base_rate, "slo_ms": args.slo_ms}}
    with tempfile.TemporaryDirectory() as tmp:
        for profile in args.profiles.split(","):
            figures = {f: run_fleet(f, profile, args, Path(tmp)) for f in args.fleets.split(",")}
            for fleet in ("reactive", "feed_forward"):
                if fleet in figures and "fixed_peak" in figures and "fixed_min" in figures:
                    figures[fleet]["replica_minutes_vs_fixed_peak"] = round(
                        figures[fleet]["replica_minutes"] / figures["fixed_peak"]["replica_minutes"], 3
                    )
                    figures[fleet]["violation_minutes_vs_fixed_min"] = round(
                        figures[fleet]["slo_violation_minutes"]
                        / max(figures["fixed_min"]["slo_violation_minutes"], 1e-9),
                        3,
                    )
            results[profile] = figures
            print(json.dumps({profile: figures}), file=sys.stderr)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
