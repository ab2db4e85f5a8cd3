"""/v1/messages through Anthropic's own SDK against a closed gateway over simulated replicas: whole and
streamed answers, a tool round trip, count_tokens, keys as x-api-key or Bearer, errors in Anthropic's
shape with its status codes."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from corral.dialects.chat import not_shown
from tests.dialects.conftest import Cluster, streamed_answer, whole_answer
from tests.dialects.weather import MESSAGES_TOOL
from tests.gateway.conftest import Gateway, ScriptedUpstream

TOOL = MESSAGES_TOOL


def _client(url: str, key: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0)


async def test_a_message_whole_and_streamed(cluster: Cluster) -> None:
    gateway = await cluster.gateway()
    client = _client(gateway.url, await gateway.key("acme"))
    message = await client.messages.create(
        model="m",
        max_tokens=10,
        system="Be brief.",
        messages=[{"role": "user", "content": "Say hello."}],
    )
    assert message.id.startswith("msg_") and message.role == "assistant" and message.type == "message"
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 10
    assert message.content[0].type == "text" and message.content[0].text
    assert message.usage.input_tokens > 0

    async with client.messages.stream(
        model="m", max_tokens=12, messages=[{"role": "user", "content": "Tell a story."}]
    ) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    assert final.content[0].text and len(final.content[0].text.split()) == 12


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tool_round_trip(cluster: Cluster, stream: bool) -> None:
    gateway = await cluster.gateway()
    client = _client(gateway.url, await gateway.key("acme"))
    turns: list[dict] = [{"role": "user", "content": "Weather in Paris?"}]
    ask = {"model": "m", "max_tokens": 64, "tools": [TOOL], "tool_choice": {"type": "any"}, "messages": turns}
    if stream:
        async with client.messages.stream(**ask) as events:
            partial = [e.partial_json async for e in events if e.type == "input_json"]
            first = await events.get_final_message()
        assert json.loads("".join(partial)) == first.content[0].input
    else:
        first = await client.messages.create(**ask)
    assert first.stop_reason == "tool_use"
    (use,) = first.content
    assert use.type == "tool_use" and use.name == "get_weather" and isinstance(use.input["city"], str)
    assert 1 <= use.input["days"] <= 7
    turns += [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21°C, sunny"}],
        },
    ]
    second = await client.messages.create(model="m", max_tokens=8, tools=[TOOL], messages=turns)
    assert second.stop_reason == "max_tokens" and second.content[0].type == "text"


async def test_stop_sequences_count_tokens_and_bearer_keys(cluster: Cluster) -> None:
    gateway = await cluster.gateway()
    key = await gateway.key("acme")
    client = _client(gateway.url, key)
    asked = [{"role": "user", "content": "Count the words of this sentence for me."}]
    counted = await client.messages.count_tokens(model="m", messages=asked)
    answer = await client.messages.create(model="m", max_tokens=4, messages=asked)
    assert counted.input_tokens > 0  # the gateway's own count, the one admission reserves
    assert answer.usage.input_tokens > 0
    bearer = anthropic.AsyncAnthropic(base_url=gateway.url, auth_token=key, max_retries=0)
    assert (await bearer.messages.create(model="m", max_tokens=2, messages=asked)).usage.output_tokens == 2
    stopped = await client.messages.create(model="m", max_tokens=40, messages=asked, stop_sequences=["the"])
    assert "the" not in stopped.content[0].text.split()  # the sim's words end before a stop string


async def test_errors_come_in_anthropics_shape(cluster: Cluster) -> None:
    gateway = await cluster.gateway()
    client = _client(gateway.url, await gateway.key("acme", tpm=100))
    asked = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.AuthenticationError) as auth:
        await _client(gateway.url, "sk-wrong").messages.create(model="m", max_tokens=2, messages=asked)
    assert auth.value.body["type"] == "error" and auth.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        await client.messages.create(model="nope", max_tokens=2, messages=asked)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        await client.messages.create(model="m", max_tokens=0, messages=asked)
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    await client.messages.create(model="m", max_tokens=40, messages=asked)
    with pytest.raises(anthropic.RateLimitError) as limited:
        await client.messages.create(model="m", max_tokens=40, messages=asked)
    assert limited.value.body["error"]["type"] == "rate_limit_error"
    assert limited.value.response.headers.get("retry-after")
    async with (
        aiohttp.ClientSession() as session,
        session.post(gateway.url + "/v1/messages", data=b"{", headers={"x-api-key": "sk-x"}) as raw,
    ):
        assert raw.status == 401 and (await raw.json())["type"] == "error"


async def test_count_tokens_is_a_request_under_the_keys_rpm(cluster: Cluster) -> None:
    """Counting a long prompt costs the gateway as much as admitting it: a key over its RPM is refused
    count_tokens as it is a message (429 in Anthropic's shape), and the counts use up the same minute."""
    gateway = await cluster.gateway()
    client = _client(gateway.url, await gateway.key("acme", rpm=3))
    asked = [{"role": "user", "content": "hi"}]
    for _ in range(2):
        assert (await client.messages.count_tokens(model="m", messages=asked)).input_tokens > 0
    await client.messages.create(model="m", max_tokens=2, messages=asked)
    for call in (
        client.messages.count_tokens(model="m", messages=asked),
        client.messages.create(model="m", max_tokens=2, messages=asked),
    ):
        with pytest.raises(anthropic.RateLimitError) as limited:
            await call
        assert limited.value.body["error"]["type"] == "rate_limit_error"
        assert limited.value.response.headers.get("retry-after")


async def test_budgets_and_usage_hold_on_both_apis(cluster: Cluster) -> None:
    """A monthly budget refuses in each API's own shape; usage rows and metrics name the API that asked."""
    gateway = await cluster.gateway()
    key = await gateway.key("acme", monthly_token_budget=400)
    asked = [{"role": "user", "content": "hi"}]
    claude = _client(gateway.url, key)
    openai_client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)
    answered = await claude.messages.create(model="m", max_tokens=100, messages=asked)
    response = await openai_client.responses.create(model="m", input="hi", max_output_tokens=100)
    used = sum(u.input_tokens + u.output_tokens for u in (answered.usage, response.usage))
    with pytest.raises(anthropic.RateLimitError) as refused:
        await claude.messages.create(model="m", max_tokens=300, messages=asked)
    assert refused.value.body["error"]["type"] == "rate_limit_error"
    with pytest.raises(openai.RateLimitError):
        await openai_client.responses.create(model="m", input="hi", max_output_tokens=300)
    headers = {"Authorization": "Bearer dialects-admin"}
    async with aiohttp.ClientSession(headers=headers) as session:
        for _ in range(50):
            async with session.get(gateway.url + "/admin/usage?by=api") as answer:
                rows = {row["api"]: row for row in (await answer.json())["rows"]}
            if (
                rows.get("messages", {}).get("requests") == 2
                and rows.get("responses", {}).get("requests") == 2
            ):
                break
            await asyncio.sleep(0.1)  # (usage rows are written in batches)
        assert rows["messages"]["refused"] == 1 and rows["responses"]["refused"] == 1
        tokens = sum(
            rows[api]["input_tokens"] + rows[api]["output_tokens"] for api in ("messages", "responses")
        )
        assert tokens == used  # the engine's counts, as each API reported them
        async with session.get(gateway.url + "/metrics") as answer:
            metrics = await answer.text()
    assert 'corral_api_requests_total{api="messages",status="200"} 1.0' in metrics
    assert 'corral_api_requests_total{api="responses",status="429"} 1.0' in metrics


