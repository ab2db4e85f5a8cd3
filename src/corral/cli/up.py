"""`corral up`, `prepare`, `status` and `version`: running a cluster from its spec."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from corral import __version__
from corral.artifacts import ArtifactError
from corral.cli.app import app, console, run_async, setup_logging
from corral.config import (
    ClusterSpec,
    Paths,
    RaySettings,
    SpecError,
    admin_key_from_env,
    default_spec,
    load_spec,
)

logger = logging.getLogger(__name__)

SpecOption = Annotated[
    Path | None, typer.Option("--file", "-f", help="cluster spec YAML; the embedded default when omitted")
]


@app.command()
def version() -> None:
    """Print corral's version."""
    print(__version__)


@app.command()
def up(
    file: SpecOption = None,
    host: Annotated[str | None, typer.Option(help="gateway address (overrides the spec)")] = None,
    port: Annotated[int | None, typer.Option(help="gateway port (overrides the spec)")] = None,
    ray: Annotated[
        str | None, typer.Option("--ray", help="run replicas on Ray: a cluster address, 'auto', or 'local'")
    ] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning")] = "info",
) -> None:
    """Fetch and build what the cluster needs, start its replicas and the gateway; Ctrl-C stops all."""
    setup_logging(log_level)
    spec = _spec(file, host=host, port=port)
    if ray is not None:
        spec = spec.model_copy(update={"ray": RaySettings(address=None if ray == "local" else ray)})
    try:
        run_async(_serve(spec, Paths.from_env()))
    except ArtifactError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None


@app.command()
def prepare(file: SpecOption = None) -> None:
    """Fetch models and build engines for a spec without starting anything."""
    setup_logging("warning")
    spec = _spec(file)
    try:
        _prepare_all(spec, Paths.from_env())
    except ArtifactError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    console.print("[green]ready:[/green] every model and engine is in the cache")


@app.command()
def status(
    url: Annotated[str, typer.Option(help="the gateway's base URL")] = "http://127.0.0.1:8000",
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Show each replica: state, load, restarts."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/corral/status", timeout=5) as response:
            data = json.load(response)
    except (urllib.error.URLError, OSError) as exc:
        console.print(f"[red]error:[/red] no corral gateway answers at {url}: {exc}")
        raise typer.Exit(1) from None
    if as_json:
        print(json.dumps(data, indent=2))
        return
    Console().print(_status_table(data["replicas"]))


