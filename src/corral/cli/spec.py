"""`corral spec`: the spec reference and a check of a spec file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from corral.cli.app import FlagsCommand, FlagsGroup, app, console, fail

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
) -> None:
    """Validate a spec file; exit 2 with each problem's file, line and field."""
    from corral.config import SpecError, load_spec

    try:
        spec = load_spec(file)
    except SpecError as exc:
        fail(str(exc), 2)
    replicas = sum(d.replicas for m in spec.models for d in m.deployments)
    access = "open (no key needed)" if spec.auth.open else "closed (API keys required)"
    Console().print(  # the answer, on stdout (errors go to stderr)
        f"{file}: valid: {len(spec.models)} model(s), {replicas} replica(s), gateway "
        f"{spec.gateway.listen_address}, {access}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
