"""The NGINX edge, for real: `corral deploy render --target nginx` output run by Debian's NGINX with a
development CA's certificate, in front of two `corral up` gateways, used through the openai client."""

from __future__ import annotations

import os
import re
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from corral.cluster import free_port
from corral.deploy import write_dev_certificates
from tests.conftest import CORRAL, RunningCluster, cluster_of, log_has

pytestmark = pytest.mark.slow  # real engines or servers, or long drills (`make test-fast` skips)

GATEWAY = """
supervisor: {probe_interval: 0.5}
auth: {open: true}
gateway: {trusted_proxies: [127.0.0.1], access_log: true, cors_origins: ['https://chat.example.com']}
models:
  - name: llama-8b
    arch: llama-3.1-8b
    deployments:
      - {engine: sim, replicas: 1, gpu: h100-sxm, time_scale: 1}
"""

EDGE = """
deploy:
  edge:
    server_name: localhost
    port: {port}
    cert: {tls}/server.crt
    key: {tls}/server.key
    gateways: [{gateways}]
    requests_per_second: {rps}
    burst: {burst}
    fail_timeout: 30
"""


@dataclass
class Edge:
    url: str
    ca: Path

    def client(self, **options: object) -> openai.OpenAI:
        http = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=self.ca))
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", http_client=http, **options)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tls")
    write_dev_certificates(folder, ["localhost", "127.0.0.1"])
    return folder


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningCluster, RunningCluster]]:
    tmp = tmp_path_factory.mktemp("gateways")
    with cluster_of(tmp, GATEWAY, "a.yaml") as first, cluster_of(tmp, GATEWAY, "b.yaml") as second:
        yield first, second


