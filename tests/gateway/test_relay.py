"""The relay against scripted upstreams: retries, truncation, timeouts, disconnects, usage."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from corral.cluster import free_port
from corral.config import GatewaySettings
from corral.engines import EngineFeatures
from corral.engines.client import EngineClient
from corral.gateway import GatewayServer
from corral.gateway import relay as relay_module
from corral.gateway.relay import Relay, RelayTimeouts
from corral.protocol.usage import engine_usage, usage_of_answer
from corral.routing import Replica, ReplicaSet, ReplicaState, Router, RouteRequest

from .conftest import Gateway, ScriptedUpstream, make_services

MESSAGES = [{"role": "user", "content": "hi"}]


def client(gw: Gateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.base_url, api_key="none", max_retries=0, timeout=10)


async def test_non_streaming_answer_is_passed_through(gateway: Gateway, upstream: ScriptedUpstream) -> None:
    gateway.add_replica(upstream.url)
    reply = await client(gateway).chat.completions.create(model="m", messages=MESSAGES)
    assert reply.choices[0].message.content == "tok0 tok1 tok2 tok3"
    assert reply.usage is not None and reply.usage.completion_tokens == 4


async def test_stream_strips_usage_the_client_did_not_ask_for(
    gateway: Gateway, upstream: ScriptedUpstream
) -> None:
    gateway.add_replica(upstream.url)
    stream = await client(gateway).chat.completions.create(model="m", messages=MESSAGES, stream=True)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "tok0 tok1 tok2 tok3 "
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)  # no usage-only chunk
    assert upstream.bodies[-1]["stream_options"] == {"include_usage": True}  # asked upstream regardless


async def test_stream_keeps_usage_when_asked(gateway: Gateway, upstream: ScriptedUpstream) -> None:
    gateway.add_replica(upstream.url)
    stream = await client(gateway).chat.completions.create(
        model="m", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].choices == []


async def test_connect_failure_is_retried_on_another_replica(
    gateway: Gateway, upstream: ScriptedUpstream
) -> None:
    dead = gateway.add_replica(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    gateway.add_replica(upstream.url)
    for _ in range(4):  # whichever replica is picked first, every request succeeds
        reply = await client(gateway).chat.completions.create(model="m", messages=MESSAGES)
        assert reply.choices[0].message.content
    assert dead.outstanding == 0


@pytest.mark.parametrize("mode", ["fail503", "fail429", "drop", "cutwhole"])
async def test_failure_before_first_byte_is_retried(
    gateway: Gateway, upstream: ScriptedUpstream, mode: str
) -> None:
    bad = ScriptedUpstream(mode=mode)
    await bad.start()
    try:
        gateway.add_replica(bad.url)
        gateway.add_replica(upstream.url)
        for stream in (False, True, False, True):
            if stream:
                chunks = [
                    c
                    async for c in await client(gateway).chat.completions.create(
                        model="m", messages=MESSAGES, stream=True
                    )
                ]
                assert len(chunks) == 5
            else:
                reply = await client(gateway).chat.completions.create(model="m", messages=MESSAGES)
                assert reply.choices[0].message.content
        assert bad.bodies, "the failing replica was tried"
    finally:
        await bad.stop()


async def test_all_replicas_failing_gives_502(gateway: Gateway) -> None:
    bad, busy = ScriptedUpstream(mode="drop"), ScriptedUpstream(mode="fail503")
    for upstream in (bad, busy):
        await upstream.start()
        gateway.add_replica(upstream.url)
    try:
        with pytest.raises(openai.APIStatusError) as info:  # (one broken among the busy: broken)
            await client(gateway).chat.completions.create(model="m", messages=MESSAGES)
        assert info.value.status_code == 502
        assert "failed to answer" in info.value.message
        assert bad.bodies and busy.bodies
    finally:
        await bad.stop()
        await busy.stop()


@pytest.mark.parametrize(
    ("modes", "waits", "retry_after"),
    [
        (("fail429", "fail503"), ("7", None), "7"),  # the longest wait an engine asked
        (("fail429", "fail429"), ("3600", "soon"), "60"),  # within 60 s; a wait that is no number: 1 s
        (("fail503", "fail503"), (None, None), "1"),
    ],
)
async def test_replicas_all_busy_give_503_with_retry_after(
    gateway: Gateway, modes: tuple[str, str], waits: tuple[str | None, str | None], retry_after: str
) -> None:
    """Engines that say they are full (429: TGI at its max concurrent requests) or loading (503) are
    passed by; when every replica says so the client hears it is busy (503 and when to come back), not
    that the gateway broke (502), nor a 429 that would read as its own key's limit."""
    busy = [ScriptedUpstream(mode=mode, retry_after=wait) for mode, wait in zip(modes, waits, strict=True)]
    for upstream in busy:
        await upstream.start()
        gateway.add_replica(upstream.url)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(
                gateway.base_url + "/chat/completions", json={"model": "m", "messages": MESSAGES}
            ) as response:
                body = await response.json()
                assert response.status == 503, body
                assert body["error"]["code"] == "replicas_busy"
                assert response.headers["Retry-After"] == retry_after
        assert all(upstream.bodies for upstream in busy), "each busy replica was tried"
    finally:
        for upstream in busy:
            await upstream.stop()


