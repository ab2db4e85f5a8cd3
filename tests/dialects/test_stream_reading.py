"""A dialect's stream reads the engine's chat-completions events however they are cut: the whole stream in
one write (read as one array), an event a write, or a few bytes a write (an event's start kept for its
end), in the shapes vLLM and llama.cpp write; what it tells validates against the API's published schema,
in order, and holds the engine's text, reasoning, tool calls and usage."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any, cast

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from corral.dialects.anthropic_messages import MessagesEncoder, MessagesExchange, MessagesRequest
from corral.dialects.chat import ToolCall
from corral.dialects.chunks import ChunkReader
from corral.dialects.openai_responses import ResponsesExchange, ResponsesRequest
from corral.dialects.responses_stream import ResponsesEncoder
from corral.gateway.relay import SSE_HEADERS
from corral.store import ResponseStore
from tests.dialects.test_schemas import (
    Event,
    Spec,
    _events,
    _messages_order,
    _order,
    _responses_order,
    _validate_stream,
)

USAGE = {"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15}
TEXT = ['Hello "there"', ", ", "naïve\n", "world", "\\ ok"]


def _event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def _vllm(deltas: list[dict[str, Any]], finish: str) -> list[bytes]:
    """vLLM's shape: a role chunk first, a chunk a delta, the finish alone, usage alone, [DONE]."""
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return _event({**head, "choices": [choice]})

    return [
        chunk({"role": "assistant", "content": ""}),
        *(chunk(delta) for delta in deltas),
        chunk({}, finish),
        _event({**head, "choices": [], "usage": USAGE}),
        b"data: [DONE]\n\n",
    ]


def _llamacpp(deltas: list[dict[str, Any]], finish: str) -> list[bytes]:
    """llama.cpp's shape: choices first, the finish with an empty delta and its usage and timings."""
    tail = {"created": 1, "id": "chatcmpl-2", "model": "m", "object": "chat.completion.chunk"}
    events = [_event({"choices": [{"finish_reason": None, "index": 0, "delta": d}], **tail}) for d in deltas]
    last = {"choices": [{"finish_reason": finish, "index": 0, "delta": {}}], **tail, "usage": USAGE}
    return [*events, _event({**last, "timings": {"predicted_n": 6}}), b"data: [DONE]\n\n"]


