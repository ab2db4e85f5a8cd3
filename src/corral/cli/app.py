"""The typer app and what every command shares: the console, logging, and the one error boundary.

Every failure a user can cause ends as one line, `error: <what went wrong and what to do>`, on stderr with
exit code 1 (2 for bad usage or a bad spec), never a traceback; `corral --debug COMMAND` shows the
traceback of an unexpected error.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import sys
import time
import urllib.parse
from collections.abc import Coroutine
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup, TyperOption

from corral import __version__

__all__ = [
    "COMMAND_ORDER",
    "CaCertOption",
    "CliError",
    "FlagsCommand",
    "FlagsGroup",
    "LogFormat",
    "LogLevel",
    "app",
    "client_tls",
    "console",
    "fail",
    "live_progress",
    "logs_are_json",
    "main",
    "run_async",
    "setup_logging",
]

# The order `corral --help` lists commands in: running a cluster first, then tools, then reference.
COMMAND_ORDER = (
    "up",
    "status",
    "top",
    "apply",
    "drain",
    "prepare",
    "keys",
    "usage",
    "plan",
    "sim",
    "bench",
    "deploy",
    "observe",
    "spec",
    "reference",
    "version",
)


class CliError(Exception):
    """A failure to report as one line; `exit_code` 2 for bad usage or input, 1 otherwise."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _hide_flag_placeholders(params: list[Any]) -> list[Any]:
    """typer shows `<bool>` after a flag, as if it took a value; a flag takes none."""
    for param in params:
        if isinstance(param, TyperOption) and param.is_flag and param.metavar is None:
            param.metavar = ""
    return params


class FlagsCommand(TyperCommand):
    """A command whose help shows flags without a value placeholder."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _hide_flag_placeholders(super().get_params(ctx))


class FlagsGroup(TyperGroup):
    """A command group with flags shown as flags and commands listed in `COMMAND_ORDER`."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _hide_flag_placeholders(super().get_params(ctx))

    def get_command(self, ctx: Any, name: str) -> Any:
        """The command, its one-line help in the listing being its docstring's first paragraph as one
        line (the docstring's own line breaks are for the source, not the terminal)."""
        command = super().get_command(ctx, name)
        if command is not None and command.short_help is None and command.help:
            command.short_help = " ".join(command.help.split("\n\n")[0].split())
        return command

    def list_commands(self, ctx: Any) -> list[str]:
        names = super().list_commands(ctx)
        rank = {name: i for i, name in enumerate(COMMAND_ORDER)}
        return sorted(names, key=lambda name: (rank.get(name, len(rank)), name))


app = typer.Typer(
    help="corral: a private, OpenAI-compatible inference cluster.",
    cls=FlagsGroup,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)


class LogLevel(StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


class LogFormat(StrEnum):
    auto = "auto"
    rich = "rich"
    text = "text"
    json = "json"


def _print_version(value: bool) -> None:
    if value:
        print(__version__)
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="print corral's version and exit"
    ),
    debug: bool = typer.Option(False, "--debug", help="show the traceback of an unexpected error"),
) -> None:
    """corral: a private, OpenAI-compatible inference cluster."""


def fail(message: str, exit_code: int = 1) -> NoReturn:
    """Print `error: message` (markup-safe, unwrapped) and end the command with `exit_code`."""
    _error(message)
    raise typer.Exit(exit_code)


# `--ca-cert` of the commands that talk to a gateway over HTTPS.
CaCertOption = Annotated[
    Path | None, typer.Option(help="PEM CA certificate to trust for an https URL (a private CA)")
]


# `--url` of the commands that talk to a gateway (with a spec file: `SpecUrlOption`).
UrlOption = Annotated[
    str | None,
    typer.Option(
        help="the gateway's base URL (default: $CORRAL_URL, else $OPENAI_BASE_URL without its /v1, else "
        "http://127.0.0.1:8000)"
    ),
]
SpecUrlOption = Annotated[
    str | None,
    typer.Option(
        help="the gateway's base URL (default: the spec's, else $CORRAL_URL, else $OPENAI_BASE_URL without "
        "its /v1, else http://127.0.0.1:8000)"
    ),
]


def gateway_url(given: str | None, spec_file: Path | None = None) -> str:
    """The gateway a command talks to: `--url`, else the spec's `gateway` section (with -f), else
    $CORRAL_URL, else $OPENAI_BASE_URL, else the default; said on stderr with where it came from unless
    given with --url."""
    from corral.config import DEFAULT_GATEWAY_URL, gateway_url_from_env

    if given:
        return _checked_url(given, "--url").rstrip("/")
    if spec_file is not None and (from_spec := _spec_url(spec_file)) is not None:
        url, source = from_spec, f"the gateway section of {spec_file}"
    elif (found := gateway_url_from_env()) is not None:
        url, source = found
        _checked_url(url, source)
    else:
        others = "--url, -f or $CORRAL_URL" if spec_file is not None else "--url or $CORRAL_URL"
        url, source = DEFAULT_GATEWAY_URL, f"the default; {others} name another"
    console.print(
        f"gateway: {url} (from {source})", style="dim", markup=False, highlight=False, soft_wrap=True
    )
    return url.rstrip("/")


