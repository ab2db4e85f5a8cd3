"""What an outsider can send: nothing crashes, stalls or mis-answers the gateway, and others stay served."""

from __future__ import annotations

import asyncio
import gzip
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from corral.config import GatewaySettings
from corral.gateway import GatewayServer
from corral.routing import Replica, ReplicaSet, ReplicaState, Router

from .conftest import ScriptedUpstream, make_services

MESSAGES = [{"role": "user", "content": "hi"}]


class Target:
    replicas: ReplicaSet

    def __init__(self, server: GatewayServer, upstream: ScriptedUpstream) -> None:
        self.server, self.upstream = server, upstream
        assert server.port is not None
        self.port = server.port
        self.url = f"http://127.0.0.1:{server.port}"

    async def post(self, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
        async with (
            aiohttp.ClientSession(auto_decompress=False) as session,
            session.post(
                self.url + "/v1/chat/completions",
                data=body,
                headers={"Content-Type": "application/json", **(headers or {})},
            ) as response,
        ):
            return response.status, orjson.loads(await response.read())

    async def healthy(self) -> bool:
        status, _ = await self.post(orjson.dumps({"model": "m", "messages": MESSAGES}))
        return status == 200


@pytest.fixture
async def target(tmp_path: Path, upstream: ScriptedUpstream) -> AsyncIterator[Target]:
    replicas = ReplicaSet(["m"])
    replicas.add(Replica("m-0", "m", "x", url=upstream.url, state=ReplicaState.READY))
    settings = GatewaySettings(port=0, body_timeout=1.0)
    server = GatewayServer(settings, Router(replicas), make_services(replicas, tmp_path / "c.db"))
    await server.start()
    made = Target(server, upstream)
    made.replicas = replicas
    yield made
    await server.stop()


def _openai_error(body: dict) -> dict:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


async def test_invalid_utf8_is_a_400(target: Target) -> None:
    status, body = await target.post(b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}')
    assert status == 400 and _openai_error(body)["type"] == "invalid_request_error"


async def test_deeply_nested_json_is_a_400(target: Target) -> None:
    nested = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, body = await target.post(nested)
    assert status == 400 and _openai_error(body)
    assert await target.healthy()


async def test_a_hundred_thousand_messages_are_answered_or_refused_in_time(target: Target) -> None:
    many = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}] * 100_000})
    started = time.monotonic()
    status, _ = await target.post(many)
    assert status in (200, 413) and time.monotonic() - started < 10
    assert await target.healthy()


async def test_huge_headers_are_refused_and_the_gateway_goes_on(target: Target) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(target.url + "/health", headers={"X-Big": "a" * 100_000}) as response:
            assert 400 <= response.status < 500
    assert await target.healthy()


async def test_header_injection_through_a_model_name_goes_nowhere(target: Target) -> None:
    name = "m\r\nX-Injected: yes\r\n\r\n"
    body = {"model": name, "messages": MESSAGES}
    async with (
        aiohttp.ClientSession() as session,
        session.post(target.url + "/v1/chat/completions", json=body) as response,
    ):
        assert response.status == 404 and "X-Injected" not in response.headers
        assert _openai_error(await response.json())["code"] == "model_not_found"


async def _raw(port: int, data: bytes, then_wait: float = 0.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(65536), timeout=then_wait or 5)
    finally:
        writer.close()


async def test_a_body_shorter_than_its_content_length_times_out_with_a_408(target: Target) -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    answer = await _raw(target.port, head + b"Content-Length: 1000\r\n\r\n" + b'{"model": "m"', then_wait=5)
    assert answer.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in answer
    assert await target.healthy()


async def test_a_body_longer_than_its_content_length_leaves_no_trace(target: Target) -> None:
    body = orjson.dumps({"model": "m", "messages": MESSAGES})
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    answer = await _raw(target.port, head + b"Content-Length: 10\r\n\r\n" + body)
    assert b" 400 " in answer.split(b"\r\n", 1)[0]  # the cut body, or the rest read as a request
    assert await target.healthy()


