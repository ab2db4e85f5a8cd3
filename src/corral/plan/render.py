"""Plan output: JSON for scripts, a rich table for people, and a cluster.yaml for the chosen layout."""

from __future__ import annotations

from typing import Any

import yaml
from rich import box
from rich.table import Table

from corral.plan.search import Layout, PlanResult

__all__ = ["plan_json", "plan_table", "plan_yaml", "validation_table"]


def plan_json(result: PlanResult) -> dict[str, Any]:
    request = result.request
    return {
        "fits": result.fits,
        "reason": result.reason,
        "meets_slo": bool(result.layouts and result.layouts[0].meets_slo) if request.has_slo else None,
        "compared_with": request.api,
        "model": result.model.name,
        "quantization": result.quant.name,
        "context": result.context,
        "workload": {
            "concurrency": request.concurrency if request.request_rate is None else None,
            "request_rate": request.request_rate,
            "input_len": request.input_len,
            "output_len": request.output_len,
        },
        "slo": {"ttft_p95_ms": request.ttft_p95_ms, "itl_ms": request.itl_ms},
        "layouts": [_layout_json(layout, request.has_slo) for layout in result.layouts],
    }


def _layout_json(layout: Layout, has_slo: bool) -> dict[str, Any]:
    """`meets_slo` is null when no SLO was stated (`overloaded` says whether it keeps up at all)."""
    data = layout.to_dict()
    data["meets_slo"] = layout.meets_slo if has_slo else None
    return data


def plan_table(result: PlanResult) -> Table:
    r = result.request
    load = f"{r.request_rate:g} requests/s" if r.request_rate is not None else f"{r.concurrency} concurrent"
    title = (
        f"{result.model.name} ({result.quant.name}), context {result.context}, {load} "
        f"× {r.input_len} in / {r.output_len} out"
    )
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.add_column("GPUs (TP×PP×replicas)", overflow="fold")
    # Units in the headers keep each cell short enough for an 80-column terminal.
    headers = ("GiB\n/GPU", "KV\ntokens", "TTFT\np95 ms", "ITL\nms", "out\ntok/s", "$/mo", "$/1M\ntok", "SLO")
    for column in headers:
        table.add_column(column, justify="right", overflow="fold")
    for lay in result.layouts:
        c = lay.cost
        table.add_row(
            f"{lay.gpus}× {lay.gpu} ({lay.tp}×{lay.pp}×{lay.replicas})",
            f"{lay.weights_gib_per_gpu:.1f}",
            f"{lay.kv_tokens:,}",
            f"{lay.ttft_p95_ms:,.0f}",
            f"{lay.itl_ms:.1f}",
            f"{lay.output_tokens_per_s:,.0f}",
            f"{c.monthly_usd:,.0f}",
            f"{c.cost_per_million_tokens:.3f}",
            _verdict(lay, r.has_slo),
        )
    best = result.layouts[0].cost if result.layouts else None
    if best is not None and result.layouts[0].overloaded:
        # (what it costs at the rate it does serve is no answer to what the load would cost)
        table.caption = f"the first layout does not keep up with this load: no comparison with {r.api}"
    elif best is not None:
        verdict = "cheaper" if best.cheaper_than_api else "dearer"
        table.caption = (
            f"{r.api}: ${best.api_cost_per_million_tokens:.3f}/1M tokens; at this load the first "
            f"layout is {verdict} than the API (${best.api_monthly_usd_at_this_load:,.0f}/month); "
            f"break-even {best.break_even_requests_per_day:,.0f} requests/day"
            + (
                ""
                if best.reaches_break_even
                else f", more than this load ({result.layouts[0].requests_per_s * 86400:,.0f} a day)"
            )
        )
    return table


def _verdict(layout: Layout, has_slo: bool) -> str:
    """'meets' only against a stated SLO; without one, only whether the layout keeps up with the load."""
    if layout.overloaded:
        return "[red]overloaded[/red]"
    if not has_slo:
        return "-"
    return "[green]meets[/green]" if layout.meets_slo else "[red]misses[/red]"


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
    deployment.update(_weight_settings(result, repo))
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


# Weight formats that come from a checkpoint already in them: what an operator needs to find.
_PREQUANTIZED = {
    "awq": "an AWQ checkpoint",
    "gptq": "a GPTQ checkpoint",
    "int8": "a W8A8 INT8 checkpoint (compressed-tensors, as llm-compressor writes it)",
    "mxfp4": "an MXFP4 checkpoint",
}


def _weight_settings(result: PlanResult, repo: str) -> dict[str, str]:
    """The deployment's settings for the plan's weight format, with `repo` (a bf16 checkpoint, or one in
    the model's native format) as the source. vLLM quantizes weights as it loads them only to fp8; any
    other format needs a checkpoint in it, which the catalog does not name: refused (ValueError)."""
    quant = result.quant.name
    if quant in ("bf16", result.model.native_quant):
        return {}
    if quant == "fp32":
        return {"dtype": "float32"}
    if quant == "fp8":
        return {"quantization": "fp8"}
    needed = _PREQUANTIZED.get(quant, "a GGUF file (served by llama.cpp: engine llamacpp)")
    raise ValueError(
        f"vLLM quantizes {repo} only to fp8 as it loads it; {quant} needs {needed} of {result.model.name}, "
        "which the catalog does not name: plan with --quant fp8 (or bf16) for a spec to start from, or "
        "write one by hand with that checkpoint as source.hf"
    )


def validation_table(report: dict[str, Any]) -> Table:
    """`corral plan --validate`: mean absolute percentage error per GPU class, leaving each source out."""
    table = Table(
        title="planner error on published measurements (fit without the point's source)",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    kinds = ("output tokens/s", "TPOT", "TTFT", "E2E latency")
    table.add_column("GPU", overflow="fold")
    for kind in kinds:
        table.add_column(f"{kind}\nMAPE (n)", justify="right", overflow="fold")
    mape = report["mape_leave_one_source_out"]
    for gpu in [g for g in sorted(mape) if g != "all"] + ["all"]:
        table.add_row(
            "all GPUs" if gpu == "all" else gpu, *(_mape_cell(mape[gpu].get(kind)) for kind in kinds)
        )
    in_sample = report["mape_in_sample"]["all"]
    table.add_row("all GPUs, in-sample", *(_mape_cell(in_sample.get(kind)) for kind in kinds))
    by_engine = report["mape_leave_one_source_out_by_engine"]
    for engine in sorted(e for e in by_engine if e != "all"):
        label = f"engine {engine}" + (" *" if engine == "vllm" else "")
        table.add_row(label, *(_mape_cell(by_engine[engine].get(kind)) for kind in kinds))
    table.caption = "* the engine whose factors the planner uses for GPUs"
    return table


def _mape_cell(cell: dict[str, Any] | None) -> str:
    return f"{cell['mape']:.1%} ({cell['n']})" if cell else "–"
