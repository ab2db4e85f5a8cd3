"""The documentation site builds strictly, and its generated reference is current and complete."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from corral.cli import app
from corral.cli.reference import REGENERATE, reference_pages
from corral.config import parse_spec
from corral.gateway.metrics import GatewayMetrics
from corral.observe import alert_rules, panel_queries
from corral.routing import ReplicaSet, Router

from ..conftest import CORRAL

ROOT = Path(__file__).parents[2]
REFERENCE = ROOT / "docs" / "reference"
# A model with SLOs: its alert rules use the latency histograms too.
SLO_SPEC = parse_spec(
    "models:\n  - {name: m, arch: llama-3.1-8b, slo: {ttft_p95: 0.5, itl_p95: 0.05},"
    " deployments: [{engine: sim, gpu: l4}]}\n"
)


def test_reference_pages_are_the_generated_ones(tmp_path: Path) -> None:
    written = subprocess.run(
        [*CORRAL, "reference", "-o", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert written.returncode == 0, written.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(reference_pages())
    stale = [
        p.name
        for p in tmp_path.iterdir()
        if (REFERENCE / p.name).read_text(encoding="utf-8") != p.read_text()
    ]
    assert stale == [], f"stale in docs/reference/: {', '.join(stale)}; run `{REGENERATE}`"


def test_the_site_builds_with_no_broken_link_or_missing_page(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").is_file()
    assert (tmp_path / "site" / "reference" / "openapi.json").is_file()


def _help(path: list[str]) -> str:
    """What `corral PATH --help` prints (typer's own rendering, not the reference's)."""
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "250"}, prog_name="corral")
    assert result.exit_code == 0, result.output
    return result.output


def _panel(text: str, title: str) -> list[str]:
    """The first word of each row of one panel of the help (a command, or an option's long name)."""
    found = re.search(rf"╭─ {title} ─+╮\n(.*?)╰", text, re.S)
    rows = found.group(1).splitlines() if found else []
    return [m.group(1) for row in rows if (m := re.match(r"│ (?:\* +)?(\S+)", row))]


def _section(page: str, command: str) -> str:
    """The reference's section on one command: from its heading to the next heading."""
    found = re.search(rf"^#+ `{re.escape(command)}`\n(.*?)(?=^#+ |\Z)", page, re.S | re.M)
    assert found, f"`{command}` has no section in docs/reference/cli.md: run `{REGENERATE}`"
    return found.group(1)


def test_every_command_and_option_of_the_help_is_in_the_cli_reference() -> None:
    page = (REFERENCE / "cli.md").read_text(encoding="utf-8")
    pending: list[list[str]] = [[]]
    seen: list[list[str]] = []
    while pending:
        path = pending.pop()
        text = _help(path)
        if path:
            section = _section(page, " ".join(["corral", *path]))
            for option in _panel(text, "Options"):
                if option != "--help":
                    assert option in section, f"corral {' '.join(path)} {option}"
        seen.append(path)
        pending += [[*path, command] for command in _panel(text, "Commands")]
    assert {"keys", "create"} <= {word for path in seen for word in path} and len(seen) > 20


def test_every_metric_the_gateway_serves_and_the_rules_use_is_in_the_metrics_reference() -> None:
    page = (REFERENCE / "metrics.md").read_text(encoding="utf-8")
    exposition = GatewayMetrics(Router(ReplicaSet()), dict).exposition().decode()
    served = re.findall(r"^# TYPE (\S+) (\S+)$", exposition, re.M)
    served = [(name, kind) for name, kind in served if not name.endswith("_created")]
    assert len(served) > 30
    assert [name for name, kind in served if f"| `{name}` | {kind} |" not in page] == []
    queries = [rule.expr for rule in alert_rules(SLO_SPEC)] + [query.expr for query in panel_queries()]
    used = {re.sub(r"_(bucket|sum|count)$", "", n) for q in queries for n in re.findall(r"corral_\w+", q)}
    assert sorted(name for name in used if f"`{name}`" not in page) == []
