"""A replica hung (SIGSTOP) mid-stream: its deterministic streams go on elsewhere after the stall timeout."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import openai

from ..conftest import DATA, start_cluster

MAX_TOKENS = 16


async def test_a_hung_replica_mid_stream_is_left_after_the_stall_timeout(tmp_path: Path) -> None:
    """SIGSTOP keeps the replica's connections open and silent: the gateway gives up on it after
    `gateway.stall_timeout` and continues each completion stream elsewhere."""
    spec = tmp_path / "stall.yaml"
    spec.write_text((DATA / "cluster.yaml").read_text() + "gateway: {stall_timeout: 3}\n")
    running = start_cluster(tmp_path, spec=spec)
    try:
        client = openai.AsyncOpenAI(base_url=running.base_url, api_key="none", max_retries=0, timeout=120)
        # Lists that start with "\n" "\n": re-sent as text they would come back as one "\n\n" token and
        # change the answer; the exact token ids keep it.
        prompts = [f"Count slowly from {i} to {i + 30}:" for i in range(8)]

        async def complete(prompt: str, progress: list[int], slot: int) -> tuple[str, str | None]:
            stream = await client.completions.create(
                model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
            )
            text, finish = "", None
            async for chunk in stream:
                for choice in chunk.choices:
                    text += choice.text
                    progress[slot] += bool(choice.text)
                    finish = choice.finish_reason or finish
            return text, finish

        unused = [0] * 8
        reference = [await complete(p, unused, i) for i, p in enumerate(prompts)]
        progress = [0] * 8
        tasks = [asyncio.create_task(complete(p, progress, i)) for i, p in enumerate(prompts)]
        victim = None
        deadline = time.monotonic() + 60
        while victim is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            if sum(1 for p in progress if 0 < p < MAX_TOKENS - 2) >= 2:
                busy = [r for r in running.status()["replicas"] if r["outstanding"] and r["pid"]]
                victim = busy[0] if busy else None
        assert victim is not None
        os.kill(victim["pid"], signal.SIGSTOP)
        try:
            results = await asyncio.gather(*tasks)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim["pid"], signal.SIGCONT)
        assert [finish for _, finish in results].count(None) == 0
        assert [text for text, _ in results] == [text for text, _ in reference]
        assert "continuing on" in running.log.read_text()
    finally:
        running.stop()
