"""`corral bench`: load-test any OpenAI-compatible endpoint (flags follow vLLM's benchmark where shared)."""

from __future__ import annotations

import json
import math
import tempfile
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from corral.cli.app import FlagsCommand, FlagsGroup, app, console, fail, run_async

__all__ = ["bench_app"]

bench_app = typer.Typer(
    help="Load-test an OpenAI-compatible endpoint.", cls=FlagsGroup, invoke_without_command=True
)
app.add_typer(bench_app, name="bench")


class Endpoint(StrEnum):
    completions = "/v1/completions"
    chat = "/v1/chat/completions"


class Dataset(StrEnum):
    random = "random"
    sharegpt = "sharegpt"
    prefix = "prefix"


@bench_app.callback()
def bench(
    ctx: typer.Context,
    base_url: Annotated[
        str | None, typer.Option(help="the server without /v1, e.g. http://127.0.0.1:8000 [required]")
    ] = None,
    model: Annotated[str | None, typer.Option(help="model name to request [required]")] = None,
    endpoint: Annotated[Endpoint, typer.Option(help="the API to load")] = Endpoint.completions,
    api_key: Annotated[str | None, typer.Option(help="sent as Bearer token")] = None,
    dataset_name: Annotated[
        Dataset, typer.Option(help="random prompts, a ShareGPT file, or multi-tenant shared prefixes")
    ] = Dataset.random,
    dataset_path: Annotated[Path | None, typer.Option(help="ShareGPT JSON file")] = None,
    num_prompts: Annotated[
        int, typer.Option(help="requests to send (measured ones, after warm-up)", min=1)
    ] = 100,
    max_concurrency: Annotated[int | None, typer.Option(help="requests in flight at most", min=1)] = None,
    request_rate: Annotated[float, typer.Option(help="requests/s (inf: all at once)")] = math.inf,
    burstiness: Annotated[float, typer.Option(help="gamma shape of arrivals: 1 Poisson, <1 burstier")] = 1.0,
    ramp_up_seconds: Annotated[float, typer.Option(help="grow the rate linearly over this long")] = 0.0,
    duration: Annotated[
        float | None, typer.Option(help="send for this many seconds instead of a count")
    ] = None,
    warmup: Annotated[
        int,
        typer.Option(
            help="requests sent first, all finished before the measured ones start; left out", min=0
        ),
    ] = 0,
    random_input_len: Annotated[int, typer.Option(help="random dataset: prompt tokens", min=1)] = 1024,
    random_output_len: Annotated[int, typer.Option(help="output tokens asked for (max_tokens)", min=1)] = 128,
    random_range_ratio: Annotated[float, typer.Option(help="lengths vary ±this share (0 to under 1)")] = 0.0,
    prefix_tenants: Annotated[int, typer.Option(help="prefix dataset: tenants", min=1)] = 8,
    prefix_len: Annotated[int, typer.Option(help="prefix dataset: shared prompt words", min=0)] = 1000,
    prefix_question_len: Annotated[int, typer.Option(help="prefix dataset: words per user turn", min=1)] = 50,
    prefix_turns: Annotated[int, typer.Option(help="prefix dataset: turns per chat", min=1)] = 3,
    ignore_eos: Annotated[bool, typer.Option(help="ask the server to generate exactly max_tokens")] = False,
    seed: Annotated[int, typer.Option(help="seed for prompts and arrival times")] = 0,
    sweep_concurrency: Annotated[str | None, typer.Option(help="e.g. 1,4,16,64")] = None,
    sweep_rates: Annotated[str | None, typer.Option(help="e.g. 1,2,4,8 requests/s")] = None,
    goodput: Annotated[
        list[str] | None, typer.Option(help="SLO, e.g. ttft:500 tpot:50 e2el:5000 (ms)")
    ] = None,
    search_goodput: Annotated[bool, typer.Option(help="find the highest rate meeting the SLOs")] = False,
    output: Annotated[Path | None, typer.Option(help="write JSON results here")] = None,
    save_detailed: Annotated[bool, typer.Option(help="include every request in the JSON")] = False,
    html: Annotated[Path | None, typer.Option(help="write a self-contained HTML report")] = None,
    plots: Annotated[Path | None, typer.Option(help="write PNG plots into this folder")] = None,
) -> None:
    """Load-test an endpoint and report TTFT, ITL, TPOT, E2E, throughput, goodput and errors."""
    if ctx.invoked_subcommand is not None:
        return
    if not base_url or not model:
        fail("--base-url and --model are required", 2)
    from corral.bench import LoadPlan, PreflightError, preflight

    _check_ranges(request_rate, burstiness, ramp_up_seconds, duration, random_range_ratio)
    for flag, path, folder in (
        ("--output", output, False),
        ("--html", html, False),
        ("--plots", plots, True),
    ):
        if path is not None:
            _check_writable(flag, path, folder)
    slo = _slo(goodput or [])
    plan = LoadPlan(
        base_url=base_url,
        model=model,
        endpoint=str(endpoint),
        api_key=api_key,
        max_concurrency=max_concurrency,
        request_rate=request_rate,
        burstiness=burstiness,
        ramp_up_s=ramp_up_seconds,
        duration_s=duration,
        warmup=warmup,
        ignore_eos=ignore_eos,
        seed=seed,
    )
    sweep = _sweep(sweep_concurrency, sweep_rates, plan)
    requests = _requests(
        str(dataset_name),
        dataset_path,
        num_prompts + warmup,
        random_input_len,
        random_output_len,
        random_range_ratio,
        seed,
        str(endpoint),
        prefix_tenants,
        prefix_len,
        prefix_question_len,
        prefix_turns,
    )
    if search_goodput and not slo.any:
        fail("--search-goodput needs --goodput SLOs", 2)
    if search_goodput and max_concurrency is not None:
        # a request's clock starts when it gets a slot: at a rate the server cannot keep up with, requests
        # would wait in this client, unmeasured, and every rate would look met
        fail(
            "--search-goodput offers rising request rates; --max-concurrency would hold them back in the "
            "client, where their wait is not measured, so leave it out",
            2,
        )
    detailed = save_detailed or bool(html or plots)
    try:
        preflight(base_url, model, str(endpoint), api_key)
    except PreflightError as exc:
        fail(str(exc))
    runs = [dict(_run(p, requests, slo, detailed), load=label) for label, p in sweep]
    result: dict[str, Any] = {
        **runs[-1],
        "runs": runs,
        "config": _config(plan, str(dataset_name), num_prompts),
    }
    if search_goodput:
        result["max_goodput_rate"] = _search(plan, requests, slo)
    _show(runs, slo)
    for warning in runs[-1]["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {warning}")
    if output is not None:
        output.write_text(json.dumps(result, indent=2))
        console.print(f"wrote {output}")
    if plots is not None:
        from corral.bench import write_plots

        for path in write_plots(result, plots):
            console.print(f"wrote {path}")
    if html is not None:
        from corral.bench import write_html

        write_html(result, html)
        console.print(f"wrote {html}")
    if not any(r["completed"] for r in runs):
        fail(f"no request succeeded ({_error_kinds(runs[-1]['errors'])})")


