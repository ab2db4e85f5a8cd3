"""`corral drain` on a live llama.cpp cluster under streaming and whole-answer load: the replica leaves
routing, its in-flight requests and streams finish, it stops, and not one request fails."""

from __future__ import annotations

import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest

from tests.conftest import CORRAL, pid_alive, start_cluster

pytestmark = pytest.mark.slow  # real engines or servers, or long drills (`make test-fast` skips)


@dataclass
class Tally:
    ok: int = 0
    failed: list[str] = field(default_factory=list)
    truncated: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def user(base_url: str, stream: bool, stop: threading.Event, tally: Tally) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=60)
    while not stop.is_set():
        try:
            if stream:
                finish = None
                for chunk in client.chat.completions.create(
                    model="smollm2",
                    messages=[{"role": "user", "content": "Count to ten."}],
                    max_tokens=24,
                    stream=True,
                ):
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                with tally.lock:
                    tally.ok += finish is not None
                    tally.truncated += finish is None
            else:
                client.chat.completions.create(
                    model="smollm2", messages=[{"role": "user", "content": "Say hi."}], max_tokens=24
                )
                with tally.lock:
                    tally.ok += 1
        except openai.APIError as exc:
            with tally.lock:
                tally.failed.append(repr(exc))


def test_drain_under_load_fails_nothing(tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path)
    try:
        victim = next(r for r in cluster.status()["replicas"] if r["id"] == "smollm2-0")
        stop, tally = threading.Event(), Tally()
        users = [
            threading.Thread(target=user, args=(cluster.base_url, stream, stop, tally))
            for stream in (True, True, False, False)
        ]
        for thread in users:
            thread.start()
        time.sleep(2)
        before = tally.ok
        command = [*CORRAL, "drain", "smollm2-0", "--url", cluster.url, "--grace", "30"]
        again = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)  # the same drain asked twice
        drained = subprocess.run(command, capture_output=True, text=True, timeout=90)
        _, twice = again.communicate(timeout=90)
        served_while_draining = tally.ok - before
        time.sleep(1.5)
        stop.set()
        for thread in users:
            thread.join(timeout=60)
        assert drained.returncode == 0, drained.stderr
        assert "drained smollm2-0 (smollm2)" in drained.stderr and "its requests finished" in drained.stderr
        assert again.returncode == 0 and "drained smollm2-0 (smollm2)" in twice, twice  # one drain, both told
        assert tally.failed == [] and tally.truncated == 0
        assert served_while_draining > 0 and tally.ok > before + served_while_draining
        replicas = cluster.status()["replicas"]
        assert [r["id"] for r in replicas] == ["smollm2-1"]
        deadline = time.monotonic() + 10
        while pid_alive(victim["pid"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(victim["pid"])
        missing = subprocess.run(
            [*CORRAL, "drain", "smollm2-9", "--url", cluster.url], capture_output=True, text=True, timeout=30
        )
        assert missing.returncode == 1
        assert (
            missing.stderr.startswith("error: ") and "404" in missing.stderr and "smollm2-9" in missing.stderr
        )
    finally:
        cluster.stop()
