"""`corral keys` and `corral usage`: tenants' API keys and what they used, straight from the store."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from corral.cli.app import FlagsCommand, FlagsGroup, app, console, fail

if TYPE_CHECKING:  # the store imports SQLAlchemy: only when a command needs it
    from corral.store import InvalidKey, KeyRecord, KeyStore, UsageStore

_WHEN = ["%Y-%m-%d", "%Y-%m-%dT%H:%M", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M"]  # --since/--until

__all__ = ["keys_app"]

keys_app = typer.Typer(
    help="Create, list, show, rotate and revoke API keys.", cls=FlagsGroup, no_args_is_help=True
)
app.add_typer(keys_app, name="keys")

SpecOption = Annotated[Path | None, typer.Option("--file", "-f", help="cluster spec (its store.url)")]
StoreOption = Annotated[
    str | None,
    typer.Option(
        "--store", help="store URL: sqlite:///PATH or postgresql://USER@HOST/DB (default: corral's)"
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="print JSON")]
RequestIdOption = Annotated[
    str | None, typer.Option("--request-id", help="the request's id (the x-request-id its client was given)")
]


class Priority(StrEnum):
    high = "high"
    normal = "normal"
    low = "low"


class Role(StrEnum):
    user = "user"
    tenant_admin = "tenant-admin"
    viewer = "viewer"
    operator = "operator"
    admin = "admin"


class UsageBy(StrEnum):
    key = "key"
    tenant = "tenant"
    model = "model"
    api = "api"
    day = "day"


def _stores(
    file: Path | None, store: str | None, create: bool = False, announce: bool = False
) -> tuple[KeyStore, UsageStore]:
    """The key and usage stores of `--store`, the spec's `store.url`, or corral's SQLite file, brought up
    to this corral's schema as a gateway brings it (an older corral's store gains what it lacks). Only
    `create` (`keys create`) makes a store that is not there: for the others that is an error. `announce`
    (the keys commands) names the store on stderr, and a new one is always said to be new: a key made in
    a store no gateway reads is never accepted."""
    from rich.markup import escape

    from corral.config import Paths, SpecError, load_spec
    from corral.store import KeyStore, StoreError, UsageStore, open_store

    url = store
    if url is None and file is not None:
        try:
            url = load_spec(file).store.url
        except SpecError as exc:
            fail(str(exc), 2)
    try:
        opened = open_store(url or Paths.from_env().database_url, create=create)
    except StoreError as exc:
        fail(str(exc))
    if announce:
        console.print(f"store: {escape(opened.shown)}", soft_wrap=True, highlight=False)
    if opened.new:
        console.print(
            f"[yellow]note:[/yellow] created a new, empty store at {escape(opened.shown)}: is this the "
            "store your gateway uses? (its spec's store.url, else corral.db in its CORRAL_HOME)",
            soft_wrap=True,
            highlight=False,
        )
    return KeyStore(opened.engine), UsageStore(opened.engine)


@keys_app.command("create", cls=FlagsCommand)
def create(
    tenant: Annotated[str, typer.Option(help="the tenant the key belongs to")],
    name: Annotated[str, typer.Option(help="a label")] = "",
    models: Annotated[str, typer.Option(help="comma-separated models it may use (default: all)")] = "",
    rpm: Annotated[int | None, typer.Option(help="requests per minute (≥ 1; default: unlimited)")] = None,
    tpm: Annotated[
        int | None,
        typer.Option(help="tokens per minute, input + max output reserved (≥ 1; default: unlimited)"),
    ] = None,
    max_concurrency: Annotated[
        int | None, typer.Option(help="requests in flight at once (≥ 1; default: unlimited)")
    ] = None,
    priority: Annotated[Priority, typer.Option(help="queue priority class")] = Priority.normal,
    monthly_tokens: Annotated[
        int | None, typer.Option(help="token budget per calendar month (≥ 1; default: none)")
    ] = None,
    max_files: Annotated[
        int | None,
        typer.Option(
            help="files the tenant may hold when uploading with this key (default: batch.tenant_max_files)"
        ),
    ] = None,
    max_file_bytes: Annotated[
        int | None,
        typer.Option(help="bytes of files likewise (default: batch.tenant_max_bytes)"),
    ] = None,
    role: Annotated[
        Role, typer.Option(help="its rights beyond inference (the admin API; docs/operations/security.md)")
    ] = Role.user,
    expires_in_days: Annotated[
        float | None, typer.Option(help="it stops working after this many days (default: never)")
    ] = None,
    file: SpecOption = None,
    store: StoreOption = None,
    as_json: JsonOption = False,
) -> None:
    """Create a key; its secret is printed once and stored only as a hash."""
    from pydantic import ValidationError

    from corral.store import InvalidKey, NewKey

    try:  # (before the store is opened: a refused key makes no store)
        spec = NewKey(
            tenant=tenant,
            name=name,
            models=[m for m in models.split(",") if m],
            rpm=rpm,
            tpm=tpm,
            max_concurrency=max_concurrency,
            priority=str(priority),
            monthly_token_budget=monthly_tokens,
            max_files=max_files,
            max_file_bytes=max_file_bytes,
            role=str(role),
            expires_in_s=expires_in_days * 86400 if expires_in_days is not None else None,
        )
    except ValidationError as exc:
        _refuse(InvalidKey.from_validation(exc), expires_in_days)
    keys, _ = _stores(file, store, create=True, announce=True)
    secret, record = keys.create(**spec.model_dump())
    _audit(keys, "key.create", record.id, {"tenant": tenant, "role": record.role})
    if as_json:
        print(json.dumps({"key": secret, **record.to_dict()}, indent=2))
        return
    console.print(f"created key [bold]{record.id}[/bold] for tenant {tenant}; the secret (shown only now):")
    print(secret)


@keys_app.command("list", cls=FlagsCommand)
def list_keys(
    include_revoked: Annotated[bool, typer.Option("--all", help="include revoked keys")] = False,
    tenant: Annotated[str | None, typer.Option(help="only this tenant's keys")] = None,
    file: SpecOption = None,
    store: StoreOption = None,
    as_json: JsonOption = False,
) -> None:
    """List keys (never their secrets)."""
    keys, usage_store = _stores(file, store, announce=True)
    records = keys.list(include_revoked, tenant)
    used = usage_store.month_tokens_by_key()
    if as_json:
        print(json.dumps([{**r.to_dict(), "month_tokens": used.get(r.id, 0)} for r in records], indent=2))
        return
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, padding=0)
    for column in ("id", "secret", "tenant", "models", "rpm", "tpm", "conc.", "prio.", "budget", "state"):
        table.add_column(column, no_wrap=column in {"id", "secret", "state"}, min_width=len(column))
    for r in records:
        table.add_row(
            r.id,
            r.prefix.removeprefix("sk-corral-") + "…",
            r.tenant,
            ",".join(r.models) or "all",
            _n(r.rpm),
            _n(r.tpm),
            _n(r.max_concurrency),
            r.priority,
            _budget(r.monthly_token_budget, used.get(r.id, 0)),
            "revoked" if r.revoked_at else "active" if r.active else "expired",
        )
    Console().print(table)


@keys_app.command("show", cls=FlagsCommand)
def show(
    key_id: Annotated[
        str,
        typer.Argument(
            help="the key's id, or the start of it or of its secret (as `keys list` shows; one that "
            "begins with - goes after --, as an older key's may)"
        ),
    ],
    file: SpecOption = None,
    store: StoreOption = None,
    as_json: JsonOption = False,
) -> None:
    """Show one key, with what it used of its monthly budget."""
    keys, usage_store = _stores(file, store, announce=True)
    record = _one_key(keys, key_id)
    used = usage_store.month_tokens(record.id)
    if as_json:
        print(json.dumps({**record.to_dict(), "month_tokens": used}, indent=2))
        return
    Console().print(_key_table(record, used))


@keys_app.command("revoke", cls=FlagsCommand)
def revoke(
    key_id: Annotated[
        str, typer.Argument(help="the key's id, or the start of it or of its secret (as `keys list` shows)")
    ],
    file: SpecOption = None,
    store: StoreOption = None,
    as_json: JsonOption = False,
) -> None:
    """Revoke a key: gateways refuse it within their key-cache TTL (auth.cache_ttl)."""
    keys, _ = _stores(file, store, announce=True)
    before = _one_key(keys, key_id)
    key_id = before.id
    record = keys.revoke(key_id) if before.revoked_at is None else before
    assert record is not None and record.revoked_at is not None
    if before.revoked_at is None:
        _audit(keys, "key.revoke", key_id, {"tenant": record.tenant})
    if as_json:
        print(json.dumps({**record.to_dict(), "already_revoked": before.revoked_at is not None}, indent=2))
    elif before.revoked_at is not None:
        console.print(f"{key_id} was already revoked on {before.revoked_at:%Y-%m-%d %H:%M:%S} UTC")
    else:
        console.print(f"revoked {key_id}")


@keys_app.command("rotate", cls=FlagsCommand)
def rotate(
    key_id: Annotated[
        str, typer.Argument(help="the key's id, or the start of it or of its secret (as `keys list` shows)")
    ],
    grace: Annotated[
        float,
        typer.Option(help="seconds the old secret keeps working (0: not at all)", min=0, max=30 * 86400),
    ] = 3600.0,
    file: SpecOption = None,
    store: StoreOption = None,
    as_json: JsonOption = False,
) -> None:
    """Give a key a new secret (printed once); the old one keeps working for --grace seconds."""
    from corral.store.keys import RotationConflict

    keys, _ = _stores(file, store, announce=True)
    record = _one_key(keys, key_id)
    try:
        rotated = keys.rotate(record.id, grace)
    except RotationConflict as exc:
        fail(str(exc))
    if rotated is None:
        fail(f"{record.id} is revoked: create a new key instead")
    secret, record = rotated
    _audit(keys, "key.rotate", record.id, {"tenant": record.tenant, "grace_s": grace})
    if as_json:
        print(json.dumps({"key": secret, **record.to_dict()}, indent=2))
        return
    console.print(
        f"rotated {record.id}; the old secret works for {grace:g} s more. The new one (shown only now):"
    )
    print(secret)


def _refuse(invalid: InvalidKey, expires_in_days: float | None) -> NoReturn:
    """A new key's setting out of range, named as its option; a lifetime in days, as it was given."""
    from corral.store.keys import MAX_LIFETIME_S

    if invalid.param == "expires_in_s":
        fail(
            f"--expires-in-days: must be more than 0 and at most {MAX_LIFETIME_S // 86400} days "
            f"(got {expires_in_days})",
            2,
        )
    field = (invalid.param or "").split(".")[0]  # (a model's name: models.2, of --models)
    option = {"monthly_token_budget": "monthly-tokens"}.get(field, field)
    fail(f"--{option.replace('_', '-')}: {invalid}" if option else str(invalid), 2)


