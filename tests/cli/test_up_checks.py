"""What `corral up` checks before it fetches or starts anything, and how it tells where it listens: a
tokenizer that cannot be loaded (found only by the gateway, after every model was fetched, as an
`os error 2` naming neither field nor file), flags checked as the file's values are, and an IPv6 address
in brackets."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from corral.cli import app
from corral.cli.app import fail
from corral.cli.up import _announce
from corral.config import parse_spec
from corral.routing import ReplicaSet

from .test_errors import corral, one_error

SIM = """
auth: {{open: true}}
store: {{url: 'sqlite:///{db}'}}
models:
  - name: m
    arch: llama-3.1-8b
    deployments: [{{engine: sim, gpu: l4, replicas: 1}}]
"""
LOCAL = """
  - name: local
    tokenizer: {tokenizer}
    source: {{path: {missing}}}
    deployments: [{{engine: llamacpp, replicas: 1}}]
"""


def test_a_tokenizer_that_cannot_be_loaded_is_refused_before_anything_is_prepared(tmp_path: Path) -> None:
    """The second model's weights are missing too: both are named at once, before any fetch."""
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    spec = tmp_path / "cluster.yaml"
    for tokenizer, command in ((tmp_path / "tokenzier.json", "up"), (garbage, "prepare")):
        missing = tmp_path / "no.gguf"
        spec.write_text(SIM.format(db=tmp_path / "c.db") + LOCAL.format(tokenizer=tokenizer, missing=missing))
        done = corral(command, "-f", str(spec))
        assert done.returncode == 2 and done.stderr.startswith(f"error: {spec}: 2 problems:"), done.stderr
        assert f"  models[1].tokenizer: {tokenizer}: " in done.stderr
        assert f"  models[1].source.path: {missing}: no such file or folder" in done.stderr


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (("--port", "70000"), ("--port 70000", "65535")),
        (("--port", "-1"), ("--port -1",)),
        (("--host", "0.0.0.0"), ("an open gateway", "open_to_network")),
    ],
)
def test_up_checks_its_flags_as_the_spec_checks_the_file(
    tmp_path: Path, flags: tuple[str, ...], words: tuple[str, ...]
) -> None:
    spec = tmp_path / "cluster.yaml"
    spec.write_text(SIM.format(db=tmp_path / "c.db"))
    one_error(corral("up", "-f", str(spec), *flags), 2, *words)


def test_an_ipv6_gateway_is_written_in_brackets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "cluster.yaml"
    spec.write_text("gateway: {host: '::1'}\n" + SIM.format(db=tmp_path / "c.db"))
    checked = CliRunner().invoke(app, ["spec", "check", "-f", str(spec)])
    assert checked.exit_code == 0 and "gateway [::1]:8000," in checked.stdout, checked.output
    paths = types.SimpleNamespace(logs=tmp_path)
    _announce(parse_spec(spec.read_text()), 8123, ReplicaSet(), paths)  # type: ignore[arg-type]
    banner = capsys.readouterr().err
    assert "export OPENAI_BASE_URL=http://[::1]:8123/v1" in banner
    assert "corral status --url http://[::1]:8123" in banner and ":::" not in banner


def test_an_error_line_is_printed_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    """`127.0.0.1:-1:` was printed as `127.0.0.1👎` (Rich's emoji codes)."""
    with pytest.raises(typer.Exit):
        fail("cannot listen on 127.0.0.1:-1: Servname not supported :smile:")
    assert (
        capsys.readouterr().err.strip()
        == "error: cannot listen on 127.0.0.1:-1: Servname not supported :smile:"
    )