TEXT_DELTAS = [{"content": piece} for piece in TEXT]
REASONING_DELTAS = [{"reasoning_content": "Think"}, {"reasoning_content": " twice."}, *TEXT_DELTAS]
CALL_DELTAS: list[dict[str, Any]] = [
    {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather"}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
]
STREAMS = {
    "vllm_text": (_vllm(TEXT_DELTAS, "length"), "text"),
    "vllm_reasoning": (_vllm(REASONING_DELTAS, "length"), "reasoning"),
    "vllm_call": (_vllm(CALL_DELTAS, "tool_calls"), "call"),
    "llamacpp_text": (_llamacpp(TEXT_DELTAS, "length"), "text"),
    "llamacpp_call": (_llamacpp(CALL_DELTAS, "tool_calls"), "call"),
}


def _cuts(events: list[bytes], how: str) -> Iterator[bytes]:
    whole = b"".join(events)
    if how == "whole":
        yield whole
    elif how == "events":
        yield from events
    else:
        yield from (whole[i : i + 7] for i in range(0, len(whole), 7))


async def _told(exchange: MessagesExchange | ResponsesExchange, writes: list[bytes]) -> list[Event]:
    """The client's events for the engine's stream written in `writes`, through a real server."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = exchange.stream_response(dict(SSE_HEADERS))
        await response.prepare(request)
        for data in writes:
            await response.write(data)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/", handler)
    async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session:
        async with session.get(server.make_url("/")) as answer:
            return _events(answer.headers["Content-Type"], await answer.read())


def _messages_exchange() -> MessagesExchange:
    body = {"model": "m", "max_tokens": 6, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    return MessagesExchange(MessagesRequest.model_validate(body))


def _responses_exchange() -> ResponsesExchange:
    body = ResponsesRequest.model_validate({"model": "m", "input": "Hi", "stream": True, "store": False})
    items = [{"type": "message", "role": "user", "content": "Hi"}]
    return ResponsesExchange(body, items, "acme", None, cast(ResponseStore, None), "abc")  # (store: false)


@pytest.fixture(scope="module")
def openai_spec() -> Spec:
    return Spec("openai-responses.json", "ResponseStreamEvent")


@pytest.fixture(scope="module")
def anthropic_spec() -> Spec:
    return Spec("anthropic-messages.json", "MessageStreamEvent")


@pytest.mark.parametrize("how", ["whole", "events", "bytes"])
@pytest.mark.parametrize("stream", list(STREAMS))
async def test_a_messages_stream_reads_the_engine_however_its_events_are_cut(
    anthropic_spec: Spec, stream: str, how: str
) -> None:
    events, kind = STREAMS[stream]
    told = await _told(_messages_exchange(), list(_cuts(events, how)))
    # (the extracted schema's blocks and deltas are text and tool_use only: thinking ones are not in it)
    listed = [e for e in told if not {"thinking", "signature"} & set(json.dumps(e.data).split('"'))]
    failures = _validate_stream(anthropic_spec, listed, unlisted=frozenset({"ping"}))
    failures += _order(_messages_order, told)
    assert not failures, "\n".join(failures)
    deltas = [e.data["delta"] for e in told if e.data["type"] == "content_block_delta"]
    blocks = [e.data["content_block"]["type"] for e in told if e.data["type"] == "content_block_start"]
    final = next(e.data for e in told if e.data["type"] == "message_delta")
    assert final["usage"]["input_tokens"] == 9 and final["usage"]["output_tokens"] == 6
    if kind == "call":
        assert blocks == ["tool_use"] and final["delta"]["stop_reason"] == "tool_use"
        assert json.loads("".join(d["partial_json"] for d in deltas)) == {"city": "Paris"}
        return
    assert final["delta"]["stop_reason"] == "max_tokens"
    assert "".join(d.get("text", "") for d in deltas) == "".join(TEXT)
    if kind == "reasoning":
        assert blocks == ["thinking", "text"]
        assert "".join(d.get("thinking", "") for d in deltas) == "Think twice."


@pytest.mark.parametrize("how", ["whole", "events", "bytes"])
@pytest.mark.parametrize("stream", list(STREAMS))
async def test_a_responses_stream_reads_the_engine_however_its_events_are_cut(
    openai_spec: Spec, stream: str, how: str
) -> None:
    events, kind = STREAMS[stream]
    told = await _told(_responses_exchange(), list(_cuts(events, how)))
    failures = _validate_stream(openai_spec, told)
    failures += _order(_responses_order, [*told[:-1], _completed(told[-1])])
    assert not failures, "\n".join(failures)
    final = told[-1].data["response"]
    assert told[-1].data["type"] == ("response.completed" if kind == "call" else "response.incomplete")
    assert final["usage"]["input_tokens"] == 9 and final["usage"]["output_tokens"] == 6
    items = {item["type"]: item for item in final["output"]}
    if kind == "call":
        assert list(items) == ["function_call"] and items["function_call"]["name"] == "get_weather"
        assert json.loads(items["function_call"]["arguments"]) == {"city": "Paris"}
        return
    texts = [e.data["delta"] for e in told if e.data["type"] == "response.output_text.delta"]
    assert "".join(texts) == items["message"]["content"][0]["text"] == "".join(TEXT)
    if kind == "reasoning":
        assert list(items) == ["reasoning", "message"]
        assert items["reasoning"]["content"][0]["text"] == "Think twice."


def _completed(event: Event) -> Event:
    """A response cut at max_output_tokens (incomplete) as the order check, which wants it completed, reads
    it; the events before it are the same."""
    if event.data["type"] != "response.incomplete":
        return event
    response = {**event.data["response"], "status": "completed"}
    return Event("response.completed", {**event.data, "type": "response.completed", "response": response})


def _escaped_stream(texts: list[bytes]) -> list[bytes]:
    """vLLM-shaped events a write whose texts are given as the engine escaped them (`texts`: the bytes
    between the content's quotes), then the finish, usage and [DONE]."""
    head = b'data: {"id":"chatcmpl-3","object":"chat.completion.chunk","created":1,"model":"m","choices":'
    delta = b'[{"index":0,"delta":{"content":"%s"},"finish_reason":null}]}\n\n'
    events = [head + delta % t for t in texts]
    events.append(head + b'[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n')
    return [*events, _event({"id": "chatcmpl-3", "choices": [], "usage": USAGE}), b"data: [DONE]\n\n"]


# tokens as an engine may escape them, taken the short way (one event a write, read against the template):
# escapes orjson would not write, a pair of surrogates; and two it must not pass on: a lone surrogate and
# an escape JSON has not (their events are not JSON a client could read)
ESCAPED = [b"Caf", b"\\u00e9", b" \\/ ", b"ok", b"\\ud83d", b"\\q", b" \\ud83d\\ude00", b"\\n"]


@pytest.mark.parametrize("exchange", [_responses_exchange, _messages_exchange])
async def test_tokens_escaped_any_json_way_are_told_as_their_text_and_broken_ones_not_at_all(
    exchange: Any, openai_spec: Spec, anthropic_spec: Spec
) -> None:
    told = await _told(exchange(), _escaped_stream(ESCAPED))  # (every event the client reads parses: _events)
    if isinstance(told[0].data.get("message"), dict):  # Messages
        assert not _validate_stream(anthropic_spec, told, unlisted=frozenset({"ping"}))
        deltas = [e.data["delta"]["text"] for e in told if e.data["type"] == "content_block_delta"]
        assert "".join(deltas) == "Café / ok 😀\n"
        return
    assert not _validate_stream(openai_spec, told)
    deltas = [e.data["delta"] for e in told if e.data["type"] == "response.output_text.delta"]
    assert deltas == ["Caf", "é", " / ", "ok", " 😀", "\n"]
    done = next(e.data for e in told if e.data["type"] == "response.output_text.done")
    final = told[-1].data["response"]["output"][0]["content"][0]["text"]
    assert done["text"] == final == "Café / ok 😀\n"


_HEAD = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
MISSHAPEN = {
    "delta a string": {"choices": [{"index": 0, "delta": "x"}]},
    "tool_calls an object": {"choices": [{"index": 0, "delta": {"tool_calls": {"a": 1}}}]},
    "a call's index a word": {
        "choices": [{"index": 0, "delta": {"tool_calls": [{"index": "a", "function": {"name": "f"}}]}}]
    },
    "a call's function a string": {
        "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": "f"}]}}]
    },
}


