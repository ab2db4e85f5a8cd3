"""`gateway.workers: 2`: two gateway processes on one port, fed one supervisor's replica set.

One `corral up` with simulated replicas (supervised like any engine) and limits in the real Redis: both
workers take connections; a key's rate limit holds exactly across them; /metrics on either worker counts
every request once; a killed worker is restarted while the other keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import aiohttp
import pytest

from ..conftest import CORRAL, RunningCluster, chat, get_json, pid_alive, start_cluster

pytestmark = pytest.mark.slow  # real engines or servers, or long drills (`make test-fast` skips)

RPM = 24  # per window
WINDOW = 8.0
_SKEW = 0.3  # seconds between a client sending a request and Redis counting it, at most


@pytest.fixture(scope="module")
def workers_cluster(tmp_path_factory: pytest.TempPathFactory) -> RunningCluster:
    tmp = tmp_path_factory.mktemp("workers")
    spec = tmp / "workers.yaml"
    spec.write_text(
        "gateway: {workers: 2}\n"
        "supervisor: {probe_interval: 0.5}\n"
        f"store: {{url: 'sqlite:///{tmp / 'corral.db'}'}}\n"
        # A fresh Redis database key space per run: keys are random, so nothing is shared with other tests.
        f"limits: {{backend: redis, redis_url: 'redis://127.0.0.1:6379/0', window_s: {WINDOW}}}\n"
        "auth: {open: true}\n"
        "models:\n  - name: llama-8b\n    arch: llama-3.1-8b\n"
        "    deployments: [{engine: sim, replicas: 2, gpu: h100-sxm, time_scale: 50}]\n"
    )
    running = start_cluster(tmp, spec=spec)
    yield running
    assert running.stop() == 0


def _workers_seen(url: str, tries: int = 60) -> dict[int, int]:
    """Worker index -> pid, from /corral/status over fresh connections (the kernel picks the worker)."""
    seen: dict[int, int] = {}
    for _ in range(tries):
        status, body = get_json(url + "/corral/status")
        assert status == 200
        seen[body["worker"]["index"]] = body["worker"]["pid"]
        if len(seen) == 2:
            break
    return seen


def test_both_workers_listen_on_the_one_port_and_mirror_the_replicas(workers_cluster: RunningCluster) -> None:
    seen = _workers_seen(workers_cluster.url)
    assert set(seen) == {0, 1}
    assert seen[0] != seen[1] != workers_cluster.process.pid
    for _ in range(20):  # each worker's mirror: the supervisor's replicas, ready, with their pids
        replicas = workers_cluster.status()["replicas"]
        assert [r["state"] for r in replicas] == ["ready", "ready"]
        assert all(r["pid"] and pid_alive(r["pid"]) for r in replicas)
        # capacity is split between the workers, so that their queues together admit what the engine runs
        assert all(r["capacity"] for r in replicas)


def test_a_rate_limit_holds_exactly_across_workers_and_metrics_count_every_request(
    workers_cluster: RunningCluster, tmp_path: Path
) -> None:
    store = next(Path(workers_cluster.log.parent).glob("corral.db"))
    tenant = f"t{uuid.uuid4().hex[:8]}"
    create = [
        "keys",
        "create",
        "--tenant",
        tenant,
        "--rpm",
        str(RPM),
        "--store",
        f"sqlite:///{store}",
        "--json",
    ]
    made = subprocess.run([*CORRAL, *create], capture_output=True, text=True, check=True)
    key = json.loads(made.stdout)["key"]
    before = _requests_counted(workers_cluster.url)
    admitted, refused = asyncio.run(_hammer(workers_cluster.url, key, seconds=WINDOW * 1.5))
    # Times are the clients' (a request is counted in Redis a few ms later): windows a little shorter than
    # the limiter's hold at most RPM, one a little longer holds them all. Two workers counting apart would
    # admit 2 × RPM.
    starts = sorted(admitted)
    worst = max(sum(1 for t in starts if s <= t < s + WINDOW - _SKEW) for s in starts)
    assert worst <= RPM, (worst, RPM)
    assert len([t for t in starts if t < starts[0] + WINDOW + _SKEW]) >= RPM  # the limit is used
    assert refused > 0
    for _ in range(2):  # either worker's /metrics is the one view: every request counted once
        after = _requests_counted(workers_cluster.url)
        assert after.get("200", 0) - before.get("200", 0) == len(admitted)
        assert after.get("429", 0) - before.get("429", 0) == refused


def test_each_worker_s_prefix_index_holds_the_documents_either_worker_routed(
    workers_cluster: RunningCluster,
) -> None:
    """Each request reaches one worker (the kernel picks it per connection), and each worker routes with its
    own prefix index: the workers tell each other their placements, so that either knows where every
    tenant's document went (else the second worker to see a document would place it again, elsewhere)."""
    documents = [f"tenant {t}'s handbook: " + " ".join(f"rule{t}x{i}" for i in range(200)) for t in range(8)]
    for document in documents:  # fresh connections: spread over the workers
        chat(workers_cluster.url, "llama-8b", document)
    blocks = sum(len(d.encode()) // 128 for d in documents)
    held: dict[int, int] = {}
    deadline = time.monotonic() + 20
    while (len(held) < 2 or min(held.values()) < blocks) and time.monotonic() < deadline:
        view = get_json(workers_cluster.url + "/admin/routing")[1]
        index = view["prefix_index"]["llama-8b"]["replicas"]
        held[view["worker"]] = sum(entry["blocks"] for entry in index.values())
    assert set(held) == {0, 1}
    assert min(held.values()) >= blocks, (held, blocks)


def test_either_worker_s_status_counts_the_whole_cluster(workers_cluster: RunningCluster) -> None:
    """Each worker routes with its own counts and its share of the slots, but /corral/status (the CLI's and
    the console's view) answers with the cluster's: every worker's requests, each replica's whole capacity."""

    def served() -> dict[int, int]:  # worker index -> requests served, as its status tells it
        seen: dict[int, int] = {}
        for _ in range(60):
            body = get_json(workers_cluster.url + "/corral/status")[1]
            seen[body["worker"]["index"]] = sum(r["served"] for r in body["replicas"])
            assert [r["capacity"] for r in body["replicas"]] == [256, 256]  # max_num_seqs, not a share
            if len(seen) == 2:
                break
        return seen

    before = served()
    for _ in range(20):  # the earlier tests' requests all reported (the workers report twice a second)
        time.sleep(1.0)
        if (now := served()) == before:
            break
        before = now
    assert before[0] == before[1]  # (nothing runs between the two answers here)
    for i in range(12):  # fresh connections: spread over both workers
        chat(workers_cluster.url, "llama-8b", f"count me {i}")
    deadline = time.monotonic() + 10  # the workers report twice a second
    while (now := served()) != {0: before[0] + 12, 1: before[0] + 12} and time.monotonic() < deadline:
        time.sleep(0.3)
    assert now == {0: before[0] + 12, 1: before[0] + 12}, (before, now)


def test_a_killed_worker_is_restarted_while_the_other_serves(workers_cluster: RunningCluster) -> None:
    seen = _workers_seen(workers_cluster.url)
    os.kill(seen[1], signal.SIGKILL)
    served = 0
    deadline = time.monotonic() + 30
    back: dict[int, int] = {}
    while time.monotonic() < deadline:
        try:
            status, _ = get_json(workers_cluster.url + "/v1/models")
            served += status == 200
            back = _workers_seen(workers_cluster.url, tries=4)
        except OSError:  # one queued in the killed worker's accept queue when it died: reset (or refused)
            continue
        if back.get(1) not in (None, seen[1]):
            break
        time.sleep(0.2)
    assert back.get(1) not in (None, seen[1]), back  # a new worker 1, with a new pid
    back = _workers_seen(workers_cluster.url)  # both (four tries above may all land on one)
    assert back[0] == seen[0]
    assert served > 0
    assert "gateway worker 1 exited" in workers_cluster.log.read_text()


def _requests_counted(url: str) -> dict[str, float]:
    """corral_requests_total for the model, by status, from /metrics."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    counted: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("corral_requests_total{") and 'model="llama-8b"' in line:
            status = line.split('status="')[1].split('"')[0]
            counted[status] = counted.get(status, 0.0) + float(line.rsplit(" ", 1)[1])
    return counted


async def _hammer(url: str, key: str, seconds: float) -> tuple[list[float], int]:
    """Twelve clients, each on its own connection (so both workers get some): start times of the admitted
    requests, and how many were refused."""
    admitted: list[float] = []
    refused = 0
    stop = time.monotonic() + seconds
    body = {"model": "llama-8b", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi."}]}
    headers = {"Authorization": f"Bearer {key}"}

    async def client() -> None:
        nonlocal refused
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < stop:
                started = time.monotonic()
                async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                    await r.read()
                    if r.status == 200:
                        admitted.append(started)
                    elif r.status == 429:
                        refused += 1
                        await asyncio.sleep(0.2)
                    else:
                        raise AssertionError(f"unexpected {r.status}")

    await asyncio.gather(*(client() for _ in range(12)))
    return admitted, refused


async def test_the_pool_relays_a_worker_s_placements_to_the_others_however_long_the_line() -> None:
    """A worker's placements of one event-loop turn (hundreds of hashes per long prompt, many requests) go
    to the other workers as one line: longer than asyncio's 64 KB default, it must still pass whole."""
    import orjson

    from corral.cluster.workers import WorkerPool
    from corral.routing import ReplicaSet

    pool = WorkerPool(ReplicaSet(), {"gateway": {}}, count=3, logs="warning:auto", shutdown_grace=1)
    await pool.serve_control()
    streams = []
    for index in range(3):
        reader, writer = await asyncio.open_unix_connection(str(pool.control_path), limit=1 << 24)
        writer.write(orjson.dumps({"worker": index}) + b"\n")
        await reader.readline()  # its configuration
        await reader.readline()  # the replica set
        streams.append((reader, writer))
    hashes = list(range(2**63, 2**63 + 256))  # one 32 KB prompt's blocks, as big as hashes get
    entries = [["llama-8b-0", hashes, None]] * 40
    line = orjson.dumps({"placements": {"llama-8b": entries}}) + b"\n"
    assert len(line) > 64 * 1024
    streams[0][1].write(line)
    for reader, _ in streams[1:]:
        assert await asyncio.wait_for(reader.readline(), 5) == line
    for _, writer in streams:
        writer.close()
    await pool.stop()


async def test_a_worker_that_reads_nothing_of_its_control_connection_is_let_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hung worker reads nothing of what the pool sends it (the replica set, other workers' placements,
    megabytes a second under load): past a bound of unread bytes its connection is closed (its process
    killed and started again), rather than the supervisor holding all of it until it runs out of memory."""
    import orjson

    from corral.cluster import workers
    from corral.routing import ReplicaSet

    monkeypatch.setattr(workers, "_MOST_UNREAD", 4 * 1024 * 1024)
    pool = workers.WorkerPool(ReplicaSet(), {"gateway": {}}, count=2, logs="warning:auto", shutdown_grace=1)
    await pool.serve_control()
    streams = []
    for index, limit in ((0, 1 << 24), (1, 1 << 16)):  # (worker 1's reader stops taking at 128 KiB)
        reader, writer = await asyncio.open_unix_connection(str(pool.control_path), limit=limit)
        writer.write(orjson.dumps({"worker": index}) + b"\n")
        await reader.readline()
        await reader.readline()
        streams.append((reader, writer))
    line = orjson.dumps({"placements": {"m": [["m-0", list(range(2**63, 2**63 + 4000)), None]]}}) + b"\n"
    for _ in range(200):  # ~16 MB, to a worker that reads none of it
        streams[0][1].write(line)
        await streams[0][1].drain()
        await asyncio.sleep(0)
    await asyncio.sleep(0.5)
    hung = pool._workers[1].writer
    assert hung is not None and hung.is_closing()
    assert hung.transport.get_write_buffer_size() < 8 * 1024 * 1024
    for _, writer in streams:
        writer.close()
    await pool.stop()


async def test_a_worker_that_cannot_be_started_or_hangs_before_listening_is_started_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A restart whose process cannot be made (fork's EAGAIN) is tried again, not the worker given up for
    good; a restarted worker that hangs before it listens is killed and started again, not waited on
    forever; stopping waits for all workers side by side."""
    from corral.cluster import workers
    from corral.routing import ReplicaSet

    monkeypatch.setattr(workers, "_START_TIMEOUT_S", 0.5)
    monkeypatch.setattr(workers, "_BACKOFF_MAX_S", 0.1)
    pool = workers.WorkerPool(ReplicaSet(), {"gateway": {}}, count=1, logs="warning:auto", shutdown_grace=1)
    worker = pool._workers[0]
    worker.process = await asyncio.create_subprocess_exec("true")  # (it exited: restarted)
    spawned: list[asyncio.subprocess.Process] = []

    async def spawn(one: workers._Worker) -> None:
        if not spawned and not getattr(spawn, "failed", False):
            spawn.failed = True  # type: ignore[attr-defined]
            raise OSError(11, "Resource temporarily unavailable")
        one.listening.clear()
        one.process = await asyncio.create_subprocess_exec("sleep", "30")
        spawned.append(one.process)
        if len(spawned) == 2:
            one.listening.set()  # the second one listens

    monkeypatch.setattr(pool, "_spawn", spawn)
    keeping = asyncio.create_task(pool._keep(worker))
    try:
        deadline = time.monotonic() + 10
        while len(spawned) < 2 or worker.restarts:
            assert time.monotonic() < deadline, (len(spawned), worker.restarts)
            await asyncio.sleep(0.05)
        assert spawned[0].returncode is not None  # the hung one was killed
        assert spawned[1].returncode is None
    finally:
        pool._stopping = True
        keeping.cancel()
        for process in spawned:
            if process.returncode is None:
                process.kill()
                await process.wait()


_SNAPSHOT = ("corral_replica_ready", "corral_replica_state", "corral_replica_restarts", "corral_engine_")


def test_a_drained_replica_leaves_either_worker_s_metrics(workers_cluster: RunningCluster) -> None:
    """A replica drained (or a model removed) leaves /metrics on every worker: published as a multiprocess
    gauge, it stayed at 0, "not ready", for good, and CorralReplicaDown paged for it. (Last in this module:
    it takes a replica away.)"""
    import urllib.request

    url = workers_cluster.url
    drain = urllib.request.Request(url + "/admin/replicas/llama-8b-1/drain", method="POST")
    with urllib.request.urlopen(drain, timeout=30) as answer:
        assert answer.status in (200, 202)
    deadline = time.monotonic() + 60
    while True:
        _, status = get_json(url + "/corral/status")
        ids = {r["id"] for r in status["replicas"]}
        if "llama-8b-1" not in ids:
            break
        assert time.monotonic() < deadline, ids
        time.sleep(0.5)
    time.sleep(2.5)  # (workers publish their own figures once a second)
    for _ in range(8):  # fresh connections: either worker answers
        with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
            text = response.read().decode()
        assert 'replica="llama-8b-0"' in text
        listed = [line for line in text.splitlines() if 'replica="llama-8b-1"' in line]
        # (its in-flight and circuit gauges, each worker's own, stay at a harmless 0)
        assert not [line for line in listed if line.startswith(_SNAPSHOT)], listed
