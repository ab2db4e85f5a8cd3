"""`corral spec`: the spec reference and a check of a spec file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from corral.cli.app import FlagsCommand, FlagsGroup, app, console, fail
from corral.config import ClusterSpec

__all__ = ["spec_app"]

spec_app = typer.Typer(
    help="Explain every spec field, or check a spec file.", cls=FlagsGroup, no_args_is_help=True
)
app.add_typer(spec_app, name="spec")


@spec_app.command("explain", cls=FlagsCommand)
def explain(
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="write the reference to this file")
    ] = None,
) -> None:
    """Print the reference of every spec field: type, default, unit and meaning (Markdown)."""
    from corral.spec_reference import spec_reference, write_reference

    if output is None:
        print(spec_reference(), end="")
        return
    write_reference(output)
    console.print(f"wrote {output}")


@spec_app.command("check", cls=FlagsCommand)
def check(
    file: Annotated[Path, typer.Option("--file", "-f", help="the cluster spec YAML to validate")],
    here: Annotated[
        bool,
        typer.Option(
            "--here",
            help="also check this machine as `corral up` would before it fetches anything: the files the "
            "spec names (local models and adapters, engine binaries, tokenizers, TLS certificate and key) "
            "exist, and the store answers",
        ),
    ] = False,
) -> None:
    """Validate a spec file: fields, rules across them and how its URLs are written; exit 2 naming each
    problem's file, line and field. Files and the store are checked where the spec will run: --here."""
    from corral.cli.up import preflight_or_fail
    from corral.config import Paths, SpecError, load_spec

    try:
        spec = load_spec(file)
    except SpecError as exc:
        fail(str(exc), 2)
    if here:
        preflight_or_fail(spec, file, gateway=True, store_url=spec.store.url or Paths.from_env().database_url)
    else:
        preflight_or_fail(spec, file, models=())  # (what needs no machine: how the URLs are written)
    replicas = sum(d.replicas for m in spec.models for d in m.deployments)
    access = "open (no key needed)" if spec.auth.open else "closed (API keys required)"
    checked = "; checked here: its files and store" if here else _unchecked(spec)
    Console().print(  # the answer, on stdout (errors go to stderr)
        f"{file}: valid: {len(spec.models)} model(s), {replicas} replica(s), gateway "
        f"{spec.gateway.listen_address}, {access}{checked}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )


def _unchecked(spec: ClusterSpec) -> str:
    """A reminder of what only `--here` checks, where the spec names any of it."""
    from corral.config import LocalSource

    sources = [s for m in spec.models for s in (m.source, *(a.source for a in m.adapters))]
    files = (
        any(isinstance(source, LocalSource) for source in sources)
        or any(m.tokenizer is not None or any(d.binary for d in m.deployments) for m in spec.models)
        or spec.gateway.tls is not None
    )
    named = [what for what, named in (("files", files), ("store", spec.store.url is not None)) if named]
    if not named:
        return ""
    verb = "are" if named == ["files"] or len(named) > 1 else "is"
    return f" (its {' and '.join(named)} {verb} checked where it runs: --here)"
