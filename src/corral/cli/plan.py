"""`corral plan`: size a cluster before buying it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from corral.cli.app import FlagsCommand, app, console, fail

__all__ = ["plan_command"]

MAX_CONCURRENCY = 4096


@app.command("plan", cls=FlagsCommand)
def plan_command(
    model: Annotated[
        str | None, typer.Option(help="model from the catalog (e.g. llama-3.1-8b) or its HF id [required]")
    ] = None,
    gpu: Annotated[
        str, typer.Option(help="GPU type from the catalog, or 'all' to search every GPU class")
    ] = "all",
    gpus: Annotated[
        int | None, typer.Option(help="use exactly this many GPUs", min=1, metavar="<int>")
    ] = None,
    quant: Annotated[
        str | None, typer.Option(help="bf16, fp8, int8, awq, gptq, mxfp4, gguf-q4, gguf-q8")
    ] = None,
    context: Annotated[
        int | None, typer.Option(help="max context length per sequence (tokens)", min=1, metavar="<int>")
    ] = None,
    concurrency: Annotated[
        int | None,
        typer.Option(
            help=f"concurrent requests to serve (default: 16; at most {MAX_CONCURRENCY}: every client is "
            "simulated, and past that a search takes minutes; state a larger load as --request-rate)",
            min=1,
            max=MAX_CONCURRENCY,
            metavar="<int>",
        ),
    ] = None,
    request_rate: Annotated[
        float | None, typer.Option(help="requests/s arriving at random (Poisson); instead of --concurrency")
    ] = None,
    input_len: Annotated[int, typer.Option(help="prompt tokens per request", min=1, metavar="<int>")] = 1024,
    output_len: Annotated[int, typer.Option(help="output tokens per request", min=1, metavar="<int>")] = 256,
    ttft_p95_ms: Annotated[float | None, typer.Option(help="SLO: time to first token, p95 (ms)")] = None,
    itl_ms: Annotated[float | None, typer.Option(help="SLO: mean inter-token latency (ms)")] = None,
    api: Annotated[
        str | None,
        typer.Option(
            help="hosted API to compare costs with (default: one serving models of the model's size)"
        ),
    ] = None,
    max_gpus: Annotated[
        int | None,
        typer.Option(help="largest cluster to consider (default: 64, or --gpus)", min=1, metavar="<int>"),
    ] = None,
    limit: Annotated[int, typer.Option(help="how many layouts to show", min=1, metavar="<int>")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
    yaml_out: Annotated[
        Path | None, typer.Option("--yaml", help="write a cluster.yaml for the best layout")
    ] = None,
    catalog: Annotated[
        list[Path] | None, typer.Option(help="extra catalog YAML (your GPUs, models, prices)")
    ] = None,
    explain: Annotated[
        bool, typer.Option("--explain", help="show where the best layout's step time and TTFT go")
    ] = False,
    calibrate: Annotated[
        bool,
        typer.Option(
            "--calibrate",
            help="refit the efficiency factors on the published corpus; print perf/data/fitted.yaml (~30 s)",
        ),
    ] = False,
    validate: Annotated[
        bool,
        typer.Option(
            "--validate", help="the planner's error on published measurements, each source left out (~30 s)"
        ),
    ] = False,
) -> None:
    """Size a cluster: the cheapest GPU layouts that hold the model and meet the SLOs, and their cost."""
    from corral.perf import CatalogError, load_catalog
    from corral.perf.calibration import calibrated_efficiency
    from corral.plan import PlanRequest, plan, plan_json, plan_table, plan_yaml
    from corral.plan.explain import explain as explain_step
    from corral.plan.explain import explain_table, ttft_table

    if gpus is not None and max_gpus is not None and gpus > max_gpus:
        fail(f"--gpus {gpus} is more than --max-gpus {max_gpus}: give one, or raise --max-gpus", 2)
    if concurrency is not None and request_rate is not None:
        fail("--concurrency and --request-rate are two ways to state the load: give one", 2)
    for flag, value in (
        ("--request-rate", request_rate),
        ("--ttft-p95-ms", ttft_p95_ms),
        ("--itl-ms", itl_ms),
    ):
        if value is not None and not (0 < value < math.inf):  # (nan compares false too)
            fail(f"{flag} {value:g}: give a number above 0", 2)
    if validate and calibrate:
        fail("--validate reports the fit's error, --calibrate prints the fit: give one", 2)
    if validate or calibrate:
        _validate(as_json, calibrate)
        return
    if model is None:
        fail("--model is required (a catalog name such as llama-3.1-8b)", 2)
    try:
        entries = load_catalog(catalog or [])
        request = PlanRequest(
            model=model,
            gpu=gpu,
            gpus=gpus,
            quant=quant,
            context=context,
            concurrency=concurrency or 16,
            request_rate=request_rate,
            input_len=input_len,
            output_len=output_len,
            ttft_p95_ms=ttft_p95_ms,
            itl_ms=itl_ms,
            api=api,
            max_gpus=max_gpus or max(64, gpus or 0),
            limit=limit,
        )
        result = plan(request, entries, calibrated_efficiency())
    except CatalogError as exc:
        fail(str(exc), 2)
    explained = (
        explain_step(result, result.layouts[0], entries, calibrated_efficiency())
        if explain and result.fits
        else None
    )
    if as_json:
        print(json.dumps({**plan_json(result), **({"explain": explained} if explained else {})}, indent=2))
    elif result.fits:
        Console().print(plan_table(result))
        if explained is not None:
            Console().print(explain_table(explained))
            Console().print(ttft_table(explained))
    if not result.fits:
        console.print(f"[red]does not fit:[/red] {escape(result.reason or '')}", soft_wrap=True)
    elif result.reason:  # layouts, none meeting the objective: the closest is listed first
        console.print(f"[red]misses the objective:[/red] {escape(result.reason)}", soft_wrap=True)
    if yaml_out is not None and result.fits:
        try:
            yaml_out.write_text(plan_yaml(result))
        except ValueError as exc:  # a weight format vLLM cannot make from the catalog's checkpoint
            fail(f"--yaml {yaml_out}: not written: {exc}")
        except OSError as exc:
            fail(f"--yaml {yaml_out}: cannot write: {exc.strerror or exc}")
        console.print(f"wrote {yaml_out}")
    if not result.fits or result.reason:
        raise typer.Exit(1)


def _validate(as_json: bool, calibrate: bool) -> None:
    from corral.perf import load_catalog
    from corral.perf.calibration import fitted_document
    from corral.perf.validation import report, validate
    from corral.plan.render import validation_table

    console.print(
        "fitting the planner on the published points, each source left out in turn (about 30 s)…",
        highlight=False,
    )
    with Progress(
        TextColumn("fits"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,  # stderr: stdout keeps the JSON or the fitted document
        transient=True,
    ) as bar:
        task = bar.add_task("fits", total=None)
        validation = validate(
            load_catalog(), progress=lambda done, total: bar.update(task, completed=done, total=total)
        )
    if calibrate:
        print(fitted_document(validation), end="")
        return
    result = report(validation)
    if as_json:
        print(json.dumps(result, indent=2))
        return
    Console().print(validation_table(result))
    console.print(
        "Each row's error is of predictions made without the point's source (leave one source out: what a "
        "new GPU or workload can expect); 'in-sample' predicts the points the factors were fitted on (a "
        "floor, not a claim).",
        highlight=False,
    )
    console.print("The factors the planner uses, fitted on every source:", highlight=False)
    for family, factors in result["factors"].items():
        console.print(
            f"  {family}: bandwidth {factors['bandwidth']}, compute {factors['compute']}, "
            f"overhead {factors['step_overhead_s'] * 1000:.2f} ms/step, overlap p={factors['overlap']}, "
            f"request {factors['request_overhead_s'] * 1000:.1f} ms + "
            f"{factors.get('stream_overhead_s', 0.0) * 1000:.2f} ms a stream in flight",
            highlight=False,
        )
    console.print(
        f"{len(result['points'])} points predicted, {result['unused']} recorded but not stated by the "
        f"planner (see `unused` in perf/data/published.yaml), {len(result['refused'])} it says do not fit",
        highlight=False,
    )
