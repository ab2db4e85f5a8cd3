"""How the gateway reads and tells embedding answers: it asks base64 of the engines that send it (vLLM,
llama.cpp, the simulator) and floats of the others, and either way the client gets the engine's vectors
exactly, in floats or base64, shortened where asked; a large answer is shaped while the event loop serves
others, a small one on the loop; the answer keeps the rate-limit headers; more than 2,048 inputs are
refused saying so; a model redeployed with another vector size is learnt anew. Gateways in front of an
engine on 127.0.0.1 that answers like vLLM, with the openai client."""

from __future__ import annotations

import asyncio
import base64
import json
import sqlite3
import threading
import uuid
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import openai
import orjson
import pytest
from aiohttp import web

from corral.config import GatewaySettings
from corral.engines import EngineFeatures
from corral.gateway import GatewayServer
from corral.gateway.embeddings import EmbeddingShaper
from corral.protocol import EmbeddingRequest, InvalidRequest, parse_body
from corral.routing import Replica, ReplicaSet, ReplicaState

from .conftest import start_closed_gateway
from .test_embeddings import ADMIN, _key

TEXTS = ["The cat sat on the mat.", "A cat is sitting on a mat.", "Quarterly revenue grew by four percent."]


def vectors_of(texts: list[str], size: int) -> np.ndarray:
    """The engine's vectors: seeded by each text, not of unit length (so a renormalisation shows)."""
    rows = [np.random.default_rng(zlib.crc32(t.encode())).standard_normal(size) for t in texts]
    return np.asarray(rows, dtype=np.float32)


@dataclass
class Engine:
    """An embedding engine answering in vLLM's layout (`index`, `object`, `embedding`; usage last), floats
    or, where asked and `base64` is on, base64 little-endian float32."""

    size: int = 16
    base64: bool = True
    broken: bool = False  # its vectors differ in size (an answer no client could read)
    asked: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.asked.append(body)
        texts = [body["input"]] if isinstance(body["input"], str) else body["input"]
        vectors = vectors_of([str(t) for t in texts], self.size)
        if self.broken:
            vectors = [v[: self.size - i] for i, v in enumerate(vectors)]
        in_base64 = self.base64 and body.get("encoding_format") == "base64"
        data = [
            {
                "index": i,
                "object": "embedding",
                "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode()
                if in_base64
                else v.tolist(),
            }
            for i, v in enumerate(vectors)
        ]
        usage = {"prompt_tokens": len(texts), "total_tokens": len(texts), "completion_tokens": 0}
        answer = {"id": "embd-1", "object": "list", "created": 1, "model": body["model"], "data": data}
        return web.json_response({**answer, "usage": usage})


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    engine = Engine()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/embeddings", engine.embeddings)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    engine.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield engine
    await runner.cleanup()


@dataclass
class Gateway:
    url: str
    server: GatewayServer
    replicas: ReplicaSet

    def client(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)


def replica(engine: Engine, kind: str, name: str = "e-0") -> Replica:
    features = EngineFeatures(embeddings=True, matryoshka=True)
    return Replica(
        id=name, model="e", engine=kind, url=engine.url, state=ReplicaState.READY, features=features
    )


async def gateway(engine: Engine, kind: str, tmp_path: Path) -> Gateway:
    replicas = ReplicaSet()
    replicas.add(replica(engine, kind))
    url, server, _ = await start_closed_gateway(
        replicas,
        f"sqlite:///{tmp_path / f'{uuid.uuid4().hex}.db'}",
        ADMIN,
        GatewaySettings(port=0, routing_headers=True),
    )
    return Gateway(url, server, replicas)


