"""The shared stores go down and come back under traffic: Redis (rate limits) and PostgreSQL (usage).

Neither touches what the rest of the suite uses: Redis runs as a server of its own on a free port, and
PostgreSQL is reached through a TCP path the test cuts and restores.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.orm import Session

from corral.cluster import free_port
from corral.config import AuthSettings, GatewaySettings, LimitsSettings, QueueSettings, StoreSettings
from corral.gateway import GatewayParts, GatewayServer
from corral.routing import Replica, ReplicaSet, ReplicaState, Router
from corral.store.schema import UsageRow

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
    tmp_path: Path,
    upstream: ScriptedUpstream,
    limits: LimitsSettings,
    store: str,
    auth: AuthSettings,
    max_pending: int = 1000,
    admin_key: str | None = None,
) -> tuple[GatewayServer, GatewayParts, str]:
    replicas = ReplicaSet(["m"])
    replicas.add(Replica("m-0", "m", "x", url=upstream.url, state=ReplicaState.READY))
    services = await asyncio.to_thread(  # off the loop: the PostgreSQL path below runs on it
        GatewayParts.build,
        replicas,
        f"sqlite:///{tmp_path / 'c.db'}",
        auth,
        StoreSettings(url=store, flush_interval=0.2, max_pending=max_pending),
        limits,
        QueueSettings(),
        admin_key,
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


class Outage:
    """A TCP path to the suite's PostgreSQL that can be cut and restored: to the gateway, the database is
    gone (connections reset, new ones refused) and back, while the real server keeps serving the suite."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()

    async def up(self) -> None:
        self._server = await asyncio.start_server(self._pipe, "127.0.0.1", self.port)

    async def down(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()
        for writer in list(self._open):
            writer.transport.abort()
        self._open.clear()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self._open |= {writer, up_writer}

        async def copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                sink.transport.abort()

        await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer))


@pytest.fixture
async def postgres(tmp_path: Path) -> AsyncIterator[tuple[Outage, str, Callable[[], int]]]:
    """A database of its own on the suite's PostgreSQL, reached through an `Outage`: (the path, the URL
    the gateway uses, how many usage rows it holds)."""
    outage = Outage(("127.0.0.1", 5432))
    await outage.up()
    database = f"corral_chaos_{os.getpid()}"
    admin = create_engine("postgresql+psycopg://postgres@127.0.0.1:5432/test", isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f"DROP DATABASE IF EXISTS {database}"))
        connection.execute(text(f"CREATE DATABASE {database}"))
    counter = create_engine(f"postgresql+psycopg://postgres@127.0.0.1:5432/{database}")

    def written() -> int:
        with Session(counter) as session:
            return int(session.scalar(select(func.count()).select_from(UsageRow)) or 0)

    yield outage, f"postgresql://postgres@127.0.0.1:{outage.port}/{database}", written
    await outage.down()
    counter.dispose()
    with admin.connect() as connection:
        connection.execute(text(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)"))
    admin.dispose()


async def _until_written(written: Callable[[], int], count: int) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the writer retries every flush_interval
        if await asyncio.to_thread(written) >= count:
            break
        await asyncio.sleep(0.2)
    return await asyncio.to_thread(written)


async def test_postgres_down_and_back(
    tmp_path: Path, upstream: ScriptedUpstream, postgres: tuple[Outage, str, Callable[[], int]]
) -> None:
    """Usage records made while PostgreSQL is unreachable wait in the gateway (bounded by
    store.max_pending) and are all written once it is back; requests are served throughout (an open
    gateway: no key lookups)."""
    outage, url, written = postgres
    server, _, chat = await _gateway(tmp_path, upstream, LimitsSettings(), url, AuthSettings(open=True))
    try:
        assert await _statuses(chat, None, 5) == [200] * 5
        await outage.down()
        assert await _statuses(chat, None, 20) == [200] * 20
        await asyncio.sleep(0.6)  # a few flushes fail meanwhile
        assert await asyncio.to_thread(written) < 25
        await outage.up()
        assert await _until_written(written, 25) == 25
    finally:
        await server.stop()


STORED_ID = "resp_" + "1" * 32  # (of the shape the gateway gives: it is looked for in the store)


async def test_a_closed_gateway_through_a_postgres_outage(
    tmp_path: Path, upstream: ScriptedUpstream, postgres: tuple[Outage, str, Callable[[], int]]
) -> None:
    """With the store down: a key looked up before is served as last found; a key never looked up, a
    stored response and the admin API are a 503 `store_unavailable` to retry, never a 500; the metrics
    say so (lookups and writes that failed, records waiting, and past store.max_pending, dropped), for an
    alert to fire. Once the store is back the new key works and the records kept are written."""
    outage, url, written = postgres
    auth = AuthSettings(open=False, cache_ttl=0.2)
    server, services, chat = await _gateway(
        tmp_path, upstream, LimitsSettings(), url, auth, max_pending=100, admin_key="boss"
    )
    base = chat.removesuffix("/v1/chat/completions")

    async def metric(name: str) -> float:
        async with (
            aiohttp.ClientSession() as session,
            session.get(base + "/metrics", headers={"Authorization": "Bearer boss"}) as answer,
        ):
            text_ = await answer.text()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text_.splitlines() if line.startswith(name))

    try:
        known, _ = await asyncio.to_thread(services.keys.create, "acme")  # (off the loop: the path is on it)
        fresh, _ = await asyncio.to_thread(services.keys.create, "acme")
        assert await _statuses(chat, known, 1) == [200]
        assert await _until_written(written, 1) == 1
        assert await metric('corral_store_errors_total{use="key_lookup"}') == 0  # there before an outage
        await outage.down()
        await asyncio.sleep(0.3)  # past the key's cache_ttl: it is looked up again, and the store is gone
        assert await _statuses(chat, known, 110) == [200] * 110
        async with aiohttp.ClientSession() as session:
            for path, key, body in (
                ("/v1/chat/completions", fresh, {"model": "m", "messages": MESSAGES}),
                ("/v1/responses", known, {"model": "m", "input": "hi", "previous_response_id": STORED_ID}),
                ("/admin/keys", "boss", None),
            ):
                headers = {"Authorization": f"Bearer {key}"}
                method = "GET" if body is None else "POST"
                async with session.request(method, base + path, json=body, headers=headers) as answer:
                    error = (await answer.json())["error"]
                    assert answer.status == 503 and answer.headers["Retry-After"] == "5", (path, error)
                    assert (error["type"], error["code"]) == ("service_unavailable", "store_unavailable")
        await asyncio.sleep(1.0)  # a few flushes fail meanwhile
        assert await metric('corral_store_errors_total{use="key_lookup"}') >= 2
        assert await metric('corral_store_errors_total{use="request"}') == 2  # the response and the admin
        assert await metric('corral_store_errors_total{use="usage_write"}') >= 2
        assert await metric("corral_usage_pending") == 100  # store.max_pending
        assert await metric("corral_usage_dropped_total") == 10  # 110 made: the oldest 10 (no row for a 503)
        await outage.up()
        assert await _until_written(written, 101) == 101  # 1 before the outage, the 100 kept
        assert await _statuses(chat, fresh, 1) == [200]
        assert await _until_written(written, 102) == 102
    finally:
        await server.stop()
