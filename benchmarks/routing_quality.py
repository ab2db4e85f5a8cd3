"""Routing quality: each policy over a fleet of simulated GPU replicas under multi-tenant shared-prefix load.

Workload: `--tenants` tenants, each with a long shared document (`--doc-words` tokens) that every one of its
requests starts with, then a short unique question; streamed chat completions with `--output` tokens. The
distinct documents together exceed one replica's KV cache but fit in the fleet's, which is where routing
decides the prefix-cache hit rate.

For each policy, on a fresh fleet (`corral sim`, 8 replicas of Llama-3.1-8B on L4s by default) behind a
fresh gateway (`corral up`, external replicas):
1. saturation: `--saturation-clients` clients in a closed loop: requests/s and output tokens/s;
2. latency: Poisson arrivals at 80% of round robin's saturation rate: TTFT p50/p90 (simulated seconds),
   and the fleet's prefix-cache hit rate from the engines' own metrics.
With `--rounds N` the policies run N times, interleaved (round robin, corral, the peers, then again), and
each figure is the median of its rounds, printed with every round's value; corral's comparison with each
peer also counts the rounds (paired: the same minutes of the machine) in which its p90 and p99 were lower.
On a shared machine one run's tail moves by tens of milliseconds with the neighbours; rounds show how far.

Before the load, `--idle` seconds with no requests measure the router's and the fleet's idle CPU (health
probes, polling); over both phases, the router's CPU per request (all its processes and threads).
Prints JSON (also written to results/routing_quality.json) with each policy's figures and the default
policy's ratios to round robin.

`--corral-workers N` runs corral's gateway as N worker processes (rate limits in `--redis`); `--kv-events`
has the simulated engines publish their KV-cache events (as vLLM's `--kv-events-config`), which corral
follows (`kv_events_urls`); the peers do not read them.

The fleet runs in real time by default (`--time-scale 1`), as a deployment's engines do: a router's own
latency then counts once against the engines' steps. `--time-scale 4 --duration 20` gives the same simulated
minutes in a quarter of the wall-clock time for development, but counts each router's latency four times.

    .venv/bin/python benchmarks/routing_quality.py [--replicas 8] [--time-scale 1] [--duration 80] \\
        [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psutil
from _harness import prefix_cache_tokens, spawn, stop, wait_http

ROOT = Path(__file__).resolve().parent.parent
POLICIES = [
    "round_robin",
    "least_outstanding_requests",
    "least_outstanding_tokens",
    "power_of_two",
    "session_affinity",
    "prefix_affinity",
]
DEFAULT = "prefix_affinity"
# The best peers, in front of the same fleet: (name, command before the worker URLs). Installed by
# `pip install -e '.[bench]'`; measured when present.
PEERS = {
    "sglang_cache_aware": ["-m", "sglang_router.launch_router", "--policy", "cache_aware"],
    "vllm_router_consistent_hash": ["-m", "vllm_router.launch_router", "--policy", "consistent_hash"],
}


def free_ports(n: int) -> int:
    """A base port with n free ports after it (best effort)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n < 65000 and all(_free(base + i) for i in range(n)):
            return base


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class Workload:
    """Tenants with long shared documents; which tenant asks next is uniform or Zipf (s = 1.1)."""

    def __init__(self, tenants: int, doc_words: int, distribution: str = "uniform", seed: int = 7) -> None:
        self._rng = random.Random(seed)
        self.docs = [" ".join(f"t{t}w{i}" for i in range(doc_words)) for t in range(tenants)]
        weights = [1.0 / (rank + 1) ** 1.1 for rank in range(tenants)] if distribution == "zipf" else None
        self._weights = weights
        self._n = 0

    def next_body(self, model: str, output: int) -> dict[str, Any]:
        if self._weights is None:
            tenant = self._rng.randrange(len(self.docs))
        else:
            tenant = self._rng.choices(range(len(self.docs)), weights=self._weights)[0]
        self._n += 1
        question = f"Question {self._n}: " + " ".join(f"q{self._rng.randrange(10**6)}" for _ in range(30))
        return {
            "model": model,
            "max_tokens": output,
            "stream": True,
            "user": f"tenant-{tenant}",
            "messages": [
                {"role": "system", "content": self.docs[tenant]},
                {"role": "user", "content": question},
            ],
        }


