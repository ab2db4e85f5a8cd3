"""`corral observe snapshot` asks Prometheus for rates over at least four scrape intervals, as Grafana's
$__rate_interval does: a shorter window often holds fewer than the two samples a rate needs."""

from __future__ import annotations

import json
import re
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from corral.observe.snapshot import dashboard_png


class FakePrometheus(ThreadingHTTPServer):
    """Prometheus's HTTP API as far as the snapshot asks it: its configuration, and empty ranges."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.scrape_interval = "15s"
        self.queries: list[str] = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: FakePrometheus

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        if url.path == "/api/v1/status/config":
            config = (
                f"global:\n  scrape_interval: {self.server.scrape_interval}\n  evaluation_interval: 15s\n"
            )
            body: dict[str, object] = {"status": "success", "data": {"yaml": config}}
        else:
            assert url.path == "/api/v1/query_range"
            self.server.queries.append(urllib.parse.parse_qs(url.query)["query"][0])
            body = {"status": "success", "data": {"resultType": "matrix", "result": []}}
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def prometheus() -> Iterator[FakePrometheus]:
    server = FakePrometheus()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.mark.parametrize(("scrape", "window"), [("15s", "60s"), ("30s", "120s"), ("1m", "240s")])
def test_snapshot_rates_span_four_scrape_intervals(
    prometheus: FakePrometheus, tmp_path: Path, scrape: str, window: str
) -> None:
    """Prometheus's default 15 s scrapes in a 20 s window held two samples in only a third of windows."""
    prometheus.scrape_interval = scrape
    dashboard_png(prometheus.url, "corral-cluster", tmp_path / "cluster.png", minutes=1)
    rates = [q for q in prometheus.queries if "rate(" in q and "[1h]" not in q]
    assert rates
    assert {w for q in rates for w in re.findall(r"rate\([^\[]*\[(\w+)\]", q)} == {window}
