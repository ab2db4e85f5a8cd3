"""Reasoning an engine produces (vLLM's and llama.cpp's `reasoning_content`) passes through both dialects:
a reasoning item in a response, a thinking block in a message, whole and streamed. The engine here is a
scripted upstream that answers as a reasoning model does."""

from __future__ import annotations

import json

import aiohttp
import anthropic
import openai
import orjson
import pytest

from tests.gateway.conftest import Gateway, ScriptedUpstream

_BASE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def _whole() -> bytes:
    message = {"role": "assistant", "reasoning_content": "Two and two make four.", "content": "4"}
    usage = {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16}
    choice = {"index": 0, "message": message, "finish_reason": "stop"}
    return orjson.dumps({**_BASE, "object": "chat.completion", "choices": [choice], "usage": usage})


def _stream() -> bytes:
    deltas = [{"role": "assistant", "content": ""}, {"reasoning_content": "Two and two"}]
    deltas += [{"reasoning_content": " make four."}, {"content": "4"}]
    chunks = [{**_BASE, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    chunks.append({**_BASE, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    chunks.append(
        {**_BASE, "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16}}
    )
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("stream", [False, True])
async def test_reasoning_passes_through_both_dialects(
    scripted: tuple[Gateway, ScriptedUpstream], stream: bool
) -> None:
    gateway, upstream = scripted
    upstream.mode = "answer"
    upstream.answer = (200, "text/event-stream", _stream()) if stream else (200, "application/json", _whole())
    client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="none", max_retries=0)
    if stream:
        async with client.responses.stream(model="m", input="2+2?", store=False) as events:
            kinds = [e.type async for e in events]
            response = await events.get_final_response()
        assert kinds.count("response.reasoning_text.delta") == 2
    else:
        response = await client.responses.create(model="m", input="2+2?", store=False)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Two and two make four."
    assert message.type == "message" and response.output_text == "4"

    claude = anthropic.AsyncAnthropic(base_url=gateway.url, api_key="none", max_retries=0)
    if stream:
        async with claude.messages.stream(
            model="m", max_tokens=50, messages=[{"role": "user", "content": "2+2?"}]
        ) as s:
            answer = await s.get_final_message()
    else:
        answer = await claude.messages.create(
            model="m", max_tokens=50, messages=[{"role": "user", "content": "2+2?"}]
        )
    thinking, text = answer.content
    assert thinking.type == "thinking" and thinking.thinking == "Two and two make four."
    assert text.type == "text" and text.text == "4" and answer.stop_reason == "end_turn"


async def test_a_stream_cut_mid_way_is_stored_as_failed(scripted: tuple[Gateway, ScriptedUpstream]) -> None:
    """The engine cuts the stream: the client reads response.failed, and the stored response says failed
    (it was stored as completed before: the next turn would have continued a truncated answer), as the
    client read it (the text that came, the item cut short `incomplete`), and a next turn does not carry
    the cut item on."""
    gateway, upstream = scripted
    upstream.mode = "cut"
    client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="none", max_retries=0)
    stream = await client.responses.create(model="m", input="hi", stream=True)
    events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert kinds[-1] == "response.failed" and "error" in kinds
    told = events[-1].response  # type: ignore[union-attr]
    kept = await client.responses.retrieve(told.id)
    assert kept.status == "failed" and [item.model_dump() for item in kept.output] == [
        item.model_dump() for item in told.output
    ]
    (item,) = told.output
    assert item.type == "message" and item.status == "incomplete" and item.content[0].text  # type: ignore[union-attr]
    upstream.mode = "ok"
    after = await client.responses.create(model="m", input="go on", previous_response_id=told.id)
    carried = await client.responses.input_items.list(after.id)
    assert item.id not in {getattr(i, "id", None) for i in carried.data}
    upstream.mode = "cut"
    async with aiohttp.ClientSession() as session:
        async with session.post(
            gateway.url + "/v1/responses", json={"model": "m", "input": "hi", "stream": True}
        ) as raw:
            text = await raw.text()
    first = json.loads(text.split("data: ", 2)[1].split("\n", 1)[0])
    stored = await client.responses.retrieve(first["response"]["id"])
    assert stored.status == "failed" and stored.error is not None
