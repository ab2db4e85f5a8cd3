"""Three times the load a cluster can serve: it says no cleanly and keeps serving what it admits."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import psutil
import pytest

from ..conftest import RunningCluster, cluster_of

pytestmark = pytest.mark.slow  # real engines or servers, or long drills (`make test-fast` skips)

QUEUE_TIMEOUT = 2.0
SPEC = f"""\
auth: {{open: true}}
supervisor: {{probe_interval: 0.5}}
queue: {{max_queued: 16, timeout: {QUEUE_TIMEOUT}}}
models:
  - name: llama-8b
    arch: llama-3.1-8b
    deployments: [{{engine: sim, replicas: 2, gpu: l4, max_num_seqs: 4, time_scale: 10}}]
"""
BODY = {"model": "llama-8b", "prompt": "word " * 64, "max_tokens": 32, "ignore_eos": True}


@pytest.fixture
def cluster_of_eight_slots(tmp_path: Path) -> Iterator[RunningCluster]:
    with cluster_of(tmp_path, SPEC) as running:
        yield running


async def _one(session: aiohttp.ClientSession, url: str) -> tuple[int, bool, float]:
    started = time.monotonic()
    async with session.post(url, json=BODY) as response:
        await response.read()
        return response.status, "Retry-After" in response.headers, time.monotonic() - started


async def test_three_times_capacity(cluster_of_eight_slots: RunningCluster) -> None:
    url = cluster_of_eight_slots.base_url + "/completions"
    gateway = psutil.Process(cluster_of_eight_slots.process.pid)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        served: list[float] = []
        deadline = time.monotonic() + 4

        async def client() -> None:
            while time.monotonic() < deadline:
                status, _, latency = await _one(session, url)
                if status == 200:
                    served.append(latency)

        await asyncio.gather(*(client() for _ in range(16)))
        capacity, service = len(served) / 4, max(served)
        rss_before = gateway.memory_info().rss
        rng, tasks = random.Random(3), []
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            tasks.append(asyncio.create_task(_one(session, url)))
            await asyncio.sleep(rng.expovariate(3 * capacity))
        results = await asyncio.gather(*tasks)
    statuses = {status for status, _, _ in results}
    assert statuses <= {200, 429, 503} and 200 in statuses and 503 in statuses
    assert all(retry for status, retry, _ in results if status != 200)
    admitted = sorted(latency for status, _, latency in results if status == 200)
    assert admitted[-1] <= QUEUE_TIMEOUT + service  # nobody admitted waited past the queue timeout
    assert len(admitted) / 6 >= 0.8 * capacity  # still serving near capacity (benchmarks/overload.py: ≥ 0.9)
    assert gateway.memory_info().rss - rss_before < 50 * 2**20
