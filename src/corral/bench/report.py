"""Reports: PNG plots (latency-throughput curve of a sweep, TTFT/ITL distributions), a self-contained
HTML page, and a side-by-side comparison of two result files."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

__all__ = ["compare", "write_html", "write_plots"]

_METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


def _figures(result: dict[str, Any]) -> dict[str, bytes]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures: dict[str, bytes] = {}
    runs = result.get("runs", [result])
    if len(runs) > 1:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        x = [r["output_tokens_per_s"] for r in runs]
        for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E")):
            ax.plot(x, [r[key]["p50"] for r in runs], marker="o", label=f"{label} p50")
            ax.plot(x, [r[key]["p99"] for r in runs], marker="x", linestyle="--", label=f"{label} p99")
        for r, xv in zip(runs, x, strict=True):
            ax.annotate(
                str(r.get("load", "")),
                (xv, r["e2e_ms"]["p50"]),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel("latency (ms)")
        ax.set_yscale("log")
        ax.set_title("latency vs throughput")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        figures["latency_throughput.png"] = _png(fig)
    last = runs[-1]
    samples = last.get("requests")
    if samples:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
        ttft = [s["ttft_ms"] for s in samples if s["ttft_ms"] is not None]
        itl = [g for s in samples for g in s["itl_ms"]]
        axes[0].hist(ttft, bins=40, color="#4477aa")
        axes[0].set_title("TTFT (ms)")
        axes[1].hist(itl, bins=40, color="#ee6677")
        axes[1].set_title("inter-token latency (ms)")
        for ax in axes:
            ax.grid(alpha=0.3)
        figures["distributions.png"] = _png(fig)
    plt.close("all")
    return figures


def _png(fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()


def write_plots(result: dict[str, Any], folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, data in _figures(result).items():
        path = folder / name
        path.write_bytes(data)
        paths.append(path)
    return paths


def write_html(result: dict[str, Any], path: Path) -> None:
    runs = result.get("runs", [result])
    rows = []
    for r in runs:
        cells = [str(r.get("load", "-")), f"{r['requests_per_s']:.2f}", f"{r['output_tokens_per_s']:.1f}"]
        cells += [f"{r[m]['p50']:.1f} / {r[m]['p99']:.1f}" for m in _METRICS]
        cells.append(str(sum(r["errors"].values())))
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    images = "".join(
        f'<img alt="{name}" src="data:image/png;base64,{base64.b64encode(data).decode()}">'
        for name, data in _figures(result).items()
    )
    meta = html.escape(", ".join(f"{k}: {v}" for k, v in result.get("config", {}).items()))
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>corral bench</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;color:#222}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 10px;text-align:right}}img{{max-width:100%;margin:1em 0}}</style>
</head><body><h1>corral bench</h1><p>{meta}</p>
<table><tr><th>load</th><th>req/s</th><th>out tok/s</th><th>TTFT p50/p99 ms</th><th>TPOT p50/p99 ms</th>
<th>ITL p50/p99 ms</th><th>E2E p50/p99 ms</th><th>errors</th></tr>{"".join(rows)}</table>
{images}</body></html>"""
    path.write_text(page)


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, float, float, float | None]]:
    """(metric, A, B, relative change B vs A) for the headline figures of two results' last runs
    (ValueError where one lacks them: `last_run`)."""
    ra, rb = last_run(a), last_run(b)
    rows: list[tuple[str, float, float, float | None]] = []
    for key in ("requests_per_s", "output_tokens_per_s"):
        rows.append((key, ra[key], rb[key], _change(ra[key], rb[key])))
    for metric in _METRICS:
        for stat in ("mean", "p50", "p99"):
            va, vb = ra[metric][stat], rb[metric][stat]
            rows.append((f"{metric}.{stat}", va, vb, _change(va, vb)))
    rows.append(("errors", sum(ra["errors"].values()), sum(rb["errors"].values()), None))
    return rows


def last_run(result: Any) -> dict[str, Any]:
    """A result's last run, with the figures `compare` reads; ValueError saying which one is missing."""
    runs = result.get("runs", [result]) if isinstance(result, dict) else None
    if not isinstance(runs, list) or not runs or not isinstance(runs[-1], dict):
        raise ValueError("it holds no runs")
    run: dict[str, Any] = runs[-1]
    wanted: list[tuple[str, str | None]] = [("requests_per_s", None), ("output_tokens_per_s", None)]
    wanted += [(metric, stat) for metric in _METRICS for stat in ("mean", "p50", "p99")]
    for key, stat in wanted:
        value = run.get(key)
        if stat is not None:
            value = value.get(stat) if isinstance(value, dict) else None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"its last run has no number {key}{'.' + stat if stat else ''}")
    errors = run.get("errors")
    if not isinstance(errors, dict) or not all(isinstance(n, int) for n in errors.values()):
        raise ValueError("its last run has no errors counted by kind")
    return run


def _change(a: float, b: float) -> float | None:
    return (b - a) / a if a else None
