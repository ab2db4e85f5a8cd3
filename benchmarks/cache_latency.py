"""What an exact-cache hit costs, and how many engine tokens a repeating workload saves.

Latency (all on this machine): a fast vLLM-style upstream (gateway_overhead.py's: a whole answer, or 64
one-token SSE chunks, at once) serves two models of one `corral up` (open, external deployments), `cached`
(`cache: {exact: true}`, memory store) and `uncached`. One client (aiohttp on uvloop, one kept-alive
connection) sends the same temperature-0 chat request again and again, interleaved: directly to the
upstream, through corral uncached, and through corral as a cache hit. Printed: p50/p99 ms per target, the
hit's p50 against the direct request's (the issue's bound: a hit ≤ 1 ms p50).

Tokens: `corral up` with two simulated Llama-3.1-8B replicas (L4, 10× real time), 400 requests whose
prompts are drawn Zipf(0.8) from 2,000 questions (32% repeats), 8 at a time, with the cache on and
off; the engines' own counters give the prompt and generated tokens they computed.

    .venv/bin/python benchmarks/cache_latency.py [--requests 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvloop
from _harness import free_port, spawn, stop, wait_http

HERE = Path(__file__).resolve().parent
HEADERS = {"Content-Type": "application/json"}


def body(model: str, stream: bool, question: str = "What is the capital of France?") -> bytes:
    messages = [{"role": "user", "content": question}]
    data = {"model": model, "messages": messages, "max_tokens": 64, "temperature": 0, "stream": stream}
    return orjson.dumps(data)


async def once(session: aiohttp.ClientSession, url: str, data: bytes) -> tuple[float, str | None]:
    started = time.perf_counter()
    async with session.post(url, data=data, headers=HEADERS) as response:
        response.raise_for_status()
        await response.read()
        return time.perf_counter() - started, response.headers.get("x-corral-cache")


async def latency(direct: str, gateway: str, requests: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession() as session:
        for stream in (False, True):
            targets = {
                "direct": (direct, body("bench", stream)),
                "corral_uncached": (gateway, body("uncached", stream)),
                "corral_cache_hit": (gateway, body("cached", stream)),
            }
            await once(session, gateway + "/v1/chat/completions", body("cached", stream))  # what hits read
            await asyncio.sleep(0.2)
            times: dict[str, list[float]] = {name: [] for name in targets}
            for _ in range(requests):
                for name, (url, data) in targets.items():
                    took, state = await once(session, url + "/v1/chat/completions", data)
                    if name == "corral_cache_hit" and state != "hit":
                        raise RuntimeError(f"expected a cache hit, got {state}")
                    times[name].append(took * 1000)
            kind = "stream_64_chunks" if stream else "whole"
            out[kind] = {name: _percentiles(values) for name, values in times.items()}
            hit, direct_p50 = out[kind]["corral_cache_hit"]["p50_ms"], out[kind]["direct"]["p50_ms"]
            out[kind]["hit_p50_vs_direct"] = round(hit / direct_p50, 2)
    return out


def _percentiles(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    p99 = values[int(0.99 * len(values))]
    return {"p50_ms": round(statistics.median(values), 3), "p99_ms": round(p99, 3)}


async def zipf_tokens(gateway: str, engines: list[str], requests: int) -> dict[str, float]:
    rng = random.Random(11)
    weights = [1 / (rank**0.8) for rank in range(1, 2001)]
    questions = rng.choices(range(2000), weights=weights, k=requests)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for q in questions:
        queue.put_nowait(q)
    hits = 0

    async def user(session: aiohttp.ClientSession) -> None:
        nonlocal hits
        while not queue.empty():
            q = queue.get_nowait()
            data = body("sim", False, f"Question number {q}: tell me about it.")
            _, state = await once(session, gateway + "/v1/chat/completions", data)
            hits += state == "hit"

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(user(session) for _ in range(8)))
        totals = {"prompt": 0.0, "generated": 0.0}
        for engine in engines:
            async with session.get(engine + "/metrics") as response:
                text = await response.text()
            for line in text.splitlines():
                if line.startswith("vllm:prompt_tokens_total"):
                    totals["prompt"] += float(line.split()[-1])
                elif line.startswith("vllm:generation_tokens_total"):
                    totals["generated"] += float(line.split()[-1])
    return {
        "requests": requests,
        "repeats": requests - len(set(questions)),
        "hits": hits,
        "engine_prompt_tokens": totals["prompt"],
        "engine_generated_tokens": totals["generated"],
    }


def run_latency(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    up, gw = free_port(), free_port()
    serve = [sys.executable, str(HERE / "gateway_overhead.py"), "--serve", "upstream", str(up), "64", "0"]
    upstream = spawn(serve)
    direct = f"http://127.0.0.1:{up}"
    spec = tmp / "latency.yaml"
    external = f"deployments: [{{engine: external, urls: [{direct}]}}]"
    spec.write_text(
        "auth: {open: true}\nmodels:\n"
        f"  - {{name: cached, cache: {{exact: true}}, {external}}}\n"
        f"  - {{name: uncached, {external}}}\n"
    )
    corral = spawn([sys.executable, "-m", "corral.cli", "up", "-f", str(spec), "--port", str(gw)])
    try:
        wait_http(direct + "/health")
        wait_http(f"http://127.0.0.1:{gw}/ready", timeout=120)
        return uvloop.run(latency(direct, f"http://127.0.0.1:{gw}", args.requests))
    finally:
        stop(corral, upstream)


def run_tokens(cached: bool, tmp: Path) -> dict[str, float]:
    port = free_port()
    spec = tmp / f"tokens-{cached}.yaml"
    cache = "cache: {exact: true}, " if cached else ""
    spec.write_text(
        "auth: {open: true}\nmodels:\n"
        f"  - {{name: sim, arch: llama-3.1-8b, {cache}deployments: "
        "[{engine: sim, gpu: l4, replicas: 2, time_scale: 10, max_num_seqs: 16}]}\n"
    )
    corral = spawn([sys.executable, "-m", "corral.cli", "up", "-f", str(spec), "--port", str(port)])
    gateway = f"http://127.0.0.1:{port}"
    try:
        wait_http(gateway + "/ready", timeout=120)
        engines = [r["url"] for r in get_json(gateway + "/corral/status")["replicas"]]
        return uvloop.run(zipf_tokens(gateway, engines, 400))
    finally:
        stop(corral)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="per target and kind (latency)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results: dict[str, Any] = {"latency": run_latency(args, Path(tmp))}
        off, on = run_tokens(False, Path(tmp)), run_tokens(True, Path(tmp))
        results["zipf_tokens"] = {
            "cache_off": off,
            "cache_on": on,
            "engine_tokens_on_vs_off": round(
                (on["engine_prompt_tokens"] + on["engine_generated_tokens"])
                / (off["engine_prompt_tokens"] + off["engine_generated_tokens"]),
                3,
            ),
        }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