async def test_slowloris_clients_do_not_starve_others(target: Target) -> None:
    async def slow() -> None:
        _, writer = await asyncio.open_connection("127.0.0.1", target.port)
        try:
            for byte in b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n":
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.2)
        except ConnectionError:
            pass
        finally:
            writer.close()

    crawlers = [asyncio.create_task(slow()) for _ in range(200)]
    await asyncio.sleep(0.5)
    started = time.monotonic()
    assert all(await asyncio.gather(*(target.healthy() for _ in range(10))))
    assert time.monotonic() - started < 5
    for task in crawlers:
        task.cancel()
    await asyncio.gather(*crawlers, return_exceptions=True)


async def test_compressed_bodies_are_read_and_bombs_refused(target: Target) -> None:
    body = gzip.compress(orjson.dumps({"model": "m", "messages": MESSAGES}))
    status, _ = await target.post(body, {"Content-Encoding": "gzip"})
    assert status == 200
    bomb = gzip.compress(b'{"model": "m", "messages": [], "x": "' + b"0" * 50_000_000 + b'"}')
    assert len(bomb) < 100_000
    status, body = await target.post(bomb, {"Content-Encoding": "gzip"})
    assert status == 413 and _openai_error(body)["code"] == "request_too_large"
    assert await target.healthy()


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data/"}},
        {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
        {"type": "video_url", "video_url": {"url": "https://10.0.0.7:8265/api/jobs/"}},
        {"type": "audio_url", "audio_url": {"url": "http://localhost:6379/"}},
        {"image_url": {"url": "http://169.254.169.254/"}},  # (no type: vLLM reads it by its key)
        {"type": "input_image", "image_url": "http://10.0.0.1:6379/"},
        {"type": "video_url", "image_url": {"url": "data:x"}, "video_url": {"url": "http://10.0.0.7/"}},
    ],
)
async def test_media_an_engine_would_fetch_from_inside_the_cluster_is_refused(
    target: Target, part: dict
) -> None:
    """vLLM fetches an image, audio or video URL itself, from inside the cluster's network: a tenant could
    have it reach the cloud's metadata service or a neighbour's port. Unless the model allows it
    (`models[].media_urls`, which sets the replicas' `media_urls` feature), only data: URLs pass."""
    from corral.engines import EngineFeatures

    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]}
    status, answer = await target.post(orjson.dumps(body))
    error = _openai_error(answer)
    assert status == 400 and error["param"] == "messages[0].content[1]", answer
    assert target.upstream.bodies == []  # never reached the engine
    inline = {"type": "image_url", "image_url": {"url": "DATA:image/png;base64,iVBORw0KGgo="}}
    body["messages"][0]["content"][1] = inline
    assert (await target.post(orjson.dumps(body)))[0] == 200
    (replica,) = target.replicas.of("m")
    replica.features = EngineFeatures(media_urls=True)
    target.replicas.changed("m")  # (the model's features are worked out again)
    body["messages"][0]["content"][1] = part
    assert (await target.post(orjson.dumps(body)))[0] == 200


async def test_engine_names_for_lengths_and_odd_session_ids_are_400s(target: Target) -> None:
    """llama.cpp reads `n_predict` before `max_tokens`: passed through, `n_predict: -1` beside
    `max_tokens: 1` generated to the context while the gateway reserved and checked one token. A session
    id that is no printable ASCII (sent as raw bytes) is a 400 too, not a 500 in the routing policy."""
    for name, value in (("n_predict", -1), ("n_cmpl", 8)):
        body = {"model": "m", "messages": MESSAGES, "max_tokens": 1, name: value}
        status, answer = await target.post(orjson.dumps(body))
        assert status == 400 and answer["error"]["param"] == name, answer
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            target.url + "/v1/chat/completions",
            data=orjson.dumps({"model": "m", "messages": MESSAGES}),
            headers={
                "Content-Type": "application/json",
                "x-session-id": "\udcff\udcfe".encode("utf-8", "surrogateescape").decode("latin-1"),
            },
        ) as answer,
    ):
        assert answer.status == 400, await answer.text()
    assert await target.healthy()
