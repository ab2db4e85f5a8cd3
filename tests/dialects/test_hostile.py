"""What a hostile (or careless) client sends the new routes: malformed tools, blocks and tool calls are
clear 400s in the route's own shape, never a 500 (a review found each of these a 500), and so are values
JSON reads but cannot carry on (an integer past 64 bits); a stream cut mid-way is stored as failed; tool
calls the gateway asks for as JSON come back as tool_calls; a stored conversation is bounded by all it
keeps, not only by what the engine is sent."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest

from tests.dialects.conftest import Cluster, Gateway

ASK = [{"role": "user", "content": "hi"}]
DEEP = "[" * 300 + "]" * 300  # JSON nested past what orjson writes back
BIG = b"18446744073709551616"  # 2**64: pydantic keeps it, orjson cannot write it


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
        (
            "/v1/messages",
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}],
            },
        ),
        ("/v1/messages", {"model": "m", "max_tokens": 5, "messages": ASK, "stop_sequences": [""]}),
    ],
)
async def test_malformed_messages_are_anthropic_400s(cluster: Cluster, path: str, body: dict) -> None:
    gateway = await cluster.gateway()
    status, answer = await _post(gateway, path, body, await gateway.key("eve"))
    assert status == 400 and answer["type"] == "error", answer
    assert answer["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        (
            "/v1/responses",
            b'{"model": "m", "input": [{"type": "function_call_output", "call_id": "c", "output": {"n": '
            + BIG
            + b"}}]}",
        ),
        ("/v1/responses", b'{"model": "m", "input": "hi", "seed_extra": ' + BIG + b"}"),
        ("/v1/responses", b'{"model": "m", "input": "hi", "reasoning": {"effort": ' + BIG + b"}}"),
        (  # a field of an input item the engine never sees, but the stored conversation keeps
            "/v1/responses",
            b'{"model": "m", "input": [{"type": "message", "role": "user", "content": "hi", "n": '
            + BIG
            + b"}]}",
        ),
        (
            "/v1/messages",
            b'{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}, {"role": '
            b'"assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"n": '
            + BIG
            + b"}}]}]}",
        ),
        (
            "/v1/messages/count_tokens",
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "f", '
            b'"input_schema": {"type": "object", "n": ' + BIG + b"}}]}",
        ),
    ],
)
async def test_an_integer_past_64_bits_is_a_400_in_the_routes_shape(
    cluster: Cluster, path: str, raw: bytes
) -> None:
    gateway = await cluster.gateway()
    status, answer = await _post(gateway, path, raw, await gateway.key("eve"))
    assert status == 400, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and "64 bits" in error["message"], answer
    assert (answer.get("type") == "error") == path.startswith("/v1/messages")  # Anthropic's shape there


async def test_a_stored_conversation_is_bounded_by_everything_it_keeps(cluster: Cluster) -> None:
    """Items keep every field the client sent (they are listed and carried on as sent), so a turn that
    pads its items leaves the engine's request small while the stored conversation grows: the next turn is
    held to gateway.max_body_bytes by the stored bytes it carries on, not only by the engine's request."""
    gateway = await cluster.gateway(max_body_bytes=6000)
    key = await gateway.key("eve")
    padded = [{"type": "message", "role": "user", "content": "hi", "note": "x" * 3500}]
    status, first = await _post(gateway, "/v1/responses", {"model": "m", "input": padded}, key)
    assert status == 200, first
    status, answer = await _post(
        gateway, "/v1/responses", {"model": "m", "input": padded, "previous_response_id": first["id"]}, key
    )
    assert status == 413 and answer["error"]["param"] == "previous_response_id", answer
    small = {"model": "m", "input": "and now?", "previous_response_id": first["id"]}
    status, answer = await _post(gateway, "/v1/responses", small, key)
    assert status == 200, answer  # (a turn that fits goes on)
    # counted in bytes, as the limit is: 1,400 emoji are 5,600 bytes (in characters a quarter of that)
    wide = [{"type": "message", "role": "user", "content": "hi", "note": "\U0001f600" * 1400}]
    utf8 = json.dumps({"model": "m", "input": wide}, ensure_ascii=False).encode()
    status, first = await _post(gateway, "/v1/responses", utf8, key)
    assert status == 200, first
    small["previous_response_id"] = first["id"]
    status, answer = await _post(gateway, "/v1/responses", small, key)
    assert status == 413, answer


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
