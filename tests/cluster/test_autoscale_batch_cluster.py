"""A batch on a running cluster (`corral up`, a gateway of two workers: each worker's runner reports to the
supervisor's autoscaler), for a model autoscaled from zero: the batch wakes one replica and runs on it to
the end, and the autoscaler adds none for its lines (they fill 0.8 of the slots, over the 0.7 target:
before, each interval added a replica they filled)."""

from __future__ import annotations

import io
import time
from pathlib import Path

import openai
import orjson
import pytest

from tests.conftest import cluster_of

pytestmark = pytest.mark.slow  # real engines or servers, or long drills (`make test-fast` skips)

SPEC = """
gateway: {{workers: {workers}}}
auth: {{open: true}}
limits: {{backend: redis, redis_url: "redis://127.0.0.1:6379/5"}}
store: {{url: "sqlite:///{db}"}}
batch: {{poll_s: 0.1}}
models:
  - name: m
    arch: llama-3.1-8b
    deployments:
      - engine: sim
        gpu: l4
        replicas: 0
        max_num_seqs: 8
        time_scale: 1
        autoscale: {{min_replicas: 0, max_replicas: 4, interval_s: 0.5, down_cooldown_s: 2, hold_s: 60}}
"""


@pytest.mark.parametrize("workers", [2])
def test_a_batch_wakes_one_replica_of_a_model_at_zero_and_adds_none(tmp_path: Path, workers: int) -> None:
    with cluster_of(tmp_path, SPEC.format(workers=workers, db=tmp_path / "store.db")) as cluster:
        assert cluster.status()["replicas"] == []
        client = openai.OpenAI(base_url=cluster.base_url, api_key="unused")
        body = {"model": "m", "max_tokens": 25, "messages": [{"role": "user", "content": "hi"}]}
        line = {"method": "POST", "url": "/v1/chat/completions", "body": body}
        lines = b"".join(orjson.dumps({"custom_id": f"b{i}", **line}) + b"\n" for i in range(24))
        uploaded = client.files.create(file=("b.jsonl", io.BytesIO(lines)), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        most, deadline = 0, time.monotonic() + 120
        while (found := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired"):
            assert time.monotonic() < deadline, found.request_counts
            most = max(most, len(cluster.status()["replicas"]))
            time.sleep(0.2)
        assert found.status == "completed" and found.request_counts is not None
        assert found.request_counts.completed == 24
        assert most == 1, [e["message"] for e in cluster.status()["events"] if e["kind"] == "scale"]
