"""`engine: external`: servers corral does not start, one replica per URL, routed to like its own."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from ..conftest import CORRAL, cluster_of

FLEET = ["--replicas", "3", "--port", "0", "--time-scale", "50"]


@contextlib.contextmanager
def _fleet() -> Iterator[list[str]]:
    """Three simulated servers (`corral sim`), their URLs."""
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
        yield urls
    finally:
        os.killpg(fleet.pid, signal.SIGINT)
        fleet.wait(timeout=20)


def _ask(url: str) -> str:
    body = json.dumps({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    request = urllib.request.Request(
        url + "/v1/chat/completions", body.encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        return str(response.headers["x-corral-replica"])


def test_every_url_of_an_external_deployment_is_a_replica_that_serves(tmp_path: Path) -> None:
    with _fleet() as urls:
        spec = (
            "gateway: {routing: round_robin}\nauth: {open: true}\n"
            f"models:\n  - name: m\n    deployments: [{{engine: external, urls: {json.dumps(urls)}}}]\n"
        )
        with cluster_of(tmp_path, spec) as cluster:
            replicas = cluster.status()["replicas"]
            assert sorted(r["url"] for r in replicas) == sorted(urls)
            served = Counter(_ask(cluster.url) for _ in range(6))
            assert sorted(served.values()) == [2, 2, 2], served  # round robin over all three
            # drained, then the same spec applied again: the one missing URL comes back, once
            drain = [*CORRAL, "drain", replicas[0]["id"], "--url", cluster.url, "--grace", "5"]
            subprocess.run(drain, check=True, capture_output=True, timeout=60)
            assert len(cluster.status()["replicas"]) == 2
            apply = [*CORRAL, "apply", "-f", str(tmp_path / "spec.yaml"), "--url", cluster.url]
            subprocess.run(apply, check=True, capture_output=True, timeout=60)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                now = cluster.status()["replicas"]
                if len(now) >= 3 and all(r["state"] == "ready" for r in now):
                    break
                time.sleep(0.2)
            assert sorted(r["url"] for r in cluster.status()["replicas"]) == sorted(urls)


def test_a_new_url_list_rolls_out_to_a_replica_per_url(tmp_path: Path) -> None:
    with _fleet() as urls:
        head = (
            "auth: {open: true}\nmodels:\n  - name: m\n    rollout: {steps: [1.0], step_s: 0.5}\n"
            "    deployments: [{engine: external, urls: "
        )
        with cluster_of(tmp_path, head + json.dumps(urls[:2]) + "}]\n") as cluster:
            wider = tmp_path / "wider.yaml"
            wider.write_text(head + json.dumps(urls) + "}]\n")
            apply = [*CORRAL, "apply", "-f", str(wider), "--url", cluster.url]
            applied = subprocess.run(apply, check=True, capture_output=True, text=True, timeout=60)
            deadline = time.monotonic() + 60
            seen: list[str] = []
            while time.monotonic() < deadline:
                now = cluster.status()["replicas"]
                seen = sorted(r["url"] for r in now if r["state"] == "ready")
                if seen == sorted(urls) and len(now) == 3:
                    break
                time.sleep(0.3)
            assert seen == sorted(urls), (applied.stdout, applied.stderr, cluster.status())
            assert _ask(cluster.url)
