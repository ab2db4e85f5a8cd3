"""The relay's engine client against raw HTTP servers on 127.0.0.1 that behave (and misbehave) on purpose:
keep-alive reuse, a pooled connection the engine closed, silence, a slow reader, the connection limit."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from corral.cluster import free_port
from corral.engines.client import EngineClient, EngineDisconnected, EngineUnreachable

Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes], Awaitable[None]]


@dataclass
class RawServer:
    """An HTTP/1.1 server written against the socket: each request's head and body go to `answer`."""

    answer: Answer
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    closed_by_client: int = 0
    url: str = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                self.requests.append(head + await reader.readexactly(length))
                await self.answer(reader, writer, head)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client += 1
        finally:
            writer.close()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Answer], Awaitable[RawServer]]]:
    servers: list[asyncio.Server] = []

    async def start(answer: Answer) -> RawServer:
        raw = RawServer(answer)
        server = await asyncio.start_server(raw.handle, "127.0.0.1", 0)
        servers.append(server)
        raw.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        return raw

    yield start
    for server in servers:
        server.close()


def answer_json(body: bytes = b'{"ok":true}', close: bool = False) -> Answer:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        writer.write(body)
        await writer.drain()
        if close:  # as llama-server does to idle connections, without saying so in a header
            writer.close()

    return answer


async def test_a_connection_is_kept_alive_and_reused(serve: Callable[[Answer], Awaitable[RawServer]]) -> None:
    server = await serve(answer_json())
    client = EngineClient(connect_timeout=2, read_timeout=5, limit=8)
    for _ in range(3):
        response = await client.post(server.url, "/v1/chat/completions", b'{"a":1}', "sk-engine")
        assert (response.status, response.content_type, await response.read()) == (
            200,
            "application/json",
            b'{"ok":true}',
        )
        response.release()
    assert server.connections == 1
    assert server.requests[0].startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer sk-engine\r\n" in server.requests[0]
    assert server.requests[0].endswith(b'\r\n\r\n{"a":1}')
    client.close()


async def test_a_pooled_connection_the_engine_closed_is_sent_again_on_a_new_one(
    serve: Callable[[Answer], Awaitable[RawServer]],
) -> None:
    server = await serve(answer_json(close=True))
    client = EngineClient(connect_timeout=2, read_timeout=5, limit=8)
    first = await client.post(server.url, "/x", b"{}", None)
    await first.read()
    first.release()  # pooled: nothing said the engine would close it
    await asyncio.sleep(0)  # (the close may or may not have been seen yet: both must work)
    second = await client.post(server.url, "/x", b"{}", None)
    assert await second.read() == b'{"ok":true}'
    second.release()
    assert server.connections == 2 and len(server.requests) == 2


async def test_a_stream_arrives_as_sent_and_a_body_may_end_with_the_connection(
    serve: Callable[[Answer], Awaitable[RawServer]],
) -> None:
    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\nConnection: close\r\n\r\n"
        )
        for i in range(3):
            writer.write(b"data: %d\n\n" % i)
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.close()  # no length, not chunked: the close ends the body

    server = await serve(stream)
    client = EngineClient(connect_timeout=2, read_timeout=5, limit=8)
    response = await client.post(server.url, "/x", b"{}", None)
    assert response.content_type == "text/event-stream"
    pieces = []
    while data := await response.chunk():
        pieces.append(data)
    response.release()
    assert b"".join(pieces) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert len(pieces) >= 2  # handed over as it came, not gathered to the end


async def test_silence_past_the_read_timeout_fails_but_a_slow_reader_does_not(
    serve: Callable[[Answer], Awaitable[RawServer]],
) -> None:
    big = b"x" * (1024 * 1024)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> None:
        if b"silent" in head:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
            await writer.drain()
            await asyncio.sleep(5)  # then nothing
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big) + big)
        await writer.drain()

    server = await serve(answer)
    client = EngineClient(connect_timeout=2, read_timeout=0.3, limit=8)
    silent = await client.post(server.url, "/silent", b"{}", None)
    assert await silent.chunk() == b"hello"
    with pytest.raises(TimeoutError):
        await silent.chunk()
    silent.release()

    slow = await client.post(server.url, "/big", b"{}", None)
    await asyncio.sleep(1.0)  # the reader is busy elsewhere (a slow client) for over 3 read timeouts
    assert await slow.read() == big
    slow.release()


async def test_refused_connections_and_the_connection_limit(
    serve: Callable[[Answer], Awaitable[RawServer]],
) -> None:
    client = EngineClient(connect_timeout=2, read_timeout=5, limit=1)
    with pytest.raises(EngineUnreachable):
        await client.post(f"http://127.0.0.1:{free_port()}", "/x", b"{}", None)

    server = await serve(answer_json())
    first = await client.post(server.url, "/x", b"{}", None)  # (the refused one gave its slot back)
    second = asyncio.create_task(client.post(server.url, "/x", b"{}", None))
    await asyncio.sleep(0.1)
    assert not second.done()  # waits for the one slot
    await first.read()
    first.release()
    response = await asyncio.wait_for(second, 2)
    assert await response.read() == b'{"ok":true}'
    response.release()
    assert server.connections == 1