async def one_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[float, int]:
    """(seconds to the first content chunk, content chunks) for one streamed request."""
    started = time.perf_counter()
    ttft = None
    chunks = 0
    # The tenant also as a header: vllm-router's consistent_hash keys on X-Tenant-ID (corral ignores it).
    headers = {"Content-Type": "application/json", "X-Tenant-ID": body["user"]}
    async with session.post(url, data=orjson.dumps(body), headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"status {r.status}: {await r.text()}")
        async for line in r.content:
            if line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                if ttft is None:
                    ttft = time.perf_counter() - started
                chunks += 1
    return (ttft if ttft is not None else time.perf_counter() - started), chunks


async def saturation(
    url: str, work: Workload, clients: int, duration: float, output: int
) -> dict[str, float]:
    done, tokens = 0, 0
    stop_at = time.perf_counter() + duration
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def client() -> None:
            nonlocal done, tokens
            while time.perf_counter() < stop_at:
                _, chunks = await one_request(session, url, work.next_body("llama", output))
                done += 1
                tokens += chunks

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        elapsed = time.perf_counter() - started
    return {"requests_per_s": done / elapsed, "output_tokens_per_s": tokens / elapsed, "requests": done}


async def open_loop(url: str, work: Workload, rate: float, duration: float, output: int) -> list[float]:
    rng = random.Random(11)
    ttfts: list[float] = []
    tasks = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def fire() -> None:
            ttft, _ = await one_request(session, url, work.next_body("llama", output))
            ttfts.append(ttft)

        started = time.perf_counter()
        next_at = started
        while next_at - started < duration:
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            tasks.append(asyncio.create_task(fire()))
            next_at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    return ttfts


def fleet_hit_rate(urls: list[str]) -> float:
    hits, queries = prefix_cache_tokens(urls)
    return hits / queries if queries else 0.0


def run_policy(policy: str, args: argparse.Namespace, rate: float | None) -> dict[str, Any]:
    events = args.kv_events and policy not in PEERS
    base = free_ports(2 * args.replicas + 1 if events else args.replicas + 1)
    gw_port = base + args.replicas
    urls = [f"http://127.0.0.1:{base + i}" for i in range(args.replicas)]
    publishers = [f"tcp://127.0.0.1:{gw_port + 1 + i}" for i in range(args.replicas)]
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "spec.yaml"
        kv = f", kv_events_urls: {json.dumps(publishers)}" if events else ""
        workers = (
            f", workers: {args.corral_workers}}}\nlimits: {{backend: redis, redis_url: '{args.redis}'"
            if args.corral_workers > 1
            else ""
        )
        spec.write_text(
            f"gateway: {{port: {gw_port}, routing: {policy}, read_timeout: 600{workers}}}\n"
            "auth: {open: true}\n"
            "supervisor: {probe_interval: 0.5}\n"
            "models:\n  - name: llama\n"
            f"    deployments: [{{engine: external, urls: {json.dumps(urls)}{kv}}}]\n"
        )
        fleet = spawn(
            [
                sys.executable,
                "-m",
                "corral.cli",
                "sim",
                "--model",
                "llama-3.1-8b",
                "--gpu",
                args.gpu,
                "--served-name",
                "llama",
                "--replicas",
                str(args.replicas),
                "--port",
                str(base),
                "--time-scale",
                str(args.time_scale),
                *(["--kv-events-endpoint", f"tcp://*:{gw_port + 1}"] if events else []),
            ],
        )
        gateway = _gateway(policy, spec, tmp, gw_port, urls)
        try:
            wait_http(urls[-1] + "/health")
            wait_http(f"http://127.0.0.1:{gw_port}" + ("/health" if policy in PEERS else "/ready"))
            url = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
            if policy in PEERS:  # a router may answer /health before it has admitted its workers
                asyncio.run(_until_answering(url, args.replicas))
            work = Workload(args.tenants, args.doc_words, args.distribution)
            router = _tree(gateway)
            idle_from = time.perf_counter(), _cpu(router), _cpu(_tree(fleet))
            time.sleep(args.idle)  # the router's and the fleet's CPU with no requests (probes, polling)
            idle_s = time.perf_counter() - idle_from[0]
            idle = (_cpu(router) - idle_from[1]) / idle_s, (_cpu(_tree(fleet)) - idle_from[2]) / idle_s
            busy_from = _cpu(router)
            sat = asyncio.run(saturation(url, work, args.saturation_clients, args.duration, args.output))
            result: dict[str, Any] = {
                "policy": policy,
                # per simulated second: wall-clock rates divided by the time scale
                "saturation_requests_per_s": round(sat["requests_per_s"] / args.time_scale, 3),
                "saturation_output_tokens_per_s": round(sat["output_tokens_per_s"] / args.time_scale, 1),
            }
            if rate is None:  # round robin sets the rate for everyone: a share of its own saturation
                rate = args.load * result["saturation_requests_per_s"]
            served = sat["requests"]
            if rate:
                ttfts = asyncio.run(open_loop(url, work, rate * args.time_scale, args.duration, args.output))
                served += len(ttfts)
                ttfts = sorted(t * args.time_scale for t in ttfts)  # simulated seconds
                result.update(
                    {
                        "offered_requests_per_s": round(rate, 3),
                        "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
                        "ttft_p90_ms": round(1000 * ttfts[int(0.9 * (len(ttfts) - 1))], 1),
                        "ttft_p99_ms": round(1000 * ttfts[int(0.99 * (len(ttfts) - 1))], 1),
                        "requests_measured": len(ttfts),
                    }
                )
            result["prefix_cache_hit_rate"] = round(fleet_hit_rate(urls), 4)
            # what the router itself costs (all its processes and threads): CPU per request over both
            # phases, and its share of a core when idle, beside the simulated fleet's idle share
            result["router_cpu_ms_per_request"] = round(1000 * (_cpu(router) - busy_from) / served, 3)
            result["router_idle_cpu_percent"] = round(100 * idle[0], 2)
            result["fleet_idle_cpu_percent"] = round(100 * idle[1], 2)
            return result
        finally:
            stop(gateway, fleet)


