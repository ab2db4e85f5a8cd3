"""Mid-stream failover against scripted engines: when it applies, how the two halves become one stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from corral.config import GatewaySettings
from corral.engines import EngineFeatures
from corral.engines.load import EngineLoad
from corral.gateway import GatewayServer
from corral.gateway.failover import Continuation, Sent, Transcript
from corral.protocol import events
from corral.routing import Replica, ReplicaSet, ReplicaState, RetryBudget, Router
from corral.routing.adapters import Adapter, AdapterCatalogue

from .conftest import ScriptedUpstream, make_services
from .test_relay import usage_rows

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
    budget: RetryBudget | None = None,
) -> tuple:
    replicas = ReplicaSet(["m"])
    for i, engine in enumerate(engines):  # round robin: the first stream starts on the cutting engine
        replicas.add(Replica(f"m-{i}", "m", "x", url=engine.url, state=ReplicaState.READY, features=LLAMA))
    services = make_services(replicas, tmp_path / "c.db", failover_modes={"m": mode})
    router = Router(replicas, default_policy="round_robin")
    if budget is not None:
        router.retry_budget = budget
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
    rewrite = Continuation(sent, keep_usage=True)
    upstream = b"".join(
        [
            _event({"id": "new", "choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]}),
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


class _ChatEngine:
    """An engine on 127.0.0.1 answering chat completions with its `chat`."""

    url = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        raise NotImplementedError


class _Thinker(_ChatEngine):
    """An engine of a reasoning model (vLLM's reasoning parser: `reasoning_content` deltas, then `content`)
    that continues a chat's final assistant message (`continue_final_message`, or always as llama.cpp does,
    sending it back first when `echo` and not asked `continue_final_message`, as llama.cpp does): 4 deltas
    of reasoning "think{i} ", then 4 of content "ans{j} "; a continuation goes on from the "ans" tokens in
    that message (and sends `aside` first as reasoning, where set: a parser may read what follows a
    continued message as reasoning). It cuts every stream after `cut_after` deltas, where set, and refuses
    two assistant messages at the end (400), as llama.cpp does where it takes the last as a prefill."""

    def __init__(self, cut_after: int | None = None, echo: bool = False, aside: str = "") -> None:
        self.cut_after = cut_after
        self.echo = echo
        self.aside = aside
        self.bodies: list[dict] = []

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        messages = body["messages"]
        if len(messages) > 1 and messages[-1]["role"] == messages[-2]["role"] == "assistant":
            message = "Cannot have 2 or more assistant messages at the end of the list."
            return web.json_response({"error": {"message": message}}, status=400)
        continues = messages[-1]["role"] == "assistant" and (self.echo or body.get("continue_final_message"))
        continued = messages[-1]["content"] if continues else ""
        start = continued.count("ans")
        deltas = [{"reasoning_content": f"think{i} "} for i in range(4 if not continues else 0)]
        deltas += [{"reasoning_content": self.aside}] if continues and self.aside else []
        deltas += [{"content": f"ans{j} "} for j in range(start, 4)]
        if continues and self.echo and body.get("continue_final_message") is not True:
            # (llama.cpp sends the message back with its first token, unless asked to continue it)
            first = next(i for i, d in enumerate(deltas) if "content" in d)
            deltas[first] = {"content": continued + deltas[first]["content"]}
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i, delta in enumerate(deltas):
            if i == self.cut_after:
                assert request.transport is not None
                request.transport.close()
                return response
            await response.write(_event(_thought(delta)))
        await response.write(_event(_thought({}, "stop")))
        usage = {"prompt_tokens": 5 + start, "completion_tokens": len(deltas)}
        await response.write(_event({"id": "c", "choices": [], "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        return response


def _thought(delta: dict, finish: str | None = None) -> dict:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}


async def _thinking_gateway(
    tmp_path: Path, engines: list[_Thinker], features: EngineFeatures
) -> tuple[GatewayServer, str]:
    replicas = ReplicaSet(["m"])
    for i, engine in enumerate(engines):  # round robin: the first stream starts on engines[0]
        replicas.add(Replica(f"m-{i}", "m", "x", url=engine.url, state=ReplicaState.READY, features=features))
    services = make_services(replicas, tmp_path / "c.db")
    server = GatewayServer(GatewaySettings(port=0), Router(replicas, default_policy="round_robin"), services)
    await server.start()
    return server, f"http://127.0.0.1:{server.port}/v1/chat/completions"


async def _read_raw(url: str, body: dict) -> tuple[str, str, dict | None, bytes]:
    """The stream's reasoning, content and usage as a client reads them, and its bytes."""
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as answer:
        raw = await answer.read()
    reasoning, content, usage = "", "", None
    for event in raw.split(b"\n\n"):
        if event.startswith(b"data: {"):
            chunk = orjson.loads(event[6:])
            for choice in chunk.get("choices") or []:
                reasoning += choice["delta"].get("reasoning_content") or ""
                content += choice["delta"].get("content") or ""
            usage = chunk.get("usage") or usage
    return reasoning, content, usage, raw


