"""Simulated replicas at scale: a fleet of 16 in one process, and `engine: sim` under the supervisor."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import openai

from ..conftest import CORRAL, DATA, start_cluster


def _read_urls(process: subprocess.Popen[str], count: int, timeout: float) -> list[str]:
    """The URLs `corral sim` prints on stdout, one per line, once every replica listens."""
    stdout = process.stdout
    assert stdout is not None
    with ThreadPoolExecutor(1) as pool:
        lines = pool.submit(lambda: [stdout.readline().strip() for _ in range(count)])
        try:
            urls = lines.result(timeout)
        except TimeoutError:
            process.kill()  # ends the blocked read
            raise AssertionError(f"fleet did not start within {timeout} s") from None
    assert all(urls), f"corral sim exited: {process.stderr.read() if process.stderr else ''}"
    return urls


def test_sixteen_replicas_in_one_process(tmp_path: Path) -> None:
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
            "0",
            "--time-scale",
            "20",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        urls = _read_urls(process, 16, timeout=30)
        assert len(set(urls)) == 16
        with urllib.request.urlopen(urls[-1] + "/health", timeout=5) as response:
            assert response.status == 200

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
        deadline = time.monotonic() + 15  # engine metrics are scraped every probe interval (0.5 s)
        while True:
            replicas = cluster.status()["replicas"]
            assert [r["engine"] for r in replicas] == ["sim", "sim"]
            if all(r["state"] == "ready" and r["generated_tokens_total"] > 0 for r in replicas):
                break
            assert time.monotonic() < deadline, replicas
            time.sleep(0.25)
        shown = subprocess.run(
            [*CORRAL, "status", "--url", cluster.url, "--json"], capture_output=True, text=True
        )
        assert {r["id"] for r in json.loads(shown.stdout)["replicas"]} == {"llama-8b-0", "llama-8b-1"}
    finally:
        assert cluster.stop() == 0
