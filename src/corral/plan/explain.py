"""`corral plan --explain`: why the chosen layout is as fast as it is — one engine step taken apart.

Two steps of one replica at the planned load: a decode step (each running sequence makes a token; the
batch is the replica's concurrency, each sequence holding its prompt and half its output) and a prefill
chunk (one `max_num_batched_tokens` slice of a prompt, vLLM's chunked prefill). For each: the GEMMs'
weight reads and compute, attention's KV reads and compute, the communication (tensor-parallel
all-reduces, pipeline hops) and the fixed per-step overhead, from the same step-time model the planner and
the simulator use. Reads and compute of one kind of kernel overlap (their p-norm: the larger mostly
bounds it); the two kinds, communication and overhead add up.
"""

from __future__ import annotations

from typing import Any

from rich import box
from rich.table import Table

from corral.perf import Catalog, Efficiency, PerfModel, SchedulerConfig, StepBreakdown
from corral.plan.search import Layout, PlanResult

__all__ = ["explain", "explain_table"]


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
