"""`corral up`, `prepare` and `version`: running a cluster from its spec."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import signal
import types
from collections.abc import Collection
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from corral import __version__
from corral.artifacts import ArtifactError
from corral.cli.app import (
    CliError,
    FlagsCommand,
    LogFormat,
    LogLevel,
    app,
    console,
    fail,
    live_progress,
    logs_are_json,
    run_async,
    setup_logging,
)
from corral.cli.control import status_table
from corral.cli.gateway_spec import (
    apply_cluster_settings,
    apply_model_settings,
    cluster_settings,
    gateway_parts_for,
    model_settings,
    router_for,
)
from corral.config import (
    ClusterSpec,
    Paths,
    SpecError,
    default_spec,
    load_spec,
    validation_message,
)

logger = logging.getLogger(__name__)

SpecOption = Annotated[
    Path | None, typer.Option("--file", "-f", help="cluster spec YAML; the embedded default when omitted")
]


@app.command(cls=FlagsCommand)
def version() -> None:
    """Print corral's version (also: corral --version)."""
    print(__version__)


@app.command(cls=FlagsCommand)
def up(
    file: SpecOption = None,
    host: Annotated[str | None, typer.Option(help="gateway address (overrides the spec)")] = None,
    port: Annotated[int | None, typer.Option(help="gateway port (overrides the spec; 0: any free)")] = None,
    ray: Annotated[
        str | None, typer.Option("--ray", help="run replicas on Ray: a cluster address, 'auto', or 'local'")
    ] = None,
    log_level: Annotated[LogLevel, typer.Option(help="how much corral logs")] = LogLevel.info,
    log_format: Annotated[
        LogFormat,
        typer.Option(
            help="rich (a terminal's), text (a line an event), json (an object a line); auto: rich "
            "on a terminal, else text"
        ),
    ] = LogFormat.auto,
) -> None:
    """Fetch and build what the cluster needs, start its replicas and the gateway; Ctrl-C stops all."""
    setup_logging(log_level, log_format)
    overrides = Overrides(host=host, port=port, ray=ray)
    spec = _spec(file, overrides)
    paths = Paths.from_env()
    # (before any model is fetched or engine built: each of these was found only after)
    preflight_or_fail(spec, file, gateway=True, store_url=spec.store.url or paths.database_url)
    _check_tls(spec)
    prepared = _prepare_or_fail(spec, paths)  # in the foreground: Ctrl-C ends an install at once
    from corral.engines.devices import usable_cpus

    workers = spec.gateway_workers(len(usable_cpus()))  # (a container's CPU limit, not the node's cores)
    if workers > 1:
        run_async(_serve_workers(spec, paths, prepared, workers, f"{log_level}:{log_format}", overrides))
    else:
        run_async(_serve(spec, paths, prepared, overrides))


@app.command(cls=FlagsCommand)
def prepare(file: SpecOption = None) -> None:
    """Fetch models and build engines for a spec without starting anything."""
    setup_logging("warning")
    spec = _spec(file)
    preflight_or_fail(spec, file)  # the models' files (what serving needs besides, `corral up` checks)
    _prepare_or_fail(spec, Paths.from_env())
    console.print("[green]ready:[/green] every model and engine is in the cache")


def _spec(file: Path | None, overrides: Overrides | None = None) -> ClusterSpec:
    try:
        spec = load_spec(file) if file is not None else default_spec()
        return overrides(spec) if overrides is not None else spec
    except (SpecError, ValueError) as exc:
        fail(str(exc), 2)


_FLAG_OF: dict[tuple[int | str, ...], str] = {
    ("gateway", "host"): "--host",
    ("gateway", "port"): "--port",
    ("ray", "address"): "--ray",
}


@dataclasses.dataclass(frozen=True)
class Overrides:
    """What `corral up`'s flags change in the spec of its file: in the spec it starts with, and in each one
    a live `corral apply` sends later (whose file does not say them either)."""

    host: str | None = None
    port: int | None = None
    ray: str | None = None  # a Ray cluster's address, 'auto', or 'local' (start one)

    def __call__(self, spec: ClusterSpec) -> ClusterSpec:
        """`spec` with the flags' values, checked as a file's are; ValueError naming the flag otherwise."""
        gateway = {k: v for k, v in (("host", self.host), ("port", self.port)) if v is not None}
        if not gateway and self.ray is None:
            return spec
        data = spec.model_dump()
        data["gateway"].update(gateway)
        if self.ray is not None:
            data["ray"] = {**(data["ray"] or {}), "address": None if self.ray == "local" else self.ray}
        try:
            return ClusterSpec.model_validate(data)
        except ValidationError as exc:
            given = {"--host": self.host, "--port": self.port, "--ray": self.ray}
            problems = []
            for error in exc.errors():
                flag = _FLAG_OF.get(tuple(error["loc"]))
                message = validation_message(error)
                problems.append(f"{flag} {given[flag]}: {message}" if flag else message)
            raise ValueError("; ".join(problems)) from None


