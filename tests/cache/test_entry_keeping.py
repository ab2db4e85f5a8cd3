"""Which answers the exact cache keeps and how a hit is told: an answer cut short (vLLM's `abort`, an
`error` finish) is never kept; a conversion that would lose a top-level member (vLLM's `prompt_logprobs`,
llama.cpp's `timings`) is a miss; an answer past `cache.max_entry_bytes` is not kept (a stream stops being
collected); an entry of another shape in the store is a miss, never an error; and a hit carries an id and
a time of its own, not the first requester's. Through a gateway in front of a scripted vLLM-like engine
that names its answers by the request's X-Request-Id, as vLLM does."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from pydantic import ValidationError

from corral.cache import ExactCache, MemoryStore
from corral.cache.entry import Collected, Entry, entry_from_stream, entry_from_whole
from corral.cache.exact import MAX_ENTRY_BYTES
from corral.config import CacheSettings, ModelCacheSpec
from corral.gateway import GatewayParts, GatewayServer
from corral.routing import Replica, ReplicaSet, ReplicaState
from tests.gateway.conftest import start_closed_gateway

ADMIN = "entry-admin"
CHAT = "/v1/chat/completions"
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def _stream(finish: str, extra: dict[str, Any] | None = None) -> list[bytes]:
    head = {"id": "chatcmpl-first", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    words = {"index": 0, "delta": {"role": "assistant", "content": "hi"}, "finish_reason": None}
    end = {"index": 0, "delta": {}, "finish_reason": finish}
    first = _event({**head, **(extra or {}), "choices": [words]})
    return [first, _event({**head, "choices": [end]}), b"data: [DONE]\n\n"]


def _whole(finish: str, **extra: Any) -> bytes:
    message = {"role": "assistant", "content": "hi"}
    choice = {"index": 0, "message": message, "finish_reason": finish}
    answer = {"id": "chatcmpl-first", "object": "chat.completion", "created": 1, "model": "m"}
    return orjson.dumps({**answer, "choices": [choice], "usage": USAGE, **extra})


@pytest.mark.parametrize("reason", ["abort", "error", "eos_token?"])
def test_an_answer_cut_short_is_never_kept(reason: str) -> None:
    """vLLM ends an aborted request (a drain, a shutdown) with finish_reason `abort`; a hit replayed the
    cut answer as the answer. Only stop, length, tool_calls, function_call and content_filter are kept."""
    assert entry_from_whole(_whole(reason), True) is None
    assert entry_from_stream(_stream(reason), True, USAGE) is None
    for good in ("stop", "length", "tool_calls", "function_call", "content_filter"):
        assert entry_from_whole(_whole(good), True) is not None
        assert entry_from_stream(_stream(good), True, USAGE) is not None
    # several choices: each must end well (one aborted is not kept)
    head = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    two = [
        _event({**head, "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": "stop"}]}),
        _event({**head, "choices": [{"index": 1, "delta": {"content": "b"}, "finish_reason": reason}]}),
        b"data: [DONE]\n\n",
    ]
    assert entry_from_stream(two, True, USAGE) is None


def test_a_conversion_that_would_lose_a_top_level_member_is_a_miss() -> None:
    """vLLM's `prompt_logprobs` and `prompt_token_ids`, llama.cpp's `timings`: told the other way they were
    dropped; now the entry is told only as stored (the engine answers the other kind). Empty ones say
    nothing (vLLM writes `"prompt_logprobs": null` into every answer)."""
    lossy = entry_from_whole(_whole("stop", prompt_logprobs=[None, {"1": {"logprob": -1.0}}]), True)
    assert lossy is not None and lossy.sse(with_usage=True) is None and lossy.whole() is not None
    plain = entry_from_whole(_whole("stop", prompt_logprobs=None, kv_transfer_params=None), True)
    assert plain is not None and plain.sse(with_usage=True) is not None
    stream = entry_from_stream(_stream("stop", {"prompt_token_ids": [1, 2, 3]}), True, USAGE)
    assert stream is not None and stream.whole() is None and stream.sse(with_usage=False) is not None
    # llama.cpp's timings (the relay takes them off a whole answer) and OpenAI's padding say nothing
    for extra in ({"timings": {"predicted_n": 1}}, {"obfuscation": "xyz"}):
        stream = entry_from_stream(_stream("stop", extra), True, USAGE)
        whole = stream.whole() if stream is not None else None
        assert whole is not None and b"timings" not in whole and b"obfuscation" not in whole
    stream = entry_from_stream(_stream("stop", {"prompt_token_ids": None}), True, USAGE)
    assert stream is not None and stream.whole() is not None


def test_a_hit_is_told_under_its_own_id_and_time() -> None:
    """The stored id named the first requester's x-request-id (vLLM's `chatcmpl-<request id>`); a hit
    gets `chatcmpl-<its own request id>` (`cmpl-` for completions) and the time it was answered."""
    stream = entry_from_stream(_stream("stop"), True, USAGE)
    whole = entry_from_whole(_whole("stop"), True)
    assert stream is not None and whole is not None
    for entry in (stream, whole):
        told = entry.answering("req-2", 1_900_000_000)
        sse, body = told.sse(with_usage=True), told.whole()
        assert sse is not None and body is not None
        events = [orjson.loads(e[6:]) for e in sse.split(b"\n\n") if e.startswith(b"data: {")]
        assert {e["id"] for e in events} == {"chatcmpl-req-2"}
        assert {e["created"] for e in events} == {1_900_000_000}
        assert orjson.loads(body)["id"] == "chatcmpl-req-2" and orjson.loads(body)["created"] == 1_900_000_000
        assert b"chatcmpl-first" not in sse + body
    stored = b'{"id": "cmpl-x", "created": 5, "choices": [{"text": "cmpl-x"}]}'
    completion = Entry("whole", False, body=stored)
    told = completion.answering("r", 9).body
    assert orjson.loads(told) == {"id": "cmpl-r", "created": 9, "choices": [{"text": "cmpl-x"}]}


async def test_an_entry_of_another_shape_is_a_miss_never_an_error() -> None:
    """An incompatible gateway's entry in a shared Redis (members of other types) raised AttributeError
    out of the lookup, failing the request."""
    cache = ExactCache(MemoryStore(1 << 20), {"m": ModelCacheSpec(exact=True)})
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "q"}], "temperature": 0})
    found = await cache.lookup("t", "m", CHAT, raw, None)
    assert found is not None
    odd: list[dict[str, Any]] = [
        {"kind": "stream", "chat": True, "events": [1], "body": "", "usage": None},
        {"kind": "whole", "chat": True, "events": [], "body": 7, "usage": None},
        {"kind": "stream", "chat": "yes", "events": ["data: {}"], "body": "", "usage": None},
        {"kind": "whole", "chat": True, "events": [], "body": "", "usage": USAGE, "vector": 3},
    ]
    for value in odd:
        await cache.store.put(found.key, orjson.dumps(value), 60)
        again = await cache.lookup("t", "m", CHAT, raw, None)
        assert again is not None and again.hit is None


def test_a_stream_past_max_entry_bytes_stops_being_collected() -> None:
    written = Collected(100)
    written.append(b"x" * 60)
    assert not written.over and written == [b"x" * 60]
    written.append(b"y" * 60)
    written.append(b"data: [DONE]\n\n")
    assert written.over and written == []  # dropped, and nothing more taken: never kept
    assert CacheSettings().max_entry_bytes == MAX_ENTRY_BYTES == 1024 * 1024
    assert CacheSettings(max_entry_bytes=4096).max_entry_bytes == 4096
    with pytest.raises(ValidationError):
        CacheSettings(max_entry_bytes=0)


async def test_an_answer_past_max_entry_bytes_is_not_kept_nor_parsed() -> None:
    cache = ExactCache(MemoryStore(1 << 24), {"m": ModelCacheSpec(exact=True)}, max_entry_bytes=2048)
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "q"}], "temperature": 0})
    found = await cache.lookup("t", "m", CHAT, raw, None)
    assert found is not None
    big = _whole("stop", padding="p" * 4096)
    cache.keep_whole(found, big, True)
    written = cache.collector()
    for part in _stream("stop", {"padding": "p" * 4096}):
        written.append(part)
    cache.keep_stream(found, written, True, USAGE)
    cache.keep_stream(found, _stream("stop", {"padding": "p" * 4096}), True, USAGE)  # (a plain list too)
    await cache.flush()
    assert cache.store.stats()["entries"] == 0
    cache.keep_whole(found, _whole("stop"), True)
    await cache.flush()
    assert cache.store.stats()["entries"] == 1
    # a stored value far larger than any this gateway keeps (another's, before the bound): a miss
    await cache.store.put(found.key, Entry("whole", True, body=big * 20, usage=USAGE).encode(), 60)
    again = await cache.lookup("t", "m", CHAT, raw, None)
    assert again is not None and again.hit is None


@dataclass
class VllmLike:
    """Answers chat requests as vLLM does: its id `chatcmpl-<X-Request-Id>`, `finish` as the finish reason,
    `size` bytes of text; a stream with a usage chunk when asked."""

    finish: str = "stop"
    size: int = 8
    calls: int = 0
    runner: web.AppRunner | None = None
    url: str = ""
    seen: list[str] = field(default_factory=list)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post(CHAT, self.chat)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls += 1
        head = {
            "id": f"chatcmpl-{request.headers.get('X-Request-Id')}",
            "object": "chat.completion.chunk",
            "created": int(time.time()) - 100,
            "model": "m",
        }
        text = "w" * self.size
        if not body.get("stream"):
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "finish_reason": self.finish}
            answer = {**head, "object": "chat.completion", "choices": [choice], "usage": USAGE}
            return web.json_response(answer)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for start in range(0, len(text), 4096):
            part = {"index": 0, "delta": {"content": text[start : start + 4096]}, "finish_reason": None}
            await response.write(_event({**head, "choices": [part]}))
        end = {"index": 0, "delta": {}, "finish_reason": self.finish}
        await response.write(_event({**head, "choices": [end]}))
        await response.write(_event({**head, "choices": [], "usage": USAGE}))
        await response.write(b"data: [DONE]\n\n")
        return response


@pytest.fixture
async def engine() -> AsyncIterator[VllmLike]:
    engine = VllmLike()
    await engine.start()
    yield engine
    assert engine.runner is not None
    await engine.runner.cleanup()


async def _gateway(engine: VllmLike, tmp_path: Path) -> tuple[str, GatewayServer, GatewayParts]:
    replicas = ReplicaSet()
    replicas.add(Replica(id="m-0", model="m", engine="vllm", url=engine.url, state=ReplicaState.READY))
    return await start_closed_gateway(
        replicas,
        f"sqlite:///{tmp_path / f'{uuid.uuid4().hex}.db'}",
        ADMIN,
        cache=CacheSettings(max_entry_bytes=64 * 1024),  # (the spec's setting: 1 MiB by default)
        cache_policies={"m": ModelCacheSpec(exact=True)},
    )


async def _post(url: str, key: str, body: dict[str, Any]) -> tuple[str | None, bytes, str | None]:
    """(x-corral-cache, the body, x-request-id)."""
    async with aiohttp.ClientSession() as session:
        async with session.post(url + CHAT, json=body, headers={"Authorization": f"Bearer {key}"}) as got:
            assert got.status == 200, await got.text()
            return got.headers.get("x-corral-cache"), await got.read(), got.headers.get("x-request-id")


async def test_through_a_gateway_cut_answers_huge_ones_and_hit_ids(engine: VllmLike, tmp_path: Path) -> None:
    url, server, parts = await _gateway(engine, tmp_path)
    cache = parts.cache
    assert cache is not None
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(
                url + "/admin/keys", json={"tenant": "acme"}, headers={"Authorization": f"Bearer {ADMIN}"}
            ) as got:
                key = str((await got.json())["key"])
        ask = {"model": "m", "messages": [{"role": "user", "content": "essay"}], "temperature": 0}
        for stream in (True, False):  # an aborted answer: the next ask goes to the engine again
            engine.finish = "abort"
            body = {**ask, "stream": stream, "max_tokens": 100 + stream}
            assert (await _post(url, key, body))[0] == "miss"
            await cache.flush()
            engine.finish = "stop"
            assert (await _post(url, key, body))[0] == "miss"
            await cache.flush()
        assert engine.calls == 4
        # a stream past cache.max_entry_bytes (64 KiB here) is served, not kept
        engine.size = 100 * 1024
        huge = {**ask, "messages": [{"role": "user", "content": "huge"}], "stream": True}
        assert (await _post(url, key, huge))[0] == "miss"
        await cache.flush()
        assert (await _post(url, key, huge))[0] == "miss" and engine.calls == 6
        # hits: their own ids (this request's x-request-id) and times
        for stream in (False, True):
            state, data, request_id = await _post(url, key, {**ask, "stream": stream, "max_tokens": 100})
            assert state == "hit" and request_id
            text = data if not stream else data.split(b"\n\n")[0].removeprefix(b"data: ")
            answer = orjson.loads(text)
            assert answer["id"] == f"chatcmpl-{request_id}"
            assert abs(answer["created"] - time.time()) < 5
        assert engine.calls == 6
    finally:
        await server.stop()
