"""Which gateway a client command talks to: `--url`, else the spec's `gateway` section with -f, else
$CORRAL_URL, else $OPENAI_BASE_URL (what `corral up` tells users to export), said on stderr. `corral apply
-f spec.yaml` talked to :8000 whatever the spec said (on a host with two clusters: the wrong one)."""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from corral.cli import app
from corral.cluster import free_port

from ..conftest import cluster_of

SPEC = """\
auth: {{open: false, admin_key: admin}}
store: {{url: 'sqlite:///{db}'}}
{gateway}models:
  - name: m
    arch: llama-3.1-8b
    deployments: [{{engine: sim, gpu: h100-sxm, replicas: 1, time_scale: 10}}]
"""
CLEAN = {"CORRAL_URL": "", "OPENAI_BASE_URL": "", "CORRAL_ADMIN_KEY": "admin"}


def run(*args: str, **env: str) -> tuple[int, str]:
    done = CliRunner().invoke(app, list(args), env={**CLEAN, **env})
    return done.exit_code, " ".join(done.output.split())


def test_each_source_of_the_address_in_its_order(tmp_path: Path) -> None:
    with cluster_of(tmp_path, SPEC.format(db=tmp_path / "c.db", gateway=""), admin_key="admin") as running:
        port = running.url.rsplit(":", 1)[1]
        code, said = run("status", CORRAL_URL=running.url)
        assert code == 0 and f"gateway: {running.url} (from $CORRAL_URL)" in said, said
        code, said = run("status", OPENAI_BASE_URL=running.url + "/v1")
        assert code == 0 and f"gateway: {running.url} (from $OPENAI_BASE_URL)" in said, said
        code, said = run("status", "--url", running.url, CORRAL_URL="http://127.0.0.1:9")
        assert code == 0 and "gateway:" not in said, said  # named by the user: nothing to say
        spec = tmp_path / "again.yaml"  # the cluster's own spec, with the port it listens on
        spec.write_text(
            SPEC.format(db=tmp_path / "c.db", gateway=f"gateway: {{host: 0.0.0.0, port: {port}}}\n")
        )
        code, said = run("apply", "-f", str(spec), CORRAL_URL="http://127.0.0.1:9")
        assert code == 0 and f"gateway: http://127.0.0.1:{port} (from the gateway section of {spec})" in said
        assert "gateway.host: taken at the next restart of corral up" in said, said  # (0.0.0.0: not now)
        assert "nothing else to change" in said, said


def test_batch_submit_reads_openai_base_url_and_says_why_it_cannot_connect(tmp_path: Path) -> None:
    lines = tmp_path / "in.jsonl"
    lines.write_text(
        '{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}\n'
    )
    closed = f"http://127.0.0.1:{free_port()}"
    code, said = run("batch", "submit", str(lines), OPENAI_BASE_URL=closed + "/v1", OPENAI_API_KEY="k")
    assert code == 1 and f"gateway: {closed} (from $OPENAI_BASE_URL)" in said, said
    assert re.search(r"no corral gateway answers at \S+: connect(ion)? (call failed|refused)", said), said
    assert "Cannot connect to host" not in said and "ssl:default" not in said  # aiohttp's own words


def test_a_refusal_names_the_flag_not_the_header(tmp_path: Path) -> None:
    lines = tmp_path / "in.jsonl"
    lines.write_text(
        '{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}\n'
    )
    with cluster_of(tmp_path, SPEC.format(db=tmp_path / "c.db", gateway=""), admin_key="admin") as running:
        code, said = run(
            "batch", "submit", str(lines), "--url", running.url, CORRAL_API_KEY="", OPENAI_API_KEY=""
        )
        assert code == 1 and "no key was given" in said and "--api-key" in said, said
        assert "Authorization" not in said
        code, said = run(
            "apply", "-f", str(tmp_path / "spec.yaml"), "--url", running.url, CORRAL_ADMIN_KEY=""
        )
        assert code == 1 and "--admin-key" in said and "Authorization" not in said, said


def test_the_default_names_only_the_flags_the_command_has() -> None:
    closed = "http://127.0.0.1:8000"
    _code, said = run("status")  # no -f on status
    assert f"gateway: {closed} (from the default; --url or $CORRAL_URL name another)" in said, said
    assert "-f" not in said.split("(from the default")[1].split(")")[0]
