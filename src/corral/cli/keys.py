"""`corral keys` and `corral usage`: tenants' API keys and what they used, straight from the store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from corral.cli.app import app, console

if TYPE_CHECKING:  # the store imports SQLAlchemy: only when a command needs it
    from corral.store import KeyStore, UsageStore

__all__ = ["keys_app"]

keys_app = typer.Typer(help="Create, list, show and revoke API keys.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")

SpecOption = Annotated[Path | None, typer.Option("--file", "-f", help="cluster spec (its store.url)")]
StoreOption = Annotated[str | None, typer.Option("--store", help="SQLAlchemy URL of the store")]
JsonOption = Annotated[bool, typer.Option("--json", help="print JSON")]


def _stores(file: Path | None, store: str | None) -> tuple[KeyStore, UsageStore]:
    from corral.config import Paths, SpecError, load_spec
    from corral.store import KeyStore, UsageStore, open_database

    url = store
    if url is None and file is not None:
        try:
            url = load_spec(file).store.url
        except SpecError as exc:
            console.print(f"[red]error:[/red] {exc}", markup=False)
            raise typer.Exit(2) from None
    engine = open_database(url or Paths.from_env().database_url)
    return KeyStore(engine), UsageStore(engine)


@keys_app.command("create")
def create(
    tenant: Annotated[str, typer.Option(help="the tenant the key belongs to")],
    name: Annotated[str, typer.Option(help="a label")] = "",
    models: Annotated[str, typer.Option(help="comma-separated models it may use (default: all)")] = "",
    rpm: Annotated[int | None, typer.Option(help="requests per minute")] = None,
    tpm: Annotated[int | None, typer.Option(help="tokens per minute (input + max output, reserved)")] = None,
    max_concurrency: Annotated[int | None, typer.Option(help="requests in flight at once")] = None,
    priority: Annotated[str, typer.Option(help="high, normal or low")] = "normal",
    monthly_tokens: Annotated[int | None, typer.Option(help="token budget per calendar month")] = None,
    file: SpecOption = None,
    store: StoreOption = None,
    as_json: JsonOption = False,
) -> None:
    """Create a key; its secret is printed once and stored only as a hash."""
    keys, _ = _stores(file, store)
    try:
        secret, record = keys.create(
            tenant,
            name=name,
            models=[m for m in models.split(",") if m],
            rpm=rpm,
            tpm=tpm,
            max_concurrency=max_concurrency,
            priority=priority,
            monthly_token_budget=monthly_tokens,
        )
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    if as_json:
        print(json.dumps({"key": secret, **record.to_dict()}, indent=2))
        return
    console.print(f"created key [bold]{record.id}[/bold] for tenant {tenant}; the secret (shown only now):")
    print(secret)


@keys_app.command("list")
def list_keys(
    include_revoked: Annotated[bool, typer.Option("--all", help="include revoked keys")] = False,
    file: SpecOption = None,
    store: StoreOption = None,
    as_json: JsonOption = False,
) -> None:
    """List keys (never their secrets)."""
    keys, _ = _stores(file, store)
    records = keys.list(include_revoked)
    if as_json:
        print(json.dumps([r.to_dict() for r in records], indent=2))
        return
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("id", "prefix", "tenant", "models", "rpm", "tpm", "conc.", "prio.", "budget", "state"):
        table.add_column(column, no_wrap=column in {"id", "prefix"})
    for r in records:
        table.add_row(
            r.id,
            r.prefix + "…",
            r.tenant,
            ",".join(r.models) or "all",
            _n(r.rpm),
            _n(r.tpm),
            _n(r.max_concurrency),
            r.priority,
            _n(r.monthly_token_budget),
            "revoked" if r.revoked_at else "active",
        )
    Console().print(table)


@keys_app.command("show")
def show(key_id: str, file: SpecOption = None, store: StoreOption = None) -> None:
    """Show one key."""
    keys, _ = _stores(file, store)
    record = keys.get(key_id)
    if record is None:
        console.print(f"[red]error:[/red] no key with id {key_id}")
        raise typer.Exit(1)
    print(json.dumps(record.to_dict(), indent=2))


@keys_app.command("revoke")
def revoke(key_id: str, file: SpecOption = None, store: StoreOption = None) -> None:
    """Revoke a key: gateways refuse it within their key-cache TTL (auth.cache_ttl)."""
    keys, _ = _stores(file, store)
    if keys.revoke(key_id) is None:
        console.print(f"[red]error:[/red] no key with id {key_id}")
        raise typer.Exit(1)
    console.print(f"revoked {key_id}")


@app.command("usage")
def usage(
    by: Annotated[str, typer.Option(help="key, tenant, model or day")] = "key",
    file: SpecOption = None,
    store: StoreOption = None,
    as_json: JsonOption = False,
) -> None:
    """Report recorded usage: requests, tokens, errors and latency by key, tenant, model or day."""
    _, usage_store = _stores(file, store)
    try:
        rows = usage_store.report(by)
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title=f"usage by {by}", box=box.SIMPLE_HEAD, pad_edge=False)
    for column in (by, "requests", "input tokens", "output tokens", "errors", "mean latency"):
        table.add_column(column, justify="left" if column == by else "right")
    for row in rows:
        table.add_row(
            str(row[by]),
            f"{row['requests']:,}",
            f"{row['input_tokens']:,}",
            f"{row['output_tokens']:,}",
            f"{row['errors']:,}",
            f"{row['mean_latency_ms']:,.0f} ms",
        )
    Console().print(table)


def _n(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"
