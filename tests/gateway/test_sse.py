"""The SSE filter: bytes pass through unchanged, usage is recorded and stripped, [DONE] is noticed; the
event stream response sends its headers with its first event."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest
from aiohttp import web

from corral.gateway.relay import SSE_HEADERS, EventStream
from corral.gateway.sse import SSEFilter
from corral.protocol import events
from corral.protocol.events import EventBuffer, EventTooLarge

from .conftest import Gateway

CONTENT = b'data: {"choices":[{"index":0,"delta":{"content":"hi \\"usage\\""}}]}\n\n'
FINISH = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n'
DONE = b"data: [DONE]\n\n"
STREAM = CONTENT + FINISH + USAGE + DONE


def feed_in_pieces(sse: SSEFilter, data: bytes, size: int) -> bytes:
    return b"".join(sse.feed(data[i : i + size]) for i in range(0, len(data), size))


def test_content_passes_through_byte_for_byte() -> None:
    sse = SSEFilter(keep_usage=True)
    assert sse.feed(CONTENT) == CONTENT
    assert sse.usage is None and not sse.done


def test_usage_chunk_is_dropped_but_recorded_when_not_asked() -> None:
    sse = SSEFilter(keep_usage=False)
    out = sse.feed(STREAM)
    assert out == CONTENT + FINISH + DONE
    assert sse.usage == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert sse.done


def test_usage_chunk_is_kept_when_asked() -> None:
    sse = SSEFilter(keep_usage=True)
    assert sse.feed(STREAM) == STREAM
    assert sse.usage is not None and sse.usage["total_tokens"] == 5


def test_events_split_across_reads_are_reassembled() -> None:
    for size in (1, 3, 7, 64):
        sse = SSEFilter(keep_usage=False)
        assert feed_in_pieces(sse, STREAM, size) == CONTENT + FINISH + DONE
        assert sse.done and sse.usage is not None


def test_escaped_usage_word_in_content_is_not_mistaken_for_usage() -> None:
    sse = SSEFilter(keep_usage=False)
    assert sse.feed(CONTENT) == CONTENT
    assert sse.usage is None


def test_usage_inside_a_content_chunk_is_removed_when_not_asked() -> None:
    chunk = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": {"total_tokens": 1}}
    event = b"data: " + orjson.dumps(chunk) + b"\n\n"
    sse = SSEFilter(keep_usage=False)
    out = sse.feed(event)
    assert orjson.loads(out[len(b"data: ") :]) == {"choices": chunk["choices"]}
    assert sse.usage == {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 1}  # (as checked)
    assert SSEFilter(keep_usage=True).feed(event) == event


def test_stream_without_done_is_not_done() -> None:
    sse = SSEFilter(keep_usage=False)
    sse.feed(CONTENT + FINISH)
    assert not sse.done


async def _first_read(write_event: bool) -> bytes:
    """What a client's first read of an EventStream gets, when the handler writes its first event (or
    ends without one) 0.3 s after `prepare`."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = EventStream(headers=SSE_HEADERS)
        await response.prepare(request)
        await asyncio.sleep(0.3)
        if write_event:
            await response.write(CONTENT)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        first = await asyncio.wait_for(reader.read(65536), 5)
        writer.close()
        return first
    finally:
        await runner.cleanup()


async def test_event_stream_headers_leave_with_the_first_event() -> None:
    # one write, not two: the client's first read holds the head and the event (a plain StreamResponse
    # sends the head at prepare, 0.3 s before the event)
    first = await _first_read(write_event=True)
    assert first.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"text/event-stream" in first
    assert CONTENT in first


async def test_event_stream_without_events_still_sends_its_headers() -> None:
    first = await _first_read(write_event=False)
    assert first.startswith(b"HTTP/1.1 200 OK\r\n")
    assert first.endswith(b"0\r\n\r\n")  # the chunked body's end


def test_an_event_split_across_reads_is_handed_on_whole_and_an_endless_one_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    buffer = EventBuffer()
    assert buffer.complete(b"data: {") == b""
    assert buffer.complete(b'"a":1}\n') == b""
    assert buffer.complete(b"\ndata: {") == b'data: {"a":1}\n\n'  # (the separator across two reads)
    assert buffer.complete(b"}\n\n") == b"data: {}\n\n"
    monkeypatch.setattr(events, "MAX_EVENT_BYTES", 1000)
    buffer.complete(b"data: " + b"x" * 900)
    with pytest.raises(EventTooLarge):
        buffer.complete(b"x" * 200)


def test_an_engine_that_ends_its_lines_with_crlf_or_cr_is_read_and_relayed_with_lf() -> None:
    """SSE lets a line end with CRLF or CR (sse-starlette's default is CRLF: llama-cpp-python's server).
    Events split only at LF LF never ended: every stream from such an engine was a 502, and its breaker
    opened. Its events are read whole however the reads fall (a CRLF across two of them too), its usage
    and `[DONE]` seen, and the client is sent them with LF ends."""
    for ending in (b"\r\n", b"\r"):
        stream = STREAM.replace(b"\n", ending)
        for size in (1, 2, 3, 7, 64, len(stream)):
            sse = SSEFilter(keep_usage=False)
            assert feed_in_pieces(sse, stream, size) == CONTENT + FINISH + DONE, (ending, size)
            assert sse.done and sse.usage == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def test_an_lf_stream_is_handed_on_as_it_came_once_its_first_line_ended() -> None:
    """The stream's first line ending decides how it is read, once: an LF engine's reads are not searched
    for CRs after that (nor is a CR among them taken for a line's end)."""
    buffer = EventBuffer()
    assert buffer.complete(b"data: {") == b""  # (no line ended yet)
    assert buffer.complete(b"}\n\ndata: a\r") == b"data: {}\n\n"
    assert buffer.complete(b"b\n\n") == b"data: a\rb\n\n"


async def _crlf_engine(request: web.Request) -> web.StreamResponse:
    """An OpenAI-compatible engine that ends its SSE lines with CRLF, as sse-starlette does; one CRLF is
    split between two writes."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i in range(3):
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
        chunk["choices"] = [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}]
        event = b"data: " + orjson.dumps(chunk) + b"\r\n\r\n"
        await response.write(event[:-1])
        await asyncio.sleep(0.01)
        await response.write(event[-1:])
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    last = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": []}
    await response.write(b"data: " + orjson.dumps({**last, "usage": usage}) + b"\r\n\r\n")
    await response.write(b"data: [DONE]\r\n\r\n")
    return response


async def test_a_stream_from_an_engine_that_ends_its_lines_with_crlf_reaches_the_client(
    gateway: Gateway,
) -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _crlf_engine)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    replica = gateway.add_replica(f"http://127.0.0.1:{runner.addresses[0][1]}")
    body = {"model": "m", "messages": [{"role": "user", "content": "q"}], "stream": True}
    try:
        async with aiohttp.ClientSession() as session:
            for options in (None, {"include_usage": True}):
                ask = {**body, "stream_options": options} if options else body
                async with session.post(gateway.base_url + "/chat/completions", json=ask) as answer:
                    assert answer.status == 200
                    raw = await answer.read()
                assert b"\r" not in raw and raw.endswith(b"data: [DONE]\n\n")
                events = [orjson.loads(e[len(b"data: ") :]) for e in raw.split(b"\n\n")[:-2]]
                text = "".join(c["choices"][0]["delta"]["content"] for c in events if c["choices"])
                assert text == "tok0 tok1 tok2 "
                assert (events[-1].get("usage") is not None) == (options is not None)
    finally:
        await runner.cleanup()
    assert replica.failures == 0
