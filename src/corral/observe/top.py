"""`corral top`: a live terminal view of a running cluster, from its gateway's /corral/status and /metrics.

Rates (requests/s, tokens/s, refusals/s) and latency percentiles are computed from the difference of two
scrapes of the gateway's counters and histograms, as Prometheus's rate() would; the replica table is the
gateway's own view (state, engine load, KV cache, prefix-cache hits, restarts).
"""

from __future__ import annotations

import json
import ssl
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Group
from rich.table import Table
from rich.text import Text

__all__ = ["Sample", "TopClient", "render_frame"]


@dataclass
class Sample:
    """One reading of the gateway: replicas, and the counters/histograms top turns into rates."""

    at: float
    replicas: list[dict[str, object]]
    counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)

    def total(self, name: str, **match: str) -> float:
        return sum(
            value
            for (metric, labels), value in self.counters.items()
            if metric == name and all(dict(labels).get(k) == v for k, v in match.items())
        )

    def buckets(self, name: str) -> dict[float, float]:
        out: dict[float, float] = {}
        for (metric, labels), value in self.counters.items():
            if metric == name + "_bucket":
                le = float(dict(labels)["le"])
                out[le] = out.get(le, 0.0) + value
        return out


class TopClient:
    """Reads the gateway at `url` (with the admin key when the gateway is closed)."""

    def __init__(self, url: str, key: str | None = None, context: ssl.SSLContext | None = None) -> None:
        self._url = url.rstrip("/")
        self._key = key
        self._context = context

    def _get(self, path: str) -> bytes:
        request = urllib.request.Request(self._url + path)
        if self._key:
            request.add_header("Authorization", f"Bearer {self._key}")
        with urllib.request.urlopen(request, timeout=5, context=self._context) as response:
            return bytes(response.read())

    def sample(self) -> Sample:
        status = json.loads(self._get("/corral/status"))
        metrics = self._get("/metrics").decode()
        counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for family in text_string_to_metric_families(metrics):
            for s in family.samples:
                counters[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return Sample(time.monotonic(), list(status["replicas"]), counters)


def _rate(now: Sample, before: Sample | None, name: str, **match: str) -> float | None:
    if before is None or now.at <= before.at:
        return None
    return max(0.0, now.total(name, **match) - before.total(name, **match)) / (now.at - before.at)


def _quantile(now: Sample, before: Sample | None, name: str, q: float) -> float | None:
    """histogram_quantile over the counts observed between the two samples."""
    if before is None:
        return None
    earlier = before.buckets(name)
    counts = sorted((le, now_count - earlier.get(le, 0.0)) for le, now_count in now.buckets(name).items())
    if not counts or counts[-1][1] <= 0:
        return None
    rank, lower, below = q * counts[-1][1], 0.0, 0.0
    for le, cumulative in counts:
        if cumulative >= rank:
            if le == float("inf"):
                return lower
            share = (rank - below) / (cumulative - below) if cumulative > below else 1.0
            return lower + (le - lower) * share
        lower, below = le, cumulative
    return lower


def _fmt(value: float | None, unit: str = "", scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}{unit}"


def render_frame(now: Sample, before: Sample | None) -> Group:
    """The header line of rates and latencies, and the replica table."""
    ttft = _quantile(now, before, "corral_time_to_first_token_seconds", 0.5)
    ttft95 = _quantile(now, before, "corral_time_to_first_token_seconds", 0.95)
    itl = _quantile(now, before, "corral_inter_token_latency_seconds", 0.5)
    rates = Text.assemble(
        ("requests/s ", "bold"),
        _fmt(_rate(now, before, "corral_requests_total")),
        ("   tokens/s in ", "bold"),
        _fmt(_rate(now, before, "corral_tokens_total", kind="input"), digits=0),
        (" out ", "bold"),
        _fmt(_rate(now, before, "corral_tokens_total", kind="output"), digits=0),
        ("   refused/s ", "bold"),
        _fmt(_rate(now, before, "corral_rejections_total")),
    )
    latency = Text.assemble(
        ("TTFT p50/p95 ", "bold"),
        f"{_fmt(ttft, ' ms', 1000, 0)}/{_fmt(ttft95, ' ms', 1000, 0)}",
        ("   ITL p50 ", "bold"),
        _fmt(itl, " ms", 1000, 0),
        ("   queued ", "bold"),
        f"{now.total('corral_queue_depth'):.0f}",
    )
    return Group(rates, latency, _replica_table(now.replicas))


def _replica_table(replicas: Iterable[dict[str, object]]) -> Table:
    """One row a replica (its id names its model), in 80 columns: requests in flight here, the engine's
    running and waiting sequences, KV-cache use, prefix-cache hit rate, restarts, requests served."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    columns = ("replica", "state", "reqs", "run", "wait", "KV", "hit", "restarts", "served")
    for column in columns:
        table.add_column(
            column,
            no_wrap=column != "replica",
            overflow="fold",
            justify="left" if column in columns[:2] else "right",
        )
    for r in replicas:
        kv, hit = r.get("kv_usage"), r.get("prefix_cache_hit_rate")
        state = str(r.get("state"))
        table.add_row(
            str(r.get("id")),
            Text(state, style="green" if state == "ready" else "yellow"),
            str(r.get("outstanding", "-")),
            _dash(r.get("running")),
            _dash(r.get("waiting")),
            "-" if kv is None else f"{float(kv):.0%}",  # type: ignore[arg-type]
            "-" if hit is None else f"{float(hit):.0%}",  # type: ignore[arg-type]
            str(r.get("restarts", 0)),
            str(r.get("served", 0)),
        )
    return table


def _dash(value: object) -> str:
    return "-" if value is None else str(value)
