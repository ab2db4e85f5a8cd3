"""Prefill coalescing end to end (`gateway.prefill_coalescing: true`): `corral up` with two simulated
replicas (supervised like vLLM, with vLLM's prefix cache), the default routing policy, and two requests
sharing a long document sent at once.

The second goes to the replica computing the document for the first and waits for that prefill to end, so
the engine computes the document once (its prefix-cache hits count the second request's document tokens);
without the hold both would compute it side by side.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from pathlib import Path

import aiohttp

from ..conftest import cluster_of

DOCUMENT = " ".join(f"clause{i}" for i in range(3000))
# Two simulated L4s in real time: the 3,000-token document takes about half a second to prefill.
FLEET = (
    "supervisor: {probe_interval: 0.5}\nauth: {open: true}\n"
    "models:\n  - name: llama-8b\n    arch: llama-3.1-8b\n"
    "    deployments: [{engine: sim, replicas: 2, gpu: l4, time_scale: 1}]\n"
)


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name))


async def _ask(session: aiohttp.ClientSession, url: str, question: str) -> str:
    body = {
        "model": "llama-8b",
        "max_tokens": 4,
        "stream": True,
        "messages": [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": question}],
    }
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200
        await response.read()
        return response.headers["x-corral-replica"]


async def _two_at_once(url: str) -> list[str]:
    async with aiohttp.ClientSession() as session:
        first = asyncio.create_task(_ask(session, url, "What does clause 7 say?"))
        await asyncio.sleep(0.05)  # the first is being prefilled when the second arrives
        second = asyncio.create_task(_ask(session, url, "And clause 9?"))
        return list(await asyncio.gather(first, second))


def test_a_second_request_waits_for_the_first_ones_prefill_of_their_shared_document(tmp_path: Path) -> None:
    with cluster_of(tmp_path, "gateway: {prefill_coalescing: true}\n" + FLEET) as cluster:
        replicas = asyncio.run(_two_at_once(cluster.url))
        assert replicas[0] == replicas[1]  # the document's replica, not the idle one
        assert _metric(cluster.url, "corral_prefill_holds_total") == 1
        assert _metric(cluster.url, "corral_prefill_hold_seconds_total") > 0.05
        # the engine's own count (scraped every probe interval): the second request found the whole
        # document in its cache, so about half of the tokens the replica was asked to prefill were hits
        deadline = time.monotonic() + 10
        rate = 0.0
        while rate < 0.45 and time.monotonic() < deadline:
            time.sleep(0.2)
            engine = next(r for r in cluster.status()["replicas"] if r["id"] == replicas[0])
            rate = engine["prefix_cache_hit_rate"] or 0.0
        assert rate >= 0.45, rate


def test_without_coalescing_the_second_request_is_not_held(tmp_path: Path) -> None:
    with cluster_of(tmp_path, FLEET) as cluster:
        asyncio.run(_two_at_once(cluster.url))
        assert _metric(cluster.url, "corral_prefill_holds_total") == 0
