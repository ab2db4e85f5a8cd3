"""The dialects' answers against the published OpenAPI schemas of both APIs (tests/data/schemas, with their
source in its README.md): every event of a raw SSE stream, read with aiohttp rather than an SDK, validated
against the schema of its event type, the whole answers against `Response` and `Message`, and the order
rules the specs state for the events."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from tests.dialects.conftest import Cluster
from tests.dialects.weather import MESSAGES_TOOL, RESPONSES_TOOL

SCHEMAS = Path(__file__).parents[1] / "data" / "schemas"


class Spec:
    """One API's component schemas as extracted from its OpenAPI document; `union` is the schema of its
    stream events (a oneOf/anyOf of one schema per event type)."""

    def __init__(self, file: str, union: str) -> None:
        self.document = json.loads((SCHEMAS / file).read_text())
        self.uri = f"urn:corral-test:{file}"
        resource = Resource.from_contents(self.document, default_specification=DRAFT202012)
        self.registry: Registry = Registry().with_resource(self.uri, resource)
        self.schemas: dict[str, Any] = self.document["components"]["schemas"]
        self.union = union

    @cached_property
    def events(self) -> dict[str, str]:
        """Event type → the name of its schema, as the union lists them."""
        union = self.schemas[self.union]
        out = {}
        for member in union.get("oneOf") or union["anyOf"]:
            name = member["$ref"].rsplit("/", 1)[-1]
            kind = self.schemas[name]["properties"]["type"]
            out[kind["const"] if "const" in kind else kind["enum"][0]] = name
        return out

    def validator(self, name: str) -> Draft202012Validator:
        assert name in self.schemas, f"{name} is not among the extracted schemas"
        return Draft202012Validator(
            {"$ref": f"{self.uri}#/components/schemas/{name}"}, registry=self.registry
        )

    def problems(self, name: str, instance: Any) -> list[str]:
        """Each way instance fails the schema `name`: where, and why (empty when it validates)."""
        errors = sorted(self.validator(name).iter_errors(instance), key=lambda e: list(e.absolute_path))
        return [_explain(error) for error in errors]


def _explain(error: Any) -> str:
    where = "/".join(str(p) for p in error.absolute_path) or "(root)"
    detail = error.message
    if error.context:  # a oneOf/anyOf: say why the member meant for this instance fails
        by_member: dict[Any, list[Any]] = {}
        for sub in error.context:
            by_member.setdefault(sub.relative_schema_path[0], []).append(sub)
        # the members whose `type` discriminator does not match are not meant for it
        meant = [
            subs
            for subs in by_member.values()
            if not any(s.absolute_path and s.absolute_path[-1] == "type" for s in subs)
        ] or list(by_member.values())
        best = min(meant, key=len)
        detail = "no member of the union matches; the one meant for it fails: " + "; ".join(
            f"at {'/'.join(str(p) for p in s.absolute_path)}: {_explain_leaf(s)}" for s in best
        )
    return f"at {where}: {detail[:800]}"


def _explain_leaf(error: Any) -> str:
    return _explain(error).split(": ", 1)[1] if error.context else error.message[:300]


@pytest.fixture(scope="module")
def openai_spec() -> Spec:
    return Spec("openai-responses.json", "ResponseStreamEvent")


@pytest.fixture(scope="module")
def anthropic_spec() -> Spec:
    return Spec("anthropic-messages.json", "MessageStreamEvent")


@dataclass
class Event:
    name: str | None  # the SSE `event:` field
    data: dict[str, Any]


async def _post(url: str, headers: dict[str, str], body: dict[str, Any]) -> tuple[str, bytes]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body, headers=headers) as answer:
        raw = await answer.read()
        assert answer.status == 200, raw.decode(errors="replace")
        return answer.headers.get("Content-Type", ""), raw


def _events(content_type: str, raw: bytes) -> list[Event]:
    """The SSE stream's events (https://html.spec.whatwg.org/multipage/server-sent-events.html)."""
    assert content_type.startswith("text/event-stream"), content_type
    events: list[Event] = []
    name: str | None = None
    data: list[str] = []
    for line in [*raw.decode().replace("\r\n", "\n").split("\n"), ""]:
        if line == "":
            if data:
                payload = "\n".join(data)
                assert payload != "[DONE]", "neither API ends its stream with [DONE]"
                events.append(Event(name, json.loads(payload)))
            name, data = None, []
        elif line.startswith(":"):
            continue
        else:
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)
    return events


