"""Isolation cost: what `prefix_isolation: tenant` costs tenants that share a system prompt.

Issue #38 asks what isolating tenants' prefix caches costs on routing_quality.py's workload idea (tenants
whose requests start with a long common prefix, then a short question of their own). Here every tenant sends
the SAME system prompt, the case isolation hurts most: with `shared` the fleet caches it once and every
tenant's request reuses it; with `tenant` the gateway's prefix index hashes each tenant's prompts apart and
the engines get a per-tenant `cache_salt`, so each tenant pays its own prefill of the prompt on each replica
it lands on, and the copies share the KV cache.

Set-up, once per setting (`shared`, then `tenant`), each on a FRESH `corral up` (empty caches): a closed
gateway (`auth: {open: false, admin_key}`), its store in a temporary SQLite file, one model of `--replicas`
(4) simulated Llama-3.1-8B replicas on `--gpu` (L4) (`engine: sim`, `--time-scale` 1: real time),
`routing: prefix_affinity`. `--tenants` (8) tenants each get a key through `POST /admin/keys`. Every request
is a streamed `/v1/chat/completions`: a system message of `--system-words` (1,500) words common to all
tenants, then a user message unique to the request (a dozen words), `max_tokens` `--max-tokens` (16).
Arrivals are Poisson at `--rate` (8) requests/s for `--duration` (40) s, each from a tenant chosen uniformly;
the arrival times, tenants and questions are the same in both settings (one seed).

Measured per setting: requests, status counts, errors, throughput (answers/s over the run), TTFT (the
client's seconds from sending to the first non-empty content chunk; wall clock, which is simulated time at
`--time-scale 1`) mean/p50/p90/p99/max, the fleet's prefix-cache hit rate (the engines' own
`vllm:prefix_cache_hits_total` ÷ `vllm:prefix_cache_queries_total`, in tokens, summed over the replicas
listed by `GET /corral/status`, as routing_quality.py reads it) and the answers each replica served.

Printed (JSON, also written to results/isolation_cost.json): the set-up, both settings' figures and the
tenant ÷ shared ratios (TTFT, hit rate, throughput). About 2 minutes with the defaults.

    .venv/bin/python benchmarks/isolation_cost.py [--tenants 8] [--rate 8] [--duration 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from _harness import free_port, prefix_cache_tokens, publish, spawn, stop, wait_http

MODEL = "llama-8b"
SETTINGS = ("shared", "tenant")
QUESTION_WORDS = 12
WORDS = tuple(
    (
        "the of and to in is that it for on with as was at by be this from or have an are not but which one "
        "all were when we there can more if will about out up so what time has into some them these could"
    ).split()
)


@dataclass(frozen=True)
class Arrival:
    """One planned request: when (seconds after the start), whose, and its question."""

    at: float
    tenant: int
    question: str


@dataclass(frozen=True)
class Answer:
    """One request as its client saw it."""

    status: int
    ttft: float | None  # seconds to the first non-empty content chunk (200s only)
    error: str | None  # the error's code or exception name


def spec(admin_key: str, store: Path, isolation: str, args: argparse.Namespace) -> str:
    return f"""\
auth: {{open: false, admin_key: {admin_key}}}
store: {{url: 'sqlite:///{store}'}}
supervisor: {{probe_interval: 0.5}}
models:
  - name: {MODEL}
    arch: llama-3.1-8b
    routing: prefix_affinity
    prefix_isolation: {isolation}
    deployments: [{{engine: sim, replicas: {args.replicas}, gpu: {args.gpu}, time_scale: {args.time_scale}}}]
"""


def plan(args: argparse.Namespace) -> list[Arrival]:
    """The Poisson arrivals both settings replay."""
    rng = random.Random(args.seed)
    arrivals, at, n = [], rng.expovariate(args.rate), 0
    while at < args.duration:
        words = " ".join(rng.choice(WORDS) for _ in range(QUESTION_WORDS))
        arrivals.append(Arrival(at, rng.randrange(args.tenants), f"Question {n}: {words}?"))
        at += rng.expovariate(args.rate)
        n += 1
    return arrivals


def system_prompt(words: int) -> str:
    """One long system prompt, the same for every tenant (and every run)."""
    rng = random.Random(0)
    return "You are the assistant of a shared service. " + " ".join(rng.choice(WORDS) for _ in range(words))


def admin_call(base: str, admin_key: str, path: str, fields: dict[str, Any] | None = None) -> Any:
    request = urllib.request.Request(
        f"{base}{path}",
        data=json.dumps(fields).encode() if fields is not None else None,
        headers={"Authorization": f"Bearer {admin_key}", "Content-Type": "application/json"},
        method="POST" if fields is not None else "GET",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def wait_replicas(base: str, admin_key: str, replicas: int, timeout: float = 120) -> list[str]:
    """The engines' URLs once all `replicas` are ready."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = admin_call(base, admin_key, "/corral/status")["replicas"]
        ready = [r["url"] for r in listed if r["state"] == "ready" and r["url"]]
        if len(ready) >= replicas:
            return ready
        time.sleep(0.5)
    raise RuntimeError(f"{replicas} replicas did not become ready")