def _checked_url(url: str, source: str) -> str:
    """`url` when it is a gateway's base URL (http or https, a host); else the command ends, exit 2."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (a port that is not a number raises here)
    except ValueError as exc:
        fail(f"{source} {url!r} is not a URL: {exc}", 2)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        fail(f"{source} {url!r} is not a gateway's URL: give http://HOST:PORT or https://HOST:PORT", 2)
    return url


def _spec_url(spec_file: Path) -> str | None:
    from corral.config import SpecError, load_spec

    try:
        gateway = load_spec(spec_file).gateway
    except (SpecError, OSError):
        return None  # (the command reports a bad file itself)
    host = "127.0.0.1" if gateway.host in ("0.0.0.0", "::", "") else gateway.host
    host = f"[{host}]" if ":" in host else host
    return f"{'https' if gateway.tls is not None else 'http'}://{host}:{gateway.port}"


def client_tls(ca_cert: Path | None) -> ssl.SSLContext | None:
    """The client context trusting `ca_cert` (None: the system's CAs); a bad file is one line, exit 2."""
    if ca_cert is None:
        return None
    try:
        return ssl.create_default_context(cafile=ca_cert)
    except (OSError, ssl.SSLError) as exc:
        fail(f"--ca-cert {ca_cert}: {getattr(exc, 'strerror', None) or exc}", 2)


_chosen = {"log_format": "rich"}  # as setup_logging chose it


def logs_are_json() -> bool:
    """Whether standard error carries JSON lines only (`--log-format json`): what a command would tell
    people there (a banner, progress) is logged instead."""
    return _chosen["log_format"] == "json"


def live_progress() -> bool:
    """Whether a command may draw a live spinner: on a terminal with Rich's log format (`text` and `json`
    stay one event a line, so every line of `json` parses)."""
    return console.is_terminal and _chosen["log_format"] == "rich"


def setup_logging(level: str, log_format: str = "auto") -> None:
    """Logging to standard error, as `log_format` says: `rich` (columns and colour, for a terminal), `text`
    (one line an event with its UTC time, level and logger: what journald, Docker and Kubernetes keep),
    `json` (one object a line, a log pipeline's; a record's extra fields become its keys: the access log's
    client, status, request id, ...) or `auto`: rich on a terminal, text otherwise."""
    if log_format == "auto":
        log_format = "rich" if sys.stderr.isatty() else "text"
    _chosen["log_format"] = log_format
    handler: logging.Handler
    if log_format == "rich":
        handler = RichHandler(console=console, show_path=False, rich_tracebacks=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        if log_format == "json":
            from pythonjsonlogger.json import JsonFormatter

            handler.setFormatter(
                JsonFormatter(
                    "{levelname}{name}{message}",
                    style="{",
                    timestamp="time",  # ISO 8601, UTC
                    rename_fields={"levelname": "level", "name": "logger", "exc_info": "exception"},
                )
            )
        else:
            text = logging.Formatter(
                "%(asctime)s.%(msecs)03dZ %(levelname)s %(name)s: %(message)s", "%Y-%m-%dT%H:%M:%S"
            )
            text.converter = time.gmtime
            handler.setFormatter(text)
    logging.basicConfig(level=str(level).upper(), handlers=[handler], force=True)


def run_async(coro: Coroutine[Any, Any, None]) -> None:
    """Run a command's main coroutine on uvloop (the gateway's event loop, chosen by measurement)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)


def main(argv: list[str] | None = None) -> NoReturn:
    """Run the `corral` command: the one error boundary between a user and a traceback."""
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    try:
        code = app(args=args, prog_name="corral", standalone_mode=False)
    except CliError as exc:
        if debug:
            raise
        _error(str(exc))
        sys.exit(exc.exit_code)
    except typer.Abort:
        _error("aborted")
        sys.exit(1)
    except typer.TyperException as exc:  # bad usage: an unknown option, a missing or malformed value
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        context = getattr(exc, "ctx", None)
        hint = f" (see `{context.command_path} --help`)" if context is not None else ""
        _error(f"{message.replace('Value error, ', '')}{hint}")
        sys.exit(int(getattr(exc, "exit_code", 2)))
    except KeyboardInterrupt:
        console.print("interrupted")
        sys.exit(130)
    except Exception as exc:
        if debug:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        _error(f"{type(exc).__name__}: {first} (an unexpected error; `corral --debug …` shows where)")
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


def _error(message: str) -> None:
    # (no emoji: a message's `host:-1:` or `:smile:` stays as written)
    console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True, highlight=False, emoji=False)
