"""With several gateway workers, /metrics and the console's figures sum every worker's multiprocess files:
hundreds of milliseconds with many series, which the event loop paid on every scrape and console poll
(each open console tab polls every 2 s). They are read in a thread, once for concurrent callers, and a
reading serves for a second. The workers' files are written by a real worker process (as
cluster/workers.py starts them)."""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from corral.config import GatewaySettings
from corral.gateway import GatewayServer
from corral.gateway.metrics import GatewayMetrics, read_workers
from corral.routing import ReplicaSet, Router
from tests.gateway.conftest import make_services

_WORKER = """
import sys
from pathlib import Path
from corral.gateway.metrics import GatewayMetrics
from corral.routing import ReplicaSet, Router

metrics = GatewayMetrics(Router(ReplicaSet(["m"])), dict, Path(sys.argv[1]))
metrics.of("m").finished(200, 0.5)
for tenant in range(int(sys.argv[2])):  # each tenant's requests and tokens: three series
    metrics.tenant(f"tenant{tenant:05d}").finished(200, 10, 10)
"""


@pytest.fixture(scope="module")
def worker_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The files of one worker that served 5,000 tenants, and copies as two more workers' (~0.4 s to sum)."""
    folder = tmp_path_factory.mktemp("metrics")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder)}
    subprocess.run([sys.executable, "-c", _WORKER, str(folder), "5000"], env=env, check=True, timeout=120)
    [counters] = folder.glob("counter_*.db")
    for pid in (1, 2):
        shutil.copy(counters, folder / f"counter_{pid}.db")
    return folder


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """The heap as a gateway worker keeps it (cli/worker.py freezes it once started): else the collector's
    full passes over this test process's objects, which the reading's allocations set off in its thread,
    hold the interpreter for a tenth of a second each, whichever thread runs."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


async def test_a_scrape_leaves_the_event_loop_free_while_the_workers_files_are_read(
    worker_files: Path, tmp_path: Path, frozen_heap: None
) -> None:
    started = time.perf_counter()
    read_workers(worker_files)
    blocking = time.perf_counter() - started  # what the loop was held for on each scrape
    assert blocking > 0.15, blocking  # (else this test could not tell)
    replicas = ReplicaSet(["m"])
    parts = make_services(replicas, tmp_path / "corral.db")
    server = GatewayServer(GatewaySettings(port=0), Router(replicas), parts, metrics_dir=worker_files)
    await server.start()
    gaps: list[float] = []

    async def heartbeat() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    beating = asyncio.create_task(heartbeat())
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{server.port}/metrics") as response:
                assert response.status == 200
                text = await response.text()
    finally:
        beating.cancel()
        await server.stop()
    assert 'corral_tenant_requests_total{status="200",tenant="tenant04999"} 3.0' in text  # three workers'
    assert max(gaps) < blocking / 2, (max(gaps), blocking)


async def test_concurrent_callers_share_one_reading_and_it_serves_for_a_second(
    worker_files: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "metrics"
    shutil.copytree(worker_files, folder)
    now = [100.0]
    metrics = GatewayMetrics(Router(ReplicaSet(["m"])), dict, folder, clock=lambda: now[0])
    (at, first), (_, second), scraped = await asyncio.gather(
        metrics.models_summary(), metrics.models_summary(), metrics.scrape()
    )
    assert first is second  # one reading
    assert first["m"]["requests"] == {"200": 3.0}
    assert 'corral_requests_total{model="m",status="200"} 3.0' in scraped.decode()
    [counters, *_] = folder.glob("counter_*.db")
    shutil.copy(counters, folder / "counter_3.db")  # a fourth worker's requests
    now[0] += 0.9
    assert await metrics.models_summary() == (at, first)  # (the reading of 0.9 s ago)
    now[0] += 0.2
    later, models = await metrics.models_summary()
    assert models["m"]["requests"] == {"200": 4.0} and later >= at
    await metrics.stop()
