"""A batch survives its gateway being killed: a 1,000-line batch runs on `corral up` (simulated replicas)
while `corral up` is `kill -9`ed three times and started again; the batch completes with exactly one
output line per request, none lost, none twice, and `request_counts` that match the files. On SQLite and
on PostgreSQL, and with the lines in Redis Streams."""

from __future__ import annotations

import io
import signal
import time
import uuid
from pathlib import Path

import openai
import orjson
import pytest
import redis

from ..conftest import start_cluster

pytestmark = pytest.mark.slow  # real engines or servers, or long drills (`make test-fast` skips)

LINES = 1000
SPEC = """\
auth: {{open: true}}
store: {{url: "{store}"}}
batch: {{lease_s: 3, poll_s: 0.1, headroom: 0, queue: {queue}, redis_url: "redis://127.0.0.1:6379/3"}}
supervisor: {{probe_interval: 0.5}}
models:
  - name: m
    arch: llama-3.1-8b
    deployments:
      - {{engine: sim, gpu: l4, replicas: 2, max_num_seqs: 8, time_scale: 4}}
"""


def _batch_file() -> bytes:
    return b"".join(
        orjson.dumps(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "m",
                    "max_tokens": 8,
                    "messages": [{"role": "user", "content": f"Item {i}"}],
                },
            }
        )
        + b"\n"
        for i in range(LINES)
    )


@pytest.mark.parametrize("store", ["sqlite", "postgresql", "sqlite+redis"])
def test_a_batch_survives_three_kill_9s_with_no_line_lost_or_doubled(store: str, tmp_path: Path) -> None:
    url = (
        "postgresql://postgres@127.0.0.1:5432/test"
        if store == "postgresql"
        else f"sqlite:///{tmp_path / 'corral.db'}"
    )
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.format(store=url, queue="redis" if store.endswith("redis") else "sql"))
    cluster = start_cluster(tmp_path, spec=spec)
    client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0, timeout=30)
    uploaded = client.files.create(
        file=(f"{uuid.uuid4().hex}.jsonl", io.BytesIO(_batch_file())), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    try:
        for _ in range(3):
            _until_progress(client, batch.id, 100)  # mid-run
            if store.endswith("redis"):  # the lines go through a stream in the Redis named by redis_url
                assert redis.Redis.from_url("redis://127.0.0.1:6379/3").exists("corral:batch:qt:m")
            cluster.stop(signal.SIGKILL)  # no goodbye: leases stay taken until they expire
            cluster = start_cluster(tmp_path, spec=spec)
            client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0, timeout=30)
        _until(lambda: client.batches.retrieve(batch.id).status == "completed", 300)
        final = client.batches.retrieve(batch.id)
        assert final.request_counts is not None
        assert (final.request_counts.total, final.request_counts.completed, final.request_counts.failed) == (
            LINES,
            LINES,
            0,
        )
        output = [
            orjson.loads(line) for line in client.files.content(final.output_file_id).read().splitlines()
        ]  # type: ignore[arg-type]
        ids = [line["custom_id"] for line in output]
        assert len(ids) == LINES and len(set(ids)) == LINES  # none lost, none twice
        assert set(ids) == {f"line-{i}" for i in range(LINES)}
        assert all(line["response"]["status_code"] == 200 for line in output)
        assert final.error_file_id is None
    finally:
        cluster.stop()


def _completed(client: openai.OpenAI, batch_id: str) -> int:
    counts = client.batches.retrieve(batch_id).request_counts
    return counts.completed if counts is not None else 0


def _until_progress(client: openai.OpenAI, batch_id: str, lines: int, within: float = 120) -> None:
    start = _completed(client, batch_id)
    deadline = time.monotonic() + within
    while _completed(client, batch_id) < start + lines:
        assert time.monotonic() < deadline, "the batch made no progress"
        time.sleep(0.2)


def _until(condition: object, within: float) -> None:
    deadline = time.monotonic() + within
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)
