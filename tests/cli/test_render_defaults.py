"""`deploy render` and `observe render` work without -f on the embedded default spec, as `corral up` does
(they required -f); `spec check` answers on stdout (it said "valid" on stderr)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from corral.cli import app
from corral.config import default_spec, parse_spec

ROOT = Path(__file__).parents[2]


def test_deploy_and_observe_render_the_embedded_default_without_f(tmp_path: Path) -> None:
    runner = CliRunner()
    done = runner.invoke(
        app, ["deploy", "render", "-t", "systemd", "-o", str(tmp_path), "--corral-bin", "/usr/bin/true"]
    )
    assert done.exit_code == 0, done.output
    copied = (tmp_path / "systemd" / "cluster.yaml").read_text()
    assert parse_spec(copied) == default_spec()  # the spec the unit runs is the default itself
    assert "the embedded default spec" in (tmp_path / "systemd" / "corral.service").read_text()
    done = runner.invoke(app, ["observe", "render", "-o", str(tmp_path / "observe")])
    assert done.exit_code == 0, done.output
    assert (tmp_path / "observe" / "prometheus" / "rules" / "corral.rules.yml").exists()


def test_spec_check_answers_on_stdout() -> None:
    done = CliRunner().invoke(app, ["spec", "check", "-f", str(ROOT / "examples" / "cluster.yaml")])
    assert done.exit_code == 0 and "valid: 2 model(s)" in done.stdout and "valid" not in done.stderr
