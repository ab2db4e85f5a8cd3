"""/v1/responses through the official openai SDK against a closed gateway over simulated replicas: whole
and streamed answers, stored responses (retrieve, input items, delete, another tenant's 404), function
tools, a conversation by previous_response_id that outlives its replica and its gateway, limits."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import openai
import pytest
from sqlalchemy import create_engine, event, text

from corral.config import StoreSettings
from corral.dialects.chat import not_shown
from corral.routing import ReplicaState
from corral.store import open_database
from corral.store.responses import ResponseRow, ResponseStore
from tests.dialects.conftest import Cluster, streamed_answer, whole_answer
from tests.dialects.weather import RESPONSES_TOOL
from tests.gateway.conftest import Gateway, ScriptedUpstream

TOOL = RESPONSES_TOOL


def _client(url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


async def test_a_response_is_answered_stored_retrieved_listed_and_deleted(cluster: Cluster) -> None:
    gateway = await cluster.gateway()
    client = _client(gateway.url, await gateway.key("acme"))
    response = await client.responses.create(
        model="m",
        input="Say hello.",
        instructions="Be brief.",
        max_output_tokens=12,
        metadata={"ticket": "7"},
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text and response.output[0].type == "message"
    assert response.usage.output_tokens == 12 and response.usage.input_tokens > 0
    assert response.instructions == "Be brief." and response.metadata == {"ticket": "7"}

    found = await client.responses.retrieve(response.id)
    assert found.model_dump() == response.model_dump()
    items = await client.responses.input_items.list(response.id)
    assert [item.type for item in items.data] == ["message"] and items.data[0].role == "user"

    other = _client(gateway.url, await gateway.key("eve"))
    with pytest.raises(openai.NotFoundError):
        await other.responses.retrieve(response.id)  # another tenant's: not found
    with pytest.raises(openai.NotFoundError):
        await other.responses.delete(response.id)
    with pytest.raises(openai.BadRequestError):  # nor can it continue another tenant's conversation
        await other.responses.create(model="m", input="And?", previous_response_id=response.id)
    await client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(response.id)
    unstored = await client.responses.create(model="m", input="Again.", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)


async def test_input_items_are_read_page_by_page(cluster: Cluster) -> None:
    """The SDK's auto-pagination names the last item it has (`after`): each page goes on from there, to
    the end (the first page every time looped for ever); `before` reads back; an unknown cursor is a 400."""
    gateway = await cluster.gateway()
    client = _client(gateway.url, await gateway.key("acme"))
    said = [{"role": "user", "content": f"line {n}"} for n in range(25)]
    response = await client.responses.create(model="m", input=said, max_output_tokens=2)  # type: ignore[arg-type]
    seen = [item async for item in client.responses.input_items.list(response.id, limit=10, order="asc")]
    assert [item.model_dump()["content"][0]["text"] for item in seen] == [f"line {n}" for n in range(25)]
    newest = await client.responses.input_items.list(response.id, limit=10)  # desc: the last said first
    assert newest.data[0].model_dump()["content"][0]["text"] == "line 24" and newest.has_more
    page = await client.responses.input_items.list(
        response.id,
        limit=3,
        order="asc",
        extra_query={"before": seen[10].id},  # (older SDKs' cursor)
    )
    assert [item.id for item in page.data] == [item.id for item in seen[7:10]] and page.has_more
    with pytest.raises(openai.BadRequestError, match="after"):
        await client.responses.input_items.list(response.id, after="msg_unknown")


async def test_the_sdk_reads_the_stream_in_openai_event_order(cluster: Cluster) -> None:
    gateway = await cluster.gateway()
    client = _client(gateway.url, await gateway.key("acme"))
    events = []
    async with client.responses.stream(model="m", input="Tell a story.") as stream:
        async for event in stream:
            events.append(event)
        final = await stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text and final.usage.output_tokens >= 16
    assert (await client.responses.retrieve(final.id)).output_text == text  # stored before it ended


@pytest.mark.parametrize("stream", [False, True])
async def test_a_function_tool_round_trip(cluster: Cluster, stream: bool) -> None:
    gateway = await cluster.gateway()
    client = _client(gateway.url, await gateway.key("acme"))
    ask = {"model": "m", "input": "Weather in Paris?", "tools": [TOOL], "tool_choice": "required"}
    if stream:
        async with client.responses.stream(**ask) as events:
            deltas = [e.delta async for e in events if e.type == "response.function_call_arguments.delta"]
            first = await events.get_final_response()
        assert "".join(deltas) == first.output[0].arguments
    else:
        first = await client.responses.create(**ask)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("c", "f")
    second = await client.responses.create(
        model="m",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 21}'}],
        tools=[TOOL],
        max_output_tokens=8,
    )
    assert second.output[0].type == "message" and second.output_text  # the result is in: it answers
    items = await client.responses.input_items.list(second.id, order="asc")
    assert [i.type for i in items.data] == ["message", "function_call", "function_call_output"]


async def test_a_conversation_outlives_its_replica_and_its_gateway(cluster: Cluster) -> None:
    """Three turns by previous_response_id: each turn's prompt is the whole conversation (the engine
    counts it growing), the second lands on the other replica, the third after that replica died, on a
    second gateway."""
    one = await cluster.gateway()
    key = await one.key("acme")
    client = _client(one.url, key)
    first = await client.responses.with_raw_response.create(
        model="m", input="My name is Ada.", max_output_tokens=6
    )
    turn1 = first.parse()
    served = first.headers["x-corral-replica"]
    other = "m-1" if served == "m-0" else "m-0"
    replica = {r.id: r for r in one.replicas.of("m")}[served]
    replica.state = ReplicaState.DRAINING  # the next turn goes to the other
    second = await client.responses.with_raw_response.create(
        model="m", input="What is my name?", previous_response_id=turn1.id, max_output_tokens=6
    )
    turn2 = second.parse()
    assert second.headers["x-corral-replica"] == other
    await cluster.fleet.stop_one(int(other.split("-")[1]))  # that replica dies
    replica.state = ReplicaState.READY
    two = await cluster.gateway()  # a second gateway, on the same store
    turn3 = await _client(two.url, key).responses.create(
        model="m", input="And again?", previous_response_id=turn2.id, max_output_tokens=6
    )
    prompts = [t.usage.input_tokens for t in (turn1, turn2, turn3)]
    assert prompts[0] < prompts[1] < prompts[2]
    assert prompts[2] > prompts[1] + 6  # turn 2's question, its answer and turn 3's question
    items = await _client(two.url, key).responses.input_items.list(turn3.id, order="asc")
    texts = [i.content[0].text for i in items.data if i.type == "message"]
    assert texts[0] == "My name is Ada." and texts[2] == "What is my name?" and texts[-1] == "And again?"


async def test_unknown_ids_tools_and_items_are_clear_400s(cluster: Cluster) -> None:
    gateway = await cluster.gateway()
    client = _client(gateway.url, await gateway.key("acme"))
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model="m", input="x", previous_response_id="resp_nothing")
    assert info.value.body["param"] == "previous_response_id"
    hosted = await client.responses.create(  # a hosted tool is not offered: there is none to run
        model="m", input="x", tools=[{"type": "web_search"}], tool_choice="auto", max_output_tokens=3
    )
    assert [item.type for item in hosted.output] == ["message"]
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model="m", input="x", tools=[TOOL], tool_choice={"type": "file_search"})
    assert info.value.body["param"] == "tool_choice"
    with pytest.raises(openai.NotFoundError) as info:
        await client.responses.create(model="nope", input="x")
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model="m", input="x", background=True)
    done = await client.responses.create(model="m", input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        await client.responses.cancel(done.id)  # not a background response


async def test_a_key_over_its_tpm_gets_openais_429_on_responses(cluster: Cluster) -> None:
    gateway = await cluster.gateway()
    client = _client(gateway.url, await gateway.key("acme", tpm=100))
    await client.responses.create(model="m", input="hello there", max_output_tokens=40)
    with pytest.raises(openai.RateLimitError) as info:
        await client.responses.create(model="m", input="hello there", max_output_tokens=40)
    assert info.value.body["type"] == "rate_limit_error"
    assert info.value.response.headers.get("retry-after")


async def test_a_stored_conversation_is_read_under_the_keys_rpm(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading a stored conversation costs the gateway its parse (megabytes of small JSON values: most of a
    second of a core, holding the event loop): retrieving a response, listing its items, deleting it and
    continuing it are requests under the key's RPM, and a key over it is refused before the store is read
    (a 150-byte request could otherwise have the gateway parse a 4 MB row, as often as it liked)."""
    from corral.store.responses import ResponseStore

    gateway = await cluster.gateway()
    client = _client(gateway.url, await gateway.key("acme", rpm=3))
    first = await client.responses.create(model="m", input="hi", max_output_tokens=4)
    await client.responses.retrieve(first.id)
    await client.responses.input_items.list(first.id)
    read, get = [], ResponseStore.get
    monkeypatch.setattr(ResponseStore, "get", lambda self, *args: read.append(args) or get(self, *args))
    for call in (
        client.responses.retrieve(first.id),
        client.responses.input_items.list(first.id),
        client.responses.create(model="m", input="and?", previous_response_id=first.id, max_output_tokens=4),
        client.responses.delete(first.id),
    ):
        with pytest.raises(openai.RateLimitError):
            await call
    assert read == []