async def test_engines_that_send_base64_are_asked_for_it_and_every_answer_is_the_engines_vectors(
    engine: Engine, tmp_path: Path
) -> None:
    want = vectors_of(TEXTS, engine.size)
    short = want[:, :8] / np.linalg.norm(want[:, :8], axis=1, keepdims=True)
    for kind, asked in (("vllm", "base64"), ("llamacpp", "base64"), ("sim", "base64"), ("external", None)):
        gw = await gateway(engine, kind, tmp_path)
        try:
            client = gw.client(await _key(gw.url, "acme"))
            floats = await client.embeddings.create(model="e", input=TEXTS, encoding_format="float")
            assert engine.asked[-1].get("encoding_format") == asked, kind
            assert np.array_equal(np.asarray([d.embedding for d in floats.data], dtype=np.float32), want)
            raw = await client.embeddings.with_raw_response.create(
                model="e", input=TEXTS, encoding_format="base64"
            )
            told = [
                np.frombuffer(base64.b64decode(d["embedding"]), "<f4")
                for d in raw.http_response.json()["data"]
            ]
            assert np.array_equal(np.asarray(told), want), kind
            default = await client.embeddings.create(model="e", input=TEXTS)  # (the client asks base64)
            assert np.array_equal(np.asarray([d.embedding for d in default.data], dtype=np.float32), want)
            shortened = await client.embeddings.create(model="e", input=TEXTS, dimensions=8)
            assert np.allclose([d.embedding for d in shortened.data], short, atol=1e-6), kind
        finally:
            await gw.server.stop()
    engine.base64 = False  # an engine that ignores the format and sends floats: read all the same
    gw = await gateway(engine, "vllm", tmp_path)
    try:
        raw = await gw.client(await _key(gw.url, "acme")).embeddings.with_raw_response.create(
            model="e", input=TEXTS, encoding_format="base64"
        )
        told = [
            np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in raw.http_response.json()["data"]
        ]
        assert np.array_equal(np.asarray(told), want)
    finally:
        await gw.server.stop()


def _engine_answers(vectors: np.ndarray) -> dict[str, bytes]:
    """One answer in each layout the engines write: vLLM's floats, llama.cpp's base64 (its keys sorted,
    usage before data, each item saying its format), an indented one in reverse order, and base64 with
    its slashes escaped (as some JSON writers do)."""
    usage = {"prompt_tokens": 5, "total_tokens": 5}
    encoded = [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in vectors]
    vllm = [{"index": i, "object": "embedding", "embedding": v.tolist()} for i, v in enumerate(vectors)]
    llamacpp = [
        {"embedding": e, "index": i, "object": "embedding", "encoding_format": "base64"}
        for i, e in enumerate(encoded)
    ]
    return {
        "vllm floats": orjson.dumps(
            {"id": "e", "object": "list", "model": "e", "data": vllm, "usage": usage}
        ),
        "llama.cpp base64": orjson.dumps({"model": "e", "object": "list", "usage": usage, "data": llamacpp}),
        "indented, reversed": json.dumps({"data": vllm[::-1], "usage": usage}, indent=2).encode(),
        "escaped slashes": orjson.dumps({"data": llamacpp, "usage": usage}).replace(b"/", b"\\/"),
    }


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_every_engine_layout_is_told_as_the_vectors_themselves(encoding: str) -> None:
    """The answer as the gateway wrote it before reading answers vector by vector: one JSON document of
    the vectors as float32 (their floats written as doubles), whatever layout the engine sent."""
    vectors = np.random.default_rng(7).standard_normal((5, 24)).astype(np.float32)
    vectors[0, :3] = [1e-40, -0.0, 3.4028235e38]  # a subnormal, a negative zero, the largest float32
    body = EmbeddingRequest.model_validate({"model": "e", "input": ["x"] * 5, "encoding_format": encoding})
    told = [
        base64.b64encode(v.astype("<f4").tobytes()).decode() if encoding == "base64" else v.tolist()
        for v in vectors
    ]
    data = [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(told)]
    usage = {"prompt_tokens": 5, "total_tokens": 5}
    want = orjson.dumps({"object": "list", "data": data, "model": "e", "usage": usage})
    for layout, answer in _engine_answers(vectors).items():
        assert EmbeddingShaper().shape(answer, body, False) == (want, usage), layout
    vectors = np.random.default_rng(8).standard_normal((5, 24)).astype(np.float32)
    short = EmbeddingRequest.model_validate({"model": "e", "input": ["x"] * 5, "dimensions": 6})
    expected = vectors[:, :6].astype(np.float64)
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    for layout, answer in _engine_answers(vectors).items():
        got = [d["embedding"] for d in orjson.loads(EmbeddingShaper().shape(answer, short, True)[0])["data"]]
        assert np.allclose(got, expected, atol=1e-6), layout


