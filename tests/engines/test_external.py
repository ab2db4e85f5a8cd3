"""`engine: external`: servers corral does not start, one replica per URL, routed to like its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request
from collections import Counter
from pathlib import Path

from ..conftest import CORRAL, cluster_of

FLEET = ["--replicas", "3", "--port", "0", "--time-scale", "50"]


def _ask(url: str) -> str:
    body = json.dumps({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    request = urllib.request.Request(
        url + "/v1/chat/completions", body.encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        return str(response.headers["x-corral-replica"])


def test_every_url_of_an_external_deployment_is_a_replica_that_serves(tmp_path: Path) -> None:
    fleet = subprocess.Popen(
        [*CORRAL, "sim", "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--served-name", "m", *FLEET],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert fleet.stdout is not None
        urls = [fleet.stdout.readline().decode().strip() for _ in range(3)]
        assert all(u.startswith("http://") for u in urls), urls
        spec = (
            "gateway: {routing: round_robin}\nauth: {open: true}\n"
            f"models:\n  - name: m\n    deployments: [{{engine: external, urls: {json.dumps(urls)}}}]\n"
        )
        with cluster_of(tmp_path, spec) as cluster:
            replicas = cluster.status()["replicas"]
            assert sorted(r["url"] for r in replicas) == sorted(urls)
            served = Counter(_ask(cluster.url) for _ in range(6))
            assert sorted(served.values()) == [2, 2, 2], served  # round robin over all three
    finally:
        os.killpg(fleet.pid, signal.SIGINT)
        fleet.wait(timeout=20)
