"""A replica's log is rotated by size (`supervisor.replica_log_max_mb`, `supervisor.replica_log_keep`):
copied to `<log>.1` (older copies moved along, the oldest dropped) and emptied in place, while the engine
goes on appending to it. (A Ray replica's actor rotates its engine's log the same way: test_ray.py.)"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from corral.cluster.runtime import log_name, rotate_log
from corral.config import Paths
from tests.conftest import cluster_of

WRITER = "import time\nfor i in range(10**6):\n    print(f'line {i}', flush=True)\n    time.sleep(0.001)\n"


def wait_for(check: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_log_is_rotated_while_its_process_goes_on_writing_to_it(tmp_path: Path) -> None:
    """As the runtimes start engines: the log opened for appending and given to the process as its output."""
    log = tmp_path / "m-0.log"
    with log.open("ab") as out:
        writer = subprocess.Popen([sys.executable, "-c", WRITER], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: log.stat().st_size > 4096)
        assert not rotate_log(log, 1 << 20, keep=2)  # under the limit: left alone
        assert rotate_log(log, 4096, keep=2)
        first = (tmp_path / "m-0.log.1").read_text()
        assert first.startswith("line 0\n")
        wait_for(lambda: log.stat().st_size > 100)
        after = log.read_bytes()
        assert b"\0" not in after  # the writer appends at the emptied file's start: no hole where it was
        assert len(after) < len(first)  # (a writer keeping its own offset would leave one)
        last_copied = int(first.strip().splitlines()[-1].split()[1])
        assert int(after.split(b"\n")[1].split()[1]) > last_copied  # it went on writing to the same file
        for _ in range(3):  # keep=2: .1 and .2, never a third
            wait_for(lambda: log.stat().st_size > 4096)
            assert rotate_log(log, 4096, keep=2)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["m-0.log", "m-0.log.1", "m-0.log.2"]
        newest, older = (tmp_path / "m-0.log.1").read_text(), (tmp_path / "m-0.log.2").read_text()
        assert int(newest.split()[1]) > int(older.split()[1])  # .1 is the newest copy
    finally:
        writer.kill()
        writer.wait()


SPEC = """
auth: {open: true}
supervisor: {probe_interval: 0.2, replica_log_max_mb: 0.01, replica_log_keep: 1}
models:
  - name: logrotated
    arch: llama-3.1-8b
    deployments: [{engine: sim, gpu: l4, replicas: 1, time_scale: 100}]
"""


def test_the_supervisor_rotates_a_replicas_log_as_the_spec_says(tmp_path: Path) -> None:
    with cluster_of(tmp_path, SPEC) as cluster:
        (replica,) = cluster.status()["replicas"]
        log = Paths.from_env().logs / log_name(replica["id"])
        copy = log.with_name(log.name + ".1")
        copy.unlink(missing_ok=True)
        for round_no in range(2):
            with log.open("ab") as out:  # output beyond 0.01 MiB, as the engine would write it
                out.write(f"round {round_no}\n".encode() + b"x" * 20_000 + b"\n")
            wait_for(lambda: log.stat().st_size < 10_240)  # rotated within a probe or two
            assert f"round {round_no}\n" in copy.read_text()
        assert not log.with_name(log.name + ".2").exists()  # replica_log_keep: 1


def test_no_two_replicas_ids_share_a_log() -> None:
    """`org/model`'s replica and `org_model`'s once wrote one file (and keeping the last drained replicas'
    logs could delete a running one's)."""
    assert log_name("org/model-0") != log_name("org_model-0")
    assert log_name("smollm2-0") == "smollm2-0.log"
