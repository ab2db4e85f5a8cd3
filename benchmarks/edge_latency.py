"""What the NGINX edge adds to time to first content: a corral gateway directly vs through the edge.

Set-up, all on this machine: a fast vLLM-style upstream (64 one-token SSE chunks at once, from
gateway_overhead.py); `corral up` with it as an external deployment (open, trusted proxy 127.0.0.1); the
edge from `corral deploy render --target nginx` for that spec, run by Debian's NGINX (`apt-get install
nginx-light`) with a certificate from `corral deploy certs`. Clients (aiohttp on uvloop) send streamed chat
requests and time the first content chunk. Targets, interleaved request by request:
- `direct`: HTTP to the gateway, one kept-alive connection per client;
- `edge`: HTTPS through NGINX, one kept-alive connection per client (the steady state of an SDK client);
- `edge_new_connection`: HTTPS through NGINX, a new TCP+TLS connection per request (handshake included).

Printed JSON: per concurrency, TTFC p50/p90/p99 in ms per target and the edge's added p50/p90 against
direct (the issue's bound: within 5 ms).

    .venv/bin/python benchmarks/edge_latency.py [--requests 400] [--concurrency 1,16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import statistics
import subprocess
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
BODY = orjson.dumps(
    {"model": "bench", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 64, "stream": True}
)
HEADERS = {"Content-Type": "application/json"}


async def first_content(session: aiohttp.ClientSession, url: str, context: ssl.SSLContext | None) -> float:
    """Seconds from sending the request to the first content chunk; the rest is read (connection reuse)."""
    started = time.perf_counter()
    seen: float | None = None
    async with session.post(url, data=BODY, headers=HEADERS, ssl=context if context else True) as response:
        response.raise_for_status()
        async for line in response.content:
            if seen is None and b'"content"' in line:
                seen = time.perf_counter() - started
    if seen is None:
        raise RuntimeError(f"{url}: no content chunk")
    return seen


async def client_loop(
    urls: dict[str, str], context: ssl.SSLContext, requests: int, out: dict[str, list[float]]
) -> None:
    """One client: per round one request to each target, in turn (drift hits all alike)."""
    sessions = {name: aiohttp.ClientSession() for name in ("direct", "edge")}
    try:
        for _ in range(requests):
            out["direct"].append(await first_content(sessions["direct"], urls["direct"], None))
            out["edge"].append(await first_content(sessions["edge"], urls["edge"], context))
            connector = aiohttp.TCPConnector(force_close=True)
            async with aiohttp.ClientSession(connector=connector) as fresh:
                out["edge_new_connection"].append(await first_content(fresh, urls["edge"], context))
    finally:
        for session in sessions.values():
            await session.close()


async def measure(urls: dict[str, str], context: ssl.SSLContext, requests: int, concurrency: int) -> Any:
    out: dict[str, list[float]] = {"direct": [], "edge": [], "edge_new_connection": []}
    for warm in range(2):  # warm-up: connections, NGINX workers, the gateway's first requests
        await client_loop(urls, context, 10, {k: [] for k in out})
        del warm
    per_client = max(1, requests // concurrency)
    await asyncio.gather(*(client_loop(urls, context, per_client, out) for _ in range(concurrency)))
    figures: dict[str, Any] = {"concurrency": concurrency, "requests_per_target": per_client * concurrency}
    for name, samples in out.items():
        ordered = sorted(samples)
        figures[name] = {f"p{q}_ms": round(1000 * _quantile(ordered, q / 100), 3) for q in (50, 90, 99)}
    for q in (50, 90):
        added = figures["edge"][f"p{q}_ms"] - figures["direct"][f"p{q}_ms"]
        figures[f"edge_adds_p{q}_ms"] = round(added, 3)
    figures["edge_within_5ms"] = figures["edge_adds_p50_ms"] <= 5 and figures["edge_adds_p90_ms"] <= 5
    figures["mean_ms"] = {name: round(1000 * statistics.fmean(s), 3) for name, s in out.items()}
    return figures


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="requests per target and concurrency")
    parser.add_argument("--concurrency", default="1,16", help="comma-separated client counts")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        results = run(Path(folder), args.requests, [int(c) for c in args.concurrency.split(",")])
    print(json.dumps(results, indent=2))


def run(tmp: Path, requests: int, concurrencies: list[int]) -> dict[str, Any]:
    corral = [sys.executable, "-m", "corral.cli"]
    subprocess.run([*corral, "deploy", "certs", "-o", str(tmp / "tls")], check=True, capture_output=True)
    upstream_port, gateway_port, edge_port = free_port(), free_port(), free_port()
    spec = tmp / "spec.yaml"
    spec.write_text(
        f"gateway: {{port: {gateway_port}, trusted_proxies: [127.0.0.1]}}\nauth: {{open: true}}\n"
        f"deploy:\n  edge: {{port: {edge_port}, cert: {tmp}/tls/server.crt, key: {tmp}/tls/server.key, "
        # One address sends everything here: per-client limits out of the way.
        "requests_per_second: 100000, burst: 100000, connections_per_client: 10000}\n"
        "models:\n  - name: bench\n"
        f"    deployments: [{{engine: external, urls: ['http://127.0.0.1:{upstream_port}']}}]\n"
    )
    subprocess.run(
        [*corral, "deploy", "render", "-t", "nginx", "-f", str(spec), "-o", str(tmp / "out")],
        check=True,
        capture_output=True,
    )
    prefix = tmp / "out" / "nginx"
    (prefix / "tmp").mkdir()
    nginx = ["nginx", "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-e", str(prefix / "error.log")]
    overhead = str(ROOT / "benchmarks" / "gateway_overhead.py")
    procs = [
        spawn([sys.executable, overhead, "--serve", "upstream", str(upstream_port), "64", "0"]),
        spawn([*corral, "up", "--log-level", "warning", "-f", str(spec)], env={"CORRAL_HOME": str(tmp)}),
        spawn([*nginx, "-g", "daemon off;"]),
    ]
    try:
        wait_http(f"http://127.0.0.1:{upstream_port}/health")
        wait_http(f"http://127.0.0.1:{gateway_port}/ready")
        urls = {
            "direct": f"http://127.0.0.1:{gateway_port}/v1/chat/completions",
            "edge": f"https://localhost:{edge_port}/v1/chat/completions",
        }
        context = ssl.create_default_context(cafile=tmp / "tls" / "ca.crt")
        figures = [uvloop.run(measure(urls, context, requests, concurrency)) for concurrency in concurrencies]
        return {
            "setup": "one corral gateway, external fast upstream, NGINX edge rendered by corral",
            "runs": figures,
        }
    finally:
        stop(*procs)


if __name__ == "__main__":
    main()