def _check_ranges(
    request_rate: float, burstiness: float, ramp_up: float, duration: float | None, range_ratio: float
) -> None:
    """Numbers a run cannot use, refused before it starts (nan fails every comparison, so every check)."""
    checks = (
        ("--request-rate", request_rate, request_rate > 0, "requests/s above 0 (inf: all at once)"),
        ("--burstiness", burstiness, 0 < burstiness < math.inf, "a number above 0 (1: Poisson)"),
        ("--ramp-up-seconds", ramp_up, 0 <= ramp_up < math.inf, "0 or more seconds"),
        ("--duration", duration, duration is None or 0 < duration < math.inf, "a number of seconds above 0"),
        ("--random-range-ratio", range_ratio, 0 <= range_ratio < 1, "a share of at least 0 and under 1"),
    )
    for flag, value, good, wanted in checks:
        if not good:
            fail(f"{flag} {value:g}: give {wanted}", 2)


def _check_writable(flag: str, path: Path, folder: bool) -> None:
    """Fail before the run, not after it, where its results could not be written to `path`."""
    try:
        if folder:
            path.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=path).close()
        else:
            existed = path.exists()
            path.open("a").close()
            if not existed:
                path.unlink()
    except OSError as exc:
        fail(f"{flag} {path}: cannot write there: {exc.strerror or exc}", 2)