def _thinking_body(messages: list[dict] | None = None, **extra: object) -> dict:
    return {
        "model": "m",
        "messages": messages or MESSAGES,
        "stream": True,
        "temperature": 0,
        "max_tokens": 20,
        "stream_options": {"include_usage": True},
        **extra,
    }


@pytest.fixture
async def thinkers() -> AsyncIterator[list[_Thinker]]:
    """A reasoning engine that cuts its streams after 6 deltas (4 of reasoning, then "ans0 ans1 "), and one
    that does not, sending its continuation's first token as reasoning."""
    engines = [_Thinker(cut_after=6), _Thinker(aside="(aside) ")]
    for engine in engines:
        await engine.start()
    yield engines
    for engine in engines:
        await engine.stop()


async def test_a_reasoning_stream_continued_after_its_reasoning_counts_the_reasoning_sent(
    tmp_path: Path, thinkers: list[_Thinker]
) -> None:
    """The transcript kept only content: a continuation's max_tokens was not reduced by the reasoning
    tokens sent, those tokens were never charged (usage counted only the content sent), and every reasoning
    delta of the continuation was dropped. Now reasoning events count as tokens sent, and the new replica's
    reasoning is passed on."""
    server, url = await _thinking_gateway(tmp_path, thinkers, EngineFeatures())
    try:
        reasoning, content, usage, _ = await _read_raw(url, _thinking_body())
    finally:
        await server.stop()
    (continuation,) = thinkers[1].bodies
    assert continuation["messages"][-1] == {"role": "assistant", "content": "ans0 ans1 "}
    assert continuation["max_tokens"] == 20 - 6  # 4 tokens of reasoning and 2 of content sent
    # the continuation's prompt (5 + the 2 content tokens) less the content sent; 6 sent + its 3
    assert usage == {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}
    assert content == "ans0 ans1 ans2 ans3 "
    assert reasoning == "think0 think1 think2 think3 (aside) "


async def test_a_stream_cut_in_its_reasoning_ends_truncated(tmp_path: Path, thinkers: list[_Thinker]) -> None:
    """Cut in its reasoning, a stream was continued from an empty assistant message: the new replica began
    its reasoning again, and the client read it twice. No engine is asked to continue reasoning: the stream
    ends with `stream_truncated`, as one that cannot fail over."""
    thinkers[0].cut_after = 2
    server, url = await _thinking_gateway(tmp_path, thinkers, EngineFeatures())
    try:
        reasoning, content, _, raw = await _read_raw(url, _thinking_body())
    finally:
        await server.stop()
    assert (reasoning, content) == ("think0 think1 ", "")
    assert b"stream_truncated" in raw and not raw.endswith(b"data: [DONE]\n\n")
    assert thinkers[1].bodies == []


@pytest.mark.parametrize(
    ("echo", "asked"),
    [(True, False), (True, True), (False, True)],
    ids=["llamacpp", "llamacpp-asked", "vllm"],
)
async def test_a_continued_prefill_is_extended_not_followed_by_a_second_assistant_message(
    tmp_path: Path, echo: bool, asked: bool
) -> None:
    """The client ends its chat with an assistant message of its own (a prefill), which the engine
    continues: llama.cpp always (and sends it back first unless asked `continue_final_message`), vLLM when
    asked. The continuation added the text sent as a second assistant message, which engines read as two
    turns (the prefill closed as one of its own) or refuse (llama.cpp taking the last as its prefill: 400,
    as this engine does, and the stream was cut short). It now extends the client's message. Asked, as the
    Messages dialect asks for a prefill, llama.cpp sends nothing back: the text sent lacks the prefill (the
    continuation appended a second message there, and llama.cpp refused it)."""
    engines = [_Thinker(cut_after=2, echo=echo), _Thinker(echo=echo)]
    for engine in engines:
        await engine.start()
    prefill = [*MESSAGES, {"role": "assistant", "content": "Sure: "}]
    extra = {"continue_final_message": True, "add_generation_prompt": False} if asked else {}
    features = LLAMA if echo else EngineFeatures()
    server, url = await _thinking_gateway(tmp_path, engines, features)
    try:
        _, content, _, raw = await _read_raw(url, _thinking_body(prefill, **extra))
    finally:
        await server.stop()
        for engine in engines:
            await engine.stop()
    assert b"stream_truncated" not in raw
    # (llama.cpp sends the prefill back, on the first replica as on any other: the client reads it there)
    assert content == ("Sure: " if echo and not asked else "") + "ans0 ans1 ans2 ans3 "
    (continuation,) = engines[1].bodies
    assert continuation["messages"] == [*MESSAGES, {"role": "assistant", "content": "Sure: ans0 ans1 "}]


