"""Eve holds connections open without sending a request: each is closed at `gateway.idle_timeout`, and
past `gateway.max_client_connections` from her address a new one is closed at once, while other
addresses (bob's) and the trusted edge are served."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from corral.config import AuthSettings, GatewaySettings
from corral.gateway import GatewayServer
from corral.routing import ReplicaSet, Router

from ..cluster.test_supervisor import until
from ..gateway.conftest import make_services

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@pytest.fixture
async def serve(tmp_path: Path) -> AsyncIterator[Callable[..., asyncio.Future[GatewayServer]]]:
    """Starts a closed gateway on 127.0.0.1 with the given settings; stops it after the test."""
    servers: list[GatewayServer] = []

    async def start(**settings: object) -> GatewayServer:
        replicas = ReplicaSet(["m"])
        parts = make_services(replicas, tmp_path / f"c{len(servers)}.db", auth=AuthSettings(open=False))
        server = GatewayServer(GatewaySettings(port=0, **settings), Router(replicas), parts)  # type: ignore[arg-type]
        await server.start()
        servers.append(server)
        return server

    yield start  # type: ignore[misc]
    for server in servers:
        await server.stop()


async def connect(port: int, source: str = "127.0.0.1") -> Streams:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def closed_by_gateway(streams: Streams, within: float) -> bool:
    """The gateway closed the connection (EOF or a reset) within `within` seconds."""
    reader, writer = streams
    try:
        await asyncio.wait_for(reader.read(), within)
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    finally:
        writer.close()


async def health(streams: Streams) -> bytes:
    reader, writer = streams
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return answer.partition(b"\r\n")[0]


async def test_a_thousand_idle_connections_are_all_closed_at_the_idle_timeout(serve) -> None:
    server = await serve(idle_timeout=1.0, max_client_connections=2000)
    opened = [await connect(server.port) for _ in range(1000)]
    await asyncio.sleep(0)  # (the gateway accepts them as they come)
    assert server.connections.holding("127.0.0.1") >= 900
    started = time.monotonic()
    closed = await asyncio.gather(*(closed_by_gateway(s, within=10) for s in opened))
    assert all(closed), f"{closed.count(False)} of 1000 still open after 10 s"
    assert time.monotonic() - started < 8  # closed at the 1 s timeout, not at a client's pace
    await until(lambda: server.connections.holding("127.0.0.1") == 0, within=5)


async def test_one_address_past_its_cap_is_refused_while_others_are_served(serve) -> None:
    server = await serve(max_client_connections=4)
    eve = [await connect(server.port) for _ in range(4)]
    await until(lambda: server.connections.holding("127.0.0.1") == 4, within=5)
    assert await closed_by_gateway(await connect(server.port), within=2)  # the fifth: closed at once
    assert server.connections.refused == 1
    assert await health(await connect(server.port, source="127.0.0.2")) == b"HTTP/1.1 200 OK"  # bob
    eve[0][1].close()  # eve lets one go: room for one more
    await until(lambda: server.connections.holding("127.0.0.1") == 3, within=5)
    assert await health(await connect(server.port)) == b"HTTP/1.1 200 OK"
    for _, writer in eve[1:]:
        writer.close()


async def test_the_trusted_edge_is_not_capped(serve) -> None:
    """Behind the edge every client's connection comes from the edge's address."""
    server = await serve(max_client_connections=2, trusted_proxies=["127.0.0.1"])
    held = [await connect(server.port) for _ in range(4)]
    assert await health(await connect(server.port)) == b"HTTP/1.1 200 OK"
    assert server.connections.refused == 0
    for _, writer in held:
        writer.close()