def _sweep(concurrencies: str | None, rates: str | None, plan: Any) -> list[tuple[str, Any]]:
    """The loads to run: each concurrency or rate of a sweep, or the one plan."""
    if concurrencies:
        values = _numbers(concurrencies, "--sweep-concurrency", int)
        return [(f"c={c}", _replace(plan, max_concurrency=c)) for c in values]
    if rates:
        return [(f"{r:g}/s", _replace(plan, request_rate=r)) for r in _numbers(rates, "--sweep-rates", float)]
    return [("", plan)]


def _numbers(text: str, flag: str, kind: type[int] | type[float]) -> list[Any]:
    values = []
    for part in text.split(","):
        try:
            value = kind(part.strip())
        except ValueError:
            fail(f"{flag}: {part.strip()!r} is not a number; give a comma-separated list such as 1,4,16", 2)
        if not value > 0:  # (nan too)
            fail(f"{flag}: {value} must be greater than 0", 2)
        values.append(value)
    return values


def _error_kinds(errors: dict[str, int]) -> str:
    return ", ".join(f"{kind}: {count}" for kind, count in sorted(errors.items(), key=lambda e: -e[1]))


@bench_app.command("compare", cls=FlagsCommand)
def compare_command(
    a: Annotated[Path, typer.Argument(help="the baseline result (--output of a run)")],
    b: Annotated[Path, typer.Argument(help="the result to compare with it")],
) -> None:
    """Show two result files side by side, with B's change relative to A."""
    from corral.bench import compare

    rows = compare(_result(a), _result(b))
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("metric", a.name, b.name, "change"):
        table.add_column(column, justify="left" if column == "metric" else "right", overflow="fold")
    for metric, va, vb, change in rows:
        table.add_row(metric, f"{va:,.2f}", f"{vb:,.2f}", f"{change:+.1%}" if change is not None else "-")
    Console().print(table)


def _result(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror or exc}")
    except ValueError as exc:
        fail(f"{path} is not JSON ({exc}); give files written by corral bench --output")
    if not isinstance(data, dict) or "runs" not in data:
        fail(f"{path} is not a corral bench result (written by corral bench --output)")
    from corral.bench.report import last_run

    try:
        last_run(data)
    except ValueError as exc:
        fail(f"{path} is not a whole corral bench result: {exc} (written by corral bench --output?)")
    return data


