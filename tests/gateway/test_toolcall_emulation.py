"""Emulated tool calls (gateway/toolcalls.py) through a gateway over simulated replicas taken for engines
without a tool-call parser: several choices, streamed or whole, each come back as its own call; what
OpenAI refuses, or what cannot be answered right, is a 400 naming the field."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import pytest

from corral.config import GatewaySettings
from corral.engines import EngineFeatures
from corral.gateway import GatewayServer
from corral.perf import load_catalog
from corral.perf.calibration import calibrated_efficiency
from corral.routing import Replica, ReplicaSet, ReplicaState, Router
from corral.sim import SimFleet, SimOptions, build_server

from .conftest import make_services

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@dataclass
class Emulating:
    url: str
    fleet: SimFleet

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=30)

    async def post(self, body: dict) -> tuple[int, dict]:
        async with (
            aiohttp.ClientSession() as session,
            session.post(self.url + "/v1/chat/completions", json=body) as answer,
        ):
            return answer.status, await answer.json()


async def _emulating(tmp_path: Path, features: EngineFeatures) -> AsyncIterator[Emulating]:
    options = SimOptions(model="llama-3.1-8b", gpu="h100-sxm", time_scale=50, served_name="m")
    fleet = SimFleet([build_server(options, load_catalog(), calibrated_efficiency())])
    await fleet.start([0])
    replicas = ReplicaSet(["m"])
    replica = Replica(id="m-0", model="m", engine="sim", url=fleet.urls[0], state=ReplicaState.READY)
    replica.features = features
    replicas.add(replica)
    server = GatewayServer(
        GatewaySettings(port=0), Router(replicas), make_services(replicas, tmp_path / "corral.db")
    )
    await server.start()
    try:
        yield Emulating(f"http://127.0.0.1:{server.port}", fleet)
    finally:
        await server.stop()
        await fleet.stop()


@pytest.fixture
async def vllm_without_parser(tmp_path: Path) -> AsyncIterator[Emulating]:
    """vLLM with no tool-call parser: the engine answers n > 1 itself, in one stream."""
    async for gateway in _emulating(tmp_path, EngineFeatures(tools=False)):
        yield gateway


@pytest.fixture(params=["vllm", "llamacpp"])
async def either_engine(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Emulating]:
    """vLLM with no tool-call parser (answers n > 1 itself), or llama.cpp whose template knows no tools
    (n > 1 is fanned out, one request a choice)."""
    features = EngineFeatures(tools=False, multiple_choices=request.param == "vllm")
    async for gateway in _emulating(tmp_path, features):
        yield gateway


def _call_of(tool_calls: list | None) -> dict:
    (call,) = tool_calls or []
    return {"id": call.id, "name": call.function.name, "arguments": json.loads(call.function.arguments)}


async def test_streamed_emulated_calls_come_back_one_a_choice(vllm_without_parser: Emulating) -> None:
    """Each choice's JSON is held apart and told under its own index: merged, two choices' JSON read as one
    text (`{"name":..{"name":..`) and came back as choice 0's content, finish_reason stop, no call."""
    stream = await vllm_without_parser.client().chat.completions.create(
        model="m", messages=ASK, tools=[TOOL], tool_choice="required", n=2, stream=True, max_tokens=200
    )
    calls: dict[int, dict] = {}
    finishes: dict[int, str | None] = {}
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.tool_calls:
                calls[choice.index] = _call_of(choice.delta.tool_calls)
            assert not choice.delta.content, choice
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert sorted(calls) == [0, 1] and finishes == {0: "tool_calls", 1: "tool_calls"}
    for call in calls.values():
        assert call["name"] == "weather" and isinstance(call["arguments"]["city"], str)
    assert calls[0]["id"] != calls[1]["id"]


