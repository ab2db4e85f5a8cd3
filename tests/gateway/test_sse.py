"""The SSE filter: bytes pass through unchanged, usage is recorded and stripped, [DONE] is noticed."""

from __future__ import annotations

import orjson

from corral.gateway.sse import SSEFilter

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
    assert sse.usage == {"total_tokens": 1}
    assert SSEFilter(keep_usage=True).feed(event) == event


def test_stream_without_done_is_not_done() -> None:
    sse = SSEFilter(keep_usage=False)
    sse.feed(CONTENT + FINISH)
    assert not sse.done
