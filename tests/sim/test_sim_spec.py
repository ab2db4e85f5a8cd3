"""Spec fields that shape a simulated replica, end to end: `corral up` starts the simulator with them and
its vLLM-style metrics show the result (KV blocks follow `gpu_memory_utilization`, as vLLM's do)."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

from tests.conftest import cluster_of

SPEC = """
supervisor: {probe_interval: 0.5}
auth: {open: true}
models:
  - name: half
    arch: llama-3.1-8b
    deployments: [{engine: sim, gpu: h100-sxm, gpu_memory_utilization: 0.5}]
  - name: most
    arch: llama-3.1-8b
    deployments: [{engine: sim, gpu: h100-sxm, gpu_memory_utilization: 0.9}]
"""


def kv_blocks(url: str) -> int:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    found = re.search(r'num_gpu_blocks="(\d+)"', text)
    assert found, "the simulator exports vLLM's cache_config_info"
    return int(found.group(1))


def test_kv_blocks_follow_gpu_memory_utilization(tmp_path: Path) -> None:
    with cluster_of(tmp_path, SPEC) as cluster:
        urls = {r["model"]: r["url"] for r in cluster.status()["replicas"]}
        half, most = kv_blocks(urls["half"]), kv_blocks(urls["most"])
    # H100 80 GB, 8B in bf16 (~16 GB of weights): KV gets 0.5×80−16−overhead vs 0.9×80−16−overhead
    assert 0 < half < most
    assert 1.8 < most / half < 2.6, (half, most)