@pytest.mark.parametrize("together", [False, True], ids=["apart", "in-one-write"])
@pytest.mark.parametrize("bad", list(MISSHAPEN))
@pytest.mark.parametrize("exchange", [_responses_exchange, _messages_exchange])
async def test_an_engine_event_of_another_shape_ends_the_answer_with_the_dialects_error(
    exchange: Any, bad: str, together: bool, openai_spec: Spec, anthropic_spec: Spec
) -> None:
    """Reading it raised inside the stream's write: the client's stream broke off with no closing event
    (through the gateway, aiohttp then wrote a 500's head into the open body). Now the text so far is told,
    also when it came in the same write, and the answer ends with the dialect's error event."""
    text = {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]}
    events = [_event({**_HEAD, **text}), _event({**_HEAD, **MISSHAPEN[bad]})]
    writes = [b"".join(events)] if together else events
    told = await _told(exchange(), [*writes, b"data: [DONE]\n\n"])
    kinds = [e.data["type"] for e in told]
    if isinstance(told[0].data.get("message"), dict):  # Messages
        # (Anthropic's error event is documented apart from MessageStreamEvent's union)
        assert not _validate_stream(anthropic_spec, told, unlisted=frozenset({"ping", "error"}))
        assert kinds[-1] == "error", kinds
        assert [e.data["delta"]["text"] for e in told if e.data["type"] == "content_block_delta"] == ["Hi"]
        return
    assert not _validate_stream(openai_spec, told)
    assert kinds[-2:] == ["error", "response.failed"], kinds
    assert [e.data["delta"] for e in told if e.data["type"] == "response.output_text.delta"] == ["Hi"]


