"""`corral drain` will not take a model's last ready replica without --force (every request to the model
was then a 503 until the next apply, and nothing said so); other replicas drain as before."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from corral.cli import app

from ..conftest import cluster_of

SPEC = """\
auth: {{open: false, admin_key: admin}}
store: {{url: 'sqlite:///{db}'}}
supervisor: {{probe_interval: 0.3}}
models:
  - name: m
    arch: llama-3.1-8b
    deployments: [{{engine: sim, gpu: h100-sxm, replicas: 2, time_scale: 10}}]
"""


def test_the_last_ready_replica_is_drained_only_with_force(tmp_path: Path) -> None:
    with cluster_of(tmp_path, SPEC.format(db=tmp_path / "c.db"), admin_key="admin") as running:
        runner = CliRunner()

        def drain(*args: str) -> tuple[int, str]:
            done = runner.invoke(
                app, ["drain", *args, "--url", running.url, "--admin-key", "admin", "--grace", "5"]
            )
            return done.exit_code, " ".join(done.output.split())

        code, said = drain("m-0")
        assert code == 0 and "drained m-0 (m)" in said, said
        code, said = drain("m-1")
        assert code == 1 and "last ready replica" in said and "--force" in said, said
        assert [r["id"] for r in running.status()["replicas"] if r["state"] == "ready"] == ["m-1"]
        code, said = drain("m-1", "--force")
        assert code == 0 and "drained m-1 (m)" in said, said