def preflight_or_fail(
    spec: ClusterSpec,
    file: Path | None,
    *,
    models: Collection[str] | None = None,
    gateway: bool = False,
    store_url: str | None = None,
) -> None:
    """End the command (exit 2) naming every problem `preflight` finds with the spec (read from `file`)."""
    from corral.cluster.preflight import preflight

    problems = preflight(spec, models=models, gateway=gateway, store_url=store_url)
    if not problems:
        return
    where = f"{file}: " if file is not None else ""
    if len(problems) == 1:
        fail(where + problems[0], 2)
    fail(f"{where}{len(problems)} problems:\n" + "\n".join(f"  {problem}" for problem in problems), 2)


def _check_tls(spec: ClusterSpec) -> None:
    """A certificate that cannot be used fails before anything starts (each worker loads it again)."""
    from corral.gateway.server import TLSError, server_tls_context

    if spec.gateway.tls is not None:
        try:
            server_tls_context(spec.gateway.tls)
        except TLSError as exc:
            fail(str(exc), 2)


def _prepare_or_fail(spec: ClusterSpec, paths: Paths) -> list[tuple[str, Any, list[Any]]]:
    """Check the devices the spec needs on this machine, then prepare; a problem is one error line."""
    from corral.engines.devices import DeviceError, check_local_gpus, local_gpu_count

    try:
        if spec.ray is None:
            check_local_gpus(spec, local_gpu_count())
        return _prepare_all(spec, paths)
    except (ArtifactError, DeviceError) as exc:
        fail(str(exc))


def _prepare_all(spec: ClusterSpec, paths: Paths) -> list[tuple[str, Any, list[Any]]]:
    """Resolve every deployment's launch plans, showing progress; blocking."""
    from corral.engines import engine_named, launch_plans

    prepared = []
    with _spinner("preparing") as spinner:
        for model in spec.models:
            for deployment in model.deployments:
                engine = engine_named(deployment.engine)
                report = _ProgressReport(model.name, spinner.update)
                if deployment.autoscale is not None:  # plans for its most replicas (vLLM's differ by GPU)
                    deployment = deployment.model_copy(update={"replicas": deployment.autoscale.max_replicas})
                prepared.append((model.name, engine, launch_plans(engine, model, deployment, paths, report)))
    return prepared


class _ProgressReport:
    """Progress messages: a live spinner on a terminal, plain lines (percentages every 10%) elsewhere."""

    def __init__(self, prefix: str, update: Any) -> None:
        self._prefix = prefix
        self._update = update
        self._last = ""

    def __call__(self, message: str) -> None:
        line = f"{self._prefix}: {message}"
        if live_progress():
            self._update(line)
            return
        percent = message.rsplit(" ", 1)[-1]
        if percent.endswith("%") and percent[:-1].isdigit() and int(percent[:-1]) % 10:
            return
        if line != self._last:
            _say(line)
            self._last = line


async def _serve(
    spec: ClusterSpec, paths: Paths, prepared: list[tuple[str, Any, list[Any]]], overrides: Overrides
) -> None:
    from corral.gateway import GatewayServer

    supervisor = _supervisor(spec, paths, prepared)
    replicas = supervisor.replicas
    router = router_for(spec, replicas)
    parts = gateway_parts_for(spec, paths, replicas)
    reconciler = _reconciler(
        spec,
        paths,
        supervisor,
        partial(_tell, partial(apply_model_settings, router, parts), paths),
        parts.queue.pressure,
        lambda wanted: apply_cluster_settings(router, parts, cluster_settings(wanted)),
        overrides=overrides,
    )
    # The admin API's drain, apply and rollouts reach the reconciler in this process.
    gateway = GatewayServer(spec.gateway, router, dataclasses.replace(parts, control=reconciler))
    if spec.auth.open:
        logger.warning("OPEN ACCESS: requests without an API key are served (auth.open is true in the spec)")

    stop = _stop_on_signals()
    try:
        await gateway.start()
    except OSError as exc:
        raise _cannot_listen(spec, exc) from None
    try:
        await supervisor.start()
        reconciler.start(prepared)
        await _until_serving(spec, gateway.port, supervisor, paths, stop)
        await stop.wait()
        _say("stopping: draining requests and replicas…")
    finally:
        await reconciler.stop()
        await gateway.stop()
        await supervisor.stop()
    _say("stopped")


