"""Mid-stream failover against scripted engines: when it applies, how the two halves become one stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import orjson
import pytest

from corral.config import GatewaySettings
from corral.engines import EngineFeatures
from corral.engines.load import EngineLoad
from corral.gateway import GatewayServer
from corral.gateway.failover import Continuation, Sent, Transcript
from corral.protocol import events
from corral.routing import Replica, ReplicaSet, ReplicaState, Router

from .conftest import ScriptedUpstream, make_services

MESSAGES = [{"role": "user", "content": "hi"}]
LLAMA = EngineFeatures(multiple_choices=False, prompt_lists=False, echo=False, prefill_echo=True)


@pytest.fixture
async def engines() -> AsyncIterator[tuple[ScriptedUpstream, ScriptedUpstream]]:
    cutting, whole = ScriptedUpstream(mode="cut", chunks=6), ScriptedUpstream(chunks=6, echo_prefill=True)
    await cutting.start()
    await whole.start()
    yield cutting, whole
    await cutting.stop()
    await whole.stop()


async def _client(
    tmp_path: Path,
    engines: tuple[ScriptedUpstream, ScriptedUpstream],
    mode: str,
    settings: GatewaySettings | None = None,
) -> tuple:
    replicas = ReplicaSet(["m"])
    for i, engine in enumerate(engines):  # round robin: the first stream starts on the cutting engine
        replicas.add(Replica(f"m-{i}", "m", "x", url=engine.url, state=ReplicaState.READY, features=LLAMA))
    services = make_services(replicas, tmp_path / "c.db", failover_modes={"m": mode})
    router = Router(replicas, default_policy="round_robin")
    server = GatewayServer(settings or GatewaySettings(port=0), router, services)
    await server.start()
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
    return server, client, replicas


async def _read(client: openai.AsyncOpenAI, temperature: float) -> tuple[str, list, object]:
    stream = await client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        temperature=temperature,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finishes, usage, ids = "", [], None, set()
    async for chunk in stream:
        ids.add(chunk.id)
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
        usage = chunk.usage or usage
    assert len(ids) == 1  # one stream id throughout
    return text, finishes, usage


@pytest.mark.parametrize(("mode", "temperature"), [("deterministic", 0.0), ("always", 0.7)])
async def test_a_cut_stream_continues_on_another_replica_as_one_stream(
    tmp_path: Path, engines: tuple[ScriptedUpstream, ScriptedUpstream], mode: str, temperature: float
) -> None:
    server, client, _ = await _client(tmp_path, engines, mode)
    try:
        text, finishes, usage = await _read(client, temperature)
        assert text == "tok0 tok1 tok2 tok3 tok4 tok5 "  # no repeated or missing text
        assert finishes == ["stop"]
        assert usage is not None and usage.completion_tokens == 6  # 2 sent before the cut + 4 after
        continuation = engines[1].bodies[-1]
        assert continuation["messages"][-1] == {"role": "assistant", "content": "tok0 tok1 "}
        assert continuation["continue_final_message"] is True
    finally:
        await server.stop()


@pytest.mark.parametrize(("mode", "temperature"), [("deterministic", 0.7), ("never", 0.0)])
async def test_otherwise_a_cut_stream_ends_with_an_error_event(
    tmp_path: Path, engines: tuple[ScriptedUpstream, ScriptedUpstream], mode: str, temperature: float
) -> None:
    server, client, _ = await _client(tmp_path, engines, mode)
    try:
        with pytest.raises(openai.APIError, match="cut short"):
            await _read(client, temperature)
        assert len(engines[1].bodies) == 0
    finally:
        await server.stop()


async def test_a_stream_silent_for_the_stall_timeout_continues_elsewhere(
    tmp_path: Path, engines: tuple[ScriptedUpstream, ScriptedUpstream]
) -> None:
    """The stall watch: one timer per stream, moved on while tokens come (gaps of 0.2 s under a 0.6 s
    stall timeout never cut a stream), ending it when the replica goes silent (then it goes on elsewhere)."""
    engines[0].mode = "stall"
    engines[1].gap = 0.2
    settings = GatewaySettings(port=0, stall_timeout=0.6)
    server, client, _ = await _client(tmp_path, engines, "deterministic", settings)
    try:
        started = time.monotonic()
        text, finishes, _ = await _read(client, 0.0)  # starts on the stalling engine, ends on the other
        assert text == "tok0 tok1 tok2 tok3 tok4 tok5 "
        assert finishes == ["stop"]
        assert time.monotonic() - started >= 0.6
        for _ in range(50):  # the silent replica's stream is let go
            if engines[0].cancelled:
                break
            await asyncio.sleep(0.02)
        assert engines[0].cancelled == 1
        engines[0].mode, engines[0].gap = "ok", 0.2
        sent = len(engines[0].bodies) + len(engines[1].bodies)
        text, finishes, _ = await _read(client, 0.0)  # 6 gaps of 0.2 s, on either engine: none cut
        assert text == "tok0 tok1 tok2 tok3 tok4 tok5 " and finishes == ["stop"]
        assert len(engines[0].bodies) + len(engines[1].bodies) == sent + 1  # nothing failed over
    finally:
        await server.stop()


@pytest.mark.parametrize(
    ("mode", "stall_timeout"),
    [("dribble", 0.6), ("flood", 120.0)],  # (flood: not the stall watch, bytes come all the time)
)
async def test_a_replica_sending_bytes_that_end_no_event_is_left_for_another(
    tmp_path: Path,
    engines: tuple[ScriptedUpstream, ScriptedUpstream],
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    stall_timeout: float,
) -> None:
    """dribble: a byte every 0.1 s and never an event's end; each read moved the stall timer on (and
    read_timeout counts any byte), so the stream hung as long as the replica dribbled: only an event moves
    it on now. flood: 64 KB writes that never end an event; the gateway kept all of it (and searched all
    of it again on each read) for as long as the replica wrote: past MAX_EVENT_BYTES (1 MB here) the
    stream goes on elsewhere."""
    monkeypatch.setattr(events, "MAX_EVENT_BYTES", 1024 * 1024)
    engines[0].mode = mode
    settings = GatewaySettings(port=0, stall_timeout=stall_timeout)
    server, client, _ = await _client(tmp_path, engines, "deterministic", settings)
    try:
        text, finishes, _ = await asyncio.wait_for(_read(client, 0.0), 10)
        assert text == "tok0 tok1 tok2 tok3 tok4 tok5 " and finishes == ["stop"]
        assert len(engines[1].bodies) == 1  # it went on elsewhere
    finally:
        await server.stop()


def _event(chunk: dict) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def test_continuation_events_read_as_the_original_stream() -> None:
    transcript = Transcript()
    transcript.add(
        _event({"id": "orig", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    )
    transcript.add(_event({"id": "orig", "choices": [{"index": 0, "delta": {"content": "Hello"}}]}))
    transcript.add(_event({"id": "orig", "choices": [{"index": 0, "delta": {"content": " wor"}}]}))
    sent = transcript.summary()
    assert sent == Sent("orig", ("Hello", " wor"), False)
    rewrite = Continuation(sent, keep_usage=True, echoed=True)
    upstream = b"".join(
        [
            _event({"id": "new", "choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]}),
            _event({"id": "new", "choices": [{"index": 0, "delta": {"content": "Hello wor"}}]}),
            _event({"id": "new", "choices": [{"index": 0, "delta": {"content": "ld"}}]}),
            _event({"id": "new", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
            _event({"id": "new", "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 1}}),
            b"data: [DONE]\n\n",
        ]
    )
    out = rewrite.feed(upstream[:50]) + rewrite.feed(upstream[50:])  # split mid-event on purpose
    events = [orjson.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]
    assert [e["id"] for e in events] == ["orig"] * 3
    assert [c["delta"].get("content") for e in events for c in e["choices"]] == ["ld", None]
    assert events[-1]["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    assert rewrite.done and out.endswith(b"data: [DONE]\n\n")


async def test_the_replica_that_failed_mid_stream_is_told_to_its_breaker(
    tmp_path: Path, engines: tuple[ScriptedUpstream, ScriptedUpstream]
) -> None:
    server, client, replicas = await _client(tmp_path, engines, "deterministic")
    try:
        await _read(client, 0.0)
    finally:
        await server.stop()
    assert [r.breaker.consecutive_failures for r in replicas] == [1, 0]


def test_streams_with_tools_or_echo_are_not_failed_over() -> None:
    from corral.gateway.failover import can_fail_over
    from corral.protocol import ChatCompletionRequest, CompletionRequest

    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    chat = ChatCompletionRequest(model="m", messages=MESSAGES, stream=True, temperature=0, tools=tools)
    echo = CompletionRequest(model="m", prompt="p", stream=True, temperature=0, echo=True)
    plain = CompletionRequest(model="m", prompt="p", stream=True, temperature=0)
    assert not can_fail_over(chat, "always", True) and not can_fail_over(echo, "always", True)
    assert can_fail_over(plain, "deterministic", True)


async def test_a_failed_over_stream_leaves_no_mark_on_the_replica_that_cut_it(
    tmp_path: Path, engines: tuple[ScriptedUpstream, ScriptedUpstream]
) -> None:
    """The continuation is routed on a record of its own: the cut replica's (its prefix blocks marked in
    use, its slots, an adapter's residence) is released as it was taken, where the continuation's
    overwrote it and left the first replica's blocks marked in use for good."""
    replicas = ReplicaSet(["m"])
    for i, engine in enumerate(engines):
        replica = Replica(f"m-{i}", "m", "x", url=engine.url, state=ReplicaState.READY, features=LLAMA)
        replica.load = EngineLoad(0, 0, kv_cached_tokens=0)  # (its KV events followed: ends are marked)
        replicas.add(replica)
    services = make_services(replicas, tmp_path / "c.db", failover_modes={"m": "deterministic"})
    router = Router(replicas, default_policy="prefix_affinity")
    server = GatewayServer(GatewaySettings(port=0), router, services)
    await server.start()
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
    long = [{"role": "user", "content": "tell me about the sea " * 200}]
    try:
        for engine in engines:  # the stream starts where its prompt is cached: on the cutting engine
            engine.mode = "ok"
        stream = await client.chat.completions.create(model="m", messages=long, stream=True)
        async for _ in stream:
            pass
        first = next(r for r in replicas if engines[0].bodies and r.url == engines[0].url)
        engines[0].mode = "cut"
        engines[1].mode = "ok"
        stream = await client.chat.completions.create(model="m", messages=long, temperature=0, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == "tok0 tok1 tok2 tok3 tok4 tok5 "
        assert len(engines[0].bodies) == 2 and len(engines[1].bodies) == 1  # (cut there, continued here)
        index = router.policy_for("m").index  # type: ignore[attr-defined]
        index.held()  # (what is pending applied)
        held = index._held[first.id]
        assert held and all(mark >= 0 for mark in held.values())  # ended: none still marked in use
        assert all(r.outstanding == 0 for r in replicas)
    finally:
        await server.stop()