async def test_a_full_replica_is_passed_by_without_opening_its_breaker(
    gateway: Gateway, upstream: ScriptedUpstream
) -> None:
    """A 429 says the engine is full, not broken: its breaker does not hear of it (under sustained load a
    full replica would otherwise leave routing, and its rollout's error ratio count load as failures).
    A 429 saying an upstream's quota is spent is no wait that passes: a failure, a 502."""
    full = ScriptedUpstream(mode="fail429")
    await full.start()
    try:
        replica = gateway.add_replica(full.url)
        gateway.add_replica(upstream.url)
        for _ in range(12):
            reply = await client(gateway).chat.completions.create(model="m", messages=MESSAGES)
            assert reply.choices[0].message.content
        assert len(full.bodies) >= 3, "the full replica was tried"
        assert replica.failures == 0 and replica.breaker.consecutive_failures == 0
    finally:
        await full.stop()
    spent = ScriptedUpstream(mode="answer")
    spent.answer = (429, "application/json", b'{"error": {"message": "quota", "code": "insufficient_quota"}}')
    await spent.start()
    try:
        gateway.replicas.forget("m")
        gateway.add_replica(spent.url)
        with pytest.raises(openai.APIStatusError) as info:
            await client(gateway).chat.completions.create(model="m", messages=MESSAGES)
        assert info.value.status_code == 502
    finally:
        await spent.stop()


@pytest.mark.parametrize("quota_spent", [False, True])
async def test_the_gateway_s_own_calls_pass_a_busy_replica_by(
    upstream: ScriptedUpstream, quota_spent: bool
) -> None:
    """The semantic cache's embeddings (`Relay.call`) go to another replica when one says it is full (a
    429 is the engine's state, not the input's fault), or that its upstream's quota is spent (a failure of
    the replica's, which its breaker hears of)."""
    busy = ScriptedUpstream(mode="fail429")
    if quota_spent:
        busy.mode = "answer"
        busy.answer = (429, "application/json", b'{"error": {"message": "q", "code": "insufficient_quota"}}')
    await busy.start()
    replicas = ReplicaSet(["m"])
    for i, url in enumerate((busy.url, upstream.url)):
        replicas.add(Replica(id=f"m-{i}", model="m", engine="scripted", url=url, state=ReplicaState.READY))
    engines = EngineClient(connect_timeout=1.0, read_timeout=1.0, limit=8)
    try:
        async with aiohttp.ClientSession() as session:
            router = Router(replicas, default_policy="least_outstanding_requests")
            relay = Relay(engines, session, router, 1, RelayTimeouts(connect=1.0, read=1.0))
            body = orjson.dumps({"model": "m", "messages": MESSAGES})
            for _ in range(50):  # until the busy replica has been asked
                answer = await relay.call(RouteRequest(model="m", tokens=1), "/v1/chat/completions", body)
                assert orjson.loads(answer)["choices"]
                if busy.bodies:
                    break
        assert busy.bodies
        (refusing,) = [r for r in replicas.of("m") if r.url == busy.url]
        assert refusing.failures == (1 if quota_spent else 0)
    finally:
        engines.close()
        await busy.stop()


async def test_stream_cut_after_first_byte_ends_with_error_event(gateway: Gateway) -> None:
    cut = ScriptedUpstream(mode="cut")
    await cut.start()
    try:
        gateway.add_replica(cut.url)
        async with aiohttp.ClientSession() as session:
            async with session.post(
                gateway.base_url + "/chat/completions",
                json={"model": "m", "messages": MESSAGES, "stream": True},
            ) as resp:
                text = (await resp.read()).decode()
        assert "tok0" in text and "tok1" in text
        assert "[DONE]" not in text
        assert '"stream_truncated"' in text
        stream = await client(gateway).chat.completions.create(model="m", messages=MESSAGES, stream=True)
        with pytest.raises(openai.APIError, match="cut short"):
            async for _ in stream:
                pass
    finally:
        await cut.stop()