def _status_table(replicas: list[dict[str, Any]]) -> Table:
    table = Table(title="corral replicas", box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("replica", "state", "address", "pid", "restarts", "in-flight", "run/wait"):
        table.add_column(column)
    colours = {"ready": "green", "starting": "yellow", "restarting": "yellow"}
    for r in replicas:
        colour = colours.get(r["state"], "red")
        table.add_row(
            r["id"],
            f"[{colour}]{r['state']}[/{colour}]",
            (r["url"] or "-").removeprefix("http://"),
            _dash(r["pid"]),
            str(r["restarts"]),
            str(r["outstanding"]),
            f"{_dash(r['running'])}/{_dash(r['waiting'])}",
        )
    return table


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


def _spec(file: Path | None, host: str | None = None, port: int | None = None) -> ClusterSpec:
    try:
        spec = load_spec(file) if file is not None else default_spec()
    except SpecError as exc:
        console.print(f"[red]error:[/red] {exc}", markup=False, highlight=False)
        raise typer.Exit(2) from None
    overrides = {k: v for k, v in {"host": host, "port": port}.items() if v is not None}
    if overrides:
        spec = spec.model_copy(update={"gateway": spec.gateway.model_copy(update=overrides)})
    return spec


def _prepare_all(spec: ClusterSpec, paths: Paths) -> list[tuple[str, Any, list[Any]]]:
    """Resolve every deployment's launch plans, showing progress; blocking."""
    from corral.engines import engine_named

    prepared = []
    with console.status("preparing") as spinner:
        for model in spec.models:
            for deployment in model.deployments:
                engine = engine_named(deployment.engine)
                report = _ProgressReport(model.name, spinner.update)
                prepared.append((model.name, engine, engine.prepare(model, deployment, paths, report)))
    return prepared


class _ProgressReport:
    """Progress messages: a live spinner on a terminal, plain lines (percentages every 10%) elsewhere."""

    def __init__(self, prefix: str, update: Any) -> None:
        self._prefix = prefix
        self._update = update
        self._last = ""

    def __call__(self, message: str) -> None:
        line = f"{self._prefix}: {message}"
        if console.is_terminal:
            self._update(line)
            return
        percent = message.rsplit(" ", 1)[-1]
        if percent.endswith("%") and percent[:-1].isdigit() and int(percent[:-1]) % 10:
            return
        if line != self._last:
            console.print(line, markup=False, highlight=False)
            self._last = line


async def _serve(spec: ClusterSpec, paths: Paths) -> None:
    from corral.cluster import Supervisor
    from corral.gateway import GatewayServer, GatewayServices
    from corral.routing import ReplicaSet, Router

    prepared = await asyncio.to_thread(_prepare_all, spec, paths)
    replicas = ReplicaSet()
    supervisor = Supervisor(replicas, _runtime(spec, paths), spec.supervisor)
    for model_name, engine, plans in prepared:
        supervisor.add(model_name, engine, plans)
    policies = {m.name: m.routing for m in spec.models if m.routing is not None}
    router = Router(replicas, policies, default_policy=spec.gateway.routing)
    services = GatewayServices.build(
        replicas,
        paths.database_url,
        spec.auth,
        spec.store,
        spec.limits,
        spec.queue,
        admin_key_from_env(spec.auth.admin_key),
        {m.name: m.tokenizer for m in spec.models if m.tokenizer is not None},
    )
    if spec.auth.open:
        logger.warning("OPEN ACCESS: requests without an API key are served (auth.open is true in the spec)")
    gateway = GatewayServer(spec.gateway, router, services)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await supervisor.start()
    try:
        await gateway.start()
        with console.status(f"starting {sum(len(p) for _, _, p in prepared)} replicas"):
            ready = await _first_of(supervisor.wait_ready(spec.supervisor.ready_timeout), stop.wait())
        if not stop.is_set():
            _announce(spec, gateway.port, replicas, ready, paths)
            await stop.wait()
        console.print("stopping: draining requests and replicas…")
    finally:
        await gateway.stop()
        await supervisor.stop()
    console.print("[green]stopped[/green]")


def _runtime(spec: ClusterSpec, paths: Paths) -> Any:
    """Local processes, or Ray actors when the spec (or --ray) asks for Ray."""
    from corral.cluster import LocalProcessRuntime

    if spec.ray is None:
        return LocalProcessRuntime(paths.logs)
    from corral.cluster.ray_runtime import RayPlacement, RayRuntime

    placements = {}
    for model in spec.models:
        d = model.deployments[0]
        gpus = (
            d.ray_gpus
            if d.ray_gpus is not None
            else (d.gpus_per_replica if d.engine == "vllm" and d.device == "gpu" else 0)
        )
        placements[model.name] = RayPlacement(
            gpus=gpus, cpus=float(d.threads), engine_workers=d.ray_workers, span_nodes=d.span_nodes
        )
    return RayRuntime(paths.logs, spec.ray.address, placements, spec.ray.placement_timeout)


async def _first_of(*aws: Any) -> Any:
    tasks = [asyncio.ensure_future(a) for a in aws]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return next(iter(done)).result()


def _announce(spec: ClusterSpec, port: int | None, replicas: Any, ready: bool, paths: Paths) -> None:
    base = f"http://{spec.gateway.host}:{port}/v1"
    if not ready:
        console.print(f"[yellow]some replicas are not ready yet; logs in {paths.logs}[/yellow]")
    console.print(_status_table([r.snapshot() for r in replicas]))
    console.print(
        f"[bold green]corral is serving[/bold green] {', '.join(replicas.models())} at [bold]{base}[/bold]\n"
        f"  point an OpenAI client at it: OPENAI_BASE_URL={base} OPENAI_API_KEY=none\n"
        f"  replica logs: {paths.logs}   status: corral status --url http://{spec.gateway.host}:{port}\n"
        "  Ctrl-C stops everything."
    )
