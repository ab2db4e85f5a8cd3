"""`corral plan --explain`: why the chosen layout is as fast as it is — one engine step taken apart.

Two steps of one replica at the planned load: a decode step (each running sequence makes a token; the
batch is the replica's concurrency, each sequence holding its prompt and half its output) and a prefill
chunk (one `max_num_batched_tokens` slice of a prompt, vLLM's chunked prefill). For each: the GEMMs'
weight reads and compute, attention's KV reads and compute, the communication (tensor-parallel
all-reduces, pipeline hops) and the fixed per-step overhead, from the same step-time model the planner and
the simulator use. Reads and compute of one kind of kernel overlap (their p-norm: the larger mostly
bounds it); the two kinds, communication and overhead add up.

And where the mean time to first token at the planned load comes from: the request's fixed cost outside
the engine (HTTP, tokenization: the fitted `request_overhead_s`), the API server's work for the other
streams in flight (the fitted `stream_overhead_s` each), its prompt's prefill chunks taken alone,
what the running decodes that share those steps add (interference: the other sequences' tokens take part
of each step's token budget and their KV reads and weights pass add time), and the rest of the planner's
mean TTFT, which is waiting: for the step in progress, for prefills ahead of it, for a free slot or KV.
"""

from __future__ import annotations

from typing import Any

from rich import box
from rich.table import Table

from corral.perf import Catalog, Efficiency, PerfModel, SchedulerConfig, StepBreakdown
from corral.plan.search import Layout, PlanRequest, PlanResult

__all__ = ["explain", "explain_table", "ttft_table"]


def explain(result: PlanResult, layout: Layout, catalog: Catalog, efficiency: Efficiency) -> dict[str, Any]:
    """The decode and prefill steps of `layout` at the request's workload, by part."""
    request = result.request
    gpu = catalog.gpus.get(layout.gpu)
    perf = PerfModel(result.model, gpu, result.quant, tp=layout.tp, pp=layout.pp, efficiency=efficiency)
    batch = max(1, layout.concurrency_per_replica)
    held = request.input_len + request.output_len // 2
    chunk = min(request.input_len, SchedulerConfig().max_num_batched_tokens)
    steps = {
        "decode": (perf.breakdown(batch, batch * held), batch),
        "prefill": (perf.breakdown(0, 0, chunk, chunk * (chunk + 1) / 2), chunk),
    }
    shape = f"TP {layout.tp} × PP {layout.pp} × {layout.replicas} replicas"
    return {
        "layout": f"{layout.gpus}× {layout.gpu} ({shape})",
        "steps": {name: _json(step, tokens) for name, (step, tokens) in steps.items()},
        "ttft": _ttft(request.input_len, batch - 1, held, perf, efficiency, layout, request),
    }


def _ttft(
    prompt: int,
    others: int,
    held: int,
    perf: PerfModel,
    efficiency: Efficiency,
    layout: Layout,
    request: PlanRequest,
) -> dict[str, Any]:
    """The mean TTFT split into overheads, prefill alone, interference with decodes and waiting (ms)."""
    budget = request.max_num_batched_tokens

    def prefill(decodes: int) -> tuple[float, int]:
        seconds, done, chunks = 0.0, 0, 0
        room = max(1, budget - decodes)  # decodes take their token of each step's budget first
        while done < prompt:
            chunk = min(room, prompt - done)
            pairs = ((done + chunk) * (done + chunk + 1) - done * (done + 1)) / 2
            seconds += perf.step_time(decodes, decodes * held, chunk, pairs)
            done, chunks = done + chunk, chunks + 1
        return seconds, chunks

    alone, _ = prefill(0)
    shared, chunks = prefill(others)
    overhead, streams = efficiency.request_overhead_s, layout.ttft_streams_ms / 1000
    mean = layout.ttft_mean_ms / 1000
    parts = {
        "overhead_ms": overhead,
        "streams_ms": streams,
        "prefill_ms": alone,
        "interference_ms": shared - alone,
        "waiting_ms": max(0.0, mean - overhead - streams - shared),
    }
    return {
        "mean_ms": layout.ttft_mean_ms,
        "p50_ms": layout.ttft_ms,
        "p95_ms": layout.ttft_p95_ms,
        "chunks": chunks,
        "decodes_alongside": others,
        **{k: round(v * 1000, 2) for k, v in parts.items()},
    }


_PARTS = {  # JSON key → table column
    "weights_ms": "weights",
    "gemm_ms": "GEMM",
    "kv_ms": "KV",
    "attention_ms": "attn",
    "communication_ms": "comm",
    "overhead_ms": "fixed",
    "total_ms": "total",
}


def _json(step: StepBreakdown, tokens: int) -> dict[str, Any]:
    seconds = (
        step.weights_s,
        step.gemm_s,
        step.kv_s,
        step.attention_s,
        step.communication_s,
        step.overhead_s,
        step.total_s,
    )
    return {
        "tokens": tokens,
        **{k: round(v * 1000, 3) for k, v in zip(_PARTS, seconds, strict=True)},
        "overlap": step.overlap,
        "bound": step.bound,
    }


_TTFT_PARTS = {  # JSON key → what the row says
    "waiting_ms": "waiting (the step in progress, prefills ahead, a free slot or KV)",
    "prefill_ms": "prefill of the prompt, its chunks alone",
    "interference_ms": "interference: running decodes share those steps",
    "overhead_ms": "per-request overhead (HTTP, tokenization), fitted",
    "streams_ms": "the API server's work for the other streams, fitted",
}


def ttft_table(explained: dict[str, Any]) -> Table:
    """The mean TTFT by part, each with its share (fits 80 columns)."""
    ttft = explained["ttft"]
    table = Table(
        title=(
            f"time to first token: mean {ttft['mean_ms']:,.0f} ms, p50 {ttft['p50_ms']:,.0f} ms, "
            f"p95 {ttft['p95_ms']:,.0f} ms ({ttft['chunks']} prefill chunk{'s' * (ttft['chunks'] != 1)}, "
            f"{ttft['decodes_alongside']} decodes alongside)"
        ),
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    table.add_column("part", overflow="fold")
    table.add_column("ms", justify="right", no_wrap=True)
    table.add_column("share", justify="right", no_wrap=True)
    total = sum(ttft[key] for key in _TTFT_PARTS) or 1.0
    for key, label in _TTFT_PARTS.items():
        table.add_row(label, f"{ttft[key]:,.1f}", f"{ttft[key] / total:.0%}")
    return table


def explain_table(explained: dict[str, Any]) -> Table:
    table = Table(
        title=f"one step, by part (ms): {explained['layout']}",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    for column in ("step", "tokens", *_PARTS.values(), "bound"):
        left = column in ("step", "bound")
        table.add_column(column, justify="left" if left else "right", no_wrap=not left, overflow="fold")
    for name, step in explained["steps"].items():
        table.add_row(name, str(step["tokens"]), *(f"{step[k]:.2f}" for k in _PARTS), step["bound"])
    return table
