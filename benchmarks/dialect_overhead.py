"""What the dialects cost the gateway: /v1/responses and /v1/messages against /v1/chat/completions for the
same work, and what a `previous_response_id` lookup adds to a turn.

CPU (the issue's target: each dialect within 1.2x of chat completions, whole and streamed): one fast
vLLM-style upstream (gateway_overhead.py's, run as `gateway_overhead.py --serve upstream PORT 16 0`: a
whole chat completion of 16 tokens, or 16 one-token SSE chunks back to back plus the usage chunk when
`stream_options.include_usage` is asked, then [DONE]) behind one `corral up` in open mode (no keys; one
external deployment, default routing; its SQLite store under a temporary CORRAL_HOME; one gateway process).
The same prompt (~50 words) with 16 output tokens is sent as

    chat       {model, messages: [user], max_tokens: 16} (streamed: with stream_options.include_usage, as
               the official clients' users ask; the dialects ask the engine for usage themselves)
    responses  {model, input: the same text, max_output_tokens: 16, store: false}
    messages   {model, max_tokens: 16, messages: [the same user turn]}

and, apart from the ratio target, `responses_store`: /v1/responses with `store` left at its default (true),
which writes one row per response to the store. Streams are measured twice: `stream`, the 16 tokens back to
back (the gateway reads the whole stream at once: its per-stream work is all there is), and `paced`, from a
second upstream (model `paced`) that writes a token every PACE_MS (10) as an engine streams, so the gateway
reads and writes once per token, at PACED_CONCURRENCY (64) clients. Each (route, kind) point is
REQUESTS requests at CONCURRENCY (aiohttp client on uvloop, kept-alive connections) in each of ROUNDS
interleaved rounds (the routes' order rotated each round); the figure is the median over rounds of the
gateway process's CPU time (user + system, psutil, children included) per request, and its ratio to
chat's (with, for context, requests/s, client p50/p99 and the answer's size in bytes). Every answer is
checked (200, and a stream's closing event: [DONE], response.incomplete/completed, message_stop).

Turn latency (the issue's target: a `previous_response_id` lookup adds <= 1 ms p99, SQLite store): a
first turn is stored (store: true); then TURNS sequential non-streamed requests each, alternating, of the
same second turn told two ways that reach the engine as the same chat request: naming
`previous_response_id` (resolved from the store), or carrying the earlier turn's user and assistant
messages inline. Both send `store: false`, so the difference is the lookup (a thread hop and a SELECT).
Client-side p50/p99 of the whole request.

Lookup (in process, after the gateway is stopped): `ResponseStore.get` on a fresh SQLite store (WAL, as
the gateway opens it) holding 10,000 stored responses shaped like the gateway's, 2,000 lookups of random
ids, timed alone and through `asyncio.to_thread` as the dialect calls it; and 200 `put`s (what `store:
true` adds per response).

Machine: whatever runs it (recorded in the JSON); the published figures came from a 2-core AMD EPYC VM,
with the client, the gateway and the upstream sharing the 2 cores.

    .venv/bin/python benchmarks/dialect_overhead.py [--requests 2000] [--concurrency 8] [--rounds 5]
        [--pace-ms 10] [--paced-concurrency 64] [--tokens 16] [--pin]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psutil
import uvloop
from _harness import free_port, publish, spawn, stop, wait_http
from gateway_overhead import cpu_seconds

HERE = Path(__file__).resolve().parent
TOKENS = 16
TEXT = (
    "Our team is planning a three day trip to the mountains next month and we need a packing list. "
    "Please suggest warm clothing, food that keeps well, basic first aid items, and a few games for the "
    "evenings, keeping everything light enough to carry in one backpack each."
)
FOLLOW_UP = "Thanks. Now shorten that list to the ten most important items, please."
HEADERS = {"Content-Type": "application/json"}
PATHS = {
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "responses_store": "/v1/responses",
    "messages": "/v1/messages",
}


def request_body(route: str, stream: bool, model: str = "bench", tokens: int = TOKENS) -> bytes:
    user = [{"role": "user", "content": TEXT}]
    body: dict[str, Any]
    if route == "chat":
        body = {"model": model, "messages": user, "max_tokens": tokens}
        if stream:
            body["stream_options"] = {"include_usage": True}
    elif route == "responses":
        body = {"model": model, "input": TEXT, "max_output_tokens": tokens, "store": False}
    elif route == "responses_store":  # store left at its default: true
        body = {"model": model, "input": TEXT, "max_output_tokens": tokens}
    else:
        body = {"model": model, "max_tokens": tokens, "messages": user}
    if stream:
        body["stream"] = True
    return orjson.dumps(body)


def answered(route: str, stream: bool, data: bytes) -> bool:
    """Whether an answer is whole: its own shape, or its stream's closing event."""
    if not stream:
        marker = {"chat": b'"choices"', "messages": b'"content"'}.get(route, b'"output"')
        return marker in data
    if route == "chat":
        return data.endswith(b"data: [DONE]\n\n")
    if route == "messages":
        return b"event: message_stop" in data[-200:]
    tail = data[data.rfind(b"event: ") :]
    return tail.startswith((b"event: response.incomplete", b"event: response.completed"))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