def _floats_answer(vectors: np.ndarray) -> bytes:
    items = [
        b'{"index":%d,"object":"embedding","embedding":%b}'
        % (i, orjson.dumps(v.astype(np.float64), option=orjson.OPT_SERIALIZE_NUMPY))
        for i, v in enumerate(vectors)
    ]
    return (
        b'{"object":"list","data":[' + b",".join(items) + b'],"usage":{"prompt_tokens":1,"total_tokens":1}}'
    )


async def test_a_large_answer_is_shaped_while_the_event_loop_serves_others() -> None:
    """2,048 vectors of 2,048 floats (80 MB of JSON: an engine asked for floats): shaped on the event loop
    it would stop every other request for its whole time (parsing alone holds the GIL a tenth of a second
    or more, even in a thread). A task that wakes every millisecond keeps waking throughout, never held up
    for half the shaping's time."""
    vectors = np.random.default_rng(3).standard_normal((2048, 2048)).astype(np.float32)
    answer = _floats_answer(vectors)
    body = EmbeddingRequest.model_validate({"model": "e", "input": ["x"] * 2048, "encoding_format": "base64"})
    loop = asyncio.get_running_loop()
    gaps: list[float] = []

    async def tick() -> None:
        last = loop.time()
        while True:
            await asyncio.sleep(0.001)
            gaps.append(loop.time() - last)
            last = loop.time()

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.01)
    gaps.clear()
    began = loop.time()
    shaped, _ = await EmbeddingShaper().answer(answer, body, False)
    took = loop.time() - began
    ticker.cancel()
    assert len(gaps) >= 3 and max(gaps) < took / 2, (len(gaps), max(gaps, default=None), took)
    data = orjson.loads(shaped)["data"]
    assert np.array_equal(np.frombuffer(base64.b64decode(data[2047]["embedding"]), "<f4"), vectors[2047])


class _Recorded(EmbeddingShaper):
    """A shaper that notes the thread each answer is shaped in."""

    def __init__(self, in_thread_bytes: int) -> None:
        super().__init__(in_thread_bytes)
        self.threads: list[int] = []

    def shape(self, *args: Any, **kwargs: Any) -> tuple[bytes, dict[str, Any]]:
        self.threads.append(threading.get_ident())
        return super().shape(*args, **kwargs)


async def test_a_small_answer_is_shaped_on_the_event_loop_and_a_large_one_in_a_thread() -> None:
    vectors = np.random.default_rng(4).standard_normal((1, 384)).astype(np.float32)
    answer = _floats_answer(vectors)
    body = EmbeddingRequest.model_validate({"model": "e", "input": "x"})
    shaper = _Recorded(in_thread_bytes=len(answer) + 1)
    await shaper.answer(answer, body, False)
    larger = _Recorded(in_thread_bytes=len(answer))
    await larger.answer(answer, body, False)
    assert shaper.threads == [threading.get_ident()] and larger.threads != [threading.get_ident()]


async def test_an_embedding_answer_keeps_the_rate_limit_headers(engine: Engine, tmp_path: Path) -> None:
    gw = await gateway(engine, "vllm", tmp_path)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(
                gw.url + "/admin/keys",
                json={"tenant": "limited", "rpm": 50},
                headers={"Authorization": f"Bearer {ADMIN}"},
            ) as created:
                key = (await created.json())["key"]
        raw = await gw.client(key).embeddings.with_raw_response.create(model="e", input=TEXTS)
        assert raw.headers["x-ratelimit-limit-requests"] == "50"
        assert raw.headers["x-ratelimit-remaining-requests"] == "49"
        assert raw.headers["x-corral-replica"] == "e-0"
    finally:
        await gw.server.stop()


