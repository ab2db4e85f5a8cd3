"""Real agent CLIs, non-interactive, against a simulated cluster (their system prompts exceed SmolLM2's
context): Codex (`codex exec`, a custom provider on the Responses wire API) and Claude Code (`claude -p`
with ANTHROPIC_BASE_URL) each complete a turn through corral with a tool round trip and no protocol error.
scripts/test-services.sh installs both from npm (pinned) into corral's cache. The simulator calls one of
the tools offered while the user spoke last and answers in words once a tool's result is in; each CLI runs
in a temporary home and working folder (Codex in its read-only sandbox, Claude Code with only its Read
tool), so whatever the simulated model asks for touches nothing else. Their answers' quality is not the
point here; the protocol is."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import DATA, RunningCluster, start_cluster

CLIS = (
    Path(os.environ.get("CORRAL_AGENT_CLIS", Path.home() / ".cache/corral/agent-clis")) / "node_modules/.bin"
)


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    running = start_cluster(tmp_path_factory.mktemp("agents"), spec=DATA / "sim-agents.yaml")
    yield running
    running.stop()


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    quiet = {"PATH": os.environ["PATH"], "LANG": "C.UTF-8", **env}  # (nothing of this session's own)
    return subprocess.run(
        argv, env=quiet, cwd=cwd, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL
    )


def test_claude_code_completes_a_turn_with_a_tool(sim: RunningCluster, tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("corral serves Claude Code.\n")
    done = _run(
        [str(CLIS / "claude"), "-p", "Read the file notes.txt", "--tools", "Read", "--output-format", "json"],
        {
            "HOME": str(tmp_path),
            "ANTHROPIC_BASE_URL": sim.url,
            "ANTHROPIC_AUTH_TOKEN": "none",
            "ANTHROPIC_MODEL": "m",
            "ANTHROPIC_SMALL_FAST_MODEL": "m",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
        },
        tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["is_error"] is False and result["result"], result
    assert result["num_turns"] == 2 and result["stop_reason"] == "end_turn"  # a tool_use, its result, words


def test_codex_exec_completes_a_turn_with_a_tool(sim: RunningCluster, tmp_path: Path) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    (home / ".codex").mkdir(parents=True)
    work.mkdir()
    (home / ".codex" / "config.toml").write_text(
        'model = "m"\nmodel_provider = "corral"\n\n[model_providers.corral]\nname = "corral"\n'
        f'base_url = "{sim.base_url}"\nenv_key = "CORRAL_API_KEY"\nwire_api = "responses"\n'
    )
    done = _run(
        [str(CLIS / "codex"), "exec", "--skip-git-repo-check", "--json", "Say hello"],
        {"HOME": str(home), "CORRAL_API_KEY": "none"},
        work,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    kinds = [e.get("type") for e in events]
    assert "error" not in kinds and "turn.failed" not in kinds, kinds
    items = [e["item"] for e in events if e.get("type") == "item.completed"]
    assert any(i.get("type") == "agent_message" and i.get("text") for i in items), items
    assert len(items) >= 2  # the tool it called, then its words
