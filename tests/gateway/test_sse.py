"""The SSE filter: bytes pass through unchanged, usage is recorded and stripped, [DONE] is noticed; the
event stream response sends its headers with its first event."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from aiohttp import web

from corral.gateway.relay import SSE_HEADERS, EventStream
from corral.gateway.sse import SSEFilter
from corral.protocol import events
from corral.protocol.events import EventBuffer, EventTooLarge

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
