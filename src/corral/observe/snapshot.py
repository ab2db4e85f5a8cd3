"""A dashboard drawn from Prometheus without Grafana (`corral observe snapshot`): every panel's queries
run over a time range through Prometheus's HTTP API and plotted with matplotlib into one PNG."""

from __future__ import annotations

import json
import math
import re
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from corral.observe.dashboards import DASHBOARDS, concrete_query

__all__ = ["SnapshotError", "dashboard_png", "rate_interval", "scrape_interval", "title"]


class SnapshotError(RuntimeError):
    """Prometheus could not be asked, or the dashboard is unknown."""


_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def _get(prometheus: str, path: str, what: str, params: dict[str, object] | None = None) -> Any:
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    try:
        with urllib.request.urlopen(f"{prometheus.rstrip('/')}{path}{query}", timeout=30) as r:
            body = json.load(r)
    except OSError as exc:
        raise SnapshotError(f"cannot query Prometheus at {prometheus}: {exc}") from None
    if body.get("status") != "success":
        raise SnapshotError(f"Prometheus refused {what}: {body.get('error')}")
    return body["data"]


def _query_range(prometheus: str, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
    params = {"query": expr, "start": start, "end": end, "step": step}
    return list(_get(prometheus, "/api/v1/query_range", repr(expr), params)["result"])


def scrape_interval(prometheus: str) -> float:
    """Prometheus's global scrape interval in seconds, from its loaded configuration."""
    config = yaml.safe_load(_get(prometheus, "/api/v1/status/config", "its configuration")["yaml"])
    said = str((config.get("global") or {}).get("scrape_interval", "1m"))  # Prometheus's own default
    parts = re.findall(r"(\d+)(ms|s|m|h|d|w|y)", said)
    if not parts or "".join(n + u for n, u in parts) != said:
        raise SnapshotError(f"Prometheus's scrape interval {said!r} is no duration")
    return sum(int(number) * _UNIT_S[unit] for number, unit in parts)


def rate_interval(step: float, scrape: float) -> str:
    """The window of the panels' rates, as Grafana's $__rate_interval: at least four scrapes (so it always
    holds two samples, one scrape missed), and a step and a scrape."""
    return f"{math.ceil(max(step + scrape, 4 * scrape))}s"


def _legend(template: str, labels: dict[str, str]) -> str:
    out = template
    for key, value in labels.items():
        out = out.replace("{{" + key + "}}", value)
    return out


def dashboard_png(prometheus: str, uid: str, output: Path, minutes: float = 15, step: float = 5) -> int:
    """Draw dashboard `uid` over the last `minutes`; returns the number of panels with data."""
    board = next((b for b in DASHBOARDS if b.uid == uid), None)
    if board is None:
        raise SnapshotError(f"no dashboard {uid!r}: one of {', '.join(b.uid for b in DASHBOARDS)}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rate = rate_interval(step, scrape_interval(prometheus))
    panels = [panel for _, row in board.rows for panel in row]
    end = time.time()
    start = end - 60 * minutes
    columns = 3
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.2 * rows), squeeze=False)
    with_data = 0
    for axis, panel in zip(axes.flat, panels, strict=False):
        drawn = False
        for expr, legend in panel.queries:
            concrete = concrete_query(board, expr, rate)
            for series in _query_range(prometheus, concrete, start, end, step):
                points = [
                    (float(t) - end, float(v))
                    for t, v in series["values"]
                    if v not in ("NaN", "+Inf", "-Inf")
                ]
                if points:
                    xs, ys = zip(*points, strict=True)
                    axis.plot(
                        [x / 60 for x in xs], ys, label=_legend(legend, series["metric"]), linewidth=1.2
                    )
                    drawn = True
        with_data += drawn
        axis.set_title(title(panel.title, panel.unit), fontsize=9)
        axis.tick_params(labelsize=7)
        axis.set_xlabel("minutes", fontsize=7)
        if drawn:
            axis.legend(fontsize=6, loc="upper left")
        else:
            axis.text(0.5, 0.5, "no data", ha="center", va="center", transform=axis.transAxes)
    for axis in list(axes.flat)[len(panels) :]:
        axis.axis("off")
    figure.suptitle(f"{board.title}: last {minutes:g} minutes, from {prometheus}", fontsize=11)
    figure.tight_layout(rect=(0, 0, 1, 0.97))
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=80)
    plt.close(figure)
    return with_data


# Grafana's unit ids, as a reader of the picture says them (percentunit: a 0–1 ratio drawn as one).
_UNITS = {
    "reqps": "requests/s",
    "percentunit": "ratio, 1 = 100%",
    "percent": "%",
    "s": "seconds",
    "ops": "per second",
    "short": "",
    "none": "",
    "mbytes": "MiB",
    "celsius": "°C",
    "watt": "W",
}


def title(name: str, unit: str) -> str:
    """A panel's title with its unit in words (Grafana's id where none is known)."""
    said = _UNITS.get(unit, unit)
    return f"{name} ({said})" if said else name
