"""Overload: a cluster asked for three times what it can serve.

What a deployment pays under overload is the work it still gets done (goodput) and how it says no. Set-up:
`corral up` with two simulated Llama-3.1-8B replicas on L4s (`engine: sim`, 10× real time, 4 sequences
each: 8 slots), the fair queue at its production shape (`max_queued` 32, `timeout` 3 s), an open gateway.
First the capacity: a closed loop of 16 clients for `--measure` seconds (requests/s). Then Poisson arrivals
at `--factor` × that rate for `--duration` seconds, every answer recorded: status, Retry-After, latency.

Printed (JSON, also written to results/overload.json): capacity and offered rates, goodput (200s per second)
and its ratio to capacity (target ≥ 0.9), statuses (only 200, 429 and 503 are acceptable; every refusal
must carry Retry-After), latency of admitted requests (p50, p99, max) against the queue timeout plus the
service time at capacity, and the gateway's RSS before and after.

    .venv/bin/python benchmarks/overload.py [--factor 3] [--duration 20] [--measure 10]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from _harness import free_port, publish, spawn, stop, wait_http

QUEUE_TIMEOUT = 3.0
SPEC = f"""\
auth: {{open: true}}
supervisor: {{probe_interval: 0.5}}
queue: {{max_queued: 32, timeout: {QUEUE_TIMEOUT}}}
models:
  - name: llama-8b
    arch: llama-3.1-8b
    deployments: [{{engine: sim, replicas: 2, gpu: l4, max_num_seqs: 4, time_scale: 10}}]
"""
BODY = {"model": "llama-8b", "prompt": "word " * 64, "max_tokens": 32, "ignore_eos": True}


async def one(session: aiohttp.ClientSession, url: str) -> tuple[int, bool, float]:
    started = time.monotonic()
    async with session.post(url, json=BODY) as response:
        await response.read()
        return response.status, "Retry-After" in response.headers, time.monotonic() - started


async def capacity(url: str, seconds: float, clients: int = 16) -> tuple[float, float]:
    """Requests/s of a saturating closed loop, and its p99 latency (the service time at capacity)."""
    done: list[float] = []
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession() as session:

        async def client() -> None:
            while time.monotonic() < deadline:
                status, _, latency = await one(session, url)
                if status == 200:
                    done.append(latency)

        await asyncio.gather(*(client() for _ in range(clients)))
    done.sort()
    return len(done) / seconds, done[int(0.99 * (len(done) - 1))]


async def overload(url: str, rate: float, seconds: float) -> list[tuple[int, bool, float]]:
    rng = random.Random(7)
    results: list[tuple[int, bool, float]] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            tasks.append(asyncio.create_task(one(session, url)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    return results


def report(cap: float, service_p99: float, rate: float, seconds: float, results: list[Any]) -> dict[str, Any]:
    statuses: dict[str, int] = {}
    for status, _, _ in results:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    admitted = sorted(latency for status, _, latency in results if status == 200)
    refusals = [(status, retry) for status, retry, _ in results if status != 200]
    goodput = len(admitted) / seconds
    return {
        "capacity_requests_per_s": round(cap, 2),
        "offered_requests_per_s": round(rate, 2),
        "goodput_requests_per_s": round(goodput, 2),
        "goodput_to_capacity": round(goodput / cap, 3),
        "statuses": statuses,
        "only_200_429_503": set(statuses) <= {"200", "429", "503"},
        "every_refusal_has_retry_after": all(retry for _, retry in refusals),
        "admitted_latency_s": {
            "p50": round(statistics.median(admitted), 3),
            "p99": round(admitted[int(0.99 * (len(admitted) - 1))], 3),
            "max": round(admitted[-1], 3),
        },
        "queue_timeout_s": QUEUE_TIMEOUT,
        "service_p99_at_capacity_s": round(service_p99, 3),
        "admitted_within_queue_timeout": admitted[-1] <= QUEUE_TIMEOUT + service_p99,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--factor", type=float, default=3.0)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--measure", type=float, default=10.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "overload.yaml"
        spec.write_text(SPEC)
        port = free_port()
        gateway = spawn([sys.executable, "-m", "corral.cli", "up", "-f", str(spec), "--port", str(port)])
        try:
            wait_http(f"http://127.0.0.1:{port}/ready", timeout=120)
            url = f"http://127.0.0.1:{port}/v1/completions"
            rss_before = psutil.Process(gateway.pid).memory_info().rss
            cap, service_p99 = asyncio.run(capacity(url, args.measure))
            rate = args.factor * cap
            results = asyncio.run(overload(url, rate, args.duration))
            figures = report(cap, service_p99, rate, args.duration, results)
            figures["gateway_rss_mib"] = {
                "before": round(rss_before / 2**20, 1),
                "after": round(psutil.Process(gateway.pid).memory_info().rss / 2**20, 1),
            }
        finally:
            stop(gateway)
    publish("overload", figures)


if __name__ == "__main__":
    main()