def _tree(proc: Any) -> list[psutil.Process]:
    """A spawned process and everything it started (corral's workers, a router's launcher and binary)."""
    root = psutil.Process(proc.pid)
    return [root, *root.children(recursive=True)]


def _cpu(procs: list[psutil.Process]) -> float:
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def _gateway(policy: str, spec: Path, tmp: str, port: int, urls: list[str]) -> Any:
    """corral with `policy`, or a peer router, on `port` in front of the fleet."""
    if policy in PEERS:
        level = "warn" if policy.startswith("sglang") else "warning"
        where = ["--host", "127.0.0.1", "--port", str(port), "--log-level", level]
        where += ["--prometheus-port", str(free_ports(1))]
        return spawn([sys.executable, *PEERS[policy], *where, "--worker-urls", *urls])
    return spawn(
        [sys.executable, "-m", "corral.cli", "up", "-f", str(spec), "--log-level", "warning"],
        env={"CORRAL_HOME": tmp},
    )


async def _until_answering(url: str, replicas: int, within: float = 60) -> None:
    """Until `replicas` requests in a row are answered 200 (every worker admitted, whichever it picks)."""
    body = orjson.dumps({"model": "llama", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    deadline = time.monotonic() + within
    answered = 0
    async with aiohttp.ClientSession() as session:
        while answered < replicas:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} does not answer")
            async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                await r.read()
                answered = answered + 1 if r.status == 200 else 0
            if not answered:
                await asyncio.sleep(0.5)


def _median_of(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One policy's figures: each the median over the rounds, with every round's value beside it."""
    if len(rounds) == 1:
        return rounds[0]
    merged: dict[str, Any] = {"policy": rounds[0]["policy"]}
    for key, value in rounds[0].items():
        if isinstance(value, (int, float)) and key != "offered_requests_per_s":
            values = [r[key] for r in rounds]
            merged[key] = round(statistics.median(values), 4 if key.endswith("rate") else 1)
            merged[key + "_rounds"] = values
        elif key != "policy":
            merged[key] = value
    return merged


def _installed(policy: str) -> bool:
    if policy not in PEERS:
        return True
    module = PEERS[policy][1].split(".")[0]
    found = importlib.util.find_spec(module) is not None
    if not found:
        print(f"{policy}: {module} is not installed (pip install -e '.[bench]'); skipped", file=sys.stderr)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--gpu", default="l4")
    parser.add_argument("--tenants", type=int, default=48)
    parser.add_argument("--distribution", default="uniform", choices=["uniform", "zipf"])
    parser.add_argument("--doc-words", type=int, default=3000, help="shared document length (tokens)")
    parser.add_argument("--output", type=int, default=32, help="output tokens per request")
    parser.add_argument("--time-scale", type=float, default=1.0, help="simulated seconds per second")
    parser.add_argument("--duration", type=float, default=80.0, help="wall-clock seconds per phase")
    parser.add_argument("--saturation-clients", type=int, default=48)
    parser.add_argument("--idle", type=float, default=5.0, help="seconds of idle CPU measured per policy")
    parser.add_argument(
        "--rounds", type=int, default=1, help="interleaved rounds of all policies (figures: medians)"
    )
    parser.add_argument("--load", type=float, default=0.8, help="share of round robin's saturation rate")
    parser.add_argument(
        "--rate", type=float, help="offered requests/s (simulated) when round robin is not run to set it"
    )
    parser.add_argument(
        "--policies",
        default=",".join(["round_robin", DEFAULT, *PEERS]),
        help=f"of {', '.join(POLICIES + list(PEERS))}",
    )
    parser.add_argument(
        "--corral-workers", type=int, default=1, help="corral's gateway.workers (limits in Redis)"
    )
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="for --corral-workers > 1")
    parser.add_argument(
        "--kv-events", action="store_true", help="the engines publish KV-cache events; corral follows them"
    )
    parser.add_argument("--output-file", type=Path, default=ROOT / "results" / "routing_quality.json")
    args = parser.parse_args()

    policies = [p for p in args.policies.split(",") if _installed(p)]
    if "round_robin" in policies:
        policies = ["round_robin", *[p for p in policies if p != "round_robin"]]
    runs: dict[str, list[dict[str, Any]]] = {policy: [] for policy in policies}
    rate = None if policies[0] == "round_robin" else (args.rate or 0.0)
    for round_ in range(args.rounds):  # rounds interleave the policies: a slow minute hits all alike
        for policy in policies:
            result = run_policy(policy, args, rate)
            rate = result.get("offered_requests_per_s", rate)
            runs[policy].append(result)
            print(json.dumps({"round": round_ + 1, **result}), file=sys.stderr, flush=True)
    results = [_median_of(runs[policy]) for policy in policies]
    report: dict[str, Any] = {
        "benchmark": "routing_quality",
        "replicas": args.replicas,
        "gpu": args.gpu,
        "tenants": args.tenants,
        "distribution": args.distribution,
        "doc_tokens": args.doc_words,
        "output_tokens": args.output,
        "time_scale": args.time_scale,
        "load": args.load,
        "rounds": args.rounds,
        "corral_workers": args.corral_workers,
        "kv_events": args.kv_events,
        "policies": results,
    }
    by = {r["policy"]: r for r in results}
    if "round_robin" in by and DEFAULT in by:
        rr, best = by["round_robin"], by[DEFAULT]
        report["default_vs_round_robin"] = {
            "ttft_p90_lower_by": round(rr["ttft_p90_ms"] / best["ttft_p90_ms"], 2),
            "throughput_higher_by": round(
                best["saturation_requests_per_s"] / rr["saturation_requests_per_s"], 2
            ),
            "targets": {"ttft_p90_lower_by": 3.0, "throughput_higher_by": 1.3},
        }
    for peer in PEERS:
        if peer in by and DEFAULT in by and "ttft_p90_ms" in by[peer]:
            pairs = list(zip(runs[DEFAULT], runs[peer], strict=True))
            report[f"default_vs_{peer}"] = {
                "ttft_p90_ratio": round(by[DEFAULT]["ttft_p90_ms"] / by[peer]["ttft_p90_ms"], 3),
                "ttft_p99_ratio": round(by[DEFAULT]["ttft_p99_ms"] / by[peer]["ttft_p99_ms"], 3),
                "throughput_ratio": round(
                    by[DEFAULT]["saturation_requests_per_s"] / by[peer]["saturation_requests_per_s"], 3
                ),
                # paired by round: the same minutes of the machine for both
                "rounds_lower_p90": sum(a["ttft_p90_ms"] < b["ttft_p90_ms"] for a, b in pairs),
                "rounds_lower_p99": sum(a["ttft_p99_ms"] < b["ttft_p99_ms"] for a, b in pairs),
                "note": "ratios below 1 mean corral's default has the lower TTFT (higher throughput "
                "above 1); with several rounds, ratios of medians",
            }
    args.output_file.parent.mkdir(parents=True, exist_ok=True)
    args.output_file.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
