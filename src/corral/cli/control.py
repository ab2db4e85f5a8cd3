"""`corral status`, `apply` and `drain`: commands that talk to a running cluster's gateway."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from corral.cli.app import CaCertOption, FlagsCommand, app, client_tls, console, fail
from corral.config import SpecError, admin_key_from_env, load_spec

__all__ = ["status_table"]

UrlOption = Annotated[str, typer.Option(help="the gateway's base URL")]
AdminKeyOption = Annotated[
    str | None, typer.Option(help="the admin key (default: $CORRAL_ADMIN_KEY) for a closed gateway")
]


def _call(
    url: str,
    path: str,
    key: str | None,
    ca_cert: Path | None,
    body: bytes | None = None,
    timeout: float = 5,
    content_type: str = "application/json",
) -> Any:
    """The gateway's JSON answer to GET (or POST with `body`) `path`; a refusal or no answer is one line."""
    request = urllib.request.Request(
        url.rstrip("/") + path, data=body, method="GET" if body is None else "POST"
    )
    if body is not None:
        request.add_header("Content-Type", content_type)
    key = key or admin_key_from_env(None)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=client_tls(ca_cert)) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        fail(f"{url} answered {exc.code}: {_error_message(exc)}")
    except (urllib.error.URLError, OSError) as exc:
        fail(f"no corral gateway answers at {url}: {getattr(exc, 'reason', exc)}")


@app.command(cls=FlagsCommand)
def status(
    url: UrlOption = "http://127.0.0.1:8000",
    admin_key: Annotated[
        str | None,
        typer.Option(help="the admin key (default: $CORRAL_ADMIN_KEY); a tenant key sees only its models"),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
    ca_cert: CaCertOption = None,
) -> None:
    """Show each replica: state, load, restarts."""
    data = _call(url, "/corral/status", admin_key, ca_cert)
    if as_json:
        print(json.dumps(data, indent=2))
        return
    Console().print(status_table(data["replicas"]))


@app.command(cls=FlagsCommand)
def apply(
    file: Annotated[Path, typer.Option("--file", "-f", help="the new cluster spec YAML")],
    url: UrlOption = "http://127.0.0.1:8000",
    grace: Annotated[
        float, typer.Option(min=0.1, max=3600, help="seconds each removed replica may take to finish")
    ] = 60.0,
    admin_key: AdminKeyOption = None,
    ca_cert: CaCertOption = None,
) -> None:
    """Bring a running cluster to a spec: add or remove models, change replica counts, no restart."""
    try:
        load_spec(file)  # a bad file is refused here, with its lines, before anything is sent
    except SpecError as exc:
        fail(str(exc), 2)
    answer = _call(
        url, f"/admin/spec?grace={grace}", admin_key, ca_cert, file.read_bytes(), 3600, "application/yaml"
    )
    changes = answer["changes"]
    if not changes:
        console.print("nothing to change: the cluster already runs this spec", markup=False)
    for change in changes:
        count = (
            f" (deployment {change['deployment']}, {change['replicas']} replicas)"
            if change["replicas"]
            else ""
        )
        console.print(f"{change['action']}: {change['model']}{count}", markup=False, highlight=False)


@app.command(cls=FlagsCommand)
def drain(
    replica: Annotated[str, typer.Argument(help="the replica's id, as `corral status` lists it")],
    url: UrlOption = "http://127.0.0.1:8000",
    grace: Annotated[
        float, typer.Option(min=0.1, max=3600, help="seconds to wait for its requests before stopping it")
    ] = 60.0,
    admin_key: AdminKeyOption = None,
    ca_cert: CaCertOption = None,
) -> None:
    """Take a replica out of routing, let its requests and streams finish, then stop it."""
    result = _call(url, f"/admin/replicas/{replica}/drain?grace={grace}", admin_key, ca_cert, b"", grace + 30)
    how = "its requests finished" if result["idle"] else f"stopped after the {grace:g} s grace period"
    console.print(
        f"drained {result['replica']} ({result['model']}) in {result['waited_s']} s: {how}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )


def _error_message(exc: Any) -> str:
    try:
        return str(json.load(exc)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return str(exc.reason)


def status_table(replicas: list[dict[str, Any]]) -> Table:
    table = Table(title="corral replicas", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for column in ("replica", "state", "address", "pid", "restarts", "in-flight", "run/wait"):
        table.add_column(column, no_wrap=column in {"replica", "state", "address"}, min_width=len(column))
    colours = {"ready": "green", "starting": "yellow", "restarting": "yellow"}
    for r in replicas:
        colour = colours.get(r["state"], "red")
        table.add_row(
            r["id"],
            f"[{colour}]{r['state']}[/{colour}]",
            (r.get("url") or "-").removeprefix("http://"),
            _dash(r.get("pid")),
            str(r["restarts"]),
            str(r["outstanding"]),
            f"{_dash(r['running'])}/{_dash(r['waiting'])}",
        )
    return table


def _dash(value: object) -> str:
    return "-" if value is None else str(value)