async def test_whole_emulated_calls_come_back_one_a_choice(either_engine: Emulating) -> None:
    """Not streamed, each choice is read back on its own, whether the engine answers n itself or the
    gateway fans the request out."""
    reply = await either_engine.client().chat.completions.create(
        model="m", messages=ASK, tools=[TOOL], tool_choice="required", n=2, max_tokens=200
    )
    assert [c.index for c in reply.choices] == [0, 1]
    calls = [_call_of(c.message.tool_calls) for c in reply.choices]
    assert all(c.finish_reason == "tool_calls" for c in reply.choices)
    assert all(call["name"] == "weather" and isinstance(call["arguments"]["city"], str) for call in calls)
    assert calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [], "tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "weather"}}}, "tool_choice"),
        ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "weather"}}}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": "required", "stop": ["}"]}, "stop"),
        ({"tools": [TOOL], "tool_choice": "required", "stop": "}"}, "stop"),
        (
            {
                "tools": [TOOL],
                "tool_choice": {"type": "function", "function": {"name": "weather"}},
                "stop": ",",
            },
            "stop",
        ),
    ],
)
async def test_a_call_that_cannot_be_answered_right_is_a_400_naming_the_field(
    vllm_without_parser: Emulating, fields: dict, param: str
) -> None:
    """OpenAI refuses a required or named call with no tools to call (answered before as plain text); a
    stop string would cut the call's JSON, which came back before as text with finish_reason stop."""
    status, answer = await vllm_without_parser.post(
        {"model": "m", "messages": ASK, "max_tokens": 50, **fields}
    )
    assert status == 400, answer
    assert answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error", answer


async def test_tools_beside_a_response_format_are_answered_when_no_call_is_asked_for(
    vllm_without_parser: Emulating,
) -> None:
    """With tool_choice none the gateway asks for no schema of its own: the client's schema holds the
    answer (refused before, as if both schemas were asked for)."""
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    status, answer = await vllm_without_parser.post(
        {
            "model": "m",
            "messages": ASK,
            "max_tokens": 100,
            "tools": [TOOL],
            "tool_choice": "none",
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        }
    )
    assert status == 200, answer
    (choice,) = answer["choices"]
    assert "tool_calls" not in choice["message"] or not choice["message"]["tool_calls"]
    assert isinstance(json.loads(choice["message"]["content"])["answer"], str)
    status, answer = await vllm_without_parser.post(  # (a call asked for beside it: still refused)
        {
            "model": "m",
            "messages": ASK,
            "tools": [TOOL],
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        }
    )
    assert status == 400 and answer["error"]["param"] == "response_format", answer


async def test_stop_is_taken_where_the_answer_may_be_text(vllm_without_parser: Emulating) -> None:
    """With tool_choice auto or none a stop string is the client's to send (documented: with auto a stop
    found in the JSON ends the answer there)."""
    for choice in ("auto", "none"):
        status, answer = await vllm_without_parser.post(
            {
                "model": "m",
                "messages": ASK,
                "max_tokens": 50,
                "tools": [TOOL],
                "tool_choice": choice,
                "stop": "zz",
            }
        )
        assert status == 200, answer


@pytest.mark.parametrize(
    ("tools", "can_fail_over"),
    [({"tool_choice": "none"}, True), ({"tool_choice": "auto"}, True), ({"tools": [TOOL]}, False)],
)
async def test_a_stream_with_no_call_to_hold_keeps_its_mid_stream_failover(
    tools: dict, can_fail_over: bool
) -> None:
    """A `tool_choice` with no tools asks the gateway for no call: nothing is held as JSON, and its stream may
    be continued elsewhere if its replica fails mid-way; a call asked for is held, and is not (it lost it)."""
    from corral.admission import TokenSizing
    from corral.gateway.intake import Intake
    from corral.protocol import ChatCompletionRequest
    from corral.routing.adapters import AdapterCatalogue

    replicas = ReplicaSet(["m"])
    replica = Replica(id="m-0", model="m", engine="vllm", url="http://127.0.0.1:9", state=ReplicaState.READY)
    replica.features = EngineFeatures(tools=False)
    replicas.add(replica)
    intake = Intake(Router(replicas), AdapterCatalogue(), TokenSizing(0.3), {"m": "always"})
    body = {"model": "m", "messages": ASK, "stream": True, "max_tokens": 8, **tools}
    try:
        ctx = await intake.generation(
            json.dumps(body).encode(), "/v1/chat/completions", ChatCompletionRequest, None, "t"
        )
        assert ctx.failover is can_fail_over
    finally:
        intake.close()