async def test_a_batch_of_responses_lines(cluster: Cluster) -> None:
    """/v1/responses lines run by the batch runner: each answer is a response object, stored as its
    `store` says."""
    gateway = await cluster.gateway()
    client = _client(gateway.url, await gateway.key("acme"))
    lines = [
        {"custom_id": f"q{i}", "method": "POST", "url": "/v1/responses", "body": body}
        for i, body in enumerate(
            [
                {"model": "m", "input": "First question.", "max_output_tokens": 5},
                {"model": "m", "input": "Second.", "max_output_tokens": 3, "store": False},
            ]
        )
    ]
    upload = await client.files.create(
        file=("lines.jsonl", b"\n".join(json.dumps(line).encode() for line in lines)), purpose="batch"
    )
    batch = await client.batches.create(
        input_file_id=upload.id, endpoint="/v1/responses", completion_window="24h"
    )
    for _ in range(200):
        batch = await client.batches.retrieve(batch.id)
        if batch.status in ("completed", "failed", "expired"):
            break
        await asyncio.sleep(0.1)
    assert batch.status == "completed", batch
    output = [
        json.loads(line) for line in (await client.files.content(batch.output_file_id)).text.splitlines()
    ]
    answers = {line["custom_id"]: line["response"]["body"] for line in output}
    assert answers["q0"]["object"] == "response" and answers["q0"]["usage"]["output_tokens"] == 5
    assert (await client.responses.retrieve(answers["q0"]["id"])).status == "incomplete"
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(answers["q1"]["id"])  # store: false


