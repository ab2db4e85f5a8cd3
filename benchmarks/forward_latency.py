"""The latency a router adds on a long prompt's way to its engine, and on the first tokens' way back.

The routing benchmark's requests (benchmarks/routing_quality.py: 48 tenants' 3,000-word documents, 26 KB
bodies, a question of their own, streamed) go one at a time (`--concurrency 1`: latency, not throughput)
through each router to two upstreams that timestamp them: when a request reaches the upstream's handler,
and when it writes each of its `--chunks` one-token chunks (`--pace-ms` apart, an engine's steps). The
client timestamps its send and each content chunk's arrival; all processes read the same monotonic clock.
Per target, interleaved over `--rounds`, the medians and p90s of:
- forward: the client's send to the upstream's handler (direct: the upstream's own HTTP server alone);
- back (first, second, third token): the upstream's write of a chunk to the client's read of it;
and each router's CPU per request (all its processes). Targets: the upstream directly; the lean relay
(aiohttp's server and corral's engine client, nothing else: gateway_overhead.py's floor for corral's stack);
corral (`corral up`, open, external upstreams, default routing: prefix_affinity); sglang-router
`cache_aware` and vllm-router `consistent_hash` when installed (`pip install -e '.[bench]'`).

The routing benchmark's fleet runs in real time (a millisecond here is one there); with its
`--time-scale 4` a millisecond here is four there.

    .venv/bin/python benchmarks/forward_latency.py [--requests 200] [--rounds 3] [--pace-ms 2]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import re
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
from routing_quality import Workload, _cpu, _tree

ROOT = Path(__file__).resolve().parent.parent
_QUESTION = re.compile(rb"Question (\d+):")


def serve_upstream(port: int, chunks: int, pace: float) -> None:
    """A streaming upstream that notes, per request (by its question's number), when its handler started
    and when it wrote each chunk; GET /timings hands them over and forgets them."""
    _, one, last = upstream_payloads(chunks)
    chunk, usage = b"data: " + one + b"\n\n", b"data: " + last + b"\n\n"
    timings: dict[int, list[float]] = {}

    async def chat(request: web.Request) -> web.StreamResponse:
        arrived = time.perf_counter()
        raw = await request.read()
        found = _QUESTION.search(raw)
        marks = timings[int(found[1]) if found else -1] = [arrived]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(chunks):
            await asyncio.sleep(pace)
            marks.append(time.perf_counter())
            await response.write(chunk)
        if b'"include_usage":true' in raw:
            await response.write(usage)
        await response.write(b"data: [DONE]\n\n")
        return response

    async def taken(request: web.Request) -> web.Response:
        body = orjson.dumps(timings, option=orjson.OPT_NON_STR_KEYS)
        timings.clear()
        return web.Response(body=body, content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/timings", taken)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, loop=uvloop.new_event_loop())


async def one_request(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[float, list[float]]:
    """(when it was sent, when each of its first three content chunks arrived)."""
    data = orjson.dumps(body)
    sent = time.perf_counter()
    arrivals: list[float] = []
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: status {response.status}: {await response.text()}")
        async for line in response.content:
            if len(arrivals) < 3 and line.startswith(b"data: {") and b'"content"' in line:
                arrivals.append(time.perf_counter())
    return sent, arrivals


async def measure(url: str, work: Workload, requests: int) -> dict[int, tuple[float, list[float]]]:
    """Requests one at a time; per question number, (sent, first chunks' arrivals)."""
    seen = {}
    async with aiohttp.ClientSession() as session:
        for _ in range(requests):
            body = work.next_body("llama", 32)
            found = _QUESTION.search(body["messages"][-1]["content"].encode())
            assert found is not None  # (every question is numbered)
            seen[int(found[1])] = await one_request(session, url, body)
    return seen


def legs(seen: dict[int, tuple[float, list[float]]], marks: dict[str, list[float]]) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {"forward": [], "back_first": [], "back_second": [], "back_third": []}
    for number, (sent, arrivals) in seen.items():
        upstream = marks.get(str(number))
        if upstream is None or len(arrivals) < 3:
            continue
        found["forward"].append(upstream[0] - sent)
        for i, key in enumerate(("back_first", "back_second", "back_third")):
            found[key].append(arrivals[i] - upstream[1 + i])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=200, help="requests per target per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--pace-ms", type=float, default=2.0, help="between an upstream's chunks")
    parser.add_argument("--output", type=Path, default=ROOT / "results" / "forward_latency.json")
    parser.add_argument("--serve", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve_upstream(int(args.serve[0]), int(args.serve[1]), float(args.serve[2]))
        return
    with tempfile.TemporaryDirectory() as tmp:
        results = run(args, Path(tmp))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    up_ports = [free_port(), free_port()]
    upstreams = [f"http://127.0.0.1:{p}" for p in up_ports]
    ports = {name: free_port() for name in ("lean_relay", "corral", "sglang_cache_aware", "vllm_router")}
    spec = tmp / "spec.yaml"
    spec.write_text(
        f"gateway: {{port: {ports['corral']}}}\nauth: {{open: true}}\nmodels:\n  - name: llama\n"
        f"    deployments: [{{engine: external, urls: {json.dumps(upstreams)}}}]\n"
    )
    me = [sys.executable, __file__, "--serve"]
    overhead = [sys.executable, str(ROOT / "benchmarks" / "gateway_overhead.py"), "--serve"]
    procs = {
        **{
            f"upstream{i}": spawn([*me, str(p), str(args.chunks), str(args.pace_ms / 1000)])
            for i, p in enumerate(up_ports)
        },
        "lean_relay": spawn([*overhead, "lean", str(ports["lean_relay"]), *upstreams]),
        "corral": spawn(
            [sys.executable, "-m", "corral.cli", "up", "-f", str(spec), "--log-level", "warning"],
            env={"CORRAL_HOME": str(tmp)},
        ),
    }
    peers = {
        "sglang_cache_aware": (["-m", "sglang_router.launch_router", "--policy", "cache_aware"], "warn"),
        "vllm_router": (["-m", "vllm_router.launch_router", "--policy", "consistent_hash"], "warning"),
    }
    for name, (command, level) in peers.items():
        if importlib.util.find_spec(command[1].split(".")[0]) is not None:
            where = ["--host", "127.0.0.1", "--port", str(ports[name]), "--log-level", level]
            where += ["--prometheus-port", str(free_port()), "--worker-urls", *upstreams]
            procs[name] = spawn([sys.executable, *command, *where])
        else:
            print(
                f"{name} is not installed (pip install -e '.[bench]'): measured without it", file=sys.stderr
            )
    try:
        for url in upstreams:
            wait_http(url + "/health")
        wait_http(f"http://127.0.0.1:{ports['corral']}/ready")
        for name in peers:
            if name in procs:
                wait_http(f"http://127.0.0.1:{ports[name]}/health")
        targets = {"direct": upstreams[0]} | {
            n: f"http://127.0.0.1:{p}" for n, p in ports.items() if n in procs
        }
        trees = {name: _tree(procs[name]) for name in targets if name in procs}
        return asyncio.run(compare(args, targets, upstreams, trees))
    finally:
        stop(*procs.values())


async def compare(
    args: argparse.Namespace,
    targets: dict[str, str],
    upstreams: list[str],
    trees: dict[str, list[psutil.Process]],
) -> dict[str, Any]:
    """Each target's legs and CPU per request (`trees`: each router's processes)."""
    work = Workload(48, 3000)
    found: dict[str, dict[str, list[float]]] = {name: {} for name in targets}
    cpu: dict[str, float] = dict.fromkeys(targets, 0.0)
    for url in targets.values():  # warm up: connections, code paths, every tenant's first request
        await measure(url + "/v1/chat/completions", work, 60)
    await _taken(upstreams)
    for _ in range(args.rounds):
        for name, url in targets.items():
            before = _cpu(trees.get(name, []))
            seen = await measure(url + "/v1/chat/completions", work, args.requests)
            cpu[name] += _cpu(trees.get(name, [])) - before
            for key, values in legs(seen, await _taken(upstreams)).items():
                found[name].setdefault(key, []).extend(values)
    figures = {}
    for name, measured in found.items():
        figures[name] = {
            f"{key}_{p}_us": round(1e6 * _quantile(values, share), 1)
            for key, values in measured.items()
            for p, share in (("p50", 0.5), ("p90", 0.9))
        }
        if name in trees:
            figures[name]["cpu_ms_per_request"] = round(1000 * cpu[name] / (args.rounds * args.requests), 3)
    return {
        "benchmark": "forward_latency",
        **{k: v for k, v in vars(args).items() if k not in ("serve", "output")},
        "targets": figures,
    }


async def _taken(upstreams: list[str]) -> dict[str, list[float]]:
    marks: dict[str, list[float]] = {}
    async with aiohttp.ClientSession() as session:
        for url in upstreams:
            async with session.get(url + "/timings") as response:
                marks.update(await response.json())
    return marks


def _quantile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else float("nan")


if __name__ == "__main__":
    main()
