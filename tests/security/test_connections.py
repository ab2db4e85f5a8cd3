"""Eve holds connections open without sending a request: each is closed at `gateway.idle_timeout`, and
past `gateway.max_client_connections` from her address a new one is closed at once (with native TLS, before
its handshake), while other addresses (bob's) and the trusted edge are served."""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import orjson
import pytest
import uvloop
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from corral.config import AuthSettings, GatewaySettings, TLSSettings
from corral.deploy import write_dev_certificates
from corral.gateway import GatewayServer, connections
from corral.routing import Replica, ReplicaSet, ReplicaState, Router
from corral.store.schema import UsageRow

from ..cluster.test_supervisor import until
from ..gateway.conftest import ScriptedUpstream, make_services

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
    server = await serve(idle_timeout=3.0, max_client_connections=2000)
    opened: list[Streams] = []
    for _ in range(10):  # a hundred at a time (the listen backlog's size): on a busy machine one by one took
        opened += await asyncio.gather(*(connect(server.port) for _ in range(100)))  # past the timeout
    await asyncio.sleep(0)  # (the gateway accepts them as they come)
    assert server.connections.holding("127.0.0.1") >= 900
    started = time.monotonic()
    closed = await asyncio.gather(*(closed_by_gateway(s, within=12) for s in opened))
    assert all(closed), f"{closed.count(False)} of 1000 still open after 12 s"
    assert time.monotonic() - started < 9  # closed at the 3 s timeout, not at a client's pace
    await until(lambda: server.connections.holding("127.0.0.1") == 0, within=5)


async def test_one_address_past_its_cap_is_refused_while_others_are_served(serve) -> None:
    server = await serve(max_client_connections=4)
    eve = [await connect(server.port) for _ in range(4)]
    await until(lambda: server.connections.holding("127.0.0.1") == 4, within=5)
    assert await closed_by_gateway(await connect(server.port), within=2)  # the fifth: closed at once
    assert server.connections.closed["address_cap"] == 1
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
    assert server.connections.closed["address_cap"] == 0
    for _, writer in held:
        writer.close()


