"""`corral status`, `apply`, `drain` and `rollout`: commands that talk to a running cluster's gateway."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from corral.cli.app import (
    CaCertOption,
    FlagsCommand,
    FlagsGroup,
    SpecUrlOption,
    UrlOption,
    app,
    client_tls,
    console,
    fail,
    gateway_url,
)
from corral.config import SpecError, admin_key_from_env, api_key_from_env, load_spec

__all__ = ["status_table"]

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
    try:
        request = urllib.request.Request(
            url.rstrip("/") + path, data=body, method="GET" if body is None else "POST"
        )
    except ValueError as exc:  # (gateway_url checked it: this is a last word, not a traceback)
        fail(f"{url} is not a gateway's URL: {exc}", 2)
    if body is not None:
        request.add_header("Content-Type", content_type)
    key = key or admin_key_from_env(None)
    if key and not all("!" <= c <= "~" for c in key):
        fail(
            "the key (--admin-key, else from the environment) must be printable ASCII without spaces or "
            "line breaks (a key read from a file may carry a trailing newline)",
            2,
        )
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=client_tls(ca_cert)) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        message = _error_message(exc)
        if exc.code == 401:  # the API says which header; the CLI says which flag
            given = "the key given was refused" if key else "no key was given"
            message = (
                f"a closed gateway needs its admin key ({given}): pass --admin-key or set $CORRAL_ADMIN_KEY"
            )
        fail(f"{url} answered {exc.code}: {message}")
    except json.JSONDecodeError:
        fail(f"{url} did not answer with JSON: is it a corral gateway?")
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:  # (not HTTP: BadStatusLine)
        fail(f"no corral gateway answers at {url}: {getattr(exc, 'reason', exc)}")
    except ValueError as exc:  # (a URL urllib cannot send: a space in its path)
        fail(f"cannot ask {url}: {exc}", 2)


@app.command(cls=FlagsCommand)
def status(
    url: UrlOption = None,
    admin_key: Annotated[
        str | None,
        typer.Option(
            help="the admin key (default: $CORRAL_ADMIN_KEY, else $CORRAL_API_KEY/$OPENAI_API_KEY); a tenant "
            "key sees only its models"
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
    ca_cert: CaCertOption = None,
) -> None:
    """Show each replica: state, load, restarts. A tenant's key (--admin-key, else $CORRAL_ADMIN_KEY, else
    $CORRAL_API_KEY or $OPENAI_API_KEY) shows its models' replicas only."""
    url = gateway_url(url)
    admin_key = admin_key or admin_key_from_env(None) or api_key_from_env(None)
    data = _call(url, "/corral/status", admin_key, ca_cert)
    if as_json:
        print(json.dumps(data, indent=2))
        return
    out = Console()
    out.print(status_table(data["replicas"]))
    for rollout in data.get("rollouts", {}).values():
        out.print(_rollout_line(rollout), markup=False, highlight=False, soft_wrap=True)
    events = data.get("events", [])[-10:]
    if events:
        out.print("recent changes:", markup=False)
    for event in events:
        when = time.strftime("%H:%M:%S", time.localtime(float(event["at"])))
        line = f"  {when} {event['kind']:<8} {event['model']}: {event['message']}"
        out.print(line, markup=False, highlight=False, soft_wrap=True)


# What an apply answers that changes nothing now, in words
_UNAPPLIED = {
    "at_restart": "{fields}: taken at the next restart of corral up (the gateway listens where it did)",
    "render_only": "{fields}: read by `corral deploy render` alone, nothing running uses it",
}


