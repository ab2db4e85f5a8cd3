"""What a hostile (or careless) client sends the new routes: malformed tools, blocks and tool calls are
clear 400s in the route's own shape, never a 500 (a review found each of these a 500); a stream cut
mid-way is stored as failed; tool calls the gateway asks for as JSON come back as tool_calls."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest

from tests.dialects.conftest import Cluster, Gateway

ASK = [{"role": "user", "content": "hi"}]
DEEP = "[" * 300 + "]" * 300  # JSON nested past what orjson writes back


async def _post(gateway: Gateway, path: str, body: object, key: str) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with (
        aiohttp.ClientSession() as session,
        session.post(gateway.url + path, data=raw, headers=headers) as answer,
    ):
        return answer.status, await answer.json()


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "input": "hi", "tools": [{"type": "function"}]},
        {"model": "m", "input": "hi", "tools": [{"type": "function", "name": 5}]},
        {"model": "m", "input": "hi", "tools": [{"type": "namespace", "tools": [{"type": "function"}]}]},
        {"model": "m", "input": [{"type": None, "role": "user", "content": 7}]},
    ],
)
async def test_malformed_responses_requests_are_400s(cluster: Cluster, body: dict) -> None:
    gateway = await cluster.gateway()
    status, answer = await _post(gateway, "/v1/responses", body, await gateway.key("eve"))
    assert status == 400 and answer["error"]["type"] == "invalid_request_error", answer


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/messages", {"model": "m", "max_tokens": 5, "messages": ASK, "tools": [{"name": "a"}]}),
        ("/v1/messages/count_tokens", {"model": "m", "messages": ASK, "tools": [{"name": "a"}]}),
        (
            "/v1/messages",
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "image", "source": "x"}]}],
            },
        ),
    ],
)
async def test_malformed_messages_are_anthropic_400s(cluster: Cluster, path: str, body: dict) -> None:
    gateway = await cluster.gateway()
    status, answer = await _post(gateway, path, body, await gateway.key("eve"))
    assert status == 400 and answer["type"] == "error", answer
    assert answer["error"]["type"] == "invalid_request_error"


async def test_emulated_tool_calls_come_back_as_tool_calls_and_bad_ones_are_400s(cluster: Cluster) -> None:
    """Replicas taken for an engine without tool calls: the gateway asks for the call as JSON."""
    gateway = await cluster.gateway(tools=False)
    key = await gateway.key("eve")
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
        },
    }
    reply = await client.chat.completions.create(
        model="m", messages=ASK, tools=[tool], tool_choice="required", max_tokens=40
    )
    (call,) = reply.choices[0].message.tool_calls or []
    assert call.function.name == "f" and isinstance(json.loads(call.function.arguments)["x"], int)
    assert reply.choices[0].finish_reason == "tool_calls"
    for body in (
        {"model": "m", "messages": ASK, "tools": [{"type": "function", "function": "x"}]},
        {
            "model": "m",
            "messages": ASK,
            "tools": [tool],
            "tool_choice": {"type": "function", "function": "f"},
        },
        {
            "model": "m",
            "messages": ASK,
            "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": ["f"]}},
        },
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
        b'"function": {"name": "f", "parameters": {"x": NaN}}}]}',
    ):
        status, answer = await _post(gateway, "/v1/chat/completions", body, key)
        assert status == 400, (body, answer)
    turns = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": "x"}],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "d", "type": "function", "function": {"name": "f", "arguments": DEEP}}],
        },
        {"role": "tool", "tool_call_id": "d", "content": "ok"},
    ]
    status, answer = await _post(
        gateway,
        "/v1/chat/completions",
        {"model": "m", "messages": turns, "tools": [tool], "max_tokens": 5},
        key,
    )
    assert status == 200, answer  # odd tool calls in the history are told as text, not a 500


async def test_a_conversation_past_max_body_bytes_is_a_413(cluster: Cluster) -> None:
    """A conversation resolved from previous_response_id is held to gateway.max_body_bytes, as if the
    client had sent it whole: stored conversations stay bounded, and resuming one costs at most that."""
    gateway = await cluster.gateway(max_body_bytes=6000)
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=await gateway.key("eve"), max_retries=0)
    first = await client.responses.create(model="m", input="word " * 800, max_output_tokens=4)
    with pytest.raises(openai.APIStatusError) as info:
        await client.responses.create(
            model="m", input="word " * 400, previous_response_id=first.id, max_output_tokens=4
        )
    assert info.value.status_code == 413 and info.value.body["param"] == "previous_response_id"
