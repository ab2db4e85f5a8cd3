"""`corral observe render` (dashboards, alert rules, Prometheus and Grafana files) and `corral top`."""

from __future__ import annotations

import time
import urllib.error
from pathlib import Path
from typing import Annotated

import typer

from corral.cli.app import (
    CaCertOption,
    FlagsCommand,
    FlagsGroup,
    UrlOption,
    app,
    client_tls,
    console,
    fail,
    gateway_url,
)
from corral.config import admin_key_from_env

__all__ = ["observe_app"]

observe_app = typer.Typer(
    help="Grafana dashboards, Prometheus alert rules and scrape configuration for a spec.",
    cls=FlagsGroup,
    no_args_is_help=True,
)
app.add_typer(observe_app, name="observe")


@observe_app.command("render", cls=FlagsCommand)
def render_command(
    output: Annotated[Path, typer.Option("--output", "-o", help="folder to write the files into")],
    file: Annotated[
        Path | None,
        typer.Option(
            "--file", "-f", help="the cluster spec YAML (default: the embedded one `corral up` runs)"
        ),
    ] = None,
    scrape_interval: Annotated[
        str, typer.Option(help="Prometheus scrape and rule evaluation interval, e.g. 15s")
    ] = "15s",
) -> None:
    """Write dashboards (Grafana JSON), alert rules, prometheus.yml and Grafana provisioning files."""
    from corral.config import SpecError, default_spec, load_spec
    from corral.deploy import write_rendered
    from corral.observe import render_observability

    try:
        spec = load_spec(file) if file is not None else default_spec()
    except SpecError as exc:
        fail(str(exc), 2)
    source = str(file) if file is not None else "the embedded default spec"
    for path in write_rendered(render_observability(spec, source, output, scrape_interval), output):
        console.print(f"wrote {path}", markup=False, highlight=False, soft_wrap=True)
    if (not spec.auth.open or spec.auth.admin_key) and not spec.gateway.metrics_token:
        needs = "/corral/sd" if spec.auth.open else "/corral/sd and /metrics"
        console.print(
            f"next: put the admin key in {output / 'prometheus' / 'admin.key'} (owner-readable only): "
            f"Prometheus reads it for the gateway's {needs}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )


@observe_app.command("snapshot", cls=FlagsCommand)
def snapshot_command(
    prometheus: Annotated[str, typer.Option(help="Prometheus's base URL")] = "http://127.0.0.1:9090",
    dashboard: Annotated[
        str, typer.Option(help="corral-cluster, corral-tenants or corral-gpu")
    ] = "corral-cluster",
    output: Annotated[Path, typer.Option("--output", "-o", help="the PNG to write")] = Path("dashboard.png"),
    minutes: Annotated[float, typer.Option(min=0.5, help="how far back to draw")] = 15.0,
) -> None:
    """Draw a dashboard's panels from Prometheus into a PNG (no Grafana needed)."""
    from corral.observe.snapshot import SnapshotError, dashboard_png

    try:
        panels = dashboard_png(prometheus, dashboard, output, minutes)
    except SnapshotError as exc:
        fail(str(exc))
    console.print(
        f"wrote {output} ({panels} panels with data)", markup=False, highlight=False, soft_wrap=True
    )


@app.command(cls=FlagsCommand)
def top(
    url: UrlOption = None,
    interval: Annotated[float, typer.Option(min=0.1, help="seconds between refreshes")] = 2.0,
    iterations: Annotated[
        int, typer.Option(min=0, help="stop after this many refreshes (0: until Ctrl-C)")
    ] = 0,
    admin_key: Annotated[
        str | None, typer.Option(help="the admin key (default: $CORRAL_ADMIN_KEY) for a closed gateway")
    ] = None,
    ca_cert: CaCertOption = None,
) -> None:
    """A live view of a running cluster: rates, latency percentiles and every replica's load."""
    url = gateway_url(url)
    from rich.live import Live

    from corral.observe.top import TopClient, render_frame

    context = client_tls(ca_cert)
    client = TopClient(url, admin_key or admin_key_from_env(None), context)
    before = None
    with Live(console=console, auto_refresh=False, transient=False) as live:
        count = 0
        while iterations == 0 or count < iterations:
            try:
                now = client.sample()
            except urllib.error.HTTPError as exc:
                fail(f"{url} answered {exc.code}: a closed gateway needs --admin-key or $CORRAL_ADMIN_KEY")
            except (urllib.error.URLError, OSError) as exc:
                fail(f"no corral gateway answers at {url}: {getattr(exc, 'reason', exc)}")
            live.update(render_frame(now, before), refresh=True)
            before, count = now, count + 1
            if iterations == 0 or count < iterations:
                time.sleep(interval)