def test_a_token_read_the_short_way_is_its_escaped_text_and_nothing_else_is() -> None:
    """`ChunkReader.one`: once a text delta taught the template, an event around any JSON string's inside
    is read as that inside, escaped quotes and all (they took the long way before); an event whose text
    does not parse as one string (two events in one write, a stray quote, a broken escape) is not."""
    reader = ChunkReader()
    text = {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]}
    reader.read(_event({**_HEAD, **text}))

    def event(inside: bytes) -> bytes:
        return _event({**_HEAD, **text}).replace(b'"Hi"', b'"' + inside + b'"')

    assert reader.one(event(b'say \\"yes\\"')) == b'say \\"yes\\"'
    assert reader.one(event(b"caf\\u00e9 \\\\")) == b"caf\\u00e9 \\\\"
    assert reader.one(event(b"")) == b""
    assert reader.one(event(b"a") + event(b"b")) is None  # two events: the general path reads them
    assert reader.one(event(b'stray " quote')) is None
    assert reader.one(event(b"broken \\x escape")) is None
    assert reader.one(event(b"\\ud800 lone surrogate")) is None


def _start(index: int) -> dict[str, Any]:
    call = {"index": index, "id": f"c{index}", "type": "function", "function": {"name": "f", "arguments": ""}}
    return {"tool_calls": [call]}


def _args(index: int, piece: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}


PARALLEL = {  # two calls' deltas: side by side (an engine may interleave them), or one call after the other
    "interleaved": [
        _start(0),
        _start(1),
        _args(0, '{"x": '),
        _args(1, '{"y": '),
        _args(0, "1}"),
        _args(1, "2}"),
    ],
    "in_turn": [_start(0), _args(0, '{"x": '), _args(0, "1}"), _start(1), _args(1, '{"y": '), _args(1, "2}")],
}


@pytest.mark.parametrize("how", ["whole", "events", "bytes"])
@pytest.mark.parametrize("order", list(PARALLEL))
async def test_parallel_calls_are_each_their_own_messages_block(
    anthropic_spec: Spec, order: str, how: str
) -> None:
    """Anthropic's content blocks do not interleave: a call's deltas went to whatever block was open, so
    side by side calls' inputs were mixed ({} and {"x": {"y": 1}}). The first call's block stays open and a
    later call waits for it (told whole once it closes, or live once its arguments are whole); calls in
    turn stream live, each in its own block, as a whole answer lists them."""
    told = await _told(_messages_exchange(), list(_cuts(_vllm(PARALLEL[order], "tool_calls"), how)))
    failures = _validate_stream(anthropic_spec, told, unlisted=frozenset({"ping"}))
    failures += _order(_messages_order, told)
    assert not failures, "\n".join(failures)
    blocks: dict[int, str] = {}
    inputs: dict[int, list[str]] = {}
    for event in told:
        if event.data["type"] == "content_block_start":
            blocks[event.data["index"]] = event.data["content_block"]["id"]
        elif event.data["type"] == "content_block_delta":
            inputs.setdefault(event.data["index"], []).append(event.data["delta"]["partial_json"])
    calls = [(blocks[i], json.loads("".join(inputs[i]))) for i in sorted(blocks)]
    assert calls == [("c0", {"x": 1}), ("c1", {"y": 2})]
    assert [len(inputs[i]) for i in sorted(blocks)] == ([2, 1] if order == "interleaved" else [2, 2])
    stop = next(e.data for e in told if e.data["type"] == "message_delta")["delta"]["stop_reason"]
    assert stop == "tool_use"
    whole = {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": json.dumps(args)}}
        for i, args in enumerate([{"x": 1}, {"y": 2}])
    ]}  # fmt: skip
    completion = {"choices": [{"index": 0, "message": whole, "finish_reason": "tool_calls"}], "usage": USAGE}
    answer = await _messages_exchange().whole(web.Response(body=orjson.dumps(completion)))
    assert isinstance(answer, web.Response) and isinstance(answer.body, bytes)
    content = json.loads(answer.body)["content"]
    assert [(block["id"], block["input"]) for block in content] == calls


