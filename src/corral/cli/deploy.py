"""`corral deploy`: production configs from a spec, and development certificates."""

from __future__ import annotations

import shutil
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from corral.cli.app import FlagsCommand, FlagsGroup, app, console, fail

__all__ = ["deploy_app"]

deploy_app = typer.Typer(
    help="Render NGINX, systemd, Compose or KubeRay configs from a spec; make development certificates.",
    cls=FlagsGroup,
    no_args_is_help=True,
)
app.add_typer(deploy_app, name="deploy")


class TargetName(StrEnum):
    nginx = "nginx"
    systemd = "systemd"
    compose = "compose"
    kuberay = "kuberay"


@deploy_app.command("render", cls=FlagsCommand)
def render_command(
    target: Annotated[TargetName, typer.Option("--target", "-t", help="what to render")],
    output: Annotated[Path, typer.Option("--output", "-o", help="folder to write the files into")],
    file: Annotated[
        Path | None,
        typer.Option(
            "--file", "-f", help="the cluster spec YAML (default: the embedded one `corral up` runs)"
        ),
    ] = None,
    corral_bin: Annotated[
        Path | None,
        typer.Option(help="systemd: the corral executable the unit runs (default: this corral)"),
    ] = None,
) -> None:
    """Write the configs for one target; each file says where it came from. Render again after editing
    the spec."""
    from corral.config import SpecError, default_spec, load_spec
    from corral.deploy import RenderError, render, write_rendered

    try:
        spec = load_spec(file) if file is not None else default_spec()
    except SpecError as exc:
        fail(str(exc), 2)
    if file is not None:
        source, text = str(file), file.read_text(encoding="utf-8")
    else:
        source, text = "the embedded default spec", default_spec_yaml()
    executable = corral_bin or _this_corral()
    try:
        files = render(spec, target.value, source, text, executable)
    except RenderError as exc:
        fail(str(exc), 2)
    for path in write_rendered(files, output):
        console.print(f"wrote {path}", markup=False, highlight=False, soft_wrap=True)


@deploy_app.command("certs", cls=FlagsCommand)
def certs_command(
    output: Annotated[Path, typer.Option("--output", "-o", help="folder for ca.crt, server.crt and keys")],
    name: Annotated[
        list[str] | None,
        typer.Option("--name", "-n", help="a host name or IP address the certificate is for (repeatable)"),
    ] = None,
    days: Annotated[int, typer.Option(min=1, max=3650, help="days the server certificate is valid")] = 825,
    new_ca: Annotated[
        bool,
        typer.Option("--new-ca", help="replace the folder's CA (clients must then trust the new ca.crt)"),
    ] = False,
) -> None:
    """Make a development CA and a server certificate it signs (clients trust ca.crt). Run again, it signs
    a new server certificate with the CA already in the folder."""
    from corral.deploy import CertificateError, write_dev_certificates

    names = name or ["localhost", "127.0.0.1", "::1"]
    try:
        files, made = write_dev_certificates(output, names, days, new_ca)
    except CertificateError as exc:
        fail(str(exc))
    ca = (
        f"a new CA {files.ca_cert}: clients trust it; keep {files.ca_key} private"
        if made
        else f"signed by the CA already in {files.ca_cert} (clients that trust it keep working)"
    )
    console.print(
        f"wrote {files.cert} and {files.key} (for {', '.join(names)}); {ca}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )


def default_spec_yaml() -> str:
    """The embedded default spec as a file would say it (its settings that differ from the defaults)."""
    import yaml

    from corral.config import default_spec

    data = default_spec().model_dump(mode="json", exclude_defaults=True)
    return "# corral's embedded default spec (what `corral up` runs without -f)\n" + yaml.safe_dump(
        data, sort_keys=False
    )


def _this_corral() -> Path:
    beside = Path(sys.executable).parent / "corral"
    if beside.exists():
        return beside
    found = shutil.which("corral")
    return Path(found) if found else Path("/usr/local/bin/corral")