async def test_a_tenant_keeps_response_tenant_max_bytes_of_stored_responses(cluster: Cluster) -> None:
    """`store.response_tenant_max_bytes`: a tenant storing past it loses its own oldest responses, never
    another tenant's; its conversation goes on from the latest (which holds all of it)."""
    gateway = await cluster.gateway(store=StoreSettings(flush_interval=0.1, response_tenant_max_bytes=64_000))
    acme = _client(gateway.url, await gateway.key("acme"))
    bob = _client(gateway.url, await gateway.key("bob"))
    kept = await bob.responses.create(model="m", input="Keep me.", max_output_tokens=2)
    first = await acme.responses.create(model="m", input="x " * 2000, max_output_tokens=2)
    latest = first
    for _ in range(40):  # about 8 kB each: 320 kB stored by acme, five times its bound
        latest = await acme.responses.create(model="m", input="y " * 2000, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        await acme.responses.retrieve(first.id)  # acme's oldest went
    assert (await acme.responses.retrieve(latest.id)).id == latest.id
    assert (await bob.responses.retrieve(kept.id)).id == kept.id  # bob's stays
    went_on = await acme.responses.create(
        model="m", input="And?", previous_response_id=latest.id, max_output_tokens=2
    )
    assert went_on.previous_response_id == latest.id and went_on.output
    with create_engine(cluster.store).connect() as db:
        held = db.execute(text("SELECT SUM(size) FROM corral_responses WHERE tenant = 'acme'")).scalar()
    assert 48_000 < held <= 64_000 + 64_000 // 16 + 10_000  # the bound, a sixteenth's slack, one response


async def test_stored_responses_expire_after_response_ttl_days(cluster: Cluster) -> None:
    """`store.response_ttl_days`: past it a stored response is gone for retrieval and for continuing."""
    gateway = await cluster.gateway(store=StoreSettings(flush_interval=0.1, response_ttl_days=1 / 86400))
    client = _client(gateway.url, await gateway.key("acme"))
    response = await client.responses.create(model="m", input="Remember me.", max_output_tokens=2)
    assert (await client.responses.retrieve(response.id)).id == response.id  # within its second
    await asyncio.sleep(1.2)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model="m", input="And?", previous_response_id=response.id)


