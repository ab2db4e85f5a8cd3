"""Shared fixtures: a real corral cluster started with the CLI, and scripted upstream servers."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from uuid import uuid4

import pytest
from sqlalchemy import create_engine, text

from corral.cluster import free_port

POSTGRES_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432"  # the suite's PostgreSQL (trust auth)

# Ray in the tests runs on one machine, on loopback only (not its other addresses), reporting nothing.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

DATA = Path(__file__).parent / "data"
CORRAL = [sys.executable, "-m", "corral.cli"]


def _own_home() -> None:
    """This test process's corral home: the prepared models and engines of the real one, its own store.
    A spec without `store.url` keeps keys, usage and batches in its home's SQLite file, and any gateway
    on that store checks and runs any batch in it: the two xdist workers' clusters, serving different
    models, sharing one file failed each other's batches ("the model 'marker' does not exist")."""
    from corral.config.env import Paths

    cache = Paths.from_env()
    home = Path(tempfile.mkdtemp(prefix="corral-home-"))
    for shared in (cache.models, cache.engines):
        shared.mkdir(parents=True, exist_ok=True)
        (home / shared.name).symlink_to(shared.resolve())
    os.environ["CORRAL_HOME"] = str(home)
    atexit.register(shutil.rmtree, home, ignore_errors=True)


_own_home()


@dataclass
class RunningCluster:
    """A `corral up` process and where its gateway listens."""

    process: subprocess.Popen[bytes]
    url: str
    log: Path
    tls: ssl.SSLContext | None = None
    admin_key: str | None = None

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def status(self) -> dict:
        return get_json(self.url + "/corral/status", context=self.tls, key=self.admin_key)[1]

    def replica_pids(self) -> list[int]:
        return [r["pid"] for r in self.status()["replicas"] if r["pid"]]

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=timeout)


def start_cluster(
    tmp: Path,
    spec: Path = DATA / "cluster.yaml",
    ready_timeout: float = 120,
    tls: ssl.SSLContext | None = None,
    admin_key: str | None = None,
    args: tuple[str, ...] = (),
) -> RunningCluster:
    """Run `corral up -f spec` (and `args`) on a free port and wait until every replica is ready (/ready
    alone says every model can serve: one replica each). `tls`: the gateway serves HTTPS, checked with this
    client context."""
    port = free_port()
    log = tmp / f"corral-up-{spec.stem}-{port}.log"
    process = subprocess.Popen(
        [*CORRAL, "up", "-f", str(spec), "--port", str(port), *args],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "COLUMNS": "200"},
    )
    scheme = "https" if tls is not None else "http"
    cluster = RunningCluster(process, f"{scheme}://127.0.0.1:{port}", log, tls, admin_key)
    deadline = time.monotonic() + ready_timeout
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"corral up exited early:\n{log.read_text()}")
            try:
                if get_json(cluster.url + "/ready", timeout=1, context=tls)[0] == 200 and all(
                    r["state"] == "ready" for r in cluster.status()["replicas"]
                ):
                    return cluster
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"cluster not ready in {ready_timeout}s:\n{log.read_text()}")
    except BaseException:  # not ready, or the test's timeout struck while waiting: leave nothing running
        try:
            cluster.stop(timeout=30)  # Ctrl-C: corral stops its engines (a SIGKILL would orphan them)
        except subprocess.TimeoutExpired:
            cluster.stop(signal.SIGKILL)
        raise


@contextmanager
def cluster_of(
    tmp: Path,
    spec_text: str,
    name: str = "spec.yaml",
    tls: ssl.SSLContext | None = None,
    admin_key: str | None = None,
    args: tuple[str, ...] = (),
) -> Iterator[RunningCluster]:
    """`corral up` on a spec written from `spec_text`, ready, stopped (Ctrl-C) when the block ends."""
    spec = tmp / name
    spec.write_text(spec_text)
    running = start_cluster(tmp, spec=spec, tls=tls, admin_key=admin_key, args=args)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    running = start_cluster(tmp_path_factory.mktemp("cluster"))
    yield running
    running.stop()


def get_json(
    url: str, timeout: float = 5, context: ssl.SSLContext | None = None, key: str | None = None
) -> tuple[int, dict]:
    """GET a JSON document: (status, body), for any status."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        request = urllib.request.Request(url, headers=headers)
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def chat(url: str, model: str, content: str, max_tokens: int = 2, timeout: float = 30) -> tuple[dict, str]:
    """One chat completion from `url` (a gateway, or an engine directly): its body, and the replica that
    answered (the gateway's `x-corral-replica` header; empty from an engine)."""
    body = {"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": content}]}
    request = urllib.request.Request(
        url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response), response.headers.get("x-corral-replica", "")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def log_has(log: Path, text: str, timeout: float = 10) -> None:
    """Wait until `text` is in the log file (a line is written after the event it reports)."""
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert time.monotonic() < deadline, f"{text!r} not in {log}"
        time.sleep(0.05)


@pytest.fixture
def fresh_postgres() -> Iterator[str]:
    """The URL of a PostgreSQL database of this test's own on the suite's server (no tables), dropped
    after it."""
    name = f"corral_test_{uuid4().hex[:12]}"
    server = create_engine(POSTGRES_SERVER + "/test", isolation_level="AUTOCOMMIT")
    with server.connect() as connection:
        connection.execute(text(f"CREATE DATABASE {name}"))
    try:
        yield f"{POSTGRES_SERVER}/{name}"
    finally:
        with server.connect() as connection:
            connection.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        server.dispose()