def _audit(keys: KeyStore, action: str, target: str, detail: dict[str, object]) -> None:
    """The command's action in the audit trail: run on this machine against the store itself, by whoever
    holds its credentials (the break-glass path beside the admin key), named by their login."""
    import getpass

    from corral.store import AuditEntry, AuditLog

    log = AuditLog(keys.engine)
    log.record(
        AuditEntry(
            actor=f"cli:{getpass.getuser()}",
            role="admin",
            action=action,
            status=200,
            source="local",
            target=target,
            detail=detail,
        )
    )


@app.command("audit", cls=FlagsCommand)
def audit(
    action: Annotated[
        str | None, typer.Option(help="only this action (key.create; key.* for a prefix)")
    ] = None,
    actor: Annotated[
        str | None, typer.Option(help="only this actor (admin-key, key:ID, oidc:SUBJECT)")
    ] = None,
    tenant: Annotated[str | None, typer.Option(help="only actions by this tenant's people")] = None,
    since: Annotated[datetime | None, typer.Option(formats=_WHEN, help="from this time (UTC)")] = None,
    request_id: RequestIdOption = None,
    limit: Annotated[int, typer.Option(help="at most this many, latest first", min=1, max=1000)] = 50,
    file: SpecOption = None,
    store: StoreOption = None,
    as_json: JsonOption = False,
) -> None:
    """The audit trail: every administrative action (keys, applies, rollouts, drains), latest first."""
    from corral.store import AuditLog

    keys, _ = _stores(file, store)
    rows = AuditLog(keys.engine).list(
        action=action, actor=actor, tenant=tenant, since=_utc(since), request_id=request_id, limit=limit
    )
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title="corral audit trail", box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("at", "actor", "role", "action", "target", "status", "from", "request"):
        # the time, role, action and status whole on their line; a long name or id folds, never cut
        table.add_column(column, overflow="fold", no_wrap=column in ("at", "role", "action", "status"))
    for row in rows:
        table.add_row(
            row["at"][:19].replace("T", " "),
            row["actor"],
            row["role"],
            row["action"],
            row["target"] or "-",
            str(row["status"]),
            row["source"] or "-",
            row["request_id"] or "-",
        )
    Console().print(table)