@contextmanager
def edge_in_front_of(
    tmp: Path, tls: Path, clusters: list[RunningCluster], rps: float = 1000, burst: int = 1000
) -> Iterator[Edge]:
    """Render the edge for `clusters` with the real CLI, check it with nginx -t, run NGINX until the block
    ends."""
    port = free_port()
    addresses = ", ".join(c.url.removeprefix("http://") for c in clusters)
    spec = tmp / "edge.yaml"
    spec.write_text(GATEWAY + EDGE.format(port=port, tls=tls, gateways=addresses, rps=rps, burst=burst))
    rendered = subprocess.run(
        [*CORRAL, "deploy", "render", "-t", "nginx", "-f", str(spec), "-o", str(tmp / "out")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert rendered.returncode == 0, rendered.stderr
    prefix = tmp / "out" / "nginx"
    (prefix / "tmp").mkdir(exist_ok=True)
    argv = ["nginx", "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-e", str(prefix / "error.log")]
    checked = subprocess.run([*argv, "-t"], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    process = subprocess.Popen([*argv, "-g", "daemon off;"])
    try:
        wait_for_port(port, process)
        yield Edge(f"https://localhost:{port}", tls / "ca.crt")
    finally:
        process.send_signal(signal.SIGQUIT)  # graceful: workers finish their requests
        process.wait(timeout=30)


def wait_for_port(port: int, process: subprocess.Popen[bytes], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "nginx exited"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"nginx did not listen on {port}")


def ask(client: openai.OpenAI, max_tokens: int = 8) -> str:
    answer = client.chat.completions.create(
        model="llama-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens
    )
    return answer.choices[0].message.content or ""


def test_openai_client_through_the_edge_plain_and_streamed(
    tmp_path: Path, tls_dir: Path, gateways: tuple[RunningCluster, RunningCluster]
) -> None:
    with edge_in_front_of(tmp_path, tls_dir, list(gateways)) as edge:
        client = edge.client()
        for _ in range(6):
            assert ask(client)
        raw = client.chat.completions.with_raw_response.create(
            model="llama-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
        edge_id = raw.headers["x-request-id"]  # NGINX's $request_id, which the gateway took and logged
        assert re.fullmatch("[0-9a-f]{32}", edge_id) and raw.parse().choices
        stream = client.chat.completions.create(
            model="llama-8b",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
        # A batch input file past the 4 MiB a request body may be (gateway.max_body_bytes) passes the edge,
        # up to batch.max_file_bytes
        line = '{"custom_id": "r%d", "method": "POST", "url": "/v1/chat/completions", "body": {"model": '
        line += '"llama-8b", "messages": [{"role": "user", "content": "' + "x" * 1000 + '"}]}}\n'
        data = "".join(line % i for i in range(5000)).encode()
        assert len(data) > 5 * 1024 * 1024
        uploaded = client.files.create(file=("in.jsonl", data), purpose="batch")
        assert uploaded.bytes == len(data)
    # Both gateways served, and each logged the client NGINX named (trusted proxy: 127.0.0.1).
    for cluster in gateways:
        log_has(cluster.log, '127.0.0.1 "POST /v1/chat/completions" 200')
    assert any(edge_id in cluster.log.read_text() for cluster in gateways)


def test_streamed_chunks_pass_through_unbuffered(
    tmp_path: Path, tls_dir: Path, gateways: tuple[RunningCluster, RunningCluster]
) -> None:
    """Tokens arrive as the engine makes them: the first long before the last (a buffering proxy would
    hold them and hand them over in a few large reads at the end)."""
    with edge_in_front_of(tmp_path, tls_dir, list(gateways)) as edge:
        with edge.client().chat.completions.with_streaming_response.create(
            model="llama-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=160, stream=True
        ) as response:
            assert response.headers.get("content-encoding") is None
            start = time.monotonic()
            arrivals = [time.monotonic() - start for line in response.iter_lines() if '"content":"' in line]
    total = arrivals[-1]
    assert total > 0.5, f"the stream took {total:.2f}s: too fast to tell"
    assert arrivals[0] < 0.25 * total
    spread = len({round(t, 2) for t in arrivals})
    assert spread > 20, f"tokens arrived at only {spread} distinct moments"


def test_a_burst_over_the_per_client_limit_gets_openai_shaped_429s(
    tmp_path: Path, tls_dir: Path, gateways: tuple[RunningCluster, RunningCluster]
) -> None:
    with edge_in_front_of(tmp_path, tls_dir, list(gateways), rps=1, burst=2) as edge:
        context = ssl.create_default_context(cafile=edge.ca)
        statuses, refused = [], []
        for _ in range(8):
            try:
                page = urllib.request.Request(
                    edge.url + "/v1/models", headers={"Origin": "https://chat.example.com"}
                )
                with urllib.request.urlopen(page, timeout=5, context=context) as r:
                    statuses.append(r.status)
            except urllib.error.HTTPError as err:
                statuses.append(err.code)
                refused.append((err.headers, err.read()))
    assert statuses[:3] == [200, 200, 200]  # the first plus a burst of 2
    assert 429 in statuses and set(statuses) == {200, 429}
    headers, body = refused[0]
    assert headers["Retry-After"] == "1"
    assert re.fullmatch("[0-9a-f]{32}", headers["x-request-id"])  # the edge's own answer has its id too
    assert headers["Access-Control-Allow-Origin"] == "https://chat.example.com"  # and the page may read it
    assert "retry-after" in headers["Access-Control-Expose-Headers"]
    assert headers["Content-Type"].startswith("application/json")
    error = __import__("json").loads(body)["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
    assert "Retry after 1 s" in error["message"]


@dataclass
class Outcome:
    started: float
    ended: float
    ok: bool


def test_killing_a_gateway_under_load_loses_no_request_that_had_not_reached_it(
    tmp_path: Path, tls_dir: Path, gateways: tuple[RunningCluster, RunningCluster]
) -> None:
    survivor = gateways[0]
    with cluster_of(tmp_path, GATEWAY, "victim.yaml") as victim:
        with edge_in_front_of(tmp_path, tls_dir, [victim, survivor]) as edge:
            outcomes: list[Outcome] = []
            stop = threading.Event()

            def user() -> None:
                client = edge.client(max_retries=0, timeout=30)
                while not stop.is_set():
                    started = time.monotonic()
                    try:
                        ask(client, max_tokens=32)
                        ok = True
                    except openai.APIError:
                        ok = False
                    outcomes.append(Outcome(started, time.monotonic(), ok))

            users = [threading.Thread(target=user) for _ in range(8)]
            for thread in users:
                thread.start()
            time.sleep(1.5)
            os.kill(victim.process.pid, signal.SIGKILL)
            victim.process.wait(timeout=10)
            killed = time.monotonic()
            time.sleep(2.5)
            stop.set()
            for thread in users:
                thread.join(timeout=60)
    before = [o for o in outcomes if o.started < killed]
    after = [o for o in outcomes if o.started >= killed]
    assert len(after) >= 16, f"only {len(after)} requests after the kill"
    assert all(o.ok for o in after), "a request sent after the kill failed: the dead gateway was not skipped"
    failed = [o for o in before if not o.ok]
    # Only requests in flight on the killed gateway may fail (at most one per user), and they ended as the
    # gateway died: NGINX did not resend them (a POST that reached a gateway is never sent twice).
    assert len(failed) <= 8
    assert all(o.ended >= killed - 1.0 for o in failed)
    assert sum(o.ok for o in before) >= 8