async def _serve_workers(
    spec: ClusterSpec,
    paths: Paths,
    prepared: list[tuple[str, Any, list[Any]]],
    workers: int,
    logs: str,
    overrides: Overrides,
) -> None:
    """The supervisor in this process, the gateway in `workers` processes on one port (cluster/workers.py)."""
    from corral.cluster import WorkerError, WorkerPool

    supervisor = _supervisor(spec, paths, prepared)
    replicas = supervisor.replicas
    gateway_parts_for(spec, paths, replicas)  # the store answers and its schema exists before workers use it
    if spec.auth.open:
        logger.warning("OPEN ACCESS: requests without an API key are served (auth.open is true in the spec)")
    pool = WorkerPool(replicas, spec.model_dump(mode="json"), workers, logs, spec.gateway.shutdown_grace)
    # The workers' admin API asks this process's reconciler over the control socket (apply, drain,
    # rollouts); their queues reach its autoscaler the same way.
    reconciler = pool.control = _reconciler(
        spec,
        paths,
        supervisor,
        partial(_tell, pool.announce_model, paths),
        pool.pressure,
        lambda wanted: pool.announce_cluster(cluster_settings(wanted)),
        workers,
        overrides=overrides,
    )
    try:
        port = pool.reserve(spec.gateway.host, spec.gateway.port)
    except OSError as exc:
        raise _cannot_listen(spec, exc) from None
    stop = _stop_on_signals()
    try:
        await pool.start()
        await supervisor.start()
        reconciler.start(prepared)
        await _until_serving(spec, port, supervisor, paths, stop)
        await stop.wait()
        _say("stopping: draining requests and replicas…")
    except WorkerError as exc:
        raise CliError(str(exc)) from None
    finally:
        await reconciler.stop()
        await pool.stop()
        await supervisor.stop()
    _say("stopped")


def _supervisor(spec: ClusterSpec, paths: Paths, prepared: list[tuple[str, Any, list[Any]]]) -> Any:
    """The supervisor of the prepared replicas, each deployment of a model its own group (an autoscaled
    one starts with its `replicas`; the autoscaler keeps the other plans)."""
    from corral.cluster import Supervisor
    from corral.routing import ReplicaSet

    supervisor = Supervisor(ReplicaSet(), _runtime(spec, paths), spec.supervisor)
    models = {m.name: m for m in spec.models}
    groups: dict[str, int] = {}
    for model_name, engine, plans in prepared:
        group = groups[model_name] = groups.get(model_name, -1) + 1
        supervisor.add(model_name, engine, plans[: models[model_name].deployments[group].replicas], group)
    return supervisor


async def _tell(tell: Any, paths: Paths, model: Any) -> None:
    """The gateway(s) learn a model's settings (`tell`), read in a thread: an adapter's source may be
    asked of its hub, which on the event loop would stall every request."""
    tell(await asyncio.to_thread(model_settings, model, paths))


def _reconciler(
    spec: ClusterSpec,
    paths: Paths,
    supervisor: Any,
    on_model: Any,
    pressure: Any,
    on_cluster: Any,
    workers: int = 1,
    *,
    overrides: Overrides | None = None,
) -> Any:
    """What `corral apply` and `rollout` talk to, and the autoscaler's owner: prepares new deployments
    (blocking, in a thread), has the gateway(s) learn a model's settings (`on_model`) before it is served,
    reads the gateways' queues (`pressure`) and hands them live cluster settings (`on_cluster`)."""
    from corral.cluster.reconcile import Reconciler
    from corral.engines import engine_named, launch_plans

    def prepare(model: Any, deployment: Any) -> tuple[Any, list[Any]]:
        def report(message: str) -> None:
            logger.info("%s: %s", model.name, message)

        engine = engine_named(deployment.engine)
        return engine, launch_plans(engine, model, deployment, paths, report)

    def adapter_path(adapter: Any) -> str:
        from corral.artifacts import resolve_adapter

        return str(resolve_adapter(adapter.source, paths))

    return Reconciler(
        supervisor, spec, prepare, on_model, pressure, on_cluster, adapter_path, workers, overrides=overrides
    )


