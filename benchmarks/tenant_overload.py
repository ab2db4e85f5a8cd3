"""Tenant overload: a hog tenant at 10× its share beside an idle tenant's modest load.

Issue #38's done-means: "a hog tenant at 10× its share cannot raise an idle tenant's 503 rate above 0 or its
TTFT p99 by more than 10%". Set-up: `corral up` with a closed gateway (`auth: {open: false, admin_key}`),
its store in a temporary SQLite file, two simulated Llama-3.1-8B replicas on L4s (`engine: sim`, 5× real
time, 4 sequences each: 8 slots), the fair queue at its production shape (`max_queued` 32, `timeout` 3 s).
Tenant keys `bob`, `eve` and `probe` (all priority normal, no limits) are made through `POST /admin/keys`.
Every request is a streamed `/v1/completions` on a 64-word prompt of its own (no prefix-cache hits) asking
for ½ to 1½ × `--max-tokens` (32) tokens; TTFT is the client's time from sending to the first content chunk.

1. Capacity: a closed loop of 2 × slots clients (`probe`'s key) for `--measure` s: requests/s, and the
   median time an answer streams after its first token (how long it holds its slot). Eve's share is half of
   the capacity (two tenants of equal weight).
2. Bob alone: Poisson arrivals at `--bob-load` (0.2) × capacity, for `--duration` s.
3. Bob beside eve at her share: eve sends Poisson arrivals at her share (½ the capacity); after `--ramp` s
   bob sends the same load as in 2 for `--duration` s; then eve stops.
4. Bob beside the hog: the same, eve at `--eve-factor` (10) × her share, i.e. 5× the capacity.

The done-means compares 4 with 3: what eve's excess over her share costs bob. Against 2 (bob alone) the
engine's own batching also counts (bob's prefill joins eve's decodes in the simulator's steps, as on a
GPU), which no admission policy removes while eve uses her share; both ratios are printed.

Bob connects from 127.0.0.2 and eve from 127.0.0.1 (two clients), so the per-address connection cap
(`gateway.max_client_connections`) does not stand between them. `--eve-max-concurrency N` gives eve's key
`max_concurrency: N` (slots kept free for others: what a reserve for idle tenants would buy).

Printed (JSON, also written to results/tenant_overload.json): the set-up; the capacity; the median seconds
an answer streams after its first token (`decode_s_p50`: a full cluster frees a slot every decode_s ÷ slots
seconds on average); offered rates; per phase bob's requests, status counts, 503 rate and TTFT
p50/p90/p99/max (of his 200s, seconds); the hog ÷ at-share and hog ÷ alone TTFT ratios; eve's status
counts and refusal codes; whether the done-means holds (bob's 503 rate 0 beside the hog, TTFT p99
ratio to the at-share phase ≤ 1.10). About 110 s with the defaults.

    .venv/bin/python benchmarks/tenant_overload.py [--duration 30] [--eve-factor 10] [--bob-load 0.2]
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from _harness import free_port, publish, spawn, stop, wait_http

MODEL = "llama-8b"
TTFT_RATIO_TARGET = 1.10
PROMPT_WORDS = 64
WORDS = tuple(
    (
        "the of and to in is that it for on with as was at by be this from or have an are not but which one "
        "all were when we there can more if will about out up so what time has into some them these could"
    ).split()
)


@dataclass
class Answer:
    """One request as its client saw it."""

    status: int
    code: str | None  # the error's code for a refusal
    ttft: float | None  # seconds to the first content chunk (200s only)
    latency: float  # seconds to the end of the answer


@dataclass
class Load:
    """A Poisson stream of requests under one tenant's key, from one local address."""

    key: str
    rate: float
    source: str
    seed: int
    answers: list[Answer] = field(default_factory=list)


def spec(admin_key: str, store: Path, args: argparse.Namespace) -> str:
    return f"""\
auth: {{open: false, admin_key: {admin_key}}}
store: {{url: 'sqlite:///{store}'}}
supervisor: {{probe_interval: 0.5}}
queue: {{max_queued: {args.max_queued}, timeout: {args.queue_timeout}}}
models:
  - name: {MODEL}
    arch: llama-3.1-8b
    routing: {args.routing}
    deployments: [{{engine: sim, replicas: 2, gpu: l4, max_num_seqs: {args.max_num_seqs},
                   time_scale: {args.time_scale}}}]
"""