async def test_a_turn_refused_after_its_stored_conversation_is_read_is_one_of_the_keys_requests(
    cluster: Cluster,
) -> None:
    """A turn of a hundred bytes naming a stored conversation of megabytes has the gateway parse it; refused
    after that (a bad item of its own: 400; too large with it: 413; more tokens than the key's TPM: 429) it
    counted against nothing, so a key could have the gateway parse megabytes as often as it sent. Each is
    now one of the key's requests, as a long prompt refused once counted is."""
    gateway = await cluster.gateway(max_body_bytes=6000)
    client = _client(gateway.url, await gateway.key("eve", rpm=4, tpm=2000))
    padded = [{"type": "message", "role": "user", "content": "hi", "note": "x" * 3500}]
    first = await client.responses.create(model="m", input=padded, max_output_tokens=2)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model="m", input=[{"type": "bogus"}], previous_response_id=first.id)  # type: ignore[list-item]
    with pytest.raises(openai.APIStatusError) as info:
        await client.responses.create(model="m", input=padded, previous_response_id=first.id)  # type: ignore[arg-type]
    assert info.value.status_code == 413
    with pytest.raises(openai.RateLimitError, match="more tokens than"):
        await client.responses.create(
            model="m", input="and?", previous_response_id=first.id, max_output_tokens=3000
        )
    with pytest.raises(openai.RateLimitError, match="4 requests per minute"):
        await client.responses.create(model="m", input="hi", max_output_tokens=2)


def test_another_tenants_stored_response_is_never_read(tmp_path: Path) -> None:
    """The store looks a response up by its id and its tenant together: another tenant's row (megabytes,
    perhaps) is not loaded to be compared and dropped."""
    store = ResponseStore(open_database(f"sqlite:///{tmp_path / 'r.db'}"), ttl_s=60)
    store.put("acme", None, {"id": "resp_1", "model": "m"}, [{"type": "message", "content": "x" * 1000}])
    loaded: list[str] = []

    def on_load(row: ResponseRow, _context: Any) -> None:
        loaded.append(row.id)

    event.listen(ResponseRow, "load", on_load)
    try:
        assert store.get("eve", "resp_1") is None
        assert loaded == []
        found = store.get("acme", "resp_1")
        assert found is not None and found.input_items[0]["content"] == "x" * 1000
    finally:
        event.remove(ResponseRow, "load", on_load)


