"""Benchmark statistics, named and defined as in vLLM's benchmark where the names overlap.

- TTFT: time from sending the request to the first chunk with output (text, content, reasoning, tool calls).
- ITL: the gaps between consecutive output chunks (`itl_ms`), and the same gaps divided by the tokens each
  chunk carried on average (`itl_per_token_ms`: chunks × gap / output tokens), which differ when a server
  sends several tokens per chunk.
- TPOT: per request, (E2E − TTFT) / (output tokens − 1), over requests with more than one output token.
- E2E: from sending the request to the end of its stream.
- Throughput: completed requests and output (and total) tokens per second of the measured run.
- Goodput: completed requests per second that met every given SLO.
Each distribution reports mean, p50, p90, p95, p99. Warm-up requests are excluded.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from corral.bench.runner import RequestResult, RunResult

__all__ = ["Slo", "distribution", "summarise"]


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met(self, result: RequestResult) -> bool:
        if self.ttft_ms is not None and (result.ttft is None or result.ttft * 1000 > self.ttft_ms):
            return False
        if self.tpot_ms is not None and result.output_tokens > 1 and result.ttft is not None:
            tpot = (result.e2e - result.ttft) / (result.output_tokens - 1)
            if tpot * 1000 > self.tpot_ms:
                return False
        return self.e2e_ms is None or result.e2e * 1000 <= self.e2e_ms

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))


def distribution(values_ms: Sequence[float]) -> dict[str, float]:
    if not values_ms:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p95": 0.0, "p99": 0.0}
    ordered = sorted(values_ms)
    out = {"mean": round(sum(ordered) / len(ordered), 3)}
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p95", 0.95), ("p99", 0.99)):
        out[name] = round(_percentile(ordered, q), 3)
    return out


def _percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarise(run: RunResult, slo: Slo | None = None, detailed: bool = False) -> dict[str, Any]:
    measured = [r for r in run.results if not r.warmup]
    done = [r for r in measured if r.ok]
    ttft = [r.ttft * 1000 for r in done if r.ttft is not None]
    itl = [gap * 1000 for r in done for gap in r.chunk_gaps]
    itl_token = [
        gap * 1000 * (len(r.chunk_gaps) + 1) / r.output_tokens
        for r in done
        if r.output_tokens
        for gap in r.chunk_gaps
    ]
    tpot = [
        (r.e2e - r.ttft) * 1000 / (r.output_tokens - 1)
        for r in done
        if r.ttft is not None and r.output_tokens > 1
    ]
    e2e = [r.e2e * 1000 for r in done]
    window = _window(measured, run.duration_s)
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.input_tokens for r in done)
    errors = Counter(r.error or "unknown" for r in measured if not r.ok)
    source = "usage" if done and all(r.tokens_from_usage for r in done) else "chunks"
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(measured) - len(done),
        "errors": dict(errors),
        "duration_s": round(window, 3),
        "requests_per_s": round(len(done) / window, 3) if window else 0.0,
        "output_tokens_per_s": round(output_tokens / window, 2) if window else 0.0,
        "total_tokens_per_s": round((input_tokens + output_tokens) / window, 2) if window else 0.0,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "token_counts_from": source,
        "ttft_ms": distribution(ttft),
        "itl_ms": distribution(itl),
        "itl_per_token_ms": distribution(itl_token),
        "tpot_ms": distribution(tpot),
        "e2e_ms": distribution(e2e),
        "client_loop_lag_p99_ms": round(run.loop_lag_p99_ms, 3),
        "client_loop_lag_max_ms": round(run.loop_lag_max_ms, 3),
        "warnings": _warnings(run, ttft),
    }
    if slo is not None and slo.any:
        good = [r for r in done if slo.met(r)]
        summary["goodput_requests_per_s"] = round(len(good) / window, 3) if window else 0.0
        summary["slo"] = {
            "ttft_ms": slo.ttft_ms,
            "tpot_ms": slo.tpot_ms,
            "e2e_ms": slo.e2e_ms,
            "met_share": round(len(good) / len(measured), 4) if measured else 0.0,  # (a failure: missed)
        }
    if detailed:
        summary["requests"] = [
            {
                "ttft_ms": r.ttft * 1000 if r.ttft is not None else None,
                "e2e_ms": r.e2e * 1000,
                "ok": r.ok,
                "error": r.error,
                "input_tokens": r.input_tokens,
                "output_tokens": r.output_tokens,
                "itl_ms": [g * 1000 for g in r.chunk_gaps],
            }
            for r in measured
        ]
    return summary


def _window(measured: list[RequestResult], fallback: float) -> float:
    """From the first measured request's start to the last one's end."""
    if not measured:
        return fallback
    start = min(r.started for r in measured)
    end = max(r.started + r.e2e for r in measured)
    return max(end - start, 1e-9)


def _warnings(run: RunResult, ttft_ms: list[float]) -> list[str]:
    notes = []
    median_ttft = sorted(ttft_ms)[len(ttft_ms) // 2] if ttft_ms else 0.0
    if run.loop_lag_p99_ms > 5 and run.loop_lag_p99_ms > 0.05 * median_ttft:
        notes.append(
            f"the client's event loop lagged {run.loop_lag_p99_ms:.1f} ms (p99): it is near saturation and "
            "inflates the latencies it reports; use fewer concurrent requests or more client processes"
        )
    return notes