@pytest.mark.parametrize("stream", [False, True])
async def test_the_exact_cache_answers_both_apis_in_their_own_shape(cluster: Cluster, stream: bool) -> None:
    gateway = await cluster.gateway(cache=True)
    key = await gateway.key("acme")
    claude, responses = (
        _client(gateway.url, key),
        openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0),
    )
    asked = [{"role": "user", "content": "Cache me."}]
    said, states = [], []
    for _ in range(2):
        raw = await claude.messages.with_raw_response.create(
            model="m", max_tokens=6, messages=asked, stream=stream, extra_body={"temperature": 0}
        )
        if stream:
            events = [e async for e in await raw.parse()]
            said.append("".join(e.delta.text for e in events if e.type == "content_block_delta"))
        else:
            said.append((await raw.parse()).content[0].text)
        states.append(raw.headers["x-corral-cache"])
    assert states == ["miss", "hit"] and said[0] == said[1]
    first = await responses.responses.with_raw_response.create(
        model="m", input="Cache me.", max_output_tokens=6, temperature=0
    )
    second = await responses.responses.with_raw_response.create(
        model="m", input="Cache me.", max_output_tokens=6, temperature=0
    )
    assert second.headers["x-corral-cache"] == "hit"
    one, two = first.parse(), second.parse()
    assert one.output_text == two.output_text and one.id != two.id  # a new response each time
    assert (await responses.responses.retrieve(two.id)).output_text == one.output_text


def test_usage_counts_the_cached_prompt_once() -> None:
    """Anthropic's input_tokens leave out the tokens read from the cache (its clients add them up for the
    prompt's count); the engine's prompt_tokens hold both."""
    from corral.dialects.anthropic_messages import _usage

    engine = {"prompt_tokens": 1000, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 768}}
    told = _usage(engine)
    assert told["input_tokens"] == 232 and told["cache_read_input_tokens"] == 768
    assert told["input_tokens"] + told["cache_read_input_tokens"] == engine["prompt_tokens"]


