"""`corral up --log-format`: what a log pipeline reads on standard error. `json`: every line one object
(time, level, logger, message; the access log's fields as keys; the banner logged too); `auto` where
standard error is not a terminal (systemd, Docker, Kubernetes): one line an event, each with its UTC time,
none cut or padded to a terminal's width."""

from __future__ import annotations

import importlib
import io
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import openai
import pytest

from tests.conftest import cluster_of

pytestmark = pytest.mark.slow  # real engines or servers, or long drills (`make test-fast` skips)

SPEC = """
supervisor: {probe_interval: 0.5}
auth: {open: true}
gateway: {access_log: true, workers: 2}
limits: {backend: redis, redis_url: 'redis://127.0.0.1:6379/0'}
models:
  - name: llama-8b
    arch: llama-3.1-8b
    deployments:
      - {engine: sim, replicas: 1, gpu: h100-sxm, time_scale: 20}
"""


def chat(url: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    answer = client.chat.completions.with_raw_response.create(
        model="llama-8b", messages=[{"role": "user", "content": "hi " + "word " * 60}], max_tokens=4
    )
    return answer.headers["x-request-id"]


def test_json_lines_from_corral_up_and_its_gateway_workers(tmp_path: Path) -> None:
    with cluster_of(tmp_path, SPEC, args=("--log-format", "json")) as cluster:
        asked = [chat(cluster.url) for _ in range(4)]  # (new connections: either worker answers)
    lines = [line for line in cluster.log.read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line: one object
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    now = datetime.now(UTC)
    assert all(now - timedelta(minutes=5) < datetime.fromisoformat(r["time"]) <= now for r in records)
    served = {r["request_id"]: r for r in records if r["logger"] == "corral.access"}
    for request_id in asked:  # logged by whichever worker served it, with the request's fields
        line = served[request_id]
        assert (line["method"], line["path"], line["status"], line["client"]) == (
            "POST",
            "/v1/chat/completions",
            200,
            "127.0.0.1",
        )
    banner = next(r for r in records if r["message"].startswith("corral is serving llama-8b at "))
    assert banner["models"] == ["llama-8b"] and banner["url"].endswith("/v1")
    assert any(r["message"] == "stopped" for r in records)


def test_auto_writes_one_plain_line_an_event_off_a_terminal(tmp_path: Path) -> None:
    spec = SPEC.replace("workers: 2", "workers: 1")
    with cluster_of(tmp_path, spec) as cluster:
        request_id = chat(cluster.url)
    lines = cluster.log.read_text().splitlines()
    access = [line for line in lines if request_id in line]
    assert len(access) == 1, access  # the whole event on one line
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
    event = rf'corral\.access: 127\.0\.0\.1 "POST /v1/chat/completions" 200 \d+ \d\.\d{{3}}s {request_id}'
    assert re.fullmatch(f"{stamp} INFO {event}", access[0]), access[0]
    logged = [line for line in lines if re.match(stamp, line)]
    assert logged and all(line == line.rstrip() for line in logged)  # not padded to a width


@pytest.mark.parametrize(("log_format", "drawn"), [("rich", True), ("text", False), ("json", False)])
def test_on_a_terminal_only_rich_logs_draw_a_live_spinner(
    log_format: str, drawn: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--log-format json` (or text) on a terminal: the progress is logged line by line; a spinner's
    redrawn line would break a JSON-lines reader."""
    from rich.console import Console

    from corral.cli import up
    from corral.config import Paths, parse_spec

    app = importlib.import_module("corral.cli.app")  # (the package's `app` is the Typer application)

    screen = io.StringIO()
    terminal = Console(file=screen, force_terminal=True, stderr=True)
    monkeypatch.setattr(app, "console", terminal)
    monkeypatch.setattr(up, "console", terminal)
    app.setup_logging("info", log_format)
    try:
        assert up._prepare_all(parse_spec(SPEC), Paths(tmp_path))  # the simulator: nothing to fetch
        assert ("preparing" in screen.getvalue()) is drawn, screen.getvalue()
    finally:
        app.setup_logging("warning", "text")
