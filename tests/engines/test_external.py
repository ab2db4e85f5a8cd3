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

import pytest

from ..conftest import CORRAL, chat, cluster_of

pytestmark = pytest.mark.slow  # real engines or servers, or long drills (`make test-fast` skips)

FLEET = ["--replicas", "3", "--port", "0", "--time-scale", "50"]


@contextlib.contextmanager
def _fleet(*options: str) -> Iterator[list[str]]:
    """Three simulated servers (`corral sim`), their URLs."""
    fleet = subprocess.Popen(
        [
            *CORRAL,
            "sim",
            "--model",
            "llama-3.1-8b",
            "--gpu",
            "h100-sxm",
            "--served-name",
            "m",
            *FLEET,
            *options,
        ],
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


def _spec(urls: list[str], settings: str = "", events: list[str] | None = None) -> str:
    """An open cluster with one model served by the external servers at `urls` (publishing their KV
    events at `events`)."""
    publishers = f", kv_events_urls: {json.dumps(events)}" if events else ""
    deployment = f"{{engine: external, urls: {json.dumps(urls)}{publishers}}}"
    return f"auth: {{open: true}}\n{settings}models:\n  - name: m\n    deployments: [{deployment}]\n"


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
        with cluster_of(tmp_path, _spec(urls, "gateway: {routing: round_robin}\n")) as cluster:
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


def test_an_external_vllm_style_server_s_kv_cache_bounds_what_routing_counts_cached(tmp_path: Path) -> None:
    """An external server that publishes vLLM's metrics (here corral's simulator) is scraped like a started
    engine: its KV cache's size comes from `vllm:cache_config_info`, and the prefix index bounds what it
    counts as cached there by it, in blocks of the engine's tokens learnt from the answers' usage."""
    from corral.engines import parse_vllm_load

    from ..conftest import get_json

    with _fleet() as urls:
        with cluster_of(tmp_path, _spec(urls, "supervisor: {probe_interval: 0.2}\n")) as cluster:
            with urllib.request.urlopen(urls[0] + "/metrics", timeout=5) as response:
                capacity = parse_vllm_load(response.read().decode()).kv_capacity_tokens
            assert capacity is not None and capacity > 10_000  # an H100's cache for an 8B model
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                shown = [r["kv_capacity_tokens"] for r in cluster.status()["replicas"]]
                if shown == [capacity] * 3:
                    break
                time.sleep(0.1)
            assert shown == [capacity] * 3
            ratios = []
            for tenant in range(3):
                # two-letter words: about 43 of the simulator's tokens per 128 bytes, far from the 32 assumed
                words = [f"{a}{b}" for a in "abcdefgh" for b in "abcdefghij"]
                document = f"Tenant {tenant}: " + " ".join(words * 20)
                usage = chat(cluster.url, "m", document)[0]["usage"]
                ratios.append(usage["prompt_tokens"] / (len(document) / 128))
            index = get_json(cluster.url + "/admin/routing")[1]["prefix_index"]["m"]
            learnt = index["tokens_per_block"]
            assert learnt > 38  # learnt from the answers' usage, not the 32 assumed before any came
            assert abs(learnt - sum(ratios) / 3) < 0.1 * learnt  # (the chat template's few tokens aside)
            held = index["replicas"]
            assert sorted(held) == sorted(r["id"] for r in cluster.status()["replicas"])
            (cache_blocks,) = {entry["cache_blocks"] for entry in held.values()}
            assert cache_blocks == pytest.approx(capacity / learnt, rel=0.001)  # (learnt: rounded)
            assert sum(entry["blocks"] for entry in held.values()) >= 3 * (len(document) // 128)


def test_draining_an_external_server_waits_for_this_gateway_s_requests_only(tmp_path: Path) -> None:
    """An external server may serve other clients too: their requests do not hold a drain up to its grace."""
    import threading

    with _fleet() as urls:
        with cluster_of(tmp_path, _spec(urls, "supervisor: {probe_interval: 0.2}\n")) as cluster:
            (busy,) = [r for r in cluster.status()["replicas"] if r["url"] == urls[0]]
            body = {"model": "m", "max_tokens": 60_000, "prompt": "Once upon a time"}  # about 8 s here
            request = urllib.request.Request(
                urls[0] + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            other = threading.Thread(target=lambda: urllib.request.urlopen(request, timeout=60).read())
            other.start()  # another client's request, straight to the server
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                (shown,) = [r for r in cluster.status()["replicas"] if r["id"] == busy["id"]]
                if shown["running"]:
                    break
                time.sleep(0.1)
            assert shown["running"] == 1  # the gateway sees it in the server's metrics
            began = time.monotonic()
            drain = [*CORRAL, "drain", busy["id"], "--url", cluster.url, "--grace", "30"]
            subprocess.run(drain, check=True, capture_output=True, timeout=60)
            assert time.monotonic() - began < 5  # not until the other client's request ends
            assert other.is_alive()
            other.join(timeout=60)


def test_an_external_server_s_kv_events_are_followed_at_its_publisher(tmp_path: Path) -> None:
    """Servers that publish their KV-cache events themselves (`corral sim --kv-events-endpoint tcp://*:P`
    binds P, P+1, P+2, as vLLM's `--kv-events-config` with a wildcard endpoint binds): `kv_events_urls`
    names each one's publisher, in the order of `urls`, and the supervisor subscribes."""
    port = _free_ports(3)
    with _fleet("--kv-events-endpoint", f"tcp://*:{port}") as urls:
        events = [f"tcp://127.0.0.1:{port + i}" for i in range(3)]
        with cluster_of(tmp_path, _spec(urls, "supervisor: {probe_interval: 0.2}\n", events)) as cluster:
            document = "A tenant's handbook: " + " ".join(f"rule{i}" for i in range(400))
            replica = chat(cluster.url, "m", document)[1]
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                held = {r["id"]: r["kv_cached_tokens"] for r in cluster.status()["replicas"]}
                if held[replica]:
                    break
                time.sleep(0.1)
            assert held[replica] >= 400  # the document's blocks, by the server's own events
            assert all(tokens == 0 for rid, tokens in held.items() if rid != replica)  # followed, empty


def _free_ports(n: int) -> int:
    """A port with the n - 1 after it free too."""
    import socket

    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            base = int(sock.getsockname()[1])
        try:
            for i in range(n):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue


def test_an_external_server_s_key_goes_with_its_replicas() -> None:
    """`engine_api_key` on an external deployment: the gateway sends it to those servers (a keyed vLLM
    of its own, another team's), as it does to corral's vLLM replicas."""
    from corral.config import DeploymentSpec, ModelSpec, Paths
    from corral.engines import engine_named

    urls = ["http://a:8000", "http://b:8000"]
    deployment = DeploymentSpec(engine="external", urls=urls, engine_api_key="k1")
    model = ModelSpec(name="m", deployments=[deployment])
    plans = engine_named("external").prepare(model, deployment, Paths.from_env(), lambda _: None)
    assert [p.api_key for p in plans] == ["k1", "k1"]
