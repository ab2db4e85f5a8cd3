"""Simulated replicas at scale: a fleet of 16 in one process, and `engine: sim` under the supervisor."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import aiohttp
import openai

from corral.cluster import free_port

from ..conftest import CORRAL, DATA, start_cluster


def test_sixteen_replicas_in_one_process(tmp_path: Path) -> None:
    base = free_port()
    process = subprocess.Popen(
        [
            *CORRAL,
            "sim",
            "--model",
            "llama-3.1-8b",
            "--gpu",
            "a100-80gb",
            "--replicas",
            "16",
            "--port",
            str(base),
            "--time-scale",
            "20",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    urls = [f"http://127.0.0.1:{base + i}" for i in range(16)]
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(urls[-1] + "/health", timeout=1)
                break
            except OSError:
                assert time.monotonic() < deadline and process.poll() is None, "fleet did not start"
                time.sleep(0.2)

        async def ask_all() -> list[int]:
            async with aiohttp.ClientSession() as session:

                async def ask(url: str) -> int:
                    body = {"model": "llama-3.1-8b", "prompt": "hello", "max_tokens": 8}
                    async with session.post(url + "/v1/completions", json=body) as response:
                        return (await response.json())["usage"]["completion_tokens"]

                return await asyncio.gather(*(ask(u) for u in urls))

        assert asyncio.run(ask_all()) == [8] * 16
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=15) == 0


def test_supervised_sim_replicas_behind_the_gateway(tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path, spec=DATA / "sim-cluster.yaml")
    try:
        client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0)
        for _ in range(4):
            reply = client.chat.completions.create(
                model="llama-8b", max_tokens=16, messages=[{"role": "user", "content": "hi"}]
            )
            assert reply.usage is not None and reply.usage.completion_tokens == 16
        time.sleep(1.2)  # a probe interval or two: engine metrics are scraped
        replicas = cluster.status()["replicas"]
        assert [r["engine"] for r in replicas] == ["sim", "sim"]
        assert all(r["state"] == "ready" and r["generated_tokens_total"] > 0 for r in replicas)
        shown = subprocess.run(
            [*CORRAL, "status", "--url", cluster.url, "--json"], capture_output=True, text=True
        )
        assert {r["id"] for r in json.loads(shown.stdout)["replicas"]} == {"llama-8b-0", "llama-8b-1"}
    finally:
        assert cluster.stop() == 0
