"""With several gateway workers, every worker runs batch lines on its own share of the slots (each worker's
router holds a share of each replica's), so a batch fills as much of the cluster as with one worker; only
the first worker checks new batches and keeps the queue. Before, only the first worker ran lines, and a
batch used one worker's share: 3 of an 8-slot replica with two workers, against 6 with one."""

from __future__ import annotations

import io
import re
import time
import urllib.request
from pathlib import Path

import openai
import orjson
import pytest

from tests.conftest import cluster_of

pytestmark = pytest.mark.slow  # real engines or servers, or long drills (`make test-fast` skips)

SPEC = """
gateway: {{workers: 2}}
auth: {{open: true}}
limits: {{backend: redis, redis_url: "redis://127.0.0.1:6379/5"}}
store: {{url: "sqlite:///{db}"}}
batch: {{poll_s: 0.1, headroom: 1, max_share: 0.8}}
models:
  - name: m
    arch: llama-3.1-8b
    deployments: [{{engine: sim, gpu: l4, replicas: 1, max_num_seqs: 8, time_scale: 1}}]
"""
RUNNING = re.compile(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)", re.M)


def test_every_worker_runs_batch_lines_on_its_share(tmp_path: Path) -> None:
    with cluster_of(tmp_path, SPEC.format(db=tmp_path / "store.db")) as cluster:
        client = openai.OpenAI(base_url=cluster.base_url, api_key="unused")
        lines = b"".join(
            orjson.dumps(
                {
                    "custom_id": f"b{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": "m",
                        "max_tokens": 200,
                        "messages": [{"role": "user", "content": f"{i}"}],
                    },
                }
            )
            + b"\n"
            for i in range(100)
        )
        uploaded = client.files.create(file=("b.jsonl", io.BytesIO(lines)), purpose="batch")
        client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        engine = cluster.status()["replicas"][0]["url"]
        peak, deadline = 0, time.monotonic() + 15
        while peak < 6 and time.monotonic() < deadline:
            text = urllib.request.urlopen(engine + "/metrics", timeout=5).read().decode()
            match = RUNNING.search(text)
            assert match is not None
            peak = max(peak, int(float(match.group(1))))
            time.sleep(0.2)
        # each worker's share is 4 slots: 0.8 of it, 3, with 1 kept free; both workers' lines on the engine
        assert peak == 6, f"{peak} batch lines ran at once on the 8-slot replica (one worker's share: 3)"
        assert cluster.log.read_text().count("lines queued for m") == 1  # checked once, by the first worker