async def _stream_request(port: int, body: bytes, rcvbuf: int | None = None) -> Streams:
    """A raw connection (its receive buffer cut to `rcvbuf`) that has sent a streamed chat request."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=2**16)
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    writer.write(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    return reader, writer


async def test_a_client_that_stops_reading_its_stream_is_closed_at_the_send_timeout(tmp_path: Path) -> None:
    """Eve asks for a long stream and reads nothing of it: without a deadline her connection's buffers fill,
    the relay stops reading the engine, and the replica's slot is hers for ever. At `gateway.send_timeout`
    the gateway closes her connection: the engine's stream is let go, the slot freed, the request recorded as
    a client that left (499), the closing counted. Bob, reading his more slowly than it comes (his buffers
    full, but taking some in every period), is not cut by the same short timeout."""
    engine = ScriptedUpstream(chunks=20_000, gap=0.0)  # about 2.5 MB of events, as fast as can be written
    await engine.start()
    replicas = ReplicaSet(["m"])
    replica = Replica("m-0", "m", "x", url=engine.url, state=ReplicaState.READY)
    replicas.add(replica)
    parts = make_services(replicas, tmp_path / "c.db")
    server = GatewayServer(GatewaySettings(port=0, send_timeout=1.0), Router(replicas), parts)
    await server.start()
    assert server.port is not None
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    try:
        eve = await _stream_request(server.port, body, rcvbuf=4096)
        assert (await eve[0].readline()).startswith(b"HTTP/1.1 200")
        bob = await _stream_request(server.port, body, rcvbuf=4096)
        received, until_then = 0, time.monotonic() + 2.5  # past eve's deadline
        while time.monotonic() < until_then:  # 16 kB every 20 ms: slower than the stream comes
            data = await asyncio.wait_for(bob[0].read(2**14), 5)
            assert data, "bob's stream was closed"
            received += len(data)
            await asyncio.sleep(0.02)
        assert received > 500_000
        bob[1].close()
        await until(lambda: server.connections.closed["send_timeout"] == 1, within=10)
        await until(lambda: replica.outstanding == 0 and engine.active == 0, within=5)  # the slot is free
        assert await closed_by_gateway(eve, within=2)
        database = create_engine(f"sqlite:///{tmp_path / 'c.db'}")

        def statuses() -> list[int]:
            with Session(database) as db:
                return sorted(db.scalars(select(UsageRow.status)))

        # eve's: a client that left; bob's, 200 or 499 (his stream may have been written whole before he left)
        await until(lambda: len(statuses()) == 2 and statuses()[-1] == 499, within=5)
        async with aiohttp.ClientSession() as session:
            metrics = await (await session.get(f"http://127.0.0.1:{server.port}/metrics")).text()
        assert 'corral_connections_closed_total{reason="send_timeout"} 1.0' in metrics
    finally:
        await server.stop()
        await engine.stop()


async def test_a_client_reading_a_large_answer_slowly_is_not_cut(tmp_path: Path) -> None:
    """A 6 MB answer, not streamed, is one write: past what the kernel takes (4 MB on loopback), its
    buffer stays over asyncio's low mark while a slower client reads it (64 kB every 20 ms, about 2 s, the
    buffer full for about 0.6 s against a 0.5 s send_timeout). The client takes some of it in every period,
    so the connection is kept (the deadline is on taking nothing, as NGINX's)."""
    completion = {
        "id": "c",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "x" * 6_000_000},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
    engine = ScriptedUpstream(mode="answer", answer=(200, "application/json", orjson.dumps(completion)))
    await engine.start()
    replicas = ReplicaSet(["m"])
    replicas.add(Replica("m-0", "m", "x", url=engine.url, state=ReplicaState.READY))
    server = GatewayServer(
        GatewaySettings(port=0, send_timeout=0.5),
        Router(replicas),
        make_services(replicas, tmp_path / "c.db"),
    )
    await server.start()
    assert server.port is not None
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    try:
        reader, writer = await _stream_request(server.port, body, rcvbuf=4096)
        received = b""
        while len(received) < 6_000_000:
            data = await asyncio.wait_for(reader.read(65536), 5)
            assert data, f"closed after {len(received)} bytes"
            received += data
            await asyncio.sleep(0.02)
        writer.close()
        assert server.connections.closed["send_timeout"] == 0
    finally:
        await server.stop()
        await engine.stop()


async def _tls_health(port: int, source: str) -> bytes:
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    streams = await asyncio.open_connection("127.0.0.1", port, ssl=context, local_addr=(source, 0))
    return await health(streams)


async def _tls_connections_are_capped_from_their_accept(tmp_path: Path) -> None:
    files, _ = write_dev_certificates(tmp_path / "certs", ["127.0.0.1"])
    replicas = ReplicaSet(["m"])
    parts = make_services(replicas, tmp_path / "c.db", auth=AuthSettings(open=False))
    tls = TLSSettings(cert=files.cert, key=files.key)
    server = GatewayServer(
        GatewaySettings(port=0, max_client_connections=4, tls=tls), Router(replicas), parts
    )
    await server.start()
    assert server.port is not None
    try:
        idle = [await connect(server.port) for _ in range(4)]  # not one byte sent: no ClientHello
        await until(lambda: server.connections.holding("127.0.0.1") == 4, within=5)
        assert await closed_by_gateway(await connect(server.port), within=2)  # the fifth: closed at once
        assert server.connections.closed["address_cap"] == 1
        assert await _tls_health(server.port, "127.0.0.2") == b"HTTP/1.1 200 OK"  # bob, over TLS
        # the idle four are let go at the handshake timeout, and their address is served again
        assert all([await closed_by_gateway(streams, within=5) for streams in idle])
        await until(lambda: server.connections.holding("127.0.0.1") == 0, within=5)
        assert await _tls_health(server.port, "127.0.0.1") == b"HTTP/1.1 200 OK"
        await until(lambda: server.connections.holding("127.0.0.1") == 0, within=5)  # (and released)
    finally:
        await server.stop()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_tls_connections_count_against_the_cap_before_their_handshake(
    loop: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """asyncio tells the application of a TLS connection only once its handshake is done: connections that
    never sent a ClientHello were never counted, each held for asyncio's 60 s handshake timeout (200 from
    one address under a cap of 4: 200 held). They count from TCP's accept, past the cap are closed at once,
    and are let go at the handshake timeout; on either event loop (the gateway runs on uvloop)."""
    monkeypatch.setattr(connections, "_HANDSHAKE_TIMEOUT_S", 1.0)
    run = uvloop.run if loop == "uvloop" else asyncio.run
    run(_tls_connections_are_capped_from_their_accept(tmp_path))
