"""`corral up` as a newcomer meets it: a model that cannot start, a narrow terminal, a closed gateway."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from corral.cluster import free_port

from ..conftest import CORRAL, get_json
from .test_errors import corral, one_error


@pytest.mark.slow
def test_replica_that_cannot_start_is_given_up_with_its_log(tmp_path: Path) -> None:
    model = tmp_path / "not-a-model.gguf"
    model.write_text("hello, I am a text file\n")
    spec = tmp_path / "broken.yaml"
    spec.write_text(
        "auth: {open: true}\n"
        "supervisor: {max_start_failures: 2, backoff_initial: 0.1, backoff_max: 0.2}\n"
        f"store: {{url: 'sqlite:///{tmp_path / 'c.db'}'}}\n"
        f"models:\n  - name: broken\n    source: {{path: {model}}}\n"
        "    deployments: [{engine: llamacpp, replicas: 1}]\n"
    )
    done = corral("up", "-f", str(spec), "--port", "0", timeout=120)
    one_error(done, 1, "model 'broken' cannot start", "failed 2 starts in a row")
    assert "last lines of" in done.stderr and "failed to load model" in done.stderr
    assert "corral is serving" not in done.stderr + done.stdout


def test_banner_fits_80_columns_and_a_closed_gateway_says_how_to_authenticate(tmp_path: Path) -> None:
    spec = tmp_path / "closed.yaml"
    spec.write_text(
        "auth: {open: false, admin_key: admin-secret}\n"
        f"store: {{url: 'sqlite:///{tmp_path / 'c.db'}'}}\n"
        "supervisor: {probe_interval: 0.5}\n"
        "models:\n  - name: llama-8b\n    arch: llama-3.1-8b\n"
        "    deployments: [{engine: sim, gpu: h100-sxm, replicas: 1, time_scale: 10}]\n"
    )
    port = free_port()
    log = tmp_path / "up.log"
    env = {k: v for k, v in os.environ.items() if k != "CORRAL_ADMIN_KEY"}
    process = subprocess.Popen(
        [*CORRAL, "up", "-f", str(spec), "--port", str(port)],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env={**env, "COLUMNS": "80"},
    )
    try:
        deadline = time.monotonic() + 60
        while "Ctrl-C stops everything" not in log.read_text() and time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()
            time.sleep(0.2)
        text = log.read_text()
        lines = text.splitlines()
        base = f"http://127.0.0.1:{port}/v1"
        assert f"    export OPENAI_BASE_URL={base}" in lines
        assert "    export OPENAI_API_KEY=<a key from: corral keys create --tenant NAME>" in lines
        assert re.search(r"llama-8b-0\s+ready\s+127\.0\.0\.1:\d{4,5}\s", text), text
        assert get_json(f"http://127.0.0.1:{port}/corral/status")[0] == 401
        url = f"http://127.0.0.1:{port}"
        assert f"status: corral status --url http://127.0.0.1:{port} --admin-key KEY" in text  # closed
        one_error(corral("status", "--url", url), 1, "answered 401", "--admin-key", "$CORRAL_ADMIN_KEY")
        refused = one_error(corral("status", "--url", url, "--admin-key", "wrong"), 1, "--admin-key")
        assert "the key given was refused" in refused and "Authorization" not in refused
        shown = corral("status", "--url", url, "--admin-key", "admin-secret")
        assert shown.returncode == 0 and "llama-8b-0" in shown.stdout and "127.0.0.1:" in shown.stdout
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)
