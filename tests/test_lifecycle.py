"""The cluster survives a replica being killed, and stopping corral leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from corral.cluster.runtime import die_with_parent

from .conftest import CORRAL, pid_alive, start_cluster

pytestmark = pytest.mark.slow  # real engines or servers, or long drills (`make test-fast` skips)

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


def wait_for(condition, timeout: float = 30) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def test_kill_9_of_a_replica_during_a_burst_loses_no_request(tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path)
    try:
        client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0, timeout=120)
        victim = cluster.status()["replicas"][0]

        def ask(i: int) -> str | None:
            reply = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=24)
            return reply.choices[0].message.content

        with ThreadPoolExecutor(max_workers=12) as pool:
            futures = [pool.submit(ask, i) for i in range(24)]
            assert wait_for(lambda: cluster.status()["replicas"][0]["outstanding"] > 0, timeout=10)
            os.kill(victim["pid"], signal.SIGKILL)
            answers = [f.result() for f in futures]  # raises if any request failed
        assert all(answers)

        def restarted() -> bool:
            replica = cluster.status()["replicas"][0]
            return (
                replica["state"] == "ready" and replica["restarts"] == 1 and replica["pid"] != victim["pid"]
            )

        assert wait_for(restarted), cluster.status()
        shown = subprocess.run(
            [*CORRAL, "status", "--url", cluster.url, "--json"], capture_output=True, text=True
        )
        assert '"restarts": 1' in shown.stdout
        assert not pid_alive(victim["pid"])
    finally:
        cluster.stop()


def test_ctrl_c_stops_gateway_and_every_replica(tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path)
    pids = cluster.replica_pids()
    assert len(pids) == 2 and all(pid_alive(p) for p in pids)
    assert cluster.stop(signal.SIGINT) == 0
    assert wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=5)
    assert "stopped" in cluster.log.read_text()


def test_replicas_die_with_a_killed_corral(tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path)
    pids = cluster.replica_pids()
    cluster.stop(signal.SIGKILL)  # no chance to clean up: the kernel must end the replicas
    # Alone they are gone within 0.15 s; 5 s once ran out late in a CI run of 2026-12-03 (cause unknown:
    # the states of any still alive are in the message)
    assert wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=20), _states(pids)


def test_a_child_whose_parent_died_before_the_pact_ends_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel sends the death signal only for a parent that dies after `prctl`; a parent gone between
    the fork and the request (the child then belongs to init or a subreaper) is caught by the pact itself."""
    monkeypatch.setattr(os, "getpid", lambda: 1)  # the pact records a parent that is not the child's
    pact = die_with_parent(signal.SIGKILL)
    monkeypatch.undo()
    assert subprocess.run(["sleep", "30"], preexec_fn=pact, timeout=10).returncode == -signal.SIGKILL
    assert subprocess.run(["true"], preexec_fn=die_with_parent(signal.SIGKILL), timeout=10).returncode == 0


def _states(pids: list[int]) -> list[str]:
    """Each pid still alive, with its state, parent and command (from /proc)."""
    alive = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        alive.append(f"{pid}: state {state}, parent {ppid}: {command}")
    return alive
