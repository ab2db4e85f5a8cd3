"""A replica hung (SIGSTOP) mid-stream: its streams go on elsewhere after the stall timeout, when the
answer is reproducible or the model's spec says `mid_stream_failover: always`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import openai
import pytest

from ..conftest import DATA, RunningCluster, start_cluster

pytestmark = pytest.mark.slow  # real engines or servers, or long drills (`make test-fast` skips)

MAX_TOKENS = 32


def _cluster(tmp_path: Path, failover: str | None = None) -> RunningCluster:
    text = (DATA / "cluster.yaml").read_text() + "gateway: {stall_timeout: 3}\n"
    if failover is not None:
        text = text.replace(
            "  - name: smollm2\n", f"  - name: smollm2\n    mid_stream_failover: {failover}\n"
        )
    spec = tmp_path / "stall.yaml"
    spec.write_text(text)
    return start_cluster(tmp_path, spec=spec)


class _Progress:
    """What each stream has received so far, and which replica serves it (the x-corral-replica header)."""

    def __init__(self, streams: int) -> None:
        self.tokens = [0] * streams
        self.replica = [""] * streams
        self.finished = [False] * streams

    def mid_answer(self) -> dict[str, int]:
        """Replica id -> how many of its streams are well short of their end."""
        counts: dict[str, int] = {}
        for tokens, replica, finished in zip(self.tokens, self.replica, self.finished, strict=True):
            if replica and not finished and 0 < tokens <= MAX_TOKENS // 2:
                counts[replica] = counts.get(replica, 0) + 1
        return counts


async def _complete(
    client: openai.AsyncOpenAI, prompt: str, temperature: float, progress: _Progress, slot: int
) -> tuple[str, str | None]:
    raw = await client.completions.with_raw_response.create(
        model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS, temperature=temperature, stream=True
    )
    progress.replica[slot] = raw.headers.get("x-corral-replica", "")
    text, finish = "", None
    async for chunk in raw.parse():
        for choice in chunk.choices:
            text += choice.text
            progress.tokens[slot] += bool(choice.text)
            finish = choice.finish_reason or finish
    progress.finished[slot] = True
    return text, finish


async def _hang_a_replica_during(
    running: RunningCluster, prompts: list[str], temperature: float
) -> list[tuple[str, str | None]]:
    """Stream every prompt at once, SIGSTOP a replica while streams are mid-answer, return the answers."""
    client = openai.AsyncOpenAI(base_url=running.base_url, api_key="none", max_retries=0, timeout=120)
    progress = _Progress(len(prompts))
    tasks = [
        asyncio.create_task(_complete(client, p, temperature, progress, i)) for i, p in enumerate(prompts)
    ]
    pids = {r["id"]: r["pid"] for r in running.status()["replicas"]}
    victim = None
    deadline = time.monotonic() + 60
    while victim is None and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        busy = progress.mid_answer()
        if busy:  # the replica with the most streams mid-answer, so that at least one is cut
            victim = {"pid": pids[max(busy, key=busy.__getitem__)]}
    assert victim is not None
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        return await asyncio.gather(*tasks)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim["pid"], signal.SIGCONT)


async def test_a_hung_replica_mid_stream_is_left_after_the_stall_timeout(tmp_path: Path) -> None:
    """SIGSTOP keeps the replica's connections open and silent: the gateway gives up on it after
    `gateway.stall_timeout` and continues each completion stream elsewhere."""
    running = _cluster(tmp_path)
    try:
        client = openai.AsyncOpenAI(base_url=running.base_url, api_key="none", max_retries=0, timeout=120)
        # Lists that start with "\n" "\n": re-sent as text they would come back as one "\n\n" token and
        # change the answer; the exact token ids keep it.
        prompts = [f"Count slowly from {i} to {i + 30}:" for i in range(8)]
        unused = _Progress(len(prompts))
        reference = [await _complete(client, p, 0, unused, i) for i, p in enumerate(prompts)]
        results = await _hang_a_replica_during(running, prompts, temperature=0)
        assert [finish for _, finish in results].count(None) == 0
        assert [text for text, _ in results] == [text for text, _ in reference]
        assert "continuing on" in running.log.read_text()
    finally:
        running.stop()


async def test_mid_stream_failover_always_continues_sampled_streams_too(tmp_path: Path) -> None:
    """With `mid_stream_failover: always` in the spec, sampled streams (temperature 0.9, which the default
    would end with a stream_truncated error) are continued too: every stream ends with a finish_reason."""
    running = _cluster(tmp_path, failover="always")
    try:
        prompts = [f"Write a line about the colour number {i}:" for i in range(8)]
        results = await _hang_a_replica_during(running, prompts, temperature=0.9)
        assert [finish for _, finish in results].count(None) == 0
        assert "continuing on" in running.log.read_text()
    finally:
        running.stop()
