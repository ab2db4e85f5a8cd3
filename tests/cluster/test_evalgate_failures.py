"""The gate's answer is always a verdict: a check that cannot be carried out on an answer (a json_schema
whose `$ref` points nowhere passes the spec's schema check, and fails only on an answer) fails the gate
with its reason, on a rollout's new replica and on an adapter being replaced alike (where the exception
once escaped the apply as something other than an ApplyError); and an embedding model's replica, asked
golden cases that check text, fails saying why rather than being sent chat requests it has no route for.
Stub engines on 127.0.0.1."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from corral.cluster.evalgate import gate_adapter as _gate_adapter
from corral.cluster.evalgate import run_gate
from corral.config import AdapterSpec, EvalCase, RolloutSpec
from corral.engines import EngineFeatures
from corral.routing import Replica, ReplicaState

UNRESOLVABLE = EvalCase(name="shape", prompt="Answer in JSON.", json_schema={"$ref": "#/$defs/city"})


@pytest.fixture
async def engine() -> AsyncIterator[tuple[str, list[str]]]:
    """A stub engine answering every chat with a JSON object and taking runtime LoRA loads: its URL, and
    the paths it was asked, in order."""
    asked: list[str] = []

    async def chat(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": '{"city": 1}'}}]})

    async def lora(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.Response(text="Success")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/load_lora_adapter", lora)
    app.router.add_post("/v1/unload_lora_adapter", lora)
    async with TestServer(app, host="127.0.0.1") as server:
        yield str(server.make_url("")).rstrip("/"), asked


def replica(url: str, embeddings: bool = False) -> Replica:
    features = EngineFeatures(embeddings=embeddings)
    return Replica(id="m-1", model="m", engine="sim", url=url, state=ReplicaState.READY, features=features)


async def test_a_check_that_cannot_be_carried_out_fails_the_gate_with_its_reason(
    engine: tuple[str, list[str]],
) -> None:
    url, _ = engine
    async with aiohttp.ClientSession() as session:
        verdict = await run_gate(session, replica(url), [UNRESOLVABLE], latency_s=None)
    assert verdict is not None and verdict.startswith(
        "golden eval 'shape': the check could not be carried out "
    )
    assert "'/$defs/city' does not exist" in verdict, verdict


async def test_an_adapter_whose_check_cannot_be_carried_out_is_refused_and_unloaded(
    engine: tuple[str, list[str]],
) -> None:
    url, asked = engine
    adapter = AdapterSpec(name="tuned", source={"path": "/adapters/tuned"})  # type: ignore[arg-type]
    policy = RolloutSpec(golden_eval=[UNRESOLVABLE])
    async with aiohttp.ClientSession() as session:
        verdict = await _gate_adapter(session, replica(url), adapter, "/adapters/tuned", policy)
    assert verdict is not None and "golden eval 'shape': the check could not be carried out" in verdict
    assert asked == [  # loaded, warmed up, asked the case, unloaded
        "/v1/load_lora_adapter", "/v1/chat/completions", "/v1/chat/completions", "/v1/unload_lora_adapter",
    ]  # fmt: skip


async def test_an_embedding_replica_asked_golden_cases_fails_saying_why(
    engine: tuple[str, list[str]],
) -> None:
    url, asked = engine
    cases = [EvalCase(prompt="cat", contains="0.")]
    async with aiohttp.ClientSession() as session:
        verdict = await run_gate(session, replica(url, embeddings=True), cases, latency_s=None)
    assert verdict == (
        "golden eval: m-1 is an embedding model: its answers are vectors, which golden_eval cases (checks of "
        "text) cannot judge"
    )
    assert asked == []