async def test_letting_go_mid_answer_closes_the_connection(
    serve: Callable[[Answer], Awaitable[RawServer]],
) -> None:
    gone = asyncio.Event()

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            for _ in range(200):
                writer.write(b"6\r\ndata: \r\n")
                await writer.drain()
                await asyncio.sleep(0.01)
        except ConnectionError:
            pass
        if writer.is_closing() or reader.at_eof() or await reader.read(1) == b"":
            gone.set()
        writer.close()

    server = await serve(endless)
    client = EngineClient(connect_timeout=2, read_timeout=5, limit=8)
    response = await client.post(server.url, "/x", b"{}", None)
    assert await response.chunk()
    response.release()  # the client went away: the engine must see it
    await asyncio.wait_for(gone.wait(), 3)
    again = await client.post(server.url, "/x", b"{}", None)  # a new connection, not the cut one
    assert server.connections == 2
    again.release()


async def test_an_answer_that_is_not_http_is_a_disconnect(
    serve: Callable[[Answer], Awaitable[RawServer]],
) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n")
        await writer.drain()

    server = await serve(garbage)
    client = EngineClient(connect_timeout=2, read_timeout=5, limit=8)
    with pytest.raises(EngineDisconnected):
        await client.post(server.url, "/x", b"{}", None)


async def test_a_path_in_the_base_url_prefixes_every_request_and_credentials_stay_out_of_host(
    serve: Callable[[Answer], Awaitable[RawServer]],
) -> None:
    server = await serve(answer_json())
    client = EngineClient(connect_timeout=2, read_timeout=5, limit=8)
    base = server.url.replace("http://", "http://user:secret@") + "/llama1/"
    response = await client.post(base, "/v1/chat/completions", b"{}", None)
    response.release()
    head = server.requests[0].split(b"\r\n\r\n")[0]
    assert head.startswith(b"POST /llama1/v1/chat/completions HTTP/1.1\r\n")
    assert b"\r\nHost: 127.0.0.1:" in head and b"secret" not in head


async def test_an_interim_answer_is_skipped_and_a_body_ended_by_close_is_whole(
    serve: Callable[[Answer], Awaitable[RawServer]],
) -> None:
    async def hints_then_identity(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes
    ) -> None:
        writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)  # the real answer in another packet
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: Application/JSON\r\nTransfer-Encoding: identity\r\n\r\n"
        )
        writer.write(b'{"whole":')
        await writer.drain()
        await asyncio.sleep(0.02)
        writer.write(b"true}")
        writer.close()

    server = await serve(hints_then_identity)
    client = EngineClient(connect_timeout=2, read_timeout=5, limit=8)
    response = await client.post(server.url, "/x", b"{}", None)
    assert (response.status, response.content_type) == (200, "application/json")
    assert await response.read() == b'{"whole":true}'
    response.release()


async def test_a_cancelled_waiter_passes_its_turn_on_and_waiting_is_bounded(
    serve: Callable[[Answer], Awaitable[RawServer]],
) -> None:
    server = await serve(answer_json())
    client = EngineClient(connect_timeout=0.5, read_timeout=5, limit=1)
    holder = await client.post(server.url, "/x", b"{}", None)
    second = asyncio.create_task(client.post(server.url, "/x", b"{}", None))
    third = asyncio.create_task(client.post(server.url, "/x", b"{}", None))
    await asyncio.sleep(0.05)
    await holder.read()
    holder.release()  # wakes the second ...
    second.cancel()  # ... whose client leaves before it runs: the third must get the slot
    response = await asyncio.wait_for(third, 0.4)
    assert await response.read() == b'{"ok":true}'
    with pytest.raises(TimeoutError):  # the slot stays taken: the next waits connect_timeout, no longer
        await asyncio.wait_for(client.post(server.url, "/x", b"{}", None), 2)
    response.release()
    again = await client.post(server.url, "/x", b"{}", None)  # the timed-out waiter left no debt
    again.release()


async def test_an_engine_address_unused_for_keepalive_s_is_forgotten(
    serve: Callable[[Answer], Awaitable[RawServer]],
) -> None:
    """A replica that restarts listens on a new port: the client (the supervisor's probes, each gateway
    worker's relay) kept every address it was ever asked, for good. One no request has used for
    `keepalive_s` is forgotten now; an answer still under way for it closes its connection when done,
    rather than leave it in a pool no request looks in."""
    server = await serve(answer_json())
    withheld = asyncio.Event()

    async def later(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n")
        await withheld.wait()
        writer.write(b"{}")
        await writer.drain()

    slow = await serve(later)
    client = EngineClient(connect_timeout=2, read_timeout=5, limit=8, keepalive_s=0.2)
    for restart in range(50):  # (a path per address: each is an origin of its own, as a port is)
        response = await client.post(f"{server.url}/incarnation{restart}", "/health", b"{}", None)
        await response.read()
        response.release()
    under_way = await client.post(slow.url, "/x", b"{}", None)
    assert len(client._origins) == 51
    deadline = asyncio.get_running_loop().time() + 5
    while len(client._origins) > 1:  # requests to one address go on: the others are forgotten
        assert asyncio.get_running_loop().time() < deadline, len(client._origins)
        response = await client.post(server.url, "/health", b"{}", None)
        await response.read()
        response.release()
        await asyncio.sleep(0.05)
    assert list(client._origins) == [server.url]
    withheld.set()
    assert await under_way.read() == b"{}"
    under_way.release()
    while slow.closed_by_client == 0:
        assert asyncio.get_running_loop().time() < deadline, "the forgotten address's connection stayed open"
        await asyncio.sleep(0.02)
    client.close()