async def test_an_adapters_continued_stream_names_the_adapter(
    tmp_path: Path, engines: tuple[ScriptedUpstream, ScriptedUpstream]
) -> None:
    """The first replica's events are renamed to the adapter the client asked for (the engine names its
    base, or the adapter's revision); a continuation's were not: the stream changed model midway."""
    adapter = Adapter("ad", "m", "ad@1", "/adapters/ad")
    replicas = ReplicaSet(["m"])
    for i, engine in enumerate(engines):
        replica = Replica(f"m-{i}", "m", "x", url=engine.url, state=ReplicaState.READY, features=LLAMA)
        replica.adapters = ("ad",)  # (started with it, as llama.cpp's are)
        replicas.add(replica)
    parts = replace(make_services(replicas, tmp_path / "c.db"), adapters=AdapterCatalogue([adapter]))
    server = GatewayServer(GatewaySettings(port=0), Router(replicas, default_policy="round_robin"), parts)
    await server.start()
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model="ad", messages=MESSAGES, temperature=0, stream=True
        )
        chunks = [chunk async for chunk in stream]
    finally:
        await server.stop()
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == "tok0 tok1 tok2 tok3 tok4 tok5 "
    )
    assert len(engines[1].bodies) == 1  # (continued there)
    assert {c.model for c in chunks} == {"ad"}


async def test_a_continuation_spends_the_retry_budget(
    tmp_path: Path, engines: tuple[ScriptedUpstream, ScriptedUpstream]
) -> None:
    """A continuation is a retry on another replica: with the retry budget spent, the stream is cut short
    (a fleet whose streams all fail over would otherwise double its load, unbounded)."""
    spent = RetryBudget(ratio=0, floor_per_s=0, cap=0)
    server, client, _ = await _client(tmp_path, engines, "deterministic", budget=spent)
    try:
        with pytest.raises(openai.APIError, match="retry budget exhausted"):
            await _read(client, 0.0)
        assert engines[1].bodies == []
    finally:
        await server.stop()


async def test_a_continuation_the_engine_refuses_is_no_failure_of_its_replica(
    tmp_path: Path, engines: tuple[ScriptedUpstream, ScriptedUpstream]
) -> None:
    """A continuation answered with a 4xx (the request's refusal: a context too long for the text so far)
    counted against the replica's breaker as if it had failed."""
    engines[1].mode = "answer"
    engines[1].answer = (400, "application/json", b'{"error": {"message": "context length exceeded"}}')
    server, client, replicas = await _client(tmp_path, engines, "deterministic")
    try:
        with pytest.raises(openai.APIError, match="refused with 400"):
            await _read(client, 0.0)
    finally:
        await server.stop()
    assert len(engines[1].bodies) == 1
    assert [r.breaker.consecutive_failures for r in replicas] == [1, 0]
    assert [r.failures for r in replicas] == [1, 0]