async def test_more_than_2048_inputs_are_refused_saying_so(engine: Engine, tmp_path: Path) -> None:
    for many in (["a"] * 2049, [[1]] * 2049):
        with pytest.raises(InvalidRequest, match="at most 2048 inputs") as refused:
            parse_body(EmbeddingRequest, orjson.dumps({"model": "e", "input": many}))
        assert refused.value.param == "input"
    assert (
        len(parse_body(EmbeddingRequest, orjson.dumps({"model": "e", "input": ["a"] * 2048})).inputs) == 2048
    )
    assert len(parse_body(EmbeddingRequest, orjson.dumps({"model": "e", "input": [1] * 5000})).inputs) == 1
    gw = await gateway(engine, "vllm", tmp_path)
    try:
        client = gw.client(await _key(gw.url, "acme"))
        with pytest.raises(openai.BadRequestError, match="at most 2048 inputs"):
            await client.embeddings.create(model="e", input=["a"] * 2049)
    finally:
        await gw.server.stop()


async def test_a_model_redeployed_with_another_vector_size_is_learnt_anew(
    engine: Engine, tmp_path: Path
) -> None:
    gw = await gateway(engine, "vllm", tmp_path)
    try:
        client = gw.client(await _key(gw.url, "acme"))
        assert len((await client.embeddings.create(model="e", input="x")).data[0].embedding) == 16
        asked = len(engine.asked)
        with pytest.raises(openai.BadRequestError, match="too large"):
            await client.embeddings.create(model="e", input="x", dimensions=32)
        assert len(engine.asked) == asked  # refused before the engine worked on it
        # the model is redeployed: its new replica makes vectors of 32
        (old,) = gw.replicas.of("e")
        engine.size = 32
        gw.replicas.add(replica(engine, "vllm", "e-1"))
        gw.replicas.remove(old)
        answer = await client.embeddings.create(model="e", input="x", dimensions=32)
        assert len(answer.data[0].embedding) == 32
        with pytest.raises(openai.BadRequestError, match="too large"):
            await client.embeddings.create(model="e", input="x", dimensions=64)
    finally:
        await gw.server.stop()


async def test_an_answer_that_cannot_be_read_is_a_502_charged_the_prompts_estimate(
    engine: Engine, tmp_path: Path
) -> None:
    """The engine answers vectors of different sizes: the client gets a 502, and the request is charged
    (and recorded) at its prompt's estimate, as the engine worked on every input (it was charged nothing)."""
    engine.broken = True
    gw = await gateway(engine, "vllm", tmp_path)
    try:
        client = gw.client(await _key(gw.url, "acme"))
        with pytest.raises(openai.APIStatusError) as failed:
            await client.embeddings.create(model="e", input=TEXTS)
        assert failed.value.status_code == 502 and "could not be read" in failed.value.message
    finally:
        await gw.server.stop()
    rows = await asyncio.to_thread(_recorded, tmp_path, "acme")
    assert [status for status, _ in rows] == [502] and rows[0][1] > 0, rows


def _recorded(folder: Path, tenant: str) -> list[tuple[int, int]]:
    """(status, input tokens) of the tenant's usage rows in the one store in `folder`."""
    (store,) = folder.glob("*.db")
    with sqlite3.connect(store) as db:
        query = "SELECT status, input_tokens FROM corral_usage WHERE tenant = ?"
        return [(int(s), int(t)) for s, t in db.execute(query, (tenant,)).fetchall()]


class _Slow(EmbeddingShaper):
    """A shaper whose every shaping takes until `go` is set (a tenant's answers of gigabytes)."""

    def __init__(self) -> None:
        super().__init__(in_thread_bytes=0)
        self.go = threading.Event()

    def shape(self, *args: Any, **kwargs: Any) -> tuple[bytes, dict[str, Any]]:
        self.go.wait(10)
        return super().shape(*args, **kwargs)


async def test_many_large_answers_leave_the_default_threads_to_key_lookups_and_usage_writes() -> None:
    """Eight large answers shaping at once take their own thread, not the default pool's (six threads on
    two cores), which every tenant's key lookups and usage writes wait for."""
    vectors = np.random.default_rng(5).standard_normal((1, 8)).astype(np.float32)
    answer = _floats_answer(vectors)
    body = EmbeddingRequest.model_validate({"model": "e", "input": "x"})
    shaper = _Slow()
    shaping = [asyncio.create_task(shaper.answer(answer, body, False)) for _ in range(8)]
    try:
        await asyncio.sleep(0.05)
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "a key looked up"), 1) == "a key looked up"
    finally:
        shaper.go.set()
        await asyncio.gather(*shaping)
        shaper.close()
