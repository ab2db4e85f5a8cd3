"""The typer app and what every command shares: the console and logging set-up."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

import typer
from rich.console import Console
from rich.logging import RichHandler

__all__ = ["app", "console", "run_async", "setup_logging"]

app = typer.Typer(
    help="corral: a private, OpenAI-compatible inference cluster.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False, rich_tracebacks=False)],
    )


def run_async(coro: Coroutine[Any, Any, None]) -> None:
    """Run a command's main coroutine on uvloop (the gateway's event loop, chosen by measurement)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)
