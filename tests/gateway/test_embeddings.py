"""/v1/embeddings through the gateway with the openai client, in front of a simulated embedding replica:
vectors equal the engine's own (called directly), list inputs keep their order, base64 decodes to the same
floats, `dimensions` shortens a Matryoshka model's vectors (renormalised) and is refused with 400 by any
other model, generation and embedding models refuse each other's endpoint, bad input is a 400, and usage
is recorded with the inputs' tokens."""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import numpy as np
import openai
import orjson
import pytest

from corral.config import GatewaySettings
from corral.engines import EngineFeatures
from corral.gateway import GatewayParts, GatewayServer
from corral.gateway.embeddings import EmbeddingShaper
from corral.perf import load_catalog
from corral.perf.calibration import calibrated_efficiency
from corral.protocol import EmbeddingRequest
from corral.routing import Replica, ReplicaSet, ReplicaState
from corral.sim import SimFleet, SimOptions, build_server

from .conftest import start_closed_gateway

ADMIN = "embed-admin"
TEXTS = ["The cat sat on the mat.", "A cat is sitting on a mat.", "Quarterly revenue grew by four percent."]


@pytest.fixture
async def engines() -> AsyncIterator[tuple[str, str]]:
    """An embedding replica and a generation replica (simulated)."""
    catalog, efficiency = load_catalog(), calibrated_efficiency()
    embed = SimOptions(model="llama-3.1-8b", gpu="h100-sxm", time_scale=50, served_name="e", embed_dim=384)
    chat = SimOptions(model="llama-3.1-8b", gpu="h100-sxm", time_scale=50, served_name="m")
    fleet = SimFleet([build_server(embed, catalog, efficiency), build_server(chat, catalog, efficiency)])
    await fleet.start([0, 0])
    yield fleet.urls[0], fleet.urls[1]
    await fleet.stop()


async def _gateway(
    engines: tuple[str, str], tmp_path: Path, matryoshka: bool = False
) -> tuple[GatewayServer, GatewayParts]:
    replicas = ReplicaSet()
    embed_features = EngineFeatures(embeddings=True, matryoshka=matryoshka)
    replicas.add(
        Replica(
            id="e-0",
            model="e",
            engine="sim",
            url=engines[0],
            state=ReplicaState.READY,
            features=embed_features,
        )
    )
    replicas.add(Replica(id="m-0", model="m", engine="sim", url=engines[1], state=ReplicaState.READY))
    _, server, services = await start_closed_gateway(
        replicas,
        f"sqlite:///{tmp_path / f'{uuid.uuid4().hex}.db'}",
        ADMIN,
        # (routing headers on: the test checks which replica served; a closed gateway hides it by default)
        GatewaySettings(port=0, routing_headers=True),
    )
    return server, services


async def _key(url: str, tenant: str) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.post(
            url + "/admin/keys", json={"tenant": tenant}, headers={"Authorization": f"Bearer {ADMIN}"}
        ) as response:
            return str((await response.json())["key"])


async def _direct(engine: str, texts: list[str]) -> np.ndarray:
    async with aiohttp.ClientSession() as session:
        async with session.post(engine + "/v1/embeddings", json={"model": "e", "input": texts}) as response:
            data = (await response.json())["data"]
    return np.asarray([d["embedding"] for d in sorted(data, key=lambda d: d["index"])])


