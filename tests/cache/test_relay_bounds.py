"""The relay reads an engine's refusals and error bodies up to 1 MiB (MAX_ERROR_BYTES): a 429 or an
adapter's 404 with a larger body, or the semantic cache's own embedding call answered with one, is the
engine's failure (a 502 in OpenAI's shape after the other replicas), never read whole into memory, never a
500. (The cache's embeddings go through `Relay.call`, hence here.)"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web

from corral.config import AuthSettings, GatewaySettings, LimitsSettings, QueueSettings, StoreSettings
from corral.engines.client import EngineClient
from corral.gateway import GatewayParts, GatewayServer
from corral.gateway.relay import MAX_ERROR_BYTES, Relay, RelayTimeouts
from corral.protocol import UpstreamError
from corral.routing import Replica, ReplicaSet, ReplicaState, Router, RouteRequest
from corral.routing.adapters import Adapter, AdapterCatalogue

HUGE = b'{"error": {"message": "' + b"x" * (2 * MAX_ERROR_BYTES) + b'"}}'
TUNED = Adapter(name="tuned", base="m", engine_name="tuned@1", path="/adapters/tuned")


async def _engine(status: int) -> AsyncIterator[str]:
    """An engine whose every generation or embedding is refused with `status` and a huge body (it loads
    adapters)."""

    async def refuse(request: web.Request) -> web.Response:
        return web.Response(status=status, body=HUGE, content_type="application/json")

    async def load(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    for path in ("/v1/chat/completions", "/v1/embeddings"):
        app.router.add_post(path, refuse)
    app.router.add_post("/v1/load_lora_adapter", load)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def _replicas(url: str) -> ReplicaSet:
    replicas = ReplicaSet(["m"])
    replica = Replica(id="m-0", model="m", engine="vllm", url=url, state=ReplicaState.READY)
    replica.adapter_slots = 2
    replicas.add(replica)
    return replicas


@pytest.mark.parametrize(("status", "model"), [(429, "m"), (404, "tuned"), (500, "m"), (400, "m")])
async def test_a_refusal_past_its_bound_is_the_engines_failure(
    tmp_path: Path, status: int, model: str
) -> None:
    """A 429 whose body passes the bound was read whole (and read as a busy engine, a 503); an adapter's
    404 likewise (and passed on as the client's 404); a 500's up to 64 MiB, then told as the client's
    answer being too large (charged, not retried). A 400 past the bound is the input's: told by its
    status."""
    async for url in _engine(status):
        replicas = _replicas(url)
        parts = GatewayParts.build(
            replicas,
            f"sqlite:///{tmp_path / 'corral.db'}",
            AuthSettings(open=True),
            StoreSettings(flush_interval=0.1),
            LimitsSettings(),
            QueueSettings(),
            None,
        )
        parts = replace(parts, adapters=AdapterCatalogue([TUNED]))
        settings = GatewaySettings(port=0, connect_timeout=1.0, read_timeout=2.0)
        server = GatewayServer(settings, Router(replicas), parts)
        await server.start()
        try:
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
            async with aiohttp.ClientSession() as session:
                url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
                async with session.post(url, json=body) as got:
                    answer = await got.json()
                    assert got.status == (400 if status == 400 else 502), answer
            if status == 400:
                assert answer["error"]["message"] == "The model's replica refused the request (400)."
            else:
                assert answer["error"]["type"] == "upstream_error"
                assert f"{MAX_ERROR_BYTES:,}" in answer["error"]["message"]  # (said how: past the bound)
        finally:
            await server.stop()


async def test_the_gateways_own_call_does_not_read_a_huge_error_whole() -> None:
    async for url in _engine(500):
        engines = EngineClient(connect_timeout=1.0, read_timeout=2.0, limit=8)
        try:
            async with aiohttp.ClientSession() as session:
                timeouts = RelayTimeouts(connect=1.0, read=2.0)
                relay = Relay(engines, session, Router(_replicas(url)), 0, timeouts)
                body = orjson.dumps({"model": "m", "input": "hi"})
                with pytest.raises(UpstreamError, match="AnswerTooLarge"):
                    await relay.call(RouteRequest(model="m", tokens=1), "/v1/embeddings", body)
        finally:
            engines.close()


async def test_the_gateways_own_call_takes_a_huge_refusal_as_the_inputs() -> None:
    """A 400 past the bound is the input's refusal, as one within it: no retry, no blame on the replica."""
    async for url in _engine(400):
        engines = EngineClient(connect_timeout=1.0, read_timeout=2.0, limit=8)
        try:
            async with aiohttp.ClientSession() as session:
                replicas = _replicas(url)
                relay = Relay(engines, session, Router(replicas), 2, RelayTimeouts(connect=1.0, read=2.0))
                body = orjson.dumps({"model": "m", "input": "hi"})
                with pytest.raises(UpstreamError, match="refused the input"):
                    await relay.call(RouteRequest(model="m", tokens=1), "/v1/embeddings", body)
                assert replicas.of("m")[0].breaker.consecutive_failures == 0  # (no blame)
        finally:
            engines.close()
