"""`corral top` against a running cluster: the replica table and live rates from two scrapes."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.conftest import CORRAL, RunningCluster, cluster_of

SPEC = """
supervisor: {probe_interval: 0.5}
auth: {open: true}
models:
  - name: llama-8b
    arch: llama-3.1-8b
    deployments:
      - {engine: sim, replicas: 2, gpu: h100-sxm, time_scale: 20}
"""


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    with cluster_of(tmp_path_factory.mktemp("top"), SPEC) as running:
        yield running


def top(url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CORRAL, "top", "--url", url, *extra], capture_output=True, text=True, timeout=60, env=None
    )


@pytest.mark.slow
def test_top_shows_replicas_and_live_rates(sims: RunningCluster) -> None:
    stop = threading.Event()

    def load() -> None:
        client = openai.OpenAI(base_url=sims.base_url, api_key="none")
        while not stop.is_set():
            for _ in client.chat.completions.create(
                model="llama-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=16, stream=True
            ):
                pass

    users = [threading.Thread(target=load) for _ in range(4)]
    for thread in users:
        thread.start()
    try:
        time.sleep(1)
        result = top(sims.url, "--interval", "1", "--iterations", "3")
    finally:
        stop.set()
        for thread in users:
            thread.join(timeout=30)
    assert result.returncode == 0, result.stderr
    frame = result.stderr
    for replica in ("llama-8b-0", "llama-8b-1"):
        assert re.search(rf"{replica}\s+ready", frame), frame
    header = next(line for line in frame.splitlines() if line.startswith("replica"))
    assert header.split() == ["replica", "state", "reqs", "run", "wait", "KV", "hit", "restarts", "served"]
    assert "…" not in frame  # at 80 columns nothing is cut (the last header was)
    rate = re.search(r"requests/s (\d+\.\d)", frame)
    assert rate and float(rate.group(1)) > 0, frame
    ttft = re.search(r"TTFT p50/p95 (\d+) ms/(\d+) ms", frame)
    assert ttft and 0 < int(ttft.group(1)) <= int(ttft.group(2)), frame


def test_top_without_a_gateway_is_one_line(tmp_path: Path) -> None:
    result = top("http://127.0.0.1:9", "--iterations", "1")
    assert result.returncode == 1
    assert result.stderr.startswith("error: no corral gateway answers at http://127.0.0.1:9")
    assert "Traceback" not in result.stderr