def _run(plan: Any, requests: list[Any], slo: Any, detailed: bool) -> dict[str, Any]:
    from corral.bench import run_load, summarise

    columns = (TextColumn("[bold]bench[/bold]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("requests", total=len(requests) if plan.duration_s is None else None)

        def advance(done: int, total: int) -> None:
            progress.update(task, completed=done)

        outcome: list[Any] = []

        async def go() -> None:
            outcome.append(await run_load(plan, requests, advance))

        run_async(go())
    return summarise(outcome[0], slo, detailed)


def _search(plan: Any, requests: list[Any], slo: Any) -> float:
    """Highest request rate at which at least 90% of requests meet the SLOs (doubling, then bisection)."""

    def good(rate: float) -> bool:
        summary = _run(_replace(plan, request_rate=rate), requests, slo, False)
        return bool(summary["completed"]) and summary["slo"]["met_share"] >= 0.9

    low, high = 0.0, 1.0
    while good(high) and high < 1024:
        low, high = high, high * 2
    for _ in range(4):
        middle = (low + high) / 2
        low, high = (middle, high) if good(middle) else (low, middle)
    return round(low, 3)


def _replace(plan: Any, **changes: Any) -> Any:
    from dataclasses import replace

    return replace(plan, **changes)


def _slo(items: list[str]) -> Any:
    from corral.bench import Slo

    values: dict[str, float] = {}
    names = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2e_ms", "e2e": "e2e_ms"}
    for item in items:
        for part in item.split():
            name, _, value = part.partition(":")
            if name not in names or not value:
                fail(f"bad --goodput {part!r}; use ttft:MS tpot:MS e2el:MS", 2)
            try:
                values[names[name]] = float(value)
            except ValueError:
                fail(f"bad --goodput {part!r}: {value!r} is not a number of milliseconds", 2)
            if not 0 < values[names[name]] < math.inf:
                fail(f"bad --goodput {part!r}: give milliseconds above 0", 2)
    return Slo(**values)


def _requests(
    name: str,
    path: Path | None,
    count: int,
    input_len: int,
    output_len: int,
    ratio: float,
    seed: int,
    endpoint: str,
    tenants: int,
    prefix_len: int,
    question_len: int,
    turns: int,
) -> list[Any]:
    from corral.bench import random_requests, shared_prefix_requests, sharegpt_requests

    if name == "random":
        return random_requests(count, input_len, output_len, ratio, seed, chat="chat" in endpoint)
    if name == "sharegpt":
        if path is None:
            fail("--dataset-name sharegpt needs --dataset-path", 2)
        try:
            return sharegpt_requests(path, count, seed, chat="chat" in endpoint)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            fail(f"cannot use {path} as a ShareGPT file: {exc}", 2)
    if "chat" not in endpoint:
        fail("the prefix dataset is chat: use --endpoint /v1/chat/completions", 2)
    return shared_prefix_requests(count, tenants, prefix_len, question_len, output_len, turns, seed)


def _config(plan: Any, dataset: str, num_prompts: int) -> dict[str, Any]:
    return {
        "base_url": plan.base_url,
        "model": plan.model,
        "endpoint": plan.endpoint,
        "dataset": dataset,
        "num_prompts": num_prompts,
        "max_concurrency": plan.max_concurrency,
        "request_rate": None if math.isinf(plan.request_rate) else plan.request_rate,
        "burstiness": plan.burstiness,
        "warmup": plan.warmup,
    }


def _show(runs: list[dict[str, Any]], slo: Any) -> None:
    """Units in the headers keep every cell short: the table reads at 80 columns, and a number too wide
    for its column folds onto the next line, never cut."""
    table = Table(title="corral bench", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for column in (
        "load",
        "req/s",
        "out\ntok/s",
        "TTFT ms\np50/p99",
        "TPOT ms\np50/p99",
        "ITL ms\np50/p99",
        "E2E ms\np50",
        "errors",
    ):
        table.add_column(column, justify="right", overflow="fold")
    for r in runs:
        table.add_row(
            r["load"] or "-",
            f"{r['requests_per_s']:,.2f}",
            f"{r['output_tokens_per_s']:,.1f}",
            f"{r['ttft_ms']['p50']:.0f}/{r['ttft_ms']['p99']:.0f}",
            f"{r['tpot_ms']['p50']:.1f}/{r['tpot_ms']['p99']:.1f}",
            f"{r['itl_ms']['p50']:.1f}/{r['itl_ms']['p99']:.1f}",
            f"{r['e2e_ms']['p50']:,.0f}",
            str(sum(r["errors"].values())),
        )
    Console().print(table)
    for r in runs:
        if r["errors"]:
            where = f" at {r['load']}" if r["load"] else ""
            console.print(f"[yellow]errors{where}:[/yellow] {_error_kinds(r['errors'])}", highlight=False)
    if slo.any:
        console.print(f"goodput: {runs[-1]['goodput_requests_per_s']:.2f} requests/s meeting the SLOs")
