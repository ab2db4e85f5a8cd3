"""A shared store goes down and comes back under traffic: Redis (rate limits).

The test runs its own Redis server on a free port, so the one the rest of the suite uses is never touched.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from corral.cluster import free_port
from corral.config import AuthSettings, GatewaySettings, LimitsSettings, QueueSettings, StoreSettings
from corral.gateway import GatewayServer, GatewayServices
from corral.routing import Replica, ReplicaSet, ReplicaState, Router

from ..gateway.conftest import ScriptedUpstream

MESSAGES = [{"role": "user", "content": "hi"}]


class Server:
    """A throwaway server that can be stopped and started again on the same port."""

    def __init__(self, argv: list[str], port: int, ready: list[str]) -> None:
        self.argv, self.port, self._ready = argv, port, ready
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while subprocess.run(self._ready, capture_output=True).returncode != 0:
            assert self.process.poll() is None and time.monotonic() < deadline, f"{self.argv} did not start"
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


@pytest.fixture
def redis() -> Iterator[Server]:
    port = free_port()
    server = Server(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
        port,
        ["redis-cli", "-p", str(port), "ping"],
    )
    server.start()
    yield server
    server.stop()


async def _gateway(
    tmp_path: Path, upstream: ScriptedUpstream, limits: LimitsSettings, store: str, auth: AuthSettings
) -> tuple[GatewayServer, GatewayServices, str]:
    replicas = ReplicaSet(["m"])
    replicas.add(Replica("m-0", "m", "x", url=upstream.url, state=ReplicaState.READY))
    services = GatewayServices.build(
        replicas,
        f"sqlite:///{tmp_path / 'c.db'}",
        auth,
        StoreSettings(url=store, flush_interval=0.2, max_pending=1000),
        limits,
        QueueSettings(),
        None,
    )
    server = GatewayServer(GatewaySettings(port=0), Router(replicas), services)
    await server.start()
    return server, services, f"http://127.0.0.1:{server.port}/v1/chat/completions"


async def _statuses(url: str, key: str | None, count: int) -> list[int]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as session:
        statuses = []
        for _ in range(count):
            async with session.post(url, json={"model": "m", "messages": MESSAGES}, headers=headers) as r:
                statuses.append(r.status)
        return statuses


async def test_redis_down_and_back(tmp_path: Path, upstream: ScriptedUpstream, redis: Server) -> None:
    """Limits hold while Redis is up, requests are served (fail-open) while it is down, and limits hold
    again once it is back, without restarting the gateway."""
    limits = LimitsSettings(backend="redis", redis_url=f"redis://127.0.0.1:{redis.port}/0", redis_timeout=0.3)
    store = f"sqlite:///{tmp_path / 'u.db'}"
    server, services, url = await _gateway(tmp_path, upstream, limits, store, AuthSettings(open=False))
    try:
        key, _ = services.keys.create("t", rpm=3)
        assert await _statuses(url, key, 4) == [200, 200, 200, 429]
        redis.stop()
        assert await _statuses(url, key, 3) == [200, 200, 200]
        redis.start()  # a fresh, empty Redis: the window starts again
        assert await _statuses(url, key, 4) == [200, 200, 200, 429]
    finally:
        await server.stop()