@pytest.mark.parametrize("how", ["whole", "events", "bytes"])
@pytest.mark.parametrize("order", list(PARALLEL))
async def test_parallel_calls_each_stream_between_their_own_responses_items_events(
    openai_spec: Spec, order: str, how: str
) -> None:
    """A call's item was closed (its arguments done, "") as the next call was added, and its later
    deltas came after its done event. A call stays open while its arguments are not whole, so side by side
    calls each stream within their own item; calls in turn close as the next begins, as before."""
    deltas = [*PARALLEL[order], {"content": "ok"}, _args(1, " ")]  # (text after them; then white space)
    told = await _told(_responses_exchange(), list(_cuts(_vllm(deltas, "tool_calls"), how)))
    failures = _validate_stream(openai_spec, told) + _order(_responses_order, told)
    assert not failures, "\n".join(failures)
    done = {e.data["item_id"]: e.data["arguments"] for e in told if e.data["type"].endswith("arguments.done")}
    final = told[-1].data["response"]["output"]
    assert [(item["type"], item.get("call_id")) for item in final] == [
        ("function_call", "c0"), ("function_call", "c1"), ("message", None)
    ]  # fmt: skip
    assert [json.loads(done[item["id"]]) for item in final[:2]] == [{"x": 1}, {"y": 2}]
    assert [json.loads(item["arguments"]) for item in final[:2]] == [{"x": 1}, {"y": 2}]
    kinds = [e.data["type"] for e in told]
    first_done = kinds.index("response.function_call_arguments.done")
    if order == "in_turn":  # the first call is done before the second is added (OpenAI's own order)
        assert first_done < [i for i, k in enumerate(kinds) if k == "response.output_item.added"][1]


@pytest.mark.parametrize("how", ["whole", "events", "bytes"])
async def test_text_between_calls_arguments_is_told_after_the_calls(anthropic_spec: Spec, how: str) -> None:
    """Text that came while calls' arguments were still coming closed their blocks for good:
    the arguments after it were lost (streamed {"x": and {"y": where the whole answer had {"x": 1} and
    {"y": 2}). It is told after the calls, in a block of its own."""
    deltas = [_start(0), _start(1), _args(0, '{"x": '), _args(1, '{"y": '), {"content": "\n"}]
    deltas += [{"content": "!"}, _args(0, "1}"), _args(1, "2}")]
    told = await _told(_messages_exchange(), list(_cuts(_vllm(deltas, "tool_calls"), how)))
    failures = _validate_stream(anthropic_spec, told, unlisted=frozenset({"ping"}))
    failures += _order(_messages_order, told)
    assert not failures, "\n".join(failures)
    blocks: dict[int, dict[str, Any]] = {}
    said: dict[int, str] = {}
    for event in told:
        data = event.data
        if data["type"] == "content_block_start":
            blocks[data["index"]] = data["content_block"]
        elif data["type"] == "content_block_delta":
            delta = data["delta"]
            said[data["index"]] = said.get(data["index"], "") + str(
                delta.get("partial_json") or delta.get("text") or ""
            )
    calls = [(block["id"], json.loads(said[i])) for i, block in blocks.items() if block["type"] == "tool_use"]
    assert calls == [("c0", {"x": 1}), ("c1", {"y": 2})]
    assert [(blocks[i]["type"], said.get(i, "")) for i in sorted(blocks)][2:] == [("text", "\n!")]