# ---- the gateway's CPU per request ----


async def run_load(
    session: aiohttp.ClientSession,
    url: str,
    route: str,
    stream: bool,
    concurrency: int,
    total: int,
    model: str = "bench",
    tokens: int = TOKENS,
) -> dict[str, Any]:
    payload = request_body(route, stream, model, tokens)
    latencies: list[float] = []
    errors: list[str] = []
    sizes: list[int] = []
    remaining = total

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            start = time.perf_counter()
            async with session.post(url, data=payload, headers=HEADERS) as response:
                data = await response.read()
                if response.status != 200 or not answered(route, stream, data):
                    errors.append(f"{response.status}: {data[-300:]!r}")
            sizes.append(len(data))
            latencies.append(time.perf_counter() - start)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    return {
        "n": len(latencies),
        "requests_per_s": len(latencies) / elapsed,
        "p50_ms": 1000 * percentile(latencies, 0.5),
        "p99_ms": 1000 * percentile(latencies, 0.99),
        "response_bytes": statistics.median(sizes),
        "errors": errors,
    }


def tree_cpu(proc: psutil.Process) -> float:
    """CPU seconds of a process and its children."""
    total = cpu_seconds(proc)
    for child in proc.children(recursive=True):
        try:
            total += cpu_seconds(child)
        except psutil.NoSuchProcess:
            pass
    return total


# the kinds of answer measured: (name, stream, the model: its upstream)
KINDS = (("whole", False, "bench"), ("stream", True, "bench"), ("paced", True, "paced"))