_TOOLS: list[Any] = [
    {"type": "function", "name": name, "parameters": {"type": "object"}} for name in ("a", "b")
]
_CUT_CALL = {"index": 0, "id": "c0", "type": "function", "function": {"name": "a", "arguments": '{"x": "ab'}}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_call_cut_by_max_output_tokens_is_incomplete_and_not_carried_on(
    scripted: tuple[Gateway, ScriptedUpstream], stream: bool
) -> None:
    """The engine ends at max_tokens inside a call's arguments: the response is incomplete, and so is the
    call (as OpenAI tells an item cut short), whole and streamed; a next turn does not carry its broken
    JSON on (vLLM parses every assistant tool call's arguments: the turn would fail there)."""
    gateway, upstream = scripted
    client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="none", max_retries=0)
    message = {"role": "assistant", "content": None, "tool_calls": [_CUT_CALL]}
    ask: dict[str, Any] = {"model": "m", "input": "go", "tools": _TOOLS, "max_output_tokens": 5}
    if stream:
        upstream.answer = streamed_answer([{"role": "assistant", "tool_calls": [_CUT_CALL]}], "length")
        events = [event async for event in await client.responses.create(**ask, stream=True)]
        done = [e.item for e in events if e.type == "response.output_item.done"]
        assert [(item.type, item.status) for item in done] == [("function_call", "incomplete")]
        assert events[-1].type == "response.incomplete"
        response = events[-1].response
    else:
        upstream.answer = whole_answer(message, "length")
        response = await client.responses.create(**ask)
    assert response.status == "incomplete"
    (call,) = response.output
    assert call.type == "function_call" and call.status == "incomplete" and call.arguments == '{"x": "ab'
    assert (await client.responses.retrieve(response.id)).output[0].status == "incomplete"
    upstream.answer = whole_answer({"role": "assistant", "content": "ok"}, "stop")
    await client.responses.create(model="m", input="go on", previous_response_id=response.id, tools=_TOOLS)
    assert [m["role"] for m in upstream.bodies[-1]["messages"]] == ["user", "user"]


async def test_allowed_tools_offer_the_model_only_the_functions_they_name(
    scripted: tuple[Gateway, ScriptedUpstream],
) -> None:
    gateway, upstream = scripted
    upstream.answer = whole_answer({"role": "assistant", "content": "ok"}, "stop")
    client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="none", max_retries=0)
    allowed = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "b"}]}
    await client.responses.create(model="m", input="go", tools=_TOOLS, tool_choice=allowed)  # type: ignore[arg-type]
    sent = upstream.bodies[-1]
    assert [tool["function"]["name"] for tool in sent["tools"]] == ["b"] and sent["tool_choice"] == "required"
    allowed["tools"] = [{"type": "function", "name": "c"}]
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model="m", input="go", tools=_TOOLS, tool_choice=allowed)  # type: ignore[arg-type]
    assert info.value.body["param"] == "tool_choice" and "'c'" in info.value.body["message"]  # type: ignore[index]


async def test_input_items_become_the_chat_turns_they_are(scripted: tuple[Gateway, ScriptedUpstream]) -> None:
    """An assistant's text and the calls after it are one assistant turn (two turns in a row read as the
    assistant speaking twice); a function's output given as parts is their text (it reached the model as
    the parts' JSON), an image or a file in it a note that it is not shown (a 400 made every later turn of
    the conversation, which keeps it, a 400), a part of no kind known a 400 naming it; an item's id of
    null or "" is one the gateway makes (it was kept: listed as null)."""
    gateway, upstream = scripted
    upstream.answer = whole_answer({"role": "assistant", "content": "done"}, "stop")
    client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="none", max_retries=0)
    said: list[Any] = [
        {"type": "message", "role": "user", "content": "weather?", "id": None},
        {"type": "message", "role": "assistant", "content": "Let me look.", "id": ""},
        {"type": "function_call", "call_id": "c1", "name": "a", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "21C"}]},
    ]
    response = await client.responses.create(model="m", input=said, tools=_TOOLS)
    user, assistant, tool = upstream.bodies[-1]["messages"]
    assert user == {"role": "user", "content": "weather?"}
    assert assistant["content"] == "Let me look." and [c["id"] for c in assistant["tool_calls"]] == ["c1"]
    assert tool == {"role": "tool", "tool_call_id": "c1", "content": "21C"}
    items = await client.responses.input_items.list(response.id, order="asc")
    assert all(item.id for item in items.data) and items.data[0].id.startswith("msg_")  # type: ignore[union-attr]
    image = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
    said[3]["output"] = [{"type": "input_text", "text": "see: "}, image]
    await client.responses.create(model="m", input=said, tools=_TOOLS)
    assert upstream.bodies[-1]["messages"][-1]["content"] == "see: " + not_shown("an image")
    said[3]["output"] = [{"type": "output_audio"}]
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model="m", input=said, tools=_TOOLS)
    assert info.value.body["param"] == "input[3].output[0]"  # type: ignore[index]