@app.command(cls=FlagsCommand)
def apply(
    file: Annotated[Path, typer.Option("--file", "-f", help="the new cluster spec YAML")],
    url: SpecUrlOption = None,
    grace: Annotated[
        float, typer.Option(min=0.1, max=3600, help="seconds each removed replica may take to finish")
    ] = 60.0,
    admin_key: AdminKeyOption = None,
    ca_cert: CaCertOption = None,
) -> None:
    """Bring a running cluster to a spec: models added or removed, replica counts, live settings, and
    rollouts of changed models, with no restart."""
    url = gateway_url(url, file)
    try:
        load_spec(file)  # a bad file is refused here, with its lines, before anything is sent
    except SpecError as exc:
        fail(str(exc), 2)
    answer = _call(
        url, f"/admin/spec?grace={grace}", admin_key, ca_cert, file.read_bytes(), 3600, "application/yaml"
    )
    notes = [c for c in answer["changes"] if c["action"] in _UNAPPLIED]  # (what changes nothing now)
    changes = [c for c in answer["changes"] if c["action"] not in _UNAPPLIED]
    if not changes and not notes:
        console.print("nothing to change: the cluster already runs this spec", markup=False)
    for change in changes:
        detail = change.get("detail") or ""
        if change["replicas"]:  # scale_up, scale_down: which deployment, how many, how many now
            detail = f"deployment {change['deployment']}: {detail}"
        said = f"{change['action']}: {change['model']}" + (f" ({detail})" if detail else "")
        console.print(said, markup=False, highlight=False, soft_wrap=True)
        if change["action"] == "rollout":
            console.print(
                f"  the rollout runs on: corral rollout status {change['model']} --url {url}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
    for number, note in enumerate(notes, 1):
        said = _UNAPPLIED[note["action"]].format(fields=note["detail"])
        if number == len(notes) and not changes:
            said += "; nothing else to change"
        console.print(said, markup=False, highlight=False, soft_wrap=True)


@app.command(cls=FlagsCommand)
def drain(
    target: Annotated[
        str, typer.Argument(help="a replica's id as `corral status` lists it, or a Ray node id with --node")
    ],
    node: Annotated[bool, typer.Option("--node", help="drain every replica on this Ray node")] = False,
    url: UrlOption = None,
    grace: Annotated[
        float, typer.Option(min=0.1, max=3600, help="seconds to wait for its requests before stopping it")
    ] = 60.0,
    force: Annotated[
        bool, typer.Option("--force", help="drain even a model's last ready replica (its requests then fail)")
    ] = False,
    admin_key: AdminKeyOption = None,
    ca_cert: CaCertOption = None,
) -> None:
    """Take a replica (or every replica on a node) out of routing, let its requests and streams finish,
    then stop it. A model's last ready replica is drained only with --force."""
    url = gateway_url(url)
    named = urllib.parse.quote(target, safe="")  # (a model's name may hold a slash: org/model)
    path = f"/admin/nodes/{named}/drain" if node else f"/admin/replicas/{named}/drain"
    query = f"?grace={grace}" + ("&force=true" if force else "")
    result = _call(url, path + query, admin_key, ca_cert, b"", grace + 30)
    for drained in result["replicas"] if node else [result]:
        how = "its requests finished" if drained["idle"] else f"stopped after the {grace:g} s grace period"
        console.print(
            f"drained {drained['replica']} ({drained['model']}) in {drained['waited_s']} s: {how}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )


rollout_app = typer.Typer(
    help="Watch and steer a model's rollout (started by `corral apply` with changed weights, engine or "
    "arguments).",
    cls=FlagsGroup,
    no_args_is_help=True,
)
app.add_typer(rollout_app, name="rollout")
ModelArgument = Annotated[str, typer.Argument(help="the model's name")]


@rollout_app.command("status", cls=FlagsCommand)
def rollout_status(
    model: Annotated[str | None, typer.Argument(help="one model (default: all)")] = None,
    url: UrlOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
    follow: Annotated[
        bool, typer.Option("--follow", help="print the rollout's changes until it completes or rolls back")
    ] = False,
    admin_key: AdminKeyOption = None,
    ca_cert: CaCertOption = None,
) -> None:
    """Each model's latest rollout: phase, traffic share, step, last message. With --follow, one model's
    rollout line by line as it changes until it completes (exit 0) or rolls back (exit 1)."""
    url = gateway_url(url)
    if follow:
        if model is None:
            fail("--follow watches one model's rollout: name it", 2)
        _follow_rollout(url, model, admin_key, ca_cert)
        return
    rollouts = _call(url, "/admin/rollouts", admin_key, ca_cert)["rollouts"]
    if model is not None:
        if model not in rollouts:
            fail(f"no rollout of model {model!r} has run")
        rollouts = {model: rollouts[model]}
    if as_json:
        print(json.dumps(rollouts, indent=2))
        return
    if not rollouts:
        console.print("no rollout has run", markup=False)
    for state in rollouts.values():
        console.print(_rollout_line(state), markup=False, highlight=False, soft_wrap=True)


def _follow_rollout(url: str, model: str, admin_key: str | None, ca_cert: Path | None) -> None:
    said = None
    while True:
        state = _call(url, "/admin/rollouts", admin_key, ca_cert)["rollouts"].get(model)
        if state is None:
            fail(f"no rollout of model {model!r} has run")
        line = _rollout_line(state)
        if line != said:
            console.print(line, markup=False, highlight=False, soft_wrap=True)
            said = line
        if state["phase"] in ("completed", "rolled_back"):
            if state["phase"] == "rolled_back":
                raise typer.Exit(1)
            return
        time.sleep(1.0)


def _rollout_action(action: str, model: str, url: str, admin_key: str | None, ca_cert: Path | None) -> None:
    named = urllib.parse.quote(model, safe="")  # (a model's name may hold a slash: org/model)
    state = _call(url, f"/admin/rollouts/{named}/{action}", admin_key, ca_cert, b"", 3600)
    console.print(_rollout_line(state), markup=False, highlight=False, soft_wrap=True)


@rollout_app.command("pause", cls=FlagsCommand)
def rollout_pause(
    model: ModelArgument,
    url: UrlOption = None,
    admin_key: AdminKeyOption = None,
    ca_cert: CaCertOption = None,
) -> None:
    """Hold the rollout at its current traffic step (checks go on)."""
    url = gateway_url(url)
    _rollout_action("pause", model, url, admin_key, ca_cert)


@rollout_app.command("resume", cls=FlagsCommand)
def rollout_resume(
    model: ModelArgument,
    url: UrlOption = None,
    admin_key: AdminKeyOption = None,
    ca_cert: CaCertOption = None,
) -> None:
    """Go on with a paused rollout."""
    url = gateway_url(url)
    _rollout_action("resume", model, url, admin_key, ca_cert)


@rollout_app.command("rollback", cls=FlagsCommand)
def rollout_rollback(
    model: ModelArgument,
    url: UrlOption = None,
    admin_key: AdminKeyOption = None,
    ca_cert: CaCertOption = None,
) -> None:
    """Roll a running rollout back (old replicas keep serving); after a finished one, roll out the spec
    before it again."""
    url = gateway_url(url)
    _rollout_action("rollback", model, url, admin_key, ca_cert)


def _rollout_line(state: dict[str, Any]) -> str:
    share = state.get("share")
    traffic = f", {share:.0%} of traffic" if isinstance(share, (int, float)) else ""
    paused = " (paused)" if state.get("paused") else ""
    message = f": {state['message']}" if state.get("message") else ""
    return (
        f"rollout {state['model']} revision {state['revision']} ({state['strategy']}): "
        f"{state['phase']}{paused}{traffic}{message}"
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
    held = [r for r in replicas if r.get("adapters")]
    if held:  # LoRA adapters: which replica holds which (and, loading at run time, its loads a minute)
        table.caption = "\n".join(
            f"{r['id']} holds {', '.join(r['adapters'])}"
            + (
                f" ({len(r['adapters'])}/{r['adapter_slots']} slots, "
                f"{r.get('adapter_loads_last_minute', 0)} loads in the last minute)"
                if r.get("adapter_slots")
                else ""
            )
            for r in held
        )
    return table


def _dash(value: object) -> str:
    return "-" if value is None else str(value)