async def measure_cpu(args: argparse.Namespace, base: str, gateway: psutil.Process) -> dict[str, Any]:
    routes = list(PATHS)
    kinds = [kind for kind in KINDS if kind[0] != "paced" or args.pace_ms > 0]
    samples: dict[tuple[str, str], list[dict[str, Any]]] = {
        (route, kind[0]): [] for kind in kinds for route in routes
    }
    connector = aiohttp.TCPConnector(limit=0)

    async def load(route: str, kind: tuple[str, bool, str], total: int) -> dict[str, Any]:
        name, stream, model = kind
        concurrency = args.paced_concurrency if name == "paced" else args.concurrency
        return await run_load(
            session, base + PATHS[route], route, stream, concurrency, total, model, args.tokens
        )

    async with aiohttp.ClientSession(connector=connector) as session:
        for kind in kinds:  # warm up connections and each route's code path
            for route in routes:
                warm = await load(route, kind, 200)
                if warm["errors"]:
                    raise RuntimeError(f"{route} {kind[0]}: {warm['errors'][0]}")
        before = tree_cpu(gateway)
        await asyncio.sleep(2)
        idle_ms_per_s = 1000 * (tree_cpu(gateway) - before) / 2
        for round_no in range(args.rounds):
            shift = round_no % len(routes)
            order = routes[shift:] + routes[:shift]
            for kind in kinds:
                for route in order:
                    before = tree_cpu(gateway)
                    result = await load(route, kind, args.requests)
                    result["cpu_ms_per_request"] = 1000 * (tree_cpu(gateway) - before) / result["n"]
                    samples[(route, kind[0])].append(result)
    points_out = []
    for name, stream, _ in kinds:
        chat_cpu = statistics.median(s["cpu_ms_per_request"] for s in samples[("chat", name)])
        for route in routes:
            runs = samples[(route, name)]
            cpu = statistics.median(s["cpu_ms_per_request"] for s in runs)
            errors = [e for s in runs for e in s["errors"]]
            points_out.append(
                {
                    "route": route,
                    "path": PATHS[route],
                    "stream": stream,
                    "kind": name,
                    "cpu_ms_per_request": round(cpu, 4),
                    "cpu_ratio_to_chat": round(cpu / chat_cpu, 3),
                    "cpu_ms_per_request_each_round": [round(s["cpu_ms_per_request"], 4) for s in runs],
                    "requests_per_s": round(statistics.median(s["requests_per_s"] for s in runs), 1),
                    "p50_ms": round(statistics.median(s["p50_ms"] for s in runs), 3),
                    "p99_ms": round(statistics.median(s["p99_ms"] for s in runs), 3),
                    "response_bytes": runs[0]["response_bytes"],
                    "errors": len(errors),
                    **({"first_error": errors[0]} if errors else {}),
                }
            )
    return {"gateway_idle_cpu_ms_per_s": round(idle_ms_per_s, 3), "points": points_out}


# ---- a turn with and without previous_response_id ----


