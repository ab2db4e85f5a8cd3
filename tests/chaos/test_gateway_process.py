"""The gateway process under stress: SIGTERM while streams run, and a client that reads one byte a second."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest

from ..conftest import RunningCluster, cluster_of

pytestmark = pytest.mark.slow  # real engines or servers, or long drills (`make test-fast` skips)

SPEC = """\
supervisor: {probe_interval: 0.5}
auth: {open: true}
gateway: {shutdown_grace: 20}
models:
  - name: llama-8b
    arch: llama-3.1-8b
    deployments: [{engine: sim, replicas: 2, gpu: h100-sxm, time_scale: 1}]
"""


@pytest.fixture
def sim_cluster(tmp_path: Path) -> Iterator[RunningCluster]:
    with cluster_of(tmp_path, SPEC) as running:
        yield running


async def _stream(client: openai.AsyncOpenAI, started: asyncio.Event) -> tuple[int, str | None]:
    stream = await client.completions.create(model="llama-8b", prompt="Go on:", max_tokens=300, stream=True)
    tokens, finish = 0, None
    async for chunk in stream:
        started.set()
        for choice in chunk.choices:
            tokens += bool(choice.text)
            finish = choice.finish_reason or finish
    return tokens, finish


async def test_sigterm_drains_every_stream_in_flight(sim_cluster: RunningCluster) -> None:
    client = openai.AsyncOpenAI(base_url=sim_cluster.base_url, api_key="none", max_retries=0, timeout=60)
    started = asyncio.Event()
    streams = [asyncio.create_task(_stream(client, started)) for _ in range(16)]
    await asyncio.wait_for(started.wait(), 30)
    await asyncio.sleep(0.2)
    sim_cluster.process.send_signal(signal.SIGTERM)
    results = await asyncio.gather(*streams, return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    assert failures == []
    assert all(finish is not None and tokens > 0 for tokens, finish in results)  # type: ignore[misc]
    assert await asyncio.to_thread(sim_cluster.process.wait, 60) == 0


def test_a_client_reading_one_byte_a_second_costs_others_nothing(sim_cluster: RunningCluster) -> None:
    """The gateway stops reading from the replica when the slow client's socket is full (backpressure), so
    its memory stays put while the simulator has megabytes to send; other clients are served as usual."""
    gateway = psutil.Process(sim_cluster.process.pid)
    before = gateway.memory_info().rss
    port = int(sim_cluster.url.rsplit(":", 1)[1])
    body = json.dumps(
        {"model": "llama-8b", "prompt": "Go on:", "max_tokens": 20000, "stream": True, "ignore_eos": True}
    ).encode()
    slow = socket.create_connection(("127.0.0.1", port))
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    client = openai.OpenAI(base_url=sim_cluster.base_url, api_key="none", max_retries=0, timeout=30)
    peak, latencies = before, []
    try:
        for _ in range(8):
            slow.recv(1)
            started = time.monotonic()
            reply = client.completions.create(model="llama-8b", prompt="Hi", max_tokens=4)
            latencies.append(time.monotonic() - started)
            assert reply.choices[0].text
            peak = max(peak, gateway.memory_info().rss)
            time.sleep(1.0)
    finally:
        slow.close()
    assert max(latencies) < 2.0
    assert peak - before < 30 * 1024 * 1024