def _validate_stream(spec: Spec, events: list[Event], unlisted: frozenset[str] = frozenset()) -> list[str]:
    """Every event against its type's schema (and the union): the failures, one line each."""
    failures: list[str] = []
    for i, event in enumerate(events):
        kind = event.data.get("type")
        if event.name != kind:
            failures.append(f"event {i}: its SSE name {event.name!r} is not its data's type {kind!r}")
        if kind in unlisted:
            continue
        name = spec.events.get(str(kind))
        if name is None:
            failures.append(f"event {i} ({kind!r}): no event of this type in {spec.union}")
            continue
        problems = spec.problems(name, event.data) or [
            f"(valid as {name}, not as the union) {p}" for p in spec.problems(spec.union, event.data)
        ]
        failures += [f"event {i} ({kind}) against {name} {p}\n  data: {_short(event.data)}" for p in problems]
    return failures


def _short(data: Any) -> str:
    text = json.dumps(data)
    return text if len(text) <= 1500 else text[:1500] + "…"


def _order(check: Callable[[list[Event]], None], events: list[Event]) -> list[str]:
    """The order rule the stream breaks (told with the schema failures, not instead of them)."""
    try:
        check(events)
    except AssertionError as exc:
        return [f"out of order: {exc}\n  types: {[e.data.get('type') for e in events]}"]
    return []


def _report(what: str, failures: list[str]) -> str:
    return f"{what} does not follow its API's published schema:\n" + "\n".join(failures)


# OpenAI's Responses API


