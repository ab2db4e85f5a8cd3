"""The gateway in front of the real vLLM (its CPU build, in its own environment), with the openai client."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from corral.engines import parse_vllm_load

from ..conftest import DATA, RunningCluster, start_cluster


@pytest.fixture(scope="module")
def vllm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    running = start_cluster(
        tmp_path_factory.mktemp("vllm"), spec=DATA / "vllm-cluster.yaml", ready_timeout=300
    )
    yield running
    running.stop(timeout=60)


def test_vllm_answers_through_the_gateway(vllm_cluster: RunningCluster) -> None:
    client = openai.OpenAI(base_url=vllm_cluster.base_url, api_key="none", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model="smollm2-vllm",
        temperature=0,
        max_tokens=16,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    text = reply.choices[0].message.content or ""
    assert "Paris" in text, text
    usage = reply.usage
    assert usage is not None and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    stream = client.chat.completions.create(
        model="smollm2-vllm",
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Name three colours."}],
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_vllm_metrics_are_read_into_the_load(vllm_cluster: RunningCluster, tmp_path: Path) -> None:
    (replica,) = vllm_cluster.status()["replicas"]
    assert replica["engine"] == "vllm" and replica["state"] == "ready"
    with urllib.request.urlopen(replica["url"] + "/metrics", timeout=10) as response:
        load = parse_vllm_load(response.read().decode())
    assert load.kv_usage is not None and load.running >= 0
    # The supervisor scrapes once per probe interval: wait for a scrape taken after the tokens above.
    deadline = time.monotonic() + 10
    shown = vllm_cluster.status()["replicas"][0]
    while not shown["generated_tokens_total"] and time.monotonic() < deadline:
        time.sleep(0.5)
        shown = vllm_cluster.status()["replicas"][0]
    assert shown["kv_usage"] is not None
    assert shown["generated_tokens_total"] > 0
    assert shown["engine_ttft_mean_ms"] > 0 and shown["engine_itl_mean_ms"] > 0