async def test_a_large_count_tokens_body_refused_by_its_parse_is_one_of_the_keys_requests(
    cluster: Cluster,
) -> None:
    """A count_tokens body of megabytes is parsed on the event loop (a few hundred ms) before its count is
    metered: refused by that parse (400) it counted against nothing, so a key could have the gateway parse
    it as often as it sent. It is now one of the key's requests, as a /v1/messages body so refused is."""
    gateway = await cluster.gateway()
    key = await gateway.key("eve", rpm=2)
    blocks: list[Any] = [{"type": "text", "text": ""}] * 12_000 + [{"type": "bogus"}]
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": blocks}]}).encode()
    assert len(body) > 256 * 1024  # (a body past the size whose key is checked before it is parsed)
    headers = {"x-api-key": key, "Content-Type": "application/json"}
    async with aiohttp.ClientSession(headers=headers) as session:
        for _ in range(2):
            async with session.post(gateway.url + "/v1/messages/count_tokens", data=body) as answer:
                assert answer.status == 400, await answer.text()
    with pytest.raises(anthropic.RateLimitError):
        await _client(gateway.url, key).messages.count_tokens(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )


_CALL = {"index": 0, "id": "c0", "type": "function", "function": {"name": "a", "arguments": '{"x": "ab'}}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tool_use_cut_by_max_tokens_stops_for_max_tokens(
    scripted: tuple[Gateway, ScriptedUpstream], stream: bool
) -> None:
    """An answer the engine ended at max_tokens inside a tool call is cut, not a finished tool use: Claude
    Code would run the tool with a broken input."""
    gateway, upstream = scripted
    claude = anthropic.AsyncAnthropic(base_url=gateway.url, api_key="none", max_retries=0)
    ask: dict[str, Any] = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "go"}]}
    if stream:
        upstream.answer = streamed_answer([{"role": "assistant", "tool_calls": [_CALL]}], "length")
        async with claude.messages.stream(**ask) as events:
            message = await events.get_final_message()
    else:
        upstream.answer = whole_answer(
            {"role": "assistant", "content": None, "tool_calls": [_CALL]}, "length"
        )
        message = await claude.messages.create(**ask)
    assert message.stop_reason == "max_tokens"
    assert [block.type for block in message.content] == ["tool_use"]


async def test_a_prefill_is_continued_by_the_engine(scripted: tuple[Gateway, ScriptedUpstream]) -> None:
    """A last turn of the assistant's is a prefill the answer goes on from: vLLM answers a new turn after it
    unless asked to continue it (llama.cpp continues it by itself; asked so, the bundled build no longer
    streams the prefill back before its continuation)."""
    gateway, upstream = scripted
    upstream.answer = whole_answer({"role": "assistant", "content": '"a": 1}'}, "stop")
    claude = anthropic.AsyncAnthropic(base_url=gateway.url, api_key="none", max_retries=0)
    asked: list[Any] = [{"role": "user", "content": "JSON please"}, {"role": "assistant", "content": "{"}]
    answer = await claude.messages.create(model="m", max_tokens=20, messages=asked)
    sent = upstream.bodies[-1]
    assert sent["messages"][-1] == {"role": "assistant", "content": "{"}
    assert sent["continue_final_message"] is True and sent["add_generation_prompt"] is False
    assert answer.content[0].text == '"a": 1}'  # type: ignore[union-attr]
    await claude.messages.create(model="m", max_tokens=20, messages=asked[:1])
    assert not {"continue_final_message", "add_generation_prompt"} & set(upstream.bodies[-1])


async def test_an_image_in_a_tool_result_is_told_as_not_shown(
    scripted: tuple[Gateway, ScriptedUpstream],
) -> None:
    """A tool message carries text only: an image in a tool result was dropped without a word, and then
    a 400 (every later turn of an agent's conversation, which keeps the result, was refused). The model
    reads that an image was there and is not shown; a block of no kind a result takes is a 400."""
    gateway, upstream = scripted
    upstream.answer = whole_answer({"role": "assistant", "content": "ok"}, "stop")
    claude = anthropic.AsyncAnthropic(base_url=gateway.url, api_key="none", max_retries=0)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    result = {
        "type": "tool_result",
        "tool_use_id": "t1",
        "content": [{"type": "text", "text": "here"}, image],
    }
    turns: list[Any] = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
        {"role": "user", "content": [result]},
    ]
    tools: list[Any] = [{"name": "shot", "input_schema": {"type": "object"}}]
    await claude.messages.create(model="m", max_tokens=5, messages=turns, tools=tools)
    told = "here" + not_shown("an image")
    assert upstream.bodies[-1]["messages"][-1] == {"role": "tool", "tool_call_id": "t1", "content": told}
    result["content"] = [{"type": "text", "text": "here"}, {"type": "tool_use", "id": "x", "name": "y"}]
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[2\]\.content\[0\]\.content\[1\]"):
        await claude.messages.create(model="m", max_tokens=5, messages=turns, tools=tools)