def test_a_messages_call_held_behind_a_long_one_costs_each_delta_the_same() -> None:
    """A held call's every delta read the open call's arguments whole, to see whether they were whole
    JSON: two calls' 32,000 interleaved deltas (160 kB of arguments) took seconds of a core. They are read
    only where they may be whole (ending with a closing bracket)."""
    encoder = MessagesEncoder(_messages_exchange())
    encoder.start()
    first, second = ToolCall("c0", "f"), ToolCall("c1", "f")
    encoder.tool_call(first)
    encoder.tool_call(second)
    started = time.process_time()
    for i in range(32000):
        for call, piece in ((first, '{"a": [' if i == 0 else f"{i}, "), (second, "{" if i == 0 else " ")):
            call.arguments += piece
            encoder.tool_arguments(call, piece)
    assert time.process_time() - started < 1.0
    told = b""
    for call, piece in ((first, "0]}"), (second, "}")):
        call.arguments += piece
        told += encoder.tool_arguments(call, piece)
    encoder.answer.finish_reason = "tool_calls"
    told += encoder.finish()
    assert told.count(b"event: content_block_start") == 1 and b'"id":"c1"' in told  # (the second call, whole)


def test_a_responses_stream_of_thousands_of_calls_costs_each_call_the_same() -> None:
    """Each call's delta looked its item up in the output list (a search a delta, and one a closing item):
    8,000 calls took 5.1 s of a core where they now take 0.12 s (2026-12-07, the development machine)."""
    encoder = ResponsesEncoder(_responses_exchange())
    encoder.start()
    started = time.process_time()
    for i in range(8000):
        call = ToolCall(f"c{i}", "f")
        encoder.tool_call(call)
        for piece in ('{"a"', ": ", "1}"):
            call.arguments += piece
            encoder.tool_arguments(call, piece)
    encoder.answer.finish_reason = "tool_calls"
    encoder.finish()
    spent = time.process_time() - started
    assert spent < 1.5, f"{spent:.2f} s of a core for 8,000 calls"
    assert [item["arguments"] for item in encoder.output[-2:]] == ['{"a": 1}'] * 2


@pytest.mark.parametrize("how", ["whole", "events"])
async def test_a_responses_call_cut_by_max_tokens_is_incomplete_only_if_its_arguments_are_cut(
    openai_spec: Spec, how: str
) -> None:
    """Cut by max_output_tokens with calls side by side, only the last call was told incomplete: c0's
    `{"x": ` went on as completed (a next turn would carry it to the engine) and c1's whole `{"y": 2}` as
    incomplete. A call is incomplete where its arguments are not whole JSON, streamed or whole. And white
    space after a whole call's arguments still lets it close as the next call begins."""
    deltas = [_start(0), _start(1), _args(0, '{"x": '), _args(1, '{"y": 2}')]
    told = await _told(_responses_exchange(), list(_cuts(_vllm(deltas, "length"), how)))
    final = told[-1].data["response"]
    assert told[-1].data["type"] == "response.incomplete"
    statuses = [("c0", "incomplete"), ("c1", "completed")]
    assert [(i["call_id"], i["status"]) for i in final["output"]] == statuses
    whole = {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": arguments}}
        for i, arguments in enumerate(['{"x": ', '{"y": 2}'])
    ]}  # fmt: skip
    completion = {"choices": [{"index": 0, "message": whole, "finish_reason": "length"}], "usage": USAGE}
    answer = await _responses_exchange().whole(web.Response(body=orjson.dumps(completion)))
    assert isinstance(answer, web.Response) and isinstance(answer.body, bytes)
    output = json.loads(answer.body)["output"]
    assert [(i["call_id"], i["status"]) for i in output] == statuses
    in_turn = [_start(0), _args(0, '{"x": 1}'), _args(0, " \n"), _start(1), _args(1, '{"y": 2}')]
    told = await _told(_responses_exchange(), list(_cuts(_vllm(in_turn, "tool_calls"), how)))
    failures = _validate_stream(openai_spec, told) + _order(_responses_order, told)
    assert not failures, "\n".join(failures)
    kinds = [e.data["type"] for e in told]
    second_added = [i for i, k in enumerate(kinds) if k == "response.output_item.added"][1]
    assert kinds.index("response.function_call_arguments.done") < second_added