def _responses_order(events: list[Event]) -> None:
    """Response stream order (OpenAI's streaming guide and the events' reference): response.created
    first, then response.in_progress; sequence_number from 0, strictly increasing; each output item
    added before its deltas and done after them; response.completed last (and only there)."""
    kinds = [e.data["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[1] == "response.in_progress", kinds[:2]
    numbers = [e.data["sequence_number"] for e in events]
    assert numbers[0] == 0, numbers
    assert all(a < b for a, b in itertools.pairwise(numbers)), numbers
    assert kinds[-1] == "response.completed", kinds[-1]
    assert sum(k in ("response.completed", "response.incomplete", "response.failed") for k in kinds) == 1
    added: dict[int, str] = {}
    done: set[int] = set()
    for event in events:
        data = event.data
        index = data.get("output_index")
        if data["type"] == "response.output_item.added":
            assert index == len(added), f"output items are added at 0, 1, …: {data}"
            added[index] = data["item"]["id"]
        elif data["type"] == "response.output_item.done":
            assert index in added and index not in done and data["item"]["id"] == added[index], data
            done.add(index)
        elif index is not None:  # an item's own event: between its added and its done
            assert index in added and index not in done, f"{data['type']} outside its item: {data}"
            assert data["item_id"] == added[index], data
    assert done == set(added), "every added output item is done"
    final = events[-1].data["response"]
    assert [item["id"] for item in final["output"]] == [added[i] for i in range(len(added))]
    assert final["status"] == "completed" and all(item["status"] == "completed" for item in final["output"])


async def _responses(cluster: Cluster, tools: bool, stream: bool) -> tuple[str, bytes]:
    """(a) a text answer; (b) a function call (tools, tool_choice required)."""
    gateway = await cluster.gateway()
    key = await gateway.key("acme")
    body: dict[str, Any] = {"model": "m", "instructions": "Be brief.", "stream": stream}
    if tools:
        body.update(input="Weather in Paris?", tools=[RESPONSES_TOOL], tool_choice="required")
    else:
        # no max_output_tokens: the simulator ends at its own end of sequence (16-256 tokens), completed
        body.update(input="Tell a story.", metadata={"ticket": "7"}, seed=7)
    return await _post(gateway.url + "/v1/responses", {"Authorization": f"Bearer {key}"}, body)


@pytest.mark.parametrize("tools", [False, True], ids=["text", "function_call"])
async def test_each_event_of_a_responses_stream_validates_and_comes_in_order(
    cluster: Cluster, openai_spec: Spec, tools: bool
) -> None:
    events = _events(*await _responses(cluster, tools, stream=True))
    failures = _validate_stream(openai_spec, events) + _order(_responses_order, events)
    assert not failures, _report("The Responses stream (or its order)", failures)
    kinds = {e.data["type"] for e in events}
    final = events[-1].data["response"]
    if tools:
        assert {"response.function_call_arguments.delta", "response.function_call_arguments.done"} <= kinds
        assert [item["type"] for item in final["output"]] == ["function_call"], final["output"]
        assert json.loads(final["output"][0]["arguments"])["city"]
    else:
        assert {"response.output_text.delta", "response.content_part.added"} <= kinds
        assert [item["type"] for item in final["output"]] == ["message"], final["output"]


@pytest.mark.parametrize("tools", [False, True], ids=["text", "function_call"])
async def test_a_whole_response_validates(cluster: Cluster, openai_spec: Spec, tools: bool) -> None:
    _, raw = await _responses(cluster, tools, stream=False)
    whole = json.loads(raw)
    problems = openai_spec.problems("Response", whole)
    assert not problems, _report("The whole Response", problems) + f"\n  data: {_short(whole)}"
    assert [item["type"] for item in whole["output"]] == ["function_call" if tools else "message"]


# Anthropic's Messages API


def _messages_order(events: list[Event]) -> None:
    """Message stream order (Anthropic's streaming guide): message_start first; then content blocks,
    each a content_block_start, its deltas and its content_block_stop at the same index before the next
    block starts (indexes 0, 1, …); then message_delta; message_stop last. ping may come anywhere."""
    kinds = [e.data["type"] for e in events]
    assert kinds[0] == "message_start", kinds
    assert kinds[-1] == "message_stop" and kinds.count("message_stop") == 1, kinds
    assert kinds.count("message_start") == 1, kinds
    open_index: int | None = None
    started = 0
    delta_seen = False
    for event in events:
        data = event.data
        kind = data["type"]
        if kind == "content_block_start":
            assert open_index is None, f"block {data['index']} starts before block {open_index} stops"
            assert not delta_seen, "a block after message_delta"
            assert data["index"] == started, f"blocks are numbered 0, 1, …: {data}"
            open_index = data["index"]
            started += 1
        elif kind == "content_block_delta":
            assert data["index"] == open_index, f"a delta outside its open block: {data}"
        elif kind == "content_block_stop":
            assert data["index"] == open_index, f"a stop without its start: {data}"
            open_index = None
        elif kind == "message_delta":
            assert open_index is None, "message_delta while a block is open"
            delta_seen = True
    assert open_index is None and started >= 1
    assert delta_seen, "no message_delta before message_stop"


async def _messages(cluster: Cluster, tools: bool, stream: bool) -> tuple[str, bytes]:
    """(c) a text answer; (d) a tool_use (tools, tool_choice any)."""
    gateway = await cluster.gateway()
    key = await gateway.key("acme")
    body: dict[str, Any] = {"model": "m", "system": "Be brief.", "stream": stream}
    if tools:
        body.update(
            max_tokens=64,
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[MESSAGES_TOOL],
            tool_choice={"type": "any"},
        )
    else:
        body.update(max_tokens=24, messages=[{"role": "user", "content": "Tell a story."}])
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
    return await _post(gateway.url + "/v1/messages", headers, body)


@pytest.mark.parametrize("tools", [False, True], ids=["text", "tool_use"])
async def test_each_event_of_a_messages_stream_validates_and_comes_in_order(
    cluster: Cluster, anthropic_spec: Spec, tools: bool
) -> None:
    events = _events(*await _messages(cluster, tools, stream=True))
    # ping: Anthropic's streaming guide names it ("any number of ping events"); its OpenAPI document does not
    for event in events:
        if event.data.get("type") == "ping":
            assert event.data == {"type": "ping"} and event.name == "ping", event
    failures = _validate_stream(anthropic_spec, events, unlisted=frozenset({"ping"}))
    failures += _order(_messages_order, events)
    assert not failures, _report("The Messages stream (or its order)", failures)
    blocks = [e.data["content_block"]["type"] for e in events if e.data["type"] == "content_block_start"]
    delta = next(e.data for e in events if e.data["type"] == "message_delta")
    if tools:
        assert blocks == ["tool_use"] and delta["delta"]["stop_reason"] == "tool_use", (blocks, delta)
        partial = "".join(
            e.data["delta"]["partial_json"] for e in events if e.data["type"] == "content_block_delta"
        )
        assert json.loads(partial)["city"]
    else:
        assert blocks == ["text"] and delta["delta"]["stop_reason"] == "max_tokens", (blocks, delta)


@pytest.mark.parametrize("tools", [False, True], ids=["text", "tool_use"])
async def test_a_whole_message_validates(cluster: Cluster, anthropic_spec: Spec, tools: bool) -> None:
    _, raw = await _messages(cluster, tools, stream=False)
    whole = json.loads(raw)
    problems = anthropic_spec.problems("Message", whole)
    assert not problems, _report("The whole Message", problems) + f"\n  data: {_short(whole)}"
    assert [b["type"] for b in whole["content"]] == (["tool_use"] if tools else ["text"])
