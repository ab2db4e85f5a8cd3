"""Every command's --help works, lists commands in a sensible order, and describes every option."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import typer
from typer.testing import CliRunner

from corral.cli import app

from ..conftest import CORRAL


def commands(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from commands(sub, (*path, name))


def test_every_option_of_every_command_has_a_description() -> None:
    root = typer.main.get_command(app)
    undescribed = [
        f"corral {' '.join(path)} {param.name}"
        for path, command in commands(root)
        for param in command.params
        if not (getattr(param, "help", None) or "").strip()
    ]
    assert undescribed == []


def test_every_help_runs_and_shows_flags_as_flags() -> None:
    root = typer.main.get_command(app)
    paths = [path for path, _ in commands(root)]
    assert len(paths) >= 15
    runner = CliRunner()  # in this process: a subprocess per command took 20 s of start-ups
    for path in paths:
        done = runner.invoke(app, [*path, "--help"], prog_name="corral", env={"COLUMNS": "100"})
        assert done.exit_code == 0, (path, done.output)
        assert "Usage: corral" in done.output and "<bool>" not in done.output, (path, done.output)


def test_commands_are_listed_in_working_order() -> None:
    shown = subprocess.run([*CORRAL, "--help"], capture_output=True, text=True, timeout=60).stdout
    order = [word for line in shown.splitlines() for word in line.strip("│ ").split()[:1]]
    listed = [w for w in order if w in {"up", "status", "keys", "plan", "bench", "spec", "version"}]
    assert listed == ["up", "status", "keys", "plan", "bench", "spec", "version"]


def test_required_options_are_marked() -> None:
    shown = subprocess.run(
        [*CORRAL, "keys", "create", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"COLUMNS": "120"},
    ).stdout
    assert "[required]" in shown and "--tenant" in shown


def test_the_command_list_keeps_each_summary_on_its_own_line_where_it_fits() -> None:
    """Docstrings' own line breaks showed in `corral --help` (apply's summary broke after "and")."""
    shown = CliRunner().invoke(app, ["--help"], prog_name="corral", env={"COLUMNS": "220"}).output
    for summary in (
        "live settings, and rollouts of changed models, with no restart.",
        "let its requests and streams finish, then stop it.",
        "errors and latency by key, tenant, model or day.",
    ):
        assert any(summary in line for line in shown.splitlines()), summary