async def test_silent_upstream_gives_504(gateway: Gateway) -> None:
    hang = ScriptedUpstream(mode="hang")
    await hang.start()
    try:
        gateway.add_replica(hang.url)
        with pytest.raises(openai.APIStatusError) as info:
            await client(gateway).chat.completions.create(model="m", messages=MESSAGES)
        assert info.value.status_code == 504
        assert info.value.body["code"] == "upstream_timeout"
    finally:
        await hang.stop()


async def test_client_disconnect_cancels_upstream_request(gateway: Gateway) -> None:
    hang = ScriptedUpstream(mode="hang")
    await hang.start()
    gateway.server  # noqa: B018
    try:
        replica = gateway.add_replica(hang.url)
        async with aiohttp.ClientSession() as session:
            request = asyncio.create_task(
                session.post(
                    gateway.base_url + "/chat/completions", json={"model": "m", "messages": MESSAGES}
                )
            )
            for _ in range(50):
                await asyncio.sleep(0.02)
                if hang.bodies:
                    break
            request.cancel()
            await asyncio.gather(request, return_exceptions=True)
        for _ in range(50):
            await asyncio.sleep(0.02)
            if hang.cancelled:
                break
        assert hang.cancelled == 1
        assert replica.outstanding == 0
    finally:
        await hang.stop()


async def test_no_ready_replica_gives_503_with_retry_after(
    gateway: Gateway, upstream: ScriptedUpstream
) -> None:
    gateway.add_replica(upstream.url, state=ReplicaState.STARTING)
    async with aiohttp.ClientSession() as session:
        async with session.post(
            gateway.base_url + "/chat/completions", json={"model": "m", "messages": MESSAGES}
        ) as resp:
            body = await resp.json()
    assert resp.status == 503
    assert int(resp.headers["Retry-After"]) >= 1
    assert body["error"]["code"] == "no_ready_replica"
    assert upstream.bodies == []


async def test_admin_routing_view_shows_circuits_and_decisions(
    gateway: Gateway, upstream: ScriptedUpstream
) -> None:
    gateway.add_replica(upstream.url)
    await client(gateway).chat.completions.create(model="m", messages=MESSAGES)
    async with aiohttp.ClientSession() as session, session.get(gateway.url + "/admin/routing") as resp:
        view = await resp.json()
    assert view["policies"] == {"m": "least_outstanding_requests"}
    assert view["replicas"][0]["circuit"] == "closed"
    assert (
        view["decisions"][-1]["replica"] == "m-0" and view["decisions"][-1]["policy"] == view["policies"]["m"]
    )