class _Completer:
    """llama.cpp's completions with its tokenizer endpoints, on a toy vocabulary (each string it is given
    to tokenize is one token; `/tokenize` takes a list of strings, each tokenized on its own, as
    llama.cpp's does): "tok{i} " up to tok5, continued from the token ids a prompt list ends with; it cuts
    its streams after `cut_after` tokens, where set."""

    def __init__(self, cut_after: int | None = None) -> None:
        self.cut_after = cut_after
        self.prompts: list[object] = []
        self.tokenized: list[object] = []  # what each /tokenize request asked
        self.words: list[str] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    def _id(self, word: str) -> int:
        if word not in self.words:
            self.words.append(word)
        return self.words.index(word)

    async def tokenize(self, request: web.Request) -> web.Response:
        content = (await request.json())["content"]
        self.tokenized.append(content)
        strings = content if isinstance(content, list) else [content]
        return web.json_response({"tokens": [self._id(s) for s in strings]})

    async def detokenize(self, request: web.Request) -> web.Response:
        tokens = (await request.json())["tokens"]
        return web.json_response({"content": "".join(self.words[t] for t in tokens)})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        prompt = (await request.json())["prompt"]
        self.prompts.append(prompt)
        start = len(prompt) - 1 if isinstance(prompt, list) else 0
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(start, 6):
            if i == self.cut_after:
                assert request.transport is not None
                request.transport.close()
                return response
            choice = {"index": 0, "text": f"tok{i} ", "finish_reason": None}
            await response.write(_event({"id": "c", "object": "text_completion", "choices": [choice]}))
        choice = {"index": 0, "text": "", "finish_reason": "stop"}
        await response.write(_event({"id": "c", "object": "text_completion", "choices": [choice]}))
        await response.write(b"data: [DONE]\n\n")
        return response


async def test_a_completion_continues_from_its_token_ids_asked_in_one_request(tmp_path: Path) -> None:
    """A completion failed over on llama.cpp continues from the exact token ids generated, which the new
    replica's tokenizer gives: one `/tokenize` request per token sent, in turn, before the continuation
    could start. One request now tokenizes every piece (each on its own, as before)."""
    engines = [_Completer(cut_after=3), _Completer()]
    for engine in engines:
        await engine.start()
    features = replace(LLAMA, token_prompts=True)
    replicas = ReplicaSet(["m"])
    for i, engine in enumerate(engines):
        replicas.add(Replica(f"m-{i}", "m", "x", url=engine.url, state=ReplicaState.READY, features=features))
    server = GatewayServer(
        GatewaySettings(port=0),
        Router(replicas, default_policy="round_robin"),
        make_services(replicas, tmp_path / "c.db"),
    )
    await server.start()
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
    try:
        stream = await client.completions.create(model="m", prompt="Count:", temperature=0, stream=True)
        text = "".join([c.choices[0].text async for c in stream if c.choices])
    finally:
        await server.stop()
        for engine in engines:
            await engine.stop()
    assert text == "tok0 tok1 tok2 tok3 tok4 tok5 "
    assert engines[1].tokenized == [["tok0 ", "tok1 ", "tok2 "]]
    assert engines[1].prompts == [["Count:", 0, 1, 2]]


class _Counter(_ChatEngine):
    """An engine streaming "tok{i} " tokens (600 in all; a continuation goes on from the tokens in the
    continued message), a token every 5 ms, cutting each stream after `cut_after` of them."""

    def __init__(self, cut_after: int) -> None:
        self.cut_after = cut_after

    async def chat(self, request: web.Request) -> web.StreamResponse:
        messages = (await request.json())["messages"]
        start = messages[-1]["content"].count("tok") if messages[-1]["role"] == "assistant" else 0
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(start, 600):
            if i - start == self.cut_after:
                assert request.transport is not None
                request.transport.close()
                return response
            await response.write(_event(_thought({"content": f"tok{i} "})))
            await asyncio.sleep(0.005)
        await response.write(b"data: [DONE]\n\n")
        return response


async def test_a_continuation_cut_too_is_charged_the_events_it_sent(tmp_path: Path) -> None:
    """A stream cut after 200 tokens, continued on another replica that cuts it after 200 more, and no
    usage ever comes: it is charged the reads of both replicas' events (about 400), where it was charged
    the first replica's alone (200: then the 256-token estimate), what the continuation sent uncounted."""
    engines = [_Counter(cut_after=200), _Counter(cut_after=200)]
    for engine in engines:
        await engine.start()
    server, url = await _thinking_gateway(tmp_path, engines, EngineFeatures())  # type: ignore[arg-type]
    try:
        body = {"model": "m", "messages": MESSAGES, "stream": True, "temperature": 0}
        _, content, usage, raw = await _read_raw(url, body)
    finally:
        await server.stop()
        for engine in engines:
            await engine.stop()
    assert content.count("tok") == 400 and usage is None and b"stream_truncated" in raw
    rows = await asyncio.to_thread(usage_rows, tmp_path / "c.db", "m")
    assert len(rows) == 1 and rows[0][2] > 300, rows  # (reads of events: a few may come two to a read)