@app.command("usage", cls=FlagsCommand)
def usage(
    by: Annotated[UsageBy, typer.Option(help="how to group the report")] = UsageBy.key,
    since: Annotated[
        datetime | None,
        typer.Option(
            help="from this day or time (UTC), e.g. 2026-12-01", formats=_WHEN, metavar="YYYY-MM-DD[THH:MM]"
        ),
    ] = None,
    until: Annotated[
        datetime | None,
        typer.Option(
            help="up to (not including) this day or time (UTC)", formats=_WHEN, metavar="YYYY-MM-DD[THH:MM]"
        ),
    ] = None,
    request_id: RequestIdOption = None,
    file: SpecOption = None,
    store: StoreOption = None,
    as_json: JsonOption = False,
) -> None:
    """Report recorded usage: requests, tokens, refusals (429), errors and latency by key, tenant, model
    or day.

    With --request-id, one request's records instead (the `x-request-id` its client was given)."""
    _, usage_store = _stores(file, store)
    if request_id is not None:
        _one_request(usage_store, request_id, as_json)
        return
    rows = usage_store.report(str(by), _utc(since), _utc(until))
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title=f"usage by {by}", box=box.SIMPLE_HEAD, pad_edge=False)
    first = [str(by), "tenant", "name"] if by == UsageBy.key else [str(by)]
    # two-line headers keep the figures' columns narrow: the key ids fit 80 columns unfolded
    figures = ("reqs", "tokens\nin", "tokens\nout", "refused\n(429)", "errors", "mean\nlatency")
    for column in (*first, *figures):
        table.add_column(
            column,
            justify="left" if column in first else "right",
            overflow="fold",  # an id folds onto the next line; figures are never cut
            no_wrap=column not in first,
        )
    for row in rows:
        table.add_row(
            *(str(row[c] if row[c] not in (None, "") else "-") for c in first),
            f"{row['requests']:,}",
            f"{row['input_tokens']:,}",
            f"{row['output_tokens']:,}",
            f"{row['refused']:,}",
            f"{row['errors']:,}",
            f"{row['mean_latency_ms']:,.0f} ms",
        )
    Console().print(table)


