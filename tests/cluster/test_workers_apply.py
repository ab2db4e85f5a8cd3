"""`corral apply` and `corral drain` with `gateway.workers: 2`: the call lands on either worker, which asks
the reconciler in `corral up`'s process over the control socket; both workers then serve the change (a
new model with its routing policy, a removed one gone from /v1/models) and no request fails."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import openai
import pytest

from tests.conftest import CORRAL, RunningCluster, cluster_of, get_json, start_cluster

pytestmark = pytest.mark.slow  # real engines or servers, or long drills (`make test-fast` skips)

SPEC = """
gateway: {{workers: 2}}
supervisor: {{probe_interval: 0.5}}
store: {{url: 'sqlite:///{tmp}/corral.db'}}
limits: {{backend: redis, redis_url: 'redis://127.0.0.1:6379/0'}}
auth: {{open: true}}
models:
  - name: llama-8b
    arch: llama-3.1-8b
    deployments: [{{engine: sim, replicas: {replicas}, gpu: h100-sxm, time_scale: 50}}]
"""
BETA = """
  - name: beta
    arch: llama-3.1-8b
    routing: least_outstanding_requests
    deployments: [{engine: sim, replicas: 1, gpu: l4, time_scale: 50}]
"""


def write(tmp: Path, name: str, replicas: int, beta: bool) -> Path:
    path = tmp / name
    path.write_text(SPEC.format(tmp=tmp, replicas=replicas) + (BETA if beta else ""))
    return path


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CORRAL, *args], capture_output=True, text=True, timeout=120)


def per_worker(cluster: RunningCluster, path: str, tries: int = 80) -> dict[int, dict]:
    """Worker index → its answer to GET path (fresh connections: the kernel picks the worker)."""
    seen: dict[int, dict] = {}
    for _ in range(tries):
        status = get_json(cluster.url + "/corral/status")[1]
        body = get_json(cluster.url + path)[1] if path != "/corral/status" else status
        seen.setdefault(status["worker"]["index"], body)
        if len(seen) == 2:
            break
    return seen


def wait_for(condition: object, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_apply_and_drain_through_gateway_workers(tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path, write(tmp_path, "start.yaml", 2, beta=False))
    stop, failures = threading.Event(), []

    def user() -> None:
        client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0)
        while not stop.is_set():
            try:
                client.chat.completions.create(model="llama-8b", messages=[{"role": "user", "content": "hi"}])
            except openai.APIError as exc:
                failures.append(repr(exc))

    users = [threading.Thread(target=user) for _ in range(3)]
    try:
        for thread in users:
            thread.start()
        grown = run("apply", "-f", str(write(tmp_path, "grow.yaml", 3, beta=True)), "--url", cluster.url)
        assert grown.returncode == 0, grown.stderr
        assert "add_model: beta" in grown.stderr and "scale_up: llama-8b" in grown.stderr

        def both_serve_beta() -> bool:
            views = per_worker(cluster, "/admin/routing")
            return len(views) == 2 and all(
                v["policies"].get("beta") == "least_outstanding_requests"
                and any(r["id"] == "beta-0" and r["state"] == "ready" for r in v["replicas"])
                for v in views.values()
            )

        wait_for(both_serve_beta, "both workers route beta by its own policy")
        for view in per_worker(cluster, "/admin/routing").values():  # each worker mirrors the GPUs held
            held = {r["id"]: r["gpus"] for r in view["replicas"] if r["id"].startswith("llama-8b")}
            assert held == {"llama-8b-0": "0", "llama-8b-1": "1", "llama-8b-2": "2"}
        client = openai.OpenAI(base_url=cluster.base_url, api_key="none")
        for _ in range(6):  # new connections each: both workers answer for beta
            assert client.chat.completions.create(model="beta", messages=[{"role": "user", "content": "hi"}])

        drained = run("drain", "llama-8b-2", "--url", cluster.url, "--grace", "30")
        assert drained.returncode == 0 and "drained llama-8b-2" in drained.stderr, drained.stderr
        shrunk = run("apply", "-f", str(write(tmp_path, "shrink.yaml", 2, beta=False)), "--url", cluster.url)
        assert shrunk.returncode == 0 and "remove_model: beta" in shrunk.stderr, shrunk.stderr
        # llama-8b-2 was drained by hand: the running count is already 2, so nothing else is scaled.
        assert "scale_down" not in shrunk.stderr
        wait_for(
            lambda: (
                {r["id"] for r in get_json(cluster.url + "/corral/status")[1]["replicas"]}
                == {"llama-8b-0", "llama-8b-1"}
            ),
            "the workers' mirrors lost beta-0 and llama-8b-2",
        )
        wait_for(
            lambda: all(
                {m["id"] for m in v["data"]} == {"llama-8b"}
                for v in per_worker(cluster, "/v1/models").values()
            ),
            "beta left both workers' /v1/models",
        )
        routed = write(tmp_path, "routed.yaml", 2, beta=False)
        routed.write_text(
            routed.read_text().replace(
                "gateway: {workers: 2}", "gateway: {workers: 2, routing: power_of_two}"
            )
        )
        changed = run("apply", "-f", str(routed), "--url", cluster.url)
        assert changed.returncode == 0 and "cluster_settings: gateway" in changed.stderr, changed.stderr
        wait_for(
            lambda: all(
                v["policies"]["llama-8b"] == "power_of_two"
                for v in per_worker(cluster, "/admin/routing").values()
            ),
            "both workers route by the new default policy",
        )
        narrow = write(tmp_path, "narrow.yaml", 2, beta=True)  # beta's replica: 1 slot for 2 workers
        narrow.write_text(narrow.read_text().replace("gpu: l4,", "gpu: l4, max_num_seqs: 1,"))
        refused = run("apply", "-f", str(narrow), "--url", cluster.url)
        assert refused.returncode != 0 and "more than the 1 slots" in refused.stderr, refused.stderr
        missing = run("drain", "llama-8b-9", "--url", cluster.url)
        assert missing.returncode == 1 and "404" in missing.stderr and "llama-8b-9" in missing.stderr
    finally:
        stop.set()
        for thread in users:
            thread.join(timeout=60)
        cluster.stop()
    assert failures == []


def test_apply_keeps_a_slot_for_each_worker_auto_started(tmp_path: Path) -> None:
    """`workers: auto` on a server runs one worker per core (2 on the CI machine) and cannot be changed
    live: a spec whose replicas would have fewer slots than the workers running is refused by apply."""
    spec = SPEC.format(tmp=tmp_path, replicas=1).replace("gateway: {workers: 2}", "gateway: {host: 0.0.0.0}")
    spec = spec.replace("auth: {open: true}", "auth: {open: true, open_to_network: true}")
    running = min(os.cpu_count() or 1, 256)  # as corral up resolves auto here
    with cluster_of(tmp_path, spec, "auto.yaml") as cluster:
        workers = {
            get_json(cluster.url + "/corral/status")[1].get("worker", {}).get("index") for _ in range(40)
        }
        assert len(workers - {None}) == running or (running == 1 and workers == {None}), workers
        narrow = tmp_path / "narrow.yaml"
        narrow.write_text(spec.replace("time_scale: 50}", "time_scale: 50, max_num_seqs: 1}"))
        answer = run("apply", "-f", str(narrow), "--url", cluster.url)
        per_process = tmp_path / "memory.yaml"  # limits kept in each worker's memory: a key's RPM × workers
        per_process.write_text(spec.replace("limits: {backend: redis", "limits: {backend: memory"))
        kept_apart = run("apply", "-f", str(per_process), "--url", cluster.url)
    if running > 1:
        assert answer.returncode != 0, answer.stderr
        assert f"by the {running} gateway workers running: workers: {running} is more than" in answer.stderr
        assert kept_apart.returncode != 0 and "needs limits.backend: redis" in kept_apart.stderr
    else:  # one worker: one slot is enough
        assert answer.returncode == 0, answer.stderr