def make_key(base: str, admin_key: str, tenant: str, max_concurrency: int | None = None) -> str:
    """A new key of `tenant` through the admin API: its secret."""
    fields: dict[str, Any] = {"tenant": tenant}
    if max_concurrency is not None:
        fields["max_concurrency"] = max_concurrency
    request = urllib.request.Request(
        f"{base}/admin/keys",
        data=json.dumps(fields).encode(),
        headers={"Authorization": f"Bearer {admin_key}", "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return str(json.load(response)["key"])


def body(rng: random.Random, max_tokens: int) -> dict[str, Any]:
    """A streamed completion on its own prompt, of between ½ and 1½ × `max_tokens` tokens (answers of one
    length would all end in the same engine step, freeing slots in bursts)."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS))
    tokens = rng.randint(max_tokens // 2, max_tokens * 3 // 2)
    return {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": True}


async def one(session: aiohttp.ClientSession, url: str, key: str, payload: dict[str, Any]) -> Answer:
    started = time.monotonic()
    headers = {"Authorization": f"Bearer {key}"}
    try:
        async with session.post(url, json=payload, headers=headers) as response:
            if response.status != 200:
                try:
                    code = (await response.json(content_type=None))["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    code = None
                return Answer(response.status, code, None, time.monotonic() - started)
            ttft = None
            async for line in response.content:
                if ttft is None and line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    if any(choice.get("text") for choice in chunk.get("choices", ())):
                        ttft = time.monotonic() - started
            return Answer(200, None, ttft, time.monotonic() - started)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Answer(0, type(exc).__name__, None, time.monotonic() - started)


def session(source: str) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, local_addr=(source, 0)),
        timeout=aiohttp.ClientTimeout(total=60),
    )


async def poisson(url: str, load: Load, seconds: float, max_tokens: int) -> None:
    """Open-loop arrivals at `load.rate` for `seconds`; every answer lands in `load.answers`."""
    rng = random.Random(load.seed)
    async with session(load.source) as client:
        tasks = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            tasks.append(asyncio.create_task(one(client, url, load.key, body(rng, max_tokens))))
            await asyncio.sleep(rng.expovariate(load.rate))
        load.answers.extend(await asyncio.gather(*tasks))


async def capacity(url: str, key: str, seconds: float, clients: int, max_tokens: int) -> tuple[float, float]:
    """Requests/s of a saturating closed loop, and the median seconds an answer streams after its first token
    (how long it holds its slot)."""
    rng = random.Random(1)
    served: list[float] = []
    deadline = time.monotonic() + seconds
    async with session("127.0.0.1") as client:

        async def loop() -> None:
            while time.monotonic() < deadline:
                answer = await one(client, url, key, body(rng, max_tokens))
                if answer.status == 200:
                    served.append(answer.latency - (answer.ttft or 0))

        await asyncio.gather(*(loop() for _ in range(clients)))
    return len(served) / seconds, statistics.median(served)


async def with_hog(url: str, bob: Load, eve: Load, args: argparse.Namespace) -> None:
    """Eve hammers from the start; bob runs his load after `args.ramp` s; eve stops when bob is done."""
    hog = asyncio.create_task(poisson(url, eve, args.ramp + args.duration, args.max_tokens))
    await asyncio.sleep(args.ramp)
    await poisson(url, bob, args.duration, args.max_tokens)
    await hog


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(answers: list[Answer]) -> dict[str, Any]:
    statuses = Counter(str(a.status) for a in answers)
    ttfts = [a.ttft for a in answers if a.ttft is not None]
    return {
        "requests": len(answers),
        "statuses": dict(sorted(statuses.items())),
        "rate_503": round(statuses["503"] / len(answers), 4) if answers else None,
        "ttft_s": {
            "p50": round(statistics.median(ttfts), 4) if ttfts else None,
            "p90": round(percentile(ttfts, 0.90), 4) if ttfts else None,
            "p99": round(percentile(ttfts, 0.99), 4) if ttfts else None,
            "max": round(max(ttfts), 4) if ttfts else None,
        },
        "refusal_codes": dict(Counter(a.code for a in answers if a.status != 200)),
    }


def ratio(after: float | None, before: float | None) -> float | None:
    return round(after / before, 3) if after is not None and before else None


def report(
    args: argparse.Namespace,
    cap: float,
    decode_s: float,
    bob: tuple[Load, Load, Load],
    eve_at_share: Load,
    eve: Load,
) -> dict[str, Any]:
    slots = 2 * args.max_num_seqs
    alone, beside, after = (summary(load.answers) for load in bob)
    p99_ratio = ratio(after["ttft_s"]["p99"], beside["ttft_s"]["p99"])
    verdict = {
        "bob_503_rate_with_hog_is_0": after["rate_503"] == 0,
        "bob_ttft_p99_ratio_at_most_1_10": p99_ratio is not None and p99_ratio <= TTFT_RATIO_TARGET,
    }
    served = sum(a.status == 200 for a in eve.answers)
    return {
        "setup": {
            "replicas": f"2 x simulated Llama-3.1-8B on L4, {args.max_num_seqs} sequences each "
            f"({slots} slots), {args.time_scale:g}x real time, routing {args.routing}",
            "queue": {"max_queued": args.max_queued, "timeout_s": args.queue_timeout},
            "gateway": "closed (API keys), store in SQLite; tenants bob and eve, priority normal",
            "eve_max_concurrency": args.eve_max_concurrency,
            "request": f"streamed /v1/completions, {PROMPT_WORDS}-word prompt of its own, "
            f"{args.max_tokens // 2}-{args.max_tokens * 3 // 2} tokens",
            "bob_seconds_per_phase": args.duration,
        },
        "capacity_requests_per_s": round(cap, 2),
        "decode_s_p50": round(decode_s, 3),
        "bob_offered_requests_per_s": round(bob[0].rate, 2),
        "eve_share_requests_per_s": round(cap / 2, 2),
        "eve_offered_requests_per_s": round(eve.rate, 2),
        "bob_alone": alone,
        "bob_beside_eve_at_her_share": beside,
        "bob_beside_eve_at_10x": after,
        "bob_ttft_ratio_10x_vs_at_share": {
            "p50": ratio(after["ttft_s"]["p50"], beside["ttft_s"]["p50"]),
            "p99": p99_ratio,
        },
        "bob_ttft_ratio_10x_vs_alone": {
            "p50": ratio(after["ttft_s"]["p50"], alone["ttft_s"]["p50"]),
            "p99": ratio(after["ttft_s"]["p99"], alone["ttft_s"]["p99"]),
        },
        "eve_at_her_share": summary(eve_at_share.answers),
        "eve_at_10x": summary(eve.answers)
        | {"served_requests_per_s": round(served / (args.ramp + args.duration), 2)},
        "done_means": verdict | {"holds": all(verdict.values())},
    }


def measure(args: argparse.Namespace, base: str, admin_key: str) -> dict[str, Any]:
    """Keys, capacity, then the three phases against the gateway at `base`."""
    url = f"{base}/v1/completions"
    slots = 2 * args.max_num_seqs
    probe_key, bob_key = make_key(base, admin_key, "probe"), make_key(base, admin_key, "bob")
    eve_key = make_key(base, admin_key, "eve", args.eve_max_concurrency)
    cap, decode_s = asyncio.run(capacity(url, probe_key, args.measure, 2 * slots, args.max_tokens))
    bob_rate, share = args.bob_load * cap, cap / 2
    alone = Load(bob_key, bob_rate, "127.0.0.2", seed=11)
    asyncio.run(poisson(url, alone, args.duration, args.max_tokens))
    at_share = (Load(bob_key, bob_rate, "127.0.0.2", seed=11), Load(eve_key, share, "127.0.0.1", seed=23))
    asyncio.run(with_hog(url, *at_share, args))
    hog = (
        Load(bob_key, bob_rate, "127.0.0.2", seed=11),
        Load(eve_key, args.eve_factor * share, "127.0.0.1", seed=23),
    )
    asyncio.run(with_hog(url, *hog, args))
    return report(args, cap, decode_s, (alone, at_share[0], hog[0]), at_share[1], hog[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of bob's load per phase")
    parser.add_argument("--measure", type=float, default=5.0, help="seconds of the capacity measurement")
    parser.add_argument("--ramp", type=float, default=2.0, help="seconds eve hammers before bob starts")
    parser.add_argument("--bob-load", type=float, default=0.2, help="bob's rate, a fraction of capacity")
    parser.add_argument("--eve-factor", type=float, default=10.0, help="eve's rate, a multiple of her share")
    parser.add_argument(
        "--eve-max-concurrency", type=int, default=None, help="eve's key's max_concurrency (default: none)"
    )
    parser.add_argument("--time-scale", type=float, default=5.0, help="the simulator's speed-up")
    parser.add_argument("--max-num-seqs", type=int, default=4, help="sequences per replica")
    parser.add_argument("--max-tokens", type=int, default=32, help="mean tokens per answer")
    parser.add_argument("--max-queued", type=int, default=32)
    parser.add_argument("--routing", default="prefix_affinity", help="the model's routing policy")
    parser.add_argument("--queue-timeout", type=float, default=3.0)
    args = parser.parse_args()
    admin_key = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tenant_overload.yaml"
        path.write_text(spec(admin_key, Path(tmp) / "c.db", args))
        port = free_port()
        gateway = spawn([sys.executable, "-m", "corral.cli", "up", "-f", str(path), "--port", str(port)])
        try:
            wait_http(f"http://127.0.0.1:{port}/ready", timeout=120)
            figures = measure(args, f"http://127.0.0.1:{port}", admin_key)
        finally:
            stop(gateway)
    publish("tenant_overload", figures)


if __name__ == "__main__":
    main()