def _stop_on_signals() -> asyncio.Event:
    """An event set by Ctrl-C or SIGTERM (the running loop's handlers, not a KeyboardInterrupt)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def _cannot_listen(spec: ClusterSpec, exc: OSError) -> CliError:
    where = spec.gateway.listen_address
    return CliError(f"cannot listen on {where}: {exc.strerror or exc} (choose another with --port)")


async def _until_serving(
    spec: ClusterSpec, port: int | None, supervisor: Any, paths: Paths, stop: asyncio.Event
) -> None:
    """Announce the cluster once every model has a ready replica; fail when a model's replicas all gave up.
    Never says "serving" while a model has none ready."""
    replicas = supervisor.replicas
    waited = 0.0
    with _spinner(f"starting {sum(1 for _ in replicas)} replicas"):
        while not stop.is_set():
            ready = await _first_of(supervisor.wait_ready(spec.supervisor.ready_timeout), stop.wait())
            if stop.is_set():
                return
            failed = supervisor.failed_models()
            if failed:
                raise CliError(_cannot_start(failed, replicas, paths, spec.supervisor.max_start_failures))
            if ready:
                break
            waited += spec.supervisor.ready_timeout
            pending = [m for m in replicas.models() if not replicas.ready(m)]
            _say(
                f"still starting after {waited:.0f}s: {', '.join(pending)} "
                f"(logs in {paths.logs}; `corral status` shows progress)"
            )
    if not stop.is_set():
        _announce(spec, port, replicas, paths)
        # What is alive now (modules, the app, the replica set) leaves the collector's generations: full
        # collections stop walking it, which took a /metrics render of 512 replicas from 15 to 60 ms at
        # p99 (benchmarks/metrics_render.py) and adds to request tails the same way.
        gc.freeze()


def _cannot_start(models: list[str], replicas: Any, paths: Paths, attempts: int) -> str:
    from corral.cluster.runtime import log_name

    lines: list[str] = []
    for model in models:
        replica = replicas.of(model)[0]
        why = f"{replica.id} failed {attempts} starts in a row ({replica.last_error})"
        lines.append(f"model {model!r} cannot start: {why}")
        if replica.log_tail:
            lines.append(f"  last lines of {paths.logs / log_name(replica.id)}:")
            lines += [f"    {line}" for line in replica.log_tail]
    return "\n".join(lines)


def _runtime(spec: ClusterSpec, paths: Paths) -> Any:
    """Local processes, or Ray actors when the spec (or --ray) asks for Ray."""
    from corral.cluster import LocalProcessRuntime

    if spec.ray is None:
        return LocalProcessRuntime(paths.logs)
    from corral.cluster.ray_runtime import RayRuntime

    # (each replica reserves what its launch plan's deployment asks: engines.Resources)
    limits = (int(spec.supervisor.replica_log_max_mb * 1024 * 1024), spec.supervisor.replica_log_keep)
    return RayRuntime(paths.logs, spec.ray.address, spec.ray.placement_timeout, limits)


async def _first_of(*aws: Any) -> Any:
    tasks = [asyncio.ensure_future(a) for a in aws]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return next(iter(done)).result()


def _spinner(text: str) -> Any:
    """A live spinner saying `text` where one may be drawn (`live_progress`), else nothing: its `update`
    goes nowhere (the progress is told line by line instead)."""
    if live_progress():
        return console.status(text)
    return contextlib.nullcontext(types.SimpleNamespace(update=lambda *_: None))


def _say(line: str) -> None:
    """A line for whoever runs `corral up`: printed, or logged where standard error is JSON lines."""
    if logs_are_json():
        logger.info("%s", line)
    else:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _announce(spec: ClusterSpec, port: int | None, replicas: Any, paths: Paths) -> None:
    scheme = "https" if spec.gateway.tls is not None else "http"
    # (the port it listens on, chosen when the spec said 0; an IPv6 host in brackets, a wildcard as loopback)
    address = spec.gateway.model_copy(update={"port": port}).address_from_here()
    base = f"{scheme}://{address}/v1"
    if logs_are_json():
        models = replicas.models()
        logger.info(
            "corral is serving %s at %s",
            ", ".join(models),
            base,
            extra={"models": models, "url": base, "replica_logs": str(paths.logs)},
        )
        return
    console.print(status_table([r.snapshot() for r in replicas]))
    console.print(
        f"[bold green]corral is serving[/bold green] {', '.join(replicas.models())} at [bold]{base}[/bold]"
    )
    # One variable per line and no wrapping, so each line can be copied whole on a narrow terminal.
    key = "none" if spec.auth.open else "<a key from: corral keys create --tenant NAME>"
    console.print(
        "  point an OpenAI client at it:\n"
        f"    export OPENAI_BASE_URL={base}\n"
        f"    export OPENAI_API_KEY={key}",
        soft_wrap=True,
        highlight=False,
        markup=False,
    )
    if not spec.auth.open:
        console.print(
            "  the gateway is closed: every request needs an API key (401 without one); create keys with "
            "`corral keys create` using the spec's store (-f)",
            soft_wrap=True,
            highlight=False,
            markup=False,
        )
    console.print(
        f"  replica logs: {paths.logs}\n  status: corral status --url {scheme}://{address}"
        f"{'' if spec.auth.open else ' --admin-key KEY (or $CORRAL_ADMIN_KEY)'}\n"
        "  Ctrl-C stops everything.",
        soft_wrap=True,
        highlight=False,
        markup=False,
    )
