"""Replicas killed or hung mid-stream under load: every deterministic stream ends as if nothing happened."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import openai
import pytest

from ..conftest import RunningCluster

pytestmark = pytest.mark.slow  # real engines or servers, or long drills (`make test-fast` skips)

PROMPTS = [f"Tell me one fact about the number {i}." for i in range(16)]
MAX_TOKENS = 16


async def _stream(
    client: openai.AsyncOpenAI, prompt: str, progress: list[int], slot: int
) -> tuple[str, str | None]:
    stream = await client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    text, finish = "", None
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                text += choice.delta.content
                progress[slot] += 1
            finish = choice.finish_reason or finish
    return text, finish


async def test_kill_9_of_a_replica_mid_stream_loses_no_stream(cluster: RunningCluster) -> None:
    client = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="none", max_retries=0, timeout=300)
    unused = [0] * len(PROMPTS)
    reference = await asyncio.gather(*(_stream(client, p, unused, i) for i, p in enumerate(PROMPTS)))
    assert all(finish for _, finish in reference)

    progress = [0] * 64
    tasks = [asyncio.create_task(_stream(client, PROMPTS[i % 16], progress, i)) for i in range(64)]
    deadline = time.monotonic() + 60
    victim = None
    while victim is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        if sum(1 for p in progress if 0 < p < MAX_TOKENS - 2) >= 4:  # streams are mid-answer
            busy = [r for r in cluster.status()["replicas"] if r["outstanding"] and r["pid"]]
            victim = busy[0] if busy else None
    assert victim is not None, "no replica was mid-stream"
    os.kill(victim["pid"], signal.SIGKILL)
    results = await asyncio.gather(*tasks)
    assert [finish for _, finish in results].count(None) == 0
    mismatched = [i for i, (text, _) in enumerate(results) if text != reference[i % 16][0]]
    assert mismatched == [], [(results[i][0], reference[i % 16][0]) for i in mismatched[:3]]
    restarted = next(r for r in cluster.status()["replicas"] if r["id"] == victim["id"])
    assert restarted["restarts"] >= 1