async def test_vectors_order_encodings_and_usage(engines: tuple[str, str], tmp_path: Path) -> None:
    server, services = await _gateway(engines, tmp_path)
    url = f"http://127.0.0.1:{server.port}"
    try:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=await _key(url, "acme"), max_retries=0)
        answer = await client.embeddings.create(model="e", input=TEXTS)
        got = np.asarray([d.embedding for d in answer.data])
        want = await _direct(engines[0], TEXTS)
        assert [d.index for d in answer.data] == [0, 1, 2]
        cosines = (got * want).sum(axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
        assert cosines.min() >= 0.999
        reversed_answer = await client.embeddings.create(model="e", input=TEXTS[::-1])
        assert np.allclose([d.embedding for d in reversed_answer.data], got[::-1], atol=1e-6)
        # the cat sentences are closer to each other than to the revenue one (the vectors mean something)
        assert float(got[0] @ got[1]) > float(got[0] @ got[2])

        raw = await client.embeddings.with_raw_response.create(
            model="e", input=TEXTS[0], encoding_format="base64"
        )
        assert raw.headers["x-corral-replica"] == "e-0"
        b64 = raw.http_response.json()["data"][0]["embedding"]
        assert isinstance(b64, str)
        assert np.allclose(np.frombuffer(base64.b64decode(b64), dtype="<f4"), got[0], atol=1e-6)
        single = await client.embeddings.create(model="e", input=TEXTS[0])  # the client asks base64 itself
        assert np.allclose(single.data[0].embedding, got[0], atol=1e-6)
        assert answer.usage.prompt_tokens == answer.usage.total_tokens > 0

        tokens = await client.embeddings.create(model="e", input=[[101, 2003, 102], [7, 8]])
        assert len(tokens.data) == 2 and len(tokens.data[0].embedding) == 384

        deadline = asyncio.get_running_loop().time() + 10
        rows: list = []
        while asyncio.get_running_loop().time() < deadline:
            rows = [r for r in services.usage_store.report("model") if r["model"] == "e"]
            if rows and rows[0]["requests"] >= 5:
                break
            await asyncio.sleep(0.1)
        assert rows and rows[0]["input_tokens"] >= answer.usage.prompt_tokens
    finally:
        await server.stop()


async def test_dimensions_only_for_matryoshka_models(engines: tuple[str, str], tmp_path: Path) -> None:
    server, _ = await _gateway(engines, tmp_path, matryoshka=True)
    plain, _ = await _gateway(engines, tmp_path, matryoshka=False)
    try:
        url = f"http://127.0.0.1:{server.port}"
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=await _key(url, "acme"), max_retries=0)
        full = (await client.embeddings.create(model="e", input=TEXTS[0])).data[0].embedding
        short = (await client.embeddings.create(model="e", input=TEXTS[0], dimensions=64)).data[0].embedding
        assert len(short) == 64
        assert np.isclose(np.linalg.norm(short), 1.0, atol=1e-5)
        assert np.allclose(short, np.asarray(full[:64]) / np.linalg.norm(full[:64]), atol=1e-5)
        with pytest.raises(openai.BadRequestError, match="too large"):
            await client.embeddings.create(model="e", input="x", dimensions=385)

        purl = f"http://127.0.0.1:{plain.port}"
        pclient = openai.AsyncOpenAI(base_url=purl + "/v1", api_key=await _key(purl, "acme"), max_retries=0)
        same = await pclient.embeddings.create(model="e", input=TEXTS[0], dimensions=384)
        assert len(same.data[0].embedding) == 384
        with pytest.raises(openai.BadRequestError, match="Matryoshka") as refused:
            await pclient.embeddings.create(model="e", input=TEXTS[0], dimensions=64)
        assert refused.value.body["param"] == "dimensions"  # type: ignore[index]
    finally:
        await server.stop()
        await plain.stop()


async def test_endpoints_refuse_the_other_kind_of_model_and_bad_input(
    engines: tuple[str, str], tmp_path: Path
) -> None:
    server, _ = await _gateway(engines, tmp_path)
    url = f"http://127.0.0.1:{server.port}"
    try:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=await _key(url, "acme"), max_retries=0)
        with pytest.raises(openai.BadRequestError, match="embedding model"):
            await client.chat.completions.create(model="e", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError, match="does not make embeddings"):
            await client.embeddings.create(model="m", input="hi")
        with pytest.raises(openai.NotFoundError):
            await client.embeddings.create(model="nope", input="hi")
        for bad in ("", [], ["ok", ""], [1, "a"]):
            with pytest.raises(openai.BadRequestError, match="input must be") as refused:
                await client.embeddings.create(model="e", input=bad)  # type: ignore[arg-type]
            assert refused.value.body["param"] == "input"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError, match="encoding_format"):
            await client.embeddings.create(model="e", input="hi", encoding_format="hex")  # type: ignore[arg-type]
    finally:
        await server.stop()


@pytest.mark.parametrize(
    ("reported", "told"),
    [
        ({"prompt_tokens": 4, "total_tokens": 4}, 4),
        (None, 7),  # none: the prompt's estimate (it was 0: an engine without usage served for free)
        ({"prompt_tokens": "4", "total_tokens": 4}, 7),
        ({"prompt_tokens": -5, "total_tokens": -5}, 7),
    ],
)
def test_an_embedding_answer_without_usage_that_reads_is_told_and_charged_the_prompts_estimate(
    reported: object, told: int
) -> None:
    engine: dict[str, object] = {"data": [{"index": i, "embedding": [0.6, 0.8]} for i in range(2)]}
    if reported is not None:
        engine["usage"] = reported
    body = EmbeddingRequest.model_validate({"model": "e", "input": ["a", "b"]})
    shaped, usage = EmbeddingShaper().shape(orjson.dumps(engine), body, False, estimate=7)
    assert usage == {"prompt_tokens": told, "total_tokens": told} == orjson.loads(shaped)["usage"]