async def one(session: aiohttp.ClientSession, url: str, key: str, payload: dict[str, Any]) -> Answer:
    started = time.perf_counter()
    try:
        async with session.post(url, json=payload, headers={"Authorization": f"Bearer {key}"}) as response:
            if response.status != 200:
                try:
                    code = (await response.json(content_type=None))["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    code = None
                return Answer(response.status, None, code)
            ttft = None
            async for line in response.content:
                if ttft is None and line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    if any(c.get("delta", {}).get("content") for c in chunk.get("choices", ())):
                        ttft = time.perf_counter() - started
            return Answer(200, ttft, None)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Answer(0, None, type(exc).__name__)


async def replay(
    url: str, keys: list[str], arrivals: list[Arrival], system: str, max_tokens: int
) -> tuple[list[Answer], float]:
    """Every arrival at its time (open loop): the answers and the seconds until the last one ended."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as client:
        started = time.perf_counter()
        tasks = []
        for arrival in arrivals:
            await asyncio.sleep(max(0.0, started + arrival.at - time.perf_counter()))
            payload = {
                "model": MODEL,
                "stream": True,
                "max_tokens": max_tokens,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": arrival.question},
                ],
            }
            tasks.append(asyncio.create_task(one(client, url, keys[arrival.tenant], payload)))
        answers = await asyncio.gather(*tasks)
        return list(answers), time.perf_counter() - started


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def figures(
    answers: list[Answer], elapsed: float, hits: float, queries: float, served: dict[str, int]
) -> dict[str, Any]:
    statuses = Counter(str(a.status) for a in answers)
    ttfts = [a.ttft for a in answers if a.ttft is not None]
    ok = statuses["200"]
    return {
        "requests": len(answers),
        "statuses": dict(sorted(statuses.items())),
        "errors": len(answers) - ok,
        "error_codes": dict(Counter(a.error for a in answers if a.status != 200)),
        "throughput_requests_per_s": round(ok / elapsed, 3),
        "ttft_s": {
            "mean": round(statistics.fmean(ttfts), 4) if ttfts else None,
            "p50": round(statistics.median(ttfts), 4) if ttfts else None,
            "p90": round(percentile(ttfts, 0.90), 4) if ttfts else None,
            "p99": round(percentile(ttfts, 0.99), 4) if ttfts else None,
            "max": round(max(ttfts), 4) if ttfts else None,
        },
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
        "prefix_cache_query_tokens": int(queries),
        "prefix_cache_hit_tokens": int(hits),
        "served_per_replica": served,
    }


def run_setting(
    isolation: str, arrivals: list[Arrival], system: str, args: argparse.Namespace
) -> dict[str, Any]:
    """A fresh `corral up` with `prefix_isolation: isolation`; keys, the replay, the engines' metrics."""
    admin_key = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "isolation_cost.yaml"
        path.write_text(spec(admin_key, Path(tmp) / "c.db", isolation, args))
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        gateway = spawn([sys.executable, "-m", "corral.cli", "up", "-f", str(path), "--port", str(port)])
        try:
            wait_http(f"{base}/ready", timeout=120)
            urls = wait_replicas(base, admin_key, args.replicas)
            keys = [
                admin_call(base, admin_key, "/admin/keys", {"tenant": f"t{t}"})["key"]
                for t in range(args.tenants)
            ]
            answers, elapsed = asyncio.run(
                replay(f"{base}/v1/chat/completions", keys, arrivals, system, args.max_tokens)
            )
            hits, queries = prefix_cache_tokens(urls)
            listed = admin_call(base, admin_key, "/corral/status")["replicas"]
            served = {str(r["id"]): int(r["served"]) for r in listed if r["model"] == MODEL}
        finally:
            stop(gateway)
    return figures(answers, elapsed, hits, queries, served)


def ratio(after: float | None, before: float | None) -> float | None:
    return round(after / before, 3) if after is not None and before else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", type=int, default=8, help="tenants, one key each")
    parser.add_argument("--replicas", type=int, default=4, help="simulated replicas")
    parser.add_argument("--gpu", default="l4", help="the replicas' GPU (perf catalog)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="the simulator's speed-up")
    parser.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals, requests/s")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per setting")
    parser.add_argument("--system-words", type=int, default=1500, help="words of the common system prompt")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per answer")
    parser.add_argument("--seed", type=int, default=7, help="seed of the arrivals, tenants and questions")
    args = parser.parse_args()
    arrivals = plan(args)
    system = system_prompt(args.system_words)
    results = {isolation: run_setting(isolation, arrivals, system, args) for isolation in SETTINGS}
    shared, tenant = results["shared"], results["tenant"]
    report = {
        "setup": {
            "gateway": "closed (API keys), store in SQLite, routing prefix_affinity, "
            "a fresh `corral up` per setting",
            "replicas": f"{args.replicas} x simulated Llama-3.1-8B on {args.gpu.upper()}, "
            f"{args.time_scale:g}x real time",
            "tenants": args.tenants,
            "request": f"streamed /v1/chat/completions: a {args.system_words}-word system prompt "
            f"common to all tenants, a {QUESTION_WORDS + 2}-word question of its own, "
            f"max_tokens {args.max_tokens}",
            "load": f"Poisson {args.rate:g} requests/s for {args.duration:g} s, tenants uniform "
            f"({len(arrivals)} requests, the same in both settings)",
        },
        "shared": shared,
        "tenant": tenant,
        "tenant_over_shared": {
            **{
                f"ttft_{q}": ratio(tenant["ttft_s"][q], shared["ttft_s"][q])
                for q in ("mean", "p50", "p90", "p99")
            },
            "prefix_cache_hit_rate": ratio(tenant["prefix_cache_hit_rate"], shared["prefix_cache_hit_rate"]),
            "throughput": ratio(tenant["throughput_requests_per_s"], shared["throughput_requests_per_s"]),
        },
    }
    publish("isolation_cost", report)


if __name__ == "__main__":
    main()
