"""What a running batch costs interactive traffic, and how much of the idle capacity it uses.

Setup (all on this machine): `corral up` with two simulated Llama-3.1-8B replicas on L4 (64 sequences
each, vLLM's scheduler timed by the perf model in real time), `batch.headroom: 1`. Interactive load:
streamed chat requests (200-token prompts, 32 output tokens) arriving as a Poisson process, for
`--seconds`, measuring each request's time to first token. Three runs, each on a fresh cluster:
1. interactive only;
2. interactive with a large batch (short chat requests, 16 output tokens) submitted first;
3. the batch alone, for the same time: the batch's rate on the whole cluster.
Printed: interactive p50/p99 TTFT in runs 1 and 2 (the issue's bound: p99 within 10%), the batch's lines
per second in runs 2 and 3, and the share of the idle capacity the batch used in run 2, in generated
tokens per second: the batch's rate in run 2 over (run 3's rate − the interactive rate of run 1).

    .venv/bin/python benchmarks/batch_interference.py [--seconds 60] [--rate 6]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai
import orjson
from _harness import free_port, spawn, stop, wait_http

SPEC = """\
auth: {open: true}
store: {url: "sqlite:///%(db)s"}
batch: {headroom: %(headroom)s, max_share: %(share)s, poll_s: 0.1}
models:
  - name: m
    arch: llama-3.1-8b
    deployments: [{engine: sim, gpu: l4, replicas: 2, max_num_seqs: 64, time_scale: 1}]
"""
HEADROOM = [1]  # batch.headroom (--headroom)
SHARE = [0.8]  # batch.max_share (--max-share)
BATCH_TOKENS = 16  # generated per batch line (the simulator generates exactly max_tokens)
INTERACTIVE_TOKENS = 32


def batch_file(lines: int) -> bytes:
    return b"".join(
        orjson.dumps(
            {
                "custom_id": f"b{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "m",
                    "max_tokens": BATCH_TOKENS,
                    "messages": [{"role": "user", "content": f"Summarise {i}."}],
                },
            }
        )
        + b"\n"
        for i in range(lines)
    )


async def interactive(base: str, seconds: float, rate: float) -> dict[str, Any]:
    client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=120)
    rng = random.Random(5)
    system = " ".join(f"rule{i}" for i in range(150))  # a shared system prompt, then each user's own
    ttfts: list[float] = []

    async def one() -> None:
        started = time.perf_counter()
        first = None
        stream = await client.chat.completions.create(
            model="m",
            max_tokens=INTERACTIVE_TOKENS,
            stream=True,
            messages=[
                {"role": "system", "content": system},
                {"role": "user", "content": " ".join(f"q{rng.randrange(10**6)}" for _ in range(50))},
            ],
        )
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - started
        ttfts.append(first if first is not None else time.perf_counter() - started)

    tasks = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        tasks.append(asyncio.create_task(one()))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    ordered = sorted(ttfts)
    return {
        "requests": len(ordered),
        "ttft_p50_ms": round(statistics.median(ordered) * 1000, 1),
        "ttft_p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000, 1),
        "generated_tokens_per_s": round(len(ordered) * INTERACTIVE_TOKENS / seconds, 1),
    }


def completed(client: openai.OpenAI, batch_id: str) -> int:
    counts = client.batches.retrieve(batch_id).request_counts
    return counts.completed if counts else 0


def run(
    tmp: Path, name: str, seconds: float, rate: float, with_batch: bool, with_interactive: bool
) -> dict[str, Any]:
    port = free_port()
    spec = tmp / f"{name}.yaml"
    capped = with_interactive  # the batch alone measures the whole cluster: no headroom, every slot
    settings = {"headroom": HEADROOM[0], "share": SHARE[0]} if capped else {"headroom": 0, "share": 1.0}
    spec.write_text(SPEC % {"db": tmp / f"{name}.db", **settings})
    corral = spawn([sys.executable, "-m", "corral.cli", "up", "-f", str(spec), "--port", str(port)])
    base = f"http://127.0.0.1:{port}/v1"
    try:
        wait_http(f"http://127.0.0.1:{port}/ready", timeout=120)
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)
        result: dict[str, Any] = {}
        batch_id = None
        if with_batch:
            uploaded = client.files.create(file=("b.jsonl", io.BytesIO(batch_file(20_000))), purpose="batch")
            batch_id = client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            ).id
            time.sleep(3)  # the batch reaches its steady share of the slots
            start_lines, started = completed(client, batch_id), time.perf_counter()
        if with_interactive:
            result["interactive"] = asyncio.run(interactive(base, seconds, rate))
        else:
            time.sleep(seconds)
        if batch_id is not None:
            lines = completed(client, batch_id) - start_lines
            result["batch_lines_per_s"] = round(lines / (time.perf_counter() - started), 2)
            client.batches.cancel(batch_id)
        return result
    finally:
        stop(corral)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=6.0, help="interactive requests per second")
    parser.add_argument("--headroom", type=int, default=1, help="batch.headroom: slots kept from batches")
    parser.add_argument("--max-share", type=float, default=0.8, help="batch.max_share")
    args = parser.parse_args()
    HEADROOM[0], SHARE[0] = args.headroom, args.max_share
    with tempfile.TemporaryDirectory() as tmp:
        alone = run(
            Path(tmp), "interactive", args.seconds, args.rate, with_batch=False, with_interactive=True
        )
        mixed = run(Path(tmp), "mixed", args.seconds, args.rate, with_batch=True, with_interactive=True)
        batch = run(Path(tmp), "batch", args.seconds, args.rate, with_batch=True, with_interactive=False)
    full = batch["batch_lines_per_s"] * BATCH_TOKENS  # the cluster's output rate on batch lines alone
    interactive_rate = alone["interactive"]["generated_tokens_per_s"]
    batch_rate = mixed["batch_lines_per_s"] * BATCH_TOKENS
    report = {
        "setup": "corral up, 2 simulated Llama-3.1-8B replicas on L4 (64 seqs each, real time), "
        f"batch.headroom {HEADROOM[0]}, batch.max_share {SHARE[0]} (the batch-alone run: every slot)",
        "interactive_only": alone["interactive"],
        "interactive_with_batch": mixed["interactive"],
        "ttft_p99_ratio": round(mixed["interactive"]["ttft_p99_ms"] / alone["interactive"]["ttft_p99_ms"], 3),
        "batch_lines_per_s_mixed": mixed["batch_lines_per_s"],
        "batch_lines_per_s_alone": batch["batch_lines_per_s"],
        "generated_tokens_per_s": {
            "batch_alone": round(full, 1),
            "interactive_alone": interactive_rate,
            "batch_mixed": round(batch_rate, 1),
        },
        "idle_capacity_share_used": round(batch_rate / (full - interactive_rate), 3),
        "bounds": {"ttft_p99_ratio_max": 1.10, "idle_capacity_share_min": 0.80},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
