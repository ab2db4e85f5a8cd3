"""Plan output: JSON for scripts, a rich table for people, and a cluster.yaml for the chosen layout."""

from __future__ import annotations

from typing import Any

import yaml
from rich import box
from rich.table import Table

from corral.plan.search import PlanResult

__all__ = ["plan_json", "plan_table", "plan_yaml"]


def plan_json(result: PlanResult) -> dict[str, Any]:
    request = result.request
    return {
        "fits": result.fits,
        "reason": result.reason,
        "model": result.model.name,
        "quantization": result.quant.name,
        "context": result.context,
        "workload": {
            "concurrency": request.concurrency,
            "input_len": request.input_len,
            "output_len": request.output_len,
        },
        "slo": {"ttft_p95_ms": request.ttft_p95_ms, "itl_ms": request.itl_ms},
        "layouts": [layout.to_dict() for layout in result.layouts],
    }


def plan_table(result: PlanResult) -> Table:
    r = result.request
    load = f"{r.request_rate:g} requests/s" if r.request_rate is not None else f"{r.concurrency} concurrent"
    title = (
        f"{result.model.name} ({result.quant.name}), context {result.context}, {load} "
        f"× {r.input_len} in / {r.output_len} out"
    )
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("GPUs (TP×PP×replicas)", no_wrap=True)
    for column in ("weights/GPU", "KV tokens", "TTFT p95", "ITL", "out tok/s", "$/month", "$/1M tok", "SLO"):
        table.add_column(column, justify="right")
    for lay in result.layouts:
        c = lay.cost
        table.add_row(
            f"{lay.gpus}× {lay.gpu} ({lay.tp}×{lay.pp}×{lay.replicas})",
            f"{lay.weights_gib_per_gpu:.1f} GiB",
            f"{lay.kv_tokens:,}",
            f"{lay.ttft_p95_ms:,.0f} ms",
            f"{lay.itl_ms:.1f} ms",
            f"{lay.output_tokens_per_s:,.0f}",
            f"{c.monthly_usd:,.0f}",
            f"{c.cost_per_million_tokens:.3f}",
            "[green]meets[/green]" if lay.meets_slo else "[red]misses[/red]",
        )
    best = result.layouts[0].cost if result.layouts else None
    if best is not None:
        verdict = "cheaper" if best.cheaper_than_api else "dearer"
        table.caption = (
            f"{r.api}: ${best.api_cost_per_million_tokens:.3f}/1M tokens; at this load the first "
            f"layout is {verdict} than the API (${best.api_monthly_usd_at_this_load:,.0f}/month); "
            f"break-even {best.break_even_requests_per_day:,.0f} requests/day"
        )
    return table


def plan_yaml(result: PlanResult) -> str:
    """A cluster spec running the first layout with vLLM (`corral up -f` reads it)."""
    if not result.layouts:
        raise ValueError("nothing to write: no layout fits")
    lay = result.layouts[0]
    repo = next((a for a in result.model.aliases if "/" in a), result.model.name)
    deployment: dict[str, Any] = {
        "engine": "vllm",
        "replicas": lay.replicas,
        "gpu": lay.gpu,
        "tensor_parallel": lay.tp,
        "pipeline_parallel": lay.pp,
        "max_model_len": result.context,
        "gpu_memory_utilization": result.request.gpu_memory_utilization,
        "max_num_seqs": result.request.max_num_seqs,
    }
    if result.quant.name != "bf16" and result.quant.name != result.model.native_quant:
        deployment["quantization"] = result.quant.name
    spec = {
        "models": [
            {
                "name": result.model.name,
                "arch": result.model.name,
                "source": {"hf": repo},
                "deployments": [deployment],
            }
        ]
    }
    header = (
        f"# corral plan: {lay.gpus}x {lay.gpu} as TP={lay.tp} x PP={lay.pp} x {lay.replicas} replicas; "
        f"predicted TTFT p95 {lay.ttft_p95_ms:.0f} ms, ITL {lay.itl_ms:.1f} ms, "
        f"{lay.output_tokens_per_s:.0f} output tokens/s\n"
    )
    return header + yaml.safe_dump(spec, sort_keys=False)