def _one_request(usage_store: UsageStore, request_id: str, as_json: bool) -> None:
    found = usage_store.of_request(request_id)
    if as_json:
        print(json.dumps(found, indent=2))
        return
    if not found:
        fail(
            f"no usage record of request {request_id} (records are written within seconds of the answer; "
            "a request refused before it was read, at the edge, has none)"
        )
    for row in found:  # one a request; a batch line's, one an attempt
        table = Table(box=None, show_header=False, pad_edge=False)
        table.add_column(style="bold")
        table.add_column(overflow="fold")
        for name, value in row.items():
            shown = "-" if value in (None, "") else value
            if name in ("ttft_ms", "latency_ms") and isinstance(value, float):
                shown = f"{value:,.0f} ms"
            table.add_row(name.removesuffix("_ms"), str(shown))
        Console().print(table)


def _utc(when: datetime | None) -> datetime | None:
    return when.replace(tzinfo=UTC) if when is not None and when.tzinfo is None else when


def _one_key(keys: KeyStore, ref: str) -> KeyRecord:
    found = keys.find(ref)
    if not found:
        fail(f"no key with id {ref}, nor one whose id or secret starts with it (see `corral keys list`)")
    if len(found) > 1:
        fail(f"{ref} names {len(found)} keys ({', '.join(k.id for k in found)}): give more of it")
    return found[0]


def _budget(budget: int | None, used: int) -> str:
    """A monthly budget and what this month used of it: 12k/1M."""
    return "-" if budget is None else f"{_n(used) if used else 0}/{_n(budget)}"


def _key_table(record: KeyRecord, used: int) -> Table:
    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for field, value in record.to_dict().items():
        if isinstance(value, list):
            shown: object = ",".join(value) or "all"
        else:
            shown = "-" if value in (None, "") else value
        table.add_row(field, str(shown))
    budget = record.monthly_token_budget
    share = f" ({used / budget:.0%} of monthly_token_budget)" if budget else ""
    table.add_row("used this month", f"{used:,} tokens{share}")
    return table


def _n(value: int | None) -> str:
    """A limit in a few characters: 600, 200k, 1.5M, 500M."""
    if value is None:
        return "-"
    for unit, size in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if value >= size:
            scaled = value / size
            return f"{scaled:.0f}{unit}" if scaled >= 10 or scaled == int(scaled) else f"{scaled:.1f}{unit}"
    return str(value)
