"""What the gateway costs per request: direct to an upstream vs through corral, a bare relay and vllm-router.

Two fast local upstreams (vLLM-style) answer chat completions at once (non-streaming, or a stream of N
one-token chunks with no delay, plus a usage chunk when asked). The same load runs, interleaved, against:
an upstream directly; a bare relay (aiohttp server + aiohttp client on uvloop, bytes passed through, round
robin over the two, nothing else: the floor for a Python gateway built on aiohttp); a lean bare relay (the
same, with corral's own engine client, engines/client.py, in place of aiohttp's: the floor for corral's
stack, so that its ratio is what corral's routing, admission, usage and metrics cost); the Rust
vllm-router (PyPI `vllm-router`, `--policy round_robin`, when installed: `pip install -e '.[bench]'`);
corral's gateway in open mode (`corral up` with the two upstreams as one external deployment, default
routing: parse, route, relay, usage records, metrics); and corral with API keys, rate limits (in memory),
queueing and metrics all on. Each runs in its own process. Streaming clients ask for
`stream_options.include_usage`, as the official clients' users do (`--no-client-usage`: they don't, and
corral asks the engine for usage itself and strips it again).

Printed JSON, per (concurrency, streaming): requests/s and its ratio to direct, p50/p99 latency and the
latency each relay adds, and each relay's CPU time per request (the steadiest figure on a shared
machine), with corral's ratios to the bare relay and to the lean bare relay.

    .venv/bin/python benchmarks/gateway_overhead.py [--chunks 64] [--requests 3000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psutil
import uvloop
from _harness import free_port, spawn, stop, upstream_payloads, wait_http
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
BODY = orjson.dumps(
    {"model": "bench", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 64}
)


# ---- the upstream and the bare relay (each runs as `python gateway_overhead.py --serve ...`) ----


def serve_upstream(port: int, chunks: int, pace: float) -> None:
    completion, one, last = upstream_payloads(chunks)
    chunk, usage = b"data: " + one + b"\n\n", b"data: " + last + b"\n\n"

    async def chat(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        if not body.get("stream"):
            if pace:
                await asyncio.sleep(pace * chunks)
            return web.Response(body=completion, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(chunks):
            if pace:  # one token per engine step, as an engine streams
                await asyncio.sleep(pace)
            await response.write(chunk)
        if (body.get("stream_options") or {}).get("include_usage"):
            await response.write(usage)
        await response.write(b"data: [DONE]\n\n")
        return response

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, loop=uvloop.new_event_loop())


def serve_lean_relay(port: int, upstreams: list[str]) -> None:
    from corral.engines.client import EngineClient

    turn = itertools.cycle(upstreams)

    async def relay(request: web.Request) -> web.StreamResponse:
        client: EngineClient = request.app["client"]
        up = await client.post(next(turn), request.path, await request.read(), None)
        try:
            response = web.StreamResponse(status=up.status, headers={"Content-Type": up.content_type})
            await response.prepare(request)
            while data := await up.chunk():
                await response.write(data)
            await response.write_eof()
            return response
        finally:
            up.release()

    async def client_ctx(app: web.Application) -> Any:
        client = EngineClient(connect_timeout=3, read_timeout=120, limit=4096)
        app["client"] = client
        yield
        client.close()

    app = web.Application()
    app.cleanup_ctx.append(client_ctx)
    app.router.add_post("/v1/chat/completions", relay)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, loop=uvloop.new_event_loop())


def serve_bare_relay(port: int, upstreams: list[str]) -> None:
    turn = itertools.cycle(upstreams)

    async def relay(request: web.Request) -> web.StreamResponse:
        session: aiohttp.ClientSession = request.app["session"]
        body = await request.read()
        async with session.post(
            next(turn) + request.path, data=body, headers={"Content-Type": "application/json"}
        ) as up:
            response = web.StreamResponse(status=up.status, headers={"Content-Type": up.content_type})
            await response.prepare(request)
            async for data in up.content.iter_any():
                await response.write(data)
            await response.write_eof()
            return response

    async def session_ctx(app: web.Application) -> Any:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            app["session"] = session
            yield

    app = web.Application()
    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/chat/completions", relay)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, loop=uvloop.new_event_loop())


# ---- the load generator ----


async def run_load(
    url: str, concurrency: int, total: int, stream: bool, key: str | None = None, usage: bool = True
) -> dict[str, Any]:
    body = orjson.loads(BODY)
    if stream:
        body["stream"] = True
        if usage:
            body["stream_options"] = {"include_usage": True}
    payload = orjson.dumps(body)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    latencies: list[float] = []
    errors = 0
    remaining = total
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal remaining, errors
            while remaining > 0:
                remaining -= 1
                start = time.perf_counter()
                async with session.post(url, data=payload, headers=headers) as r:
                    data = await r.read()
                    if r.status != 200 or (stream and not data.endswith(b"data: [DONE]\n\n")):
                        errors += 1
                latencies.append(time.perf_counter() - start)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "requests_per_s": len(latencies) / elapsed,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        "errors": errors,
        "n": len(latencies),
    }


def cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument(
        "--pace-ms",
        type=float,
        default=0.0,
        help="the upstreams wait this long before each chunk (an engine's step; whole answers wait for all "
        "of them): each chunk then reaches the relay on its own, as from a real engine (0: back to back)",
    )
    parser.add_argument("--requests", type=int, default=3000, help="requests per measurement")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per configuration")
    parser.add_argument("--concurrency", default="1,32,128")
    parser.add_argument("--kinds", default="whole,stream", help="whole answers, streams, or both")
    parser.add_argument(
        "--no-client-usage", action="store_true", help="streaming clients don't ask for include_usage"
    )
    parser.add_argument(
        "--scrape-interval",
        type=float,
        default=0.0,
        help="also measure a second open corral whose /metrics is scraped every this many seconds (0: off)",
    )
    parser.add_argument("--output", type=Path, default=ROOT / "results" / "gateway_overhead.json")
    parser.add_argument("--serve", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        if args.serve[0] == "upstream":
            serve_upstream(int(args.serve[1]), int(args.serve[2]), float(args.serve[3]))
        elif args.serve[0] == "lean":
            serve_lean_relay(int(args.serve[1]), args.serve[2:])
        else:
            serve_bare_relay(int(args.serve[1]), args.serve[2:])
        return
    with tempfile.TemporaryDirectory() as tmp:
        results = run(args, Path(tmp))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    me = [sys.executable, __file__, "--serve"]
    up_ports = [free_port(), free_port()]
    upstreams = [f"http://127.0.0.1:{p}" for p in up_ports]
    names = ["bare_relay", "lean_relay", "vllm_router", "corral", "corral_keys"]
    if args.scrape_interval > 0:
        names.append("corral_scraped")
    ports = {name: free_port() for name in names}
    model = (
        f"models:\n  - name: bench\n    deployments: [{{engine: external, urls: {json.dumps(upstreams)}}}]\n"
    )
    spec, keyed, scraped = tmp / "bench.yaml", tmp / "keyed.yaml", tmp / "scraped.yaml"
    spec.write_text(f"gateway: {{port: {ports['corral']}}}\nauth: {{open: true}}\n" + model)
    if "corral_scraped" in ports:
        scraped.write_text(f"gateway: {{port: {ports['corral_scraped']}}}\nauth: {{open: true}}\n" + model)
    keyed.write_text(f"gateway: {{port: {ports['corral_keys']}}}\n" + model)
    home = {"CORRAL_HOME": str(tmp)}
    api_key = _make_key(home)
    corral = [sys.executable, "-m", "corral.cli", "up", "--log-level", "warning", "-f"]
    procs = {
        **{
            f"upstream{i}": spawn([*me, "upstream", str(p), str(args.chunks), str(args.pace_ms / 1000)])
            for i, p in enumerate(up_ports)
        },
        "bare_relay": spawn([*me, "bare", str(ports["bare_relay"]), *upstreams]),
        "lean_relay": spawn([*me, "lean", str(ports["lean_relay"]), *upstreams]),
        "corral": spawn([*corral, str(spec)], env=home),
        "corral_keys": spawn([*corral, str(keyed)], env=home),
    }
    if "corral_scraped" in ports:
        procs["corral_scraped"] = spawn([*corral, str(scraped)], env=home)
    router = shutil.which("vllm-router") or shutil.which("vllm-router", path=str(Path(sys.executable).parent))
    if router:
        where = [
            "--host",
            "127.0.0.1",
            "--port",
            str(ports["vllm_router"]),
            "--prometheus-port",
            str(free_port()),
        ]
        options = ["--policy", "round_robin", "--log-level", "warning", "--worker-urls", *upstreams]
        procs["vllm_router"] = spawn([router, *where, *options])
    else:
        print(
            "vllm-router is not installed (pip install -e '.[bench]'): measured without it", file=sys.stderr
        )
    try:
        for url in upstreams:
            wait_http(url + "/health")
        for name in ("corral", "corral_keys", "corral_scraped"):
            if name in procs:
                wait_http(f"http://127.0.0.1:{ports[name]}/ready")
        if router:
            wait_http(f"http://127.0.0.1:{ports['vllm_router']}/health")
        time.sleep(0.5)
        urls = {"direct": upstreams[0] + "/v1/chat/completions"}
        urls.update(
            {
                name: f"http://127.0.0.1:{port}/v1/chat/completions"
                for name, port in ports.items()
                if name in procs
            }
        )
        pids = {name: procs[name].pid for name in urls if name in procs}
        return asyncio.run(measure(args, urls, pids, api_key), debug=False)
    finally:
        stop(*procs.values())


def _make_key(home: dict[str, str]) -> str:
    limits = ["--rpm", "100000000", "--tpm", "1000000000000", "--max-concurrency", "100000"]
    made = subprocess.run(
        [sys.executable, "-m", "corral.cli", "keys", "create", "--tenant", "bench", *limits, "--json"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **home},
    )
    return str(json.loads(made.stdout)["key"])


async def measure(
    args: argparse.Namespace, urls: dict[str, str], pids: dict[str, int], api_key: str
) -> dict[str, Any]:
    relays = {name: psutil.Process(pid) for name, pid in pids.items()}
    keys = {"corral_keys": api_key}
    usage = not args.no_client_usage
    for target, url in urls.items():  # warm up connections and code paths
        await run_load(url, 8, 200, False, keys.get(target))
        await run_load(url, 8, 200, True, keys.get(target), usage)
    scraper = None
    if "corral_scraped" in urls:
        metrics_url = urls["corral_scraped"].replace("/v1/chat/completions", "/metrics")
        scraper = asyncio.create_task(scrape_forever(metrics_url, args.scrape_interval))
    configs = []
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        for stream in (kind == "stream" for kind in args.kinds.split(",")):
            samples: dict[str, list[dict[str, Any]]] = {k: [] for k in urls}
            total = max(200, args.requests // (4 if concurrency == 1 else 1))
            for _ in range(args.rounds):
                for target, url in urls.items():
                    proc = relays.get(target)
                    before = cpu_seconds(proc) if proc else 0.0
                    result = await run_load(url, concurrency, total, stream, keys.get(target), usage)
                    if proc:
                        result["cpu_ms_per_request"] = 1000 * (cpu_seconds(proc) - before) / result["n"]
                    samples[target].append(result)
            configs.append(summarise(concurrency, stream, samples))
    if scraper is not None:
        scraper.cancel()
    return {
        "benchmark": "gateway_overhead",
        "chunks_per_stream": args.chunks,
        "pace_ms": args.pace_ms,
        "client_asks_usage": usage,
        "requests_per_measurement": args.requests,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "configs": configs,
    }


async def scrape_forever(url: str, interval: float) -> None:
    """What Prometheus does to the gateway: GET /metrics every `interval` seconds."""
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(url) as response:
                await response.read()
            await asyncio.sleep(interval)


def summarise(concurrency: int, stream: bool, samples: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    def median(target: str, key: str) -> float:
        return statistics.median(s[key] for s in samples[target])

    out: dict[str, Any] = {"concurrency": concurrency, "stream": stream}
    direct_rps = median("direct", "requests_per_s")
    out["direct"] = {
        "requests_per_s": round(direct_rps, 1),
        "p50_ms": round(median("direct", "p50_ms"), 3),
        "p99_ms": round(median("direct", "p99_ms"), 3),
    }
    for target in samples:
        if target == "direct":
            continue
        out[target] = {
            "requests_per_s": round(median(target, "requests_per_s"), 1),
            "rps_ratio_to_direct": round(median(target, "requests_per_s") / direct_rps, 3),
            "added_p50_ms": round(median(target, "p50_ms") - median("direct", "p50_ms"), 3),
            "added_p99_ms": round(median(target, "p99_ms") - median("direct", "p99_ms"), 3),
            "cpu_ms_per_request": round(median(target, "cpu_ms_per_request"), 4),
            "errors": sum(s["errors"] for s in samples[target]),
        }
    if "corral_scraped" in samples:
        out["scraped_cpu_ratio_to_unscraped"] = round(
            out["corral_scraped"]["cpu_ms_per_request"] / out["corral"]["cpu_ms_per_request"], 3
        )
    for target in samples:
        if target not in ("direct", "bare_relay"):
            out[f"{target}_cpu_ratio_to_bare_relay"] = round(
                out[target]["cpu_ms_per_request"] / out["bare_relay"]["cpu_ms_per_request"], 3
            )
    for target in ("corral", "corral_keys"):
        out[f"{target}_cpu_ratio_to_lean_relay"] = round(
            out[target]["cpu_ms_per_request"] / out["lean_relay"]["cpu_ms_per_request"], 3
        )
    return out


if __name__ == "__main__":
    main()
