"""The semantic cache gives up on embedding a question after the spec's `cache.embedding_timeout`: with an
embedding replica that takes a second to answer, a gateway whose spec allows 0.2 s answers a paraphrase from
the engine (a miss) without waiting the second out, and then leaves the embedder alone a while (the next
question is not held up at all); one that allows 5 s waits for the vector and answers the paraphrase from
the cache (gateways in front of a simulated chat replica, with the openai client; the embedder is a slow
HTTP server on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import openai
import orjson
import pytest
from aiohttp import web

from corral.config import GatewaySettings, parse_spec
from corral.engines import EngineFeatures
from corral.gateway import GatewayParts, GatewayServer
from corral.perf import load_catalog
from corral.perf.calibration import calibrated_efficiency
from corral.routing import Replica, ReplicaSet, ReplicaState, Router
from corral.sim import SimFleet, SimOptions, build_server
from corral.sim.embed import embed_text

from .test_exact import Gateway

EMBED_DELAY_S = 1.0  # how long the slow embedder takes for each question
SPEC = """
auth: {{open: true}}
cache: {{embedding_timeout: {timeout}}}
models:
  - name: m
    arch: llama-3.1-8b
    cache: {{exact: true, semantic: true, embedding_model: e, similarity: 0.9}}
    deployments: [{{engine: sim, gpu: h100-sxm, time_scale: 50}}]
  - name: e
    arch: llama-3.1-8b
    task: embed
    deployments: [{{engine: sim, gpu: h100-sxm}}]
"""


@dataclass
class SlowEmbedder:
    """An OpenAI-style embedding server that answers the simulator's vectors after EMBED_DELAY_S."""

    url: str
    calls: int = 0


@pytest.fixture
async def embedder() -> AsyncIterator[SlowEmbedder]:
    server = SlowEmbedder("")

    async def embeddings(request: web.Request) -> web.Response:
        server.calls += 1
        text = (await request.json())["input"]
        await asyncio.sleep(EMBED_DELAY_S)  # the slow embedding model itself
        vector = embed_text(text, 64).tolist()
        body = {
            "object": "list",
            "model": "e",
            "data": [{"object": "embedding", "index": 0, "embedding": vector}],
        }
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/embeddings", embeddings)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    server.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield server
    await runner.cleanup()


@pytest.fixture
async def chat() -> AsyncIterator[str]:
    options = SimOptions(model="llama-3.1-8b", gpu="h100-sxm", time_scale=50, served_name="m")
    fleet = SimFleet([build_server(options, load_catalog(), calibrated_efficiency())])
    await fleet.start([0])
    yield fleet.urls[0]
    await fleet.stop()


async def gateway(embedding_timeout: float, chat: str, embedder: SlowEmbedder, tmp_path: Path) -> Gateway:
    """A gateway configured by the spec with `cache.embedding_timeout`."""
    spec = parse_spec(SPEC.format(timeout=embedding_timeout), source="test")
    replicas = ReplicaSet()
    replicas.add(Replica(id="m-0", model="m", engine="sim", url=chat, state=ReplicaState.READY))
    replicas.add(
        Replica(
            id="e-0",
            model="e",
            engine="sim",
            url=embedder.url,
            state=ReplicaState.READY,
            features=EngineFeatures(embeddings=True),
        )
    )
    services = GatewayParts.build(
        replicas,
        f"sqlite:///{tmp_path / f'{uuid.uuid4().hex}.db'}",
        spec.auth,
        spec.store,
        spec.limits,
        spec.queue,
        admin_key=None,
        cache=spec.cache,
        cache_policies={m.name: m.cache for m in spec.models if m.name == "m"},
    )
    server = GatewayServer(GatewaySettings(port=0), Router(replicas), services)
    await server.start()
    return Gateway(f"http://127.0.0.1:{server.port}", server, services)


async def ask(gw: Gateway, question: str) -> tuple[str | None, str | None, float]:
    """(x-corral-cache, x-corral-cache-similarity, seconds the answer took)."""
    c = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": question}]
    began = time.monotonic()
    raw = await c.chat.completions.with_raw_response.create(
        model="m", messages=messages, max_tokens=8, temperature=0
    )
    took = time.monotonic() - began
    assert raw.parse().choices[0].message.content
    return raw.headers.get("x-corral-cache"), raw.headers.get("x-corral-cache-similarity"), took


async def test_an_embedding_slower_than_embedding_timeout_is_a_miss_that_does_not_wait(
    chat: str, embedder: SlowEmbedder, tmp_path: Path
) -> None:
    gw = await gateway(0.2, chat, embedder, tmp_path)
    try:
        assert (await ask(gw, "What is the capital of France?"))[0] == "miss"
        await gw.services.cache.flush()  # type: ignore[union-attr]
        state, similarity, took = await ask(gw, "what is the capital of france")
        assert (state, similarity) == ("miss", None)  # no vector in time: no neighbour looked up
        assert took < EMBED_DELAY_S  # the question went to the engine at once, not after the embedder
        assert embedder.calls == 1  # given up on after 0.2 s, then left alone a while (not asked again)
    finally:
        await gw.server.stop()


async def test_an_embedding_within_embedding_timeout_finds_the_paraphrase(
    chat: str, embedder: SlowEmbedder, tmp_path: Path
) -> None:
    gw = await gateway(5.0, chat, embedder, tmp_path)
    try:
        assert (await ask(gw, "What is the capital of France?"))[0] == "miss"
        await gw.services.cache.flush()  # type: ignore[union-attr]
        state, similarity, took = await ask(gw, "what is the capital of france")
        assert state == "hit" and similarity is not None and float(similarity) >= 0.9
        assert took >= EMBED_DELAY_S  # it waited for the vector
    finally:
        await gw.server.stop()