async def measure_turns(base: str, turns: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the figures, the stored first turn's response object: the store benchmark's template)."""
    url = base + "/v1/responses"
    async with aiohttp.ClientSession() as session:
        first = {"model": "bench", "input": TEXT, "max_output_tokens": TOKENS, "store": True}
        async with session.post(url, data=orjson.dumps(first), headers=HEADERS) as response:
            stored = orjson.loads(await response.read())
            if response.status != 200:
                raise RuntimeError(f"the first turn failed: {stored}")
        said = stored["output"][0]["content"][0]["text"]
        chained = {
            "model": "bench",
            "previous_response_id": stored["id"],
            "input": FOLLOW_UP,
            "max_output_tokens": TOKENS,
            "store": False,
        }
        conversation = [
            {"type": "message", "role": "user", "content": TEXT},
            {"type": "message", "role": "assistant", "content": said},
            {"type": "message", "role": "user", "content": FOLLOW_UP},
        ]
        inline = {"model": "bench", "input": conversation, "max_output_tokens": TOKENS, "store": False}
        kinds = {"with_previous_response_id": orjson.dumps(chained), "inline": orjson.dumps(inline)}
        times: dict[str, list[float]] = {k: [] for k in kinds}

        async def once(payload: bytes) -> float:
            start = time.perf_counter()
            async with session.post(url, data=payload, headers=HEADERS) as response:
                data = await response.read()
                if response.status != 200:
                    raise RuntimeError(f"a turn failed: {data!r}")
            return time.perf_counter() - start

        for _ in range(50):  # warm up
            for payload in kinds.values():
                await once(payload)
        for i in range(turns):
            order = list(kinds.items()) if i % 2 == 0 else list(kinds.items())[::-1]
            for name, payload in order:
                times[name].append(await once(payload))
    out: dict[str, Any] = {"turns_each": turns, "store": "sqlite (the gateway's default, WAL)"}
    for name, values in times.items():
        out[name] = {
            "p50_ms": round(1000 * percentile(values, 0.5), 3),
            "p99_ms": round(1000 * percentile(values, 0.99), 3),
            "mean_ms": round(1000 * statistics.fmean(values), 3),
        }
    for q in ("p50_ms", "p99_ms", "mean_ms"):
        added = out["with_previous_response_id"][q] - out["inline"][q]
        out[f"added_{q}"] = round(added, 3)
    return out, stored


# ---- ResponseStore.get in process ----


def measure_store(tmp: Path, template: dict[str, Any], rows: int, lookups: int) -> dict[str, Any]:
    from sqlalchemy.orm import Session

    from corral.store import ResponseStore, open_database
    from corral.store.responses import ResponseRow

    engine = open_database(f"sqlite:///{tmp / 'lookups.db'}")
    store = ResponseStore(engine, ttl_s=30 * 86400)
    rng = random.Random(0)
    items = [
        {
            "id": "msg_" + uuid.uuid4().hex,
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": TEXT}],
        }
    ]
    tenants = [f"tenant{i}" for i in range(20)]
    ids, now = [], time.time()
    with Session(engine) as session, session.begin():  # filled in one transaction (put commits each)
        for _ in range(rows):
            rid = "resp_" + uuid.uuid4().hex
            response = {**template, "id": rid}
            tenant = rng.choice(tenants)
            ids.append((tenant, rid))
            session.add(
                ResponseRow(
                    id=rid,
                    tenant=tenant,
                    key_id=None,
                    model="bench",
                    created_at=now,
                    expires_at=now + store.ttl_s,
                    input_items=orjson.dumps(items).decode(),
                    response=orjson.dumps(response).decode(),
                )
            )
    for tenant, rid in ids[:100]:  # warm up the connection pool and the page cache
        store.get(tenant, rid)
    picks = [rng.choice(ids) for _ in range(lookups)]
    direct = []
    for tenant, rid in picks:
        start = time.perf_counter()
        found = store.get(tenant, rid)
        direct.append(time.perf_counter() - start)
        assert found is not None and found.id == rid

    async def threaded() -> list[float]:
        out = []
        for tenant, rid in picks:
            start = time.perf_counter()
            await asyncio.to_thread(store.get, tenant, rid)
            out.append(time.perf_counter() - start)
        return out

    via_thread = uvloop.run(threaded())
    puts = []
    for _ in range(200):
        response = {**template, "id": "resp_" + uuid.uuid4().hex}
        start = time.perf_counter()
        store.put("tenant0", None, response, items)
        puts.append(time.perf_counter() - start)
    engine.dispose()

    def figures(values: list[float]) -> dict[str, float]:
        return {
            "p50_ms": round(1000 * percentile(values, 0.5), 4),
            "p99_ms": round(1000 * percentile(values, 0.99), 4),
            "mean_ms": round(1000 * statistics.fmean(values), 4),
        }

    return {
        "stored_responses": rows,
        "lookups": lookups,
        "get": figures(direct),
        "get_via_asyncio_to_thread": figures(via_thread),
        "put (200, one commit each)": figures(puts),
    }


# ---- the whole run ----


def machine() -> dict[str, Any]:
    model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu": model, "python": platform.python_version()}


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    up_port, paced_port, port = free_port(), free_port(), free_port()
    upstream, paced = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{paced_port}"
    spec = tmp / "bench.yaml"
    spec.write_text(
        f"gateway: {{port: {port}}}\nauth: {{open: true}}\nmodels:\n"
        f"  - name: bench\n    deployments: [{{engine: external, urls: [{upstream}]}}]\n"
        f"  - name: paced\n    deployments: [{{engine: external, urls: [{paced}]}}]\n"
    )
    serve = [sys.executable, str(HERE / "gateway_overhead.py"), "--serve"]
    upstream_proc = spawn([*serve, "upstream", str(up_port), str(args.tokens), "0"])
    paced_proc = spawn([*serve, "upstream", str(paced_port), str(args.tokens), str(args.pace_ms / 1000)])
    corral = [sys.executable, "-m", "corral.cli", "up", "--log-level", "warning", "-f", str(spec)]
    gateway_proc = spawn(corral, env={"CORRAL_HOME": str(tmp / "home")})
    try:
        wait_http(upstream + "/health")
        wait_http(paced + "/health")
        wait_http(f"http://127.0.0.1:{port}/ready")
        if args.pin:  # the gateway on the last core, the client and the upstreams on the others
            cores = sorted(os.sched_getaffinity(0))
            gateway = psutil.Process(gateway_proc.pid)
            for proc in (gateway, *gateway.children(recursive=True)):
                proc.cpu_affinity(cores[-1:])
            for proc in (psutil.Process(), psutil.Process(upstream_proc.pid), psutil.Process(paced_proc.pid)):
                proc.cpu_affinity(cores[:-1])
        time.sleep(0.5)
        base = f"http://127.0.0.1:{port}"
        started = time.perf_counter()
        cpu = uvloop.run(measure_cpu(args, base, psutil.Process(gateway_proc.pid)))
        cpu_s = time.perf_counter() - started
        turns, template = uvloop.run(measure_turns(base, args.turns))
    finally:
        stop(gateway_proc, upstream_proc, paced_proc)
    lookup = measure_store(tmp, template, args.stored, args.lookups)
    worst = {
        f"{p['route']}_{p['kind']}": p["cpu_ratio_to_chat"]
        for p in cpu["points"]
        if p["route"] in ("responses", "messages")
    }
    return {
        "benchmark": "dialect_overhead",
        "setup": {
            "upstream": f"gateway_overhead.py's scripted upstream, {args.tokens} tokens (whole, or one-token "
            "SSE chunks back to back + usage chunk); 'paced': a second one writing a token every "
            f"{args.pace_ms:g} ms, as an engine streams (model 'paced')",
            "paced_concurrency": args.paced_concurrency,
            "pinned": args.pin,
            "gateway": "corral up, open (no keys), one external deployment, SQLite store, one process",
            "prompt_words": len(TEXT.split()),
            "output_tokens": args.tokens,
            "concurrency": args.concurrency,
            "requests_per_point_per_round": args.requests,
            "rounds": args.rounds,
            "responses_cpu_comparison_uses": "store: false (responses_store: the default, store: true)",
            "cpu_phase_s": round(cpu_s, 1),
            "machine": machine(),
        },
        "cpu": cpu,
        "targets": {
            "cpu_ratio_to_chat_max": 1.2,
            "cpu_ratios": worst,
            "cpu_met": all(r <= 1.2 for r in worst.values()),
            "previous_response_id_added_p99_ms": turns["added_p99_ms"],
            "store_get_p99_ms": lookup["get"]["p99_ms"],
            "store_get_via_thread_p99_ms": lookup["get_via_asyncio_to_thread"]["p99_ms"],
            "lookup_met": lookup["get_via_asyncio_to_thread"]["p99_ms"] <= 1.0,
        },
        "turn_latency": turns,
        "store_lookup": lookup,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000, help="requests per point per round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--tokens", type=int, default=TOKENS, help="output tokens per answer, whole and streamed"
    )
    parser.add_argument(
        "--pace-ms",
        type=float,
        default=10.0,
        help="the paced upstream's time between tokens (0: no paced streams)",
    )
    parser.add_argument(
        "--paced-concurrency", type=int, default=64, help="clients at once for the paced streams"
    )
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (the median is kept)")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the gateway alone on the last CPU core, the client and upstreams on the others (steadier)",
    )
    parser.add_argument("--turns", type=int, default=500, help="sequential turns each, with and without")
    parser.add_argument("--stored", type=int, default=10_000, help="responses in the lookup store")
    parser.add_argument("--lookups", type=int, default=2_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        figures = run(args, Path(tmp))
    publish("dialect_overhead", figures)


if __name__ == "__main__":
    main()