@pytest.mark.parametrize(
    "body",
    [
        b'{"id":"c","choices":[{"message":{"content":"x"}}],"usage":{"prompt_tokens":9,"total_tokens":73}}',
        b'{"choices":[],"usage":{"prompt_tokens":1,"prompt_tokens_details":{"cached_tokens":0}} }\n',
        b'{"usage":{"prompt_tokens":2},"choices":[]}',  # not last: the whole body is parsed
        b'{"a":{"b":1,"usage":{"x":1}}}',  # nested, not the answer's: none
        b'{"object":"usage"}',
        b'{"usage":null}',
        b'{"c":"\\"usage\\":{\\"a\\":1}"}',  # inside a string
        b'{"c":"\\\\","usage":{"a":1}}',  # after an escaped backslash
        b"not json",
        b"[1]",
    ],
)
def test_usage_is_read_from_the_answer_s_last_member_as_from_the_whole_answer(body: bytes) -> None:
    """The fast path (only the trailing usage slice parsed) finds what parsing the whole answer finds, its
    counts checked (engine_usage)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = None
    usage = data.get("usage") if isinstance(data, dict) else None
    assert usage_of_answer(body) == engine_usage(usage)


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "stream": True, "messages": MESSAGES},
        {"model": "m", "stream": True, "messages": [{"role": "user", "content": 'say "stream_options"'}]},
        {"model": "m", "stream": True, "stream_options": None, "messages": MESSAGES},
        {"model": "m", "stream": True, "stream_options": {"include_usage": False}, "messages": MESSAGES},
    ],
)
def test_the_engine_is_asked_for_usage_whatever_the_body_says_of_it(body: dict) -> None:
    from corral.gateway.intake import _with_usage

    raw = orjson.dumps(body) + b" \n"
    asked = orjson.loads(_with_usage(raw))
    assert asked == {**body, "stream_options": {"include_usage": True}}


async def test_a_whole_answer_past_the_bound_is_a_502_and_no_fault_of_the_replica(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-streamed answer was read whole with no bound: a tenant's n=128 request with logprobs could make
    the gateway hold hundreds of megabytes (several times over). Past MAX_ANSWER_BYTES (1 MiB here) it is a
    502 `answer_too_large`, not retried and not counted against the replica (the request asked for it). An
    embedding answer, bounded by its request's inputs, is read whole whatever its size."""
    monkeypatch.setattr(relay_module, "MAX_ANSWER_BYTES", 1024 * 1024)
    vector = [0.0123456789] * 1024
    big = "x" * (2 * 1024 * 1024)

    async def chat(request: web.Request) -> web.Response:
        message = {"role": "assistant", "content": big}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        return web.json_response(
            {"id": "c", "object": "chat.completion", "choices": [choice], "usage": usage}
        )

    async def embeddings(request: web.Request) -> web.Response:
        inputs = (await request.json())["input"]
        data = [{"object": "embedding", "index": i, "embedding": vector} for i in range(len(inputs))]
        usage = {"prompt_tokens": len(inputs), "total_tokens": len(inputs)}
        return web.json_response({"object": "list", "data": data, "model": "e", "usage": usage})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/embeddings", embeddings)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    replicas = ReplicaSet(["m", "e"])
    m = Replica("m-0", "m", "x", url=url, state=ReplicaState.READY)
    replicas.add(m)
    replicas.add(
        Replica("e-0", "e", "x", url=url, state=ReplicaState.READY, features=EngineFeatures(embeddings=True))
    )
    server = GatewayServer(
        GatewaySettings(port=0), Router(replicas), make_services(replicas, tmp_path / "c.db")
    )
    await server.start()
    base = f"http://127.0.0.1:{server.port}/v1"
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(
                base + "/chat/completions", json={"model": "m", "messages": MESSAGES}
            ) as r:
                assert r.status == 502
                assert (await r.json())["error"]["code"] == "answer_too_large"
            texts = [f"text {i}" for i in range(128)]  # 128 vectors of 1,024 floats: 1.7 MB of JSON
            async with session.post(base + "/embeddings", json={"model": "e", "input": texts}) as r:
                assert r.status == 200
                assert len((await r.json())["data"]) == 128
    finally:
        await server.stop()
        await runner.cleanup()
    assert (m.failures, m.breaker.consecutive_failures, m.served) == (0, 0, 1)
    # the engine made all of the answer: charged its reservation (the 256-token estimate here), not refunded
    rows = await asyncio.to_thread(usage_rows, tmp_path / "c.db", "m")
    assert [(status, output) for status, _, output in rows] == [(502, 256)], rows


def usage_rows(store: Path, model: str) -> list[tuple[int, int, int]]:
    """(status, input tokens, output tokens) of `model`'s usage rows in the SQLite store."""
    with sqlite3.connect(store) as db:
        query = "SELECT status, input_tokens, output_tokens FROM corral_usage WHERE model = ? ORDER BY id"
        return [(int(a), int(b), int(c)) for a, b, c in db.execute(query, (model,)).fetchall()]


async def test_a_fanned_out_requests_parts_share_one_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine without native choices: `n: 16` is sixteen one-choice requests, each answer held whole
    until all are merged. Each part takes its share of MAX_ANSWER_BYTES (1 MiB here), not the whole of it
    (sixteen parts of 900 KB were all held: 14 MB past a 1 MiB bound); the parts' answers are charged."""
    monkeypatch.setattr(relay_module, "MAX_ANSWER_BYTES", 1024 * 1024)
    part = "x" * (100 * 1024)

    async def chat(request: web.Request) -> web.Response:
        choice = {"index": 0, "message": {"role": "assistant", "content": part}, "finish_reason": "stop"}
        usage = {"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6}
        return web.json_response(
            {"id": "c", "object": "chat.completion", "choices": [choice], "usage": usage}
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    replicas = ReplicaSet(["m"])
    one_choice = EngineFeatures(multiple_choices=False)
    replicas.add(Replica("m-0", "m", "x", url=url, state=ReplicaState.READY, features=one_choice))
    server = GatewayServer(
        GatewaySettings(port=0), Router(replicas), make_services(replicas, tmp_path / "c.db")
    )
    await server.start()
    try:
        async with aiohttp.ClientSession() as session:
            for n, status in ((8, 200), (16, 502)):  # (8 × 100 KB within 1 MiB; 16 parts: 64 KiB each)
                body = {"model": "m", "n": n, "messages": MESSAGES}
                async with session.post(
                    f"http://127.0.0.1:{server.port}/v1/chat/completions", json=body
                ) as r:
                    assert r.status == status, await r.text()
    finally:
        await server.stop()
        await runner.cleanup()
    rows = await asyncio.to_thread(usage_rows, tmp_path / "c.db", "m")
    assert [status for status, _, _ in rows] == [200, 502] and all(output > 0 for _, _, output in rows), rows
