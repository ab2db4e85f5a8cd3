"""The supervisor's probes read an engine's answer up to a bound: a metrics page past it is a failed scrape
(the last load kept), never read whole, and the probes go on; a large page parsed in a thread is stamped
with when it was fetched, not when its parse ended."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

from corral.cluster import LocalProcessRuntime, Supervisor
from corral.config import SupervisorSettings
from corral.engines import EngineLoad, LaunchPlan
from corral.engines.external import ExternalEngine
from corral.routing import ReplicaSet, ReplicaState

SETTINGS = SupervisorSettings(
    probe_interval=0.05,
    probe_timeout=2.0,
    unhealthy_after=3,
    backoff_initial=0.2,
    backoff_max=1.0,
    stop_timeout=1.0,
    ready_timeout=10,
)
SMALL = b"vllm:num_requests_running 7\nvllm:num_requests_waiting 0\n"
LARGE = b"vllm:num_requests_running 9\n" + b"# a comment\n" * (5 * 2**20 // 12)  # 5 MiB
MEDIUM = b"vllm:num_requests_running 8\n" + b"# a comment\n" * (2**20 // 12)  # 1 MiB: read (in a thread)


async def _until(check: Callable[[], bool], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            return
        await asyncio.sleep(0.02)


async def _engine(page: list[bytes], scrapes: list[int]) -> tuple[asyncio.Server, int]:
    """An engine answering `page[0]` on /metrics (each scrape's size in `scrapes`), nothing elsewhere."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                metrics = head.split(b" ", 2)[1] == b"/metrics"
                body = page[0] if metrics else b""
                if metrics:
                    scrapes.append(len(body))
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_a_metrics_page_past_the_bound_is_a_failed_scrape_and_the_probes_go_on(tmp_path: Path) -> None:
    page = [LARGE]
    scrapes: list[int] = []
    server, port = await _engine(page, scrapes)
    supervisor = Supervisor(ReplicaSet(), LocalProcessRuntime(tmp_path / "logs"), SETTINGS)
    (replica,) = supervisor.add("m", ExternalEngine(), [LaunchPlan(url=f"http://127.0.0.1:{port}")])
    try:
        await supervisor.start()
        await _until(lambda: len(scrapes) >= 4)
        assert len(scrapes) >= 4  # scraped round after round...
        assert replica.load is None  # ...each a failed scrape: the page was not taken
        assert replica.state is ReplicaState.READY  # (its health probes pass)
        for size, running in ((MEDIUM, 8), (SMALL, 7)):  # the probes go on
            page[0] = size
            await _until(lambda: replica.load is not None and replica.load.running == running)  # noqa: B023
            assert replica.load is not None and replica.load.running == running
    finally:
        await supervisor.stop()
        server.close()


class SlowParse(ExternalEngine):
    """Each metrics page's parse waits (in the supervisor's worker thread) for a permit of `go`."""

    def __init__(self) -> None:
        super().__init__()
        self.began: list[float] = []
        self.go = threading.Semaphore(0)

    def parse_load(self, text: str) -> EngineLoad:
        self.began.append(time.monotonic())
        self.go.acquire()
        return super().parse_load(text)


async def test_a_page_parsed_in_a_thread_carries_its_fetch_time(tmp_path: Path) -> None:
    """Before, the load carried the time its parse ended: a parse that took over half a second passed for
    a reading taken after a drain began (an engine idle then, its requests started since), and a page
    fetched long ago for a fresh one."""
    server, port = await _engine([MEDIUM], [])
    slow = SlowParse()
    supervisor = Supervisor(ReplicaSet(), LocalProcessRuntime(tmp_path / "logs"), SETTINGS)
    (replica,) = supervisor.add("m", slow, [LaunchPlan(url=f"http://127.0.0.1:{port}")])
    try:
        await supervisor.start()
        await _until(lambda: bool(slow.began))
        assert slow.began, "no metrics page was parsed"
        slow.go.release()  # the first parse ends (the next ones wait)
        await _until(lambda: replica.load is not None)
        assert replica.load is not None and replica.load.running == 8
        assert replica.load.scraped_monotonic < slow.began[0]  # fetched before its parse began
    finally:
        slow.go.release(1000)
        await supervisor.stop()
        server.close()
