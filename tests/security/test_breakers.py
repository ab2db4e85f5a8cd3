"""Tenant eve sends inputs that make the engine answer 500 (a poisoned prompt): its replicas' breakers used
to open after three of them, and bob's requests then found no replica. A streak of failures the engine
answered now opens a breaker only when two tenants' requests failed; a replica that fails everyone's still
leaves routing."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from corral.config import AuthSettings, GatewaySettings
from corral.gateway import GatewayServer
from corral.routing import CircuitBreaker, CircuitState, Replica, ReplicaSet, ReplicaState, Router

from ..gateway.conftest import make_services


def test_one_tenants_answered_failures_do_not_open_a_breaker() -> None:
    breaker = CircuitBreaker(failures=3)
    for _ in range(10):
        breaker.on_failure("eve")
    assert breaker.state is CircuitState.CLOSED
    breaker.on_failure("bob")  # a second tenant's request fails too: the replica, most likely
    assert breaker.state is CircuitState.OPEN


def test_the_replicas_own_failures_open_it_as_before() -> None:
    breaker = CircuitBreaker(failures=3)
    breaker.on_failure("eve")
    breaker.on_failure()
    assert breaker.state is CircuitState.CLOSED
    breaker.on_failure()
    assert breaker.state is CircuitState.OPEN


def _trial(breaker: CircuitBreaker) -> None:
    """Wait (2 s at most) for the open breaker's cool-down to end, and send its half-open trial."""
    deadline = time.monotonic() + 2
    while breaker.state is not CircuitState.HALF_OPEN:
        assert time.monotonic() < deadline, "the breaker never became half-open"
        time.sleep(0.01)
    assert breaker.allows() and breaker.on_dispatch()


def test_one_tenants_failed_trials_do_not_keep_an_open_breaker_shut() -> None:
    """A breaker opened by the replica's own failures (a restart, say) used to reopen, its cool-down
    doubled up to 60 s, on every trial eve's poisoned prompt failed (a 500): one tenant kept the replica
    from everyone. Her failure now lets the next request try; a second tenant's failed trial reopens it."""
    breaker = CircuitBreaker(failures=3, cooldown=0.2)
    for _ in range(3):
        breaker.on_failure()
    assert breaker.state is CircuitState.OPEN
    for _ in range(3):
        _trial(breaker)
        breaker.on_failure("eve")
        assert breaker.state is CircuitState.HALF_OPEN and breaker.allows()  # the next request tries
    _trial(breaker)
    breaker.on_failure("bob")  # two tenants' requests failed: the replica, most likely
    assert breaker.state is CircuitState.OPEN
    _trial(breaker)
    breaker.on_failure("eve")  # (two tenants seen failing: it stays shut)
    assert breaker.state is CircuitState.OPEN
    _trial(breaker)
    breaker.on_success()
    assert breaker.state is CircuitState.CLOSED


def test_a_failed_trial_the_engine_did_not_answer_reopens_the_breaker() -> None:
    breaker = CircuitBreaker(failures=3, cooldown=0.2)
    for _ in range(3):
        breaker.on_failure()
    _trial(breaker)
    breaker.on_failure("eve")
    _trial(breaker)
    breaker.on_failure()  # no connection, a timeout: the replica's own
    assert breaker.state is CircuitState.OPEN and not breaker.allows()


_OK = {
    "id": "c",
    "object": "chat.completion",
    "created": 1,
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


async def _engine(chat: Callable[[web.Request], Awaitable[web.Response]]) -> web.AppRunner:
    """An engine answering chat completions with `chat`, on a free port."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


Ask = Callable[[aiohttp.ClientSession, str, str], Awaitable[int]]


async def _gateway(
    tmp_path: Path, urls: list[str], settings: GatewaySettings, policy: str | None = None
) -> tuple[GatewayServer, ReplicaSet, Ask]:
    """A closed gateway over engines at `urls` (routed by `policy`, else the default), with keys for eve and
    bob; `ask(session, tenant, text)` sends a chat request as that tenant and answers its status."""
    replicas = ReplicaSet(["m"])
    for i, url in enumerate(urls):
        replicas.add(Replica(id=f"m-{i}", model="m", engine="x", url=url, state=ReplicaState.READY))
    parts = make_services(replicas, tmp_path / "c.db", auth=AuthSettings(open=False))
    router = Router(replicas, default_policy=policy) if policy else Router(replicas)
    server = GatewayServer(settings, router, parts)
    await server.start()
    keys = {tenant: parts.keys.create(tenant)[0] for tenant in ("eve", "bob")}
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"

    async def ask(session: aiohttp.ClientSession, tenant: str, content: str) -> int:
        body = {"model": "m", "messages": [{"role": "user", "content": content}]}
        async with session.post(url, json=body, headers={"Authorization": f"Bearer {keys[tenant]}"}) as r:
            return r.status

    return server, replicas, ask


@pytest.fixture
async def poisoned() -> AsyncIterator[list[str]]:
    """Two engines that answer 500 to a prompt containing "poison" and a completion to anything else."""

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        if "poison" in str(body["messages"]):
            return web.json_response({"error": {"message": "internal error", "code": 500}}, status=500)
        return web.json_response(_OK)

    runners = [await _engine(chat) for _ in range(2)]
    yield [f"http://127.0.0.1:{r.addresses[0][1]}" for r in runners]
    for runner in runners:
        await runner.cleanup()


async def test_a_tenants_poisoned_inputs_leave_the_replicas_to_everyone(
    tmp_path: Path, poisoned: list[str]
) -> None:
    server, replicas, ask = await _gateway(tmp_path, poisoned, GatewaySettings(port=0))
    try:
        async with aiohttp.ClientSession() as session:
            assert {await ask(session, "eve", "poison") for _ in range(12)} == {502}
            assert [r.breaker.state for r in replicas.of("m")] == [CircuitState.CLOSED] * 2
            assert [await ask(session, "bob", "hello") for _ in range(4)] == [200] * 4
    finally:
        await server.stop()


async def test_a_tenants_long_requests_past_the_read_timeout_leave_the_replica_to_everyone(
    tmp_path: Path,
) -> None:
    """Eve asks for answers that take longer than `gateway.read_timeout` (a huge output, not streamed):
    three at once on the one replica used to open its breaker (a timeout counted as the replica's fault),
    taking it from everyone for its cool-down. A replica that served bob meanwhile is alive: eve's 504s
    leave it in routing. With no one served in between it looks hung, and opens as before."""

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        if "long" in str(body["messages"]):
            await asyncio.sleep(2)
        return web.json_response(_OK)

    runner = await _engine(chat)
    settings = GatewaySettings(port=0, read_timeout=0.5, retries=0)
    server, replicas, ask = await _gateway(tmp_path, [f"http://127.0.0.1:{runner.addresses[0][1]}"], settings)
    (replica,) = replicas.of("m")
    try:
        async with aiohttp.ClientSession() as session:
            eve = asyncio.gather(*(ask(session, "eve", "long") for _ in range(3)))
            await asyncio.sleep(0.1)
            assert await ask(session, "bob", "hello") == 200  # served while eve's requests run
            assert await eve == [504] * 3
            assert replica.breaker.state is CircuitState.CLOSED
            assert await ask(session, "bob", "hello") == 200
            assert await asyncio.gather(*(ask(session, "eve", "long") for _ in range(3))) == [504] * 3
            assert replica.breaker.state is CircuitState.OPEN  # no one served meanwhile: it looks hung
    finally:
        await server.stop()
        await runner.cleanup()


@pytest.mark.parametrize("ending", ["cut", "silent"])
async def test_a_stream_the_engine_cuts_is_its_tenants_and_one_gone_silent_the_replicas(
    tmp_path: Path, ending: str
) -> None:
    """cut: eve's prompts make the engine cut its streams (a token, then the connection closed); each cut
    counted as the replica's own fault, so three of them opened its breaker and bob found no replica. A
    replica that served bob while eve's streams ran is alive; with no one served in between, it opens.
    silent: a stream that goes silent is the replica's fault even if it served others meanwhile (a hung
    engine holding streams while its HTTP server still answers), or a one-tenant cluster's stalled streams
    would never open it and new requests would wait out read_timeout there."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if "eve's" not in str(body["messages"]):
            return web.json_response(_OK)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
        chunk["choices"] = [{"index": 0, "delta": {"content": "tok"}, "finish_reason": None}]
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await asyncio.sleep(0.3 if ending == "cut" else 3)  # (silent: past read_timeout)
        assert request.transport is not None
        request.transport.close()
        return response

    runner = await _engine(chat)
    settings = GatewaySettings(port=0, retries=0, stall_timeout=0.5, read_timeout=0.5)
    server, replicas, ask = await _gateway(tmp_path, [f"http://127.0.0.1:{runner.addresses[0][1]}"], settings)
    (replica,) = replicas.of("m")
    eve = server._parts.keys.create("eve")[0]  # (another key of eve's)

    async def streamed(session: aiohttp.ClientSession) -> bytes:
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "eve's"}]}
        url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
        async with session.post(url, json=body, headers={"Authorization": f"Bearer {eve}"}) as r:
            return await r.read()

    try:
        async with aiohttp.ClientSession() as session:
            streams = asyncio.gather(*(streamed(session) for _ in range(3)))
            await asyncio.sleep(0.1)
            assert await ask(session, "bob", "hello") == 200  # served while eve's streams run
            assert all(b"stream_truncated" in told for told in await streams)
            if ending == "silent":
                assert replica.breaker.state is CircuitState.OPEN
                return
            assert replica.breaker.state is CircuitState.CLOSED
            assert await ask(session, "bob", "hello") == 200
            await asyncio.gather(*(streamed(session) for _ in range(3)))
            assert replica.breaker.state is CircuitState.OPEN  # no one served meanwhile: the replica's fault
    finally:
        await server.stop()
        await runner.cleanup()


async def _until(condition: Callable[[], bool]) -> None:
    """Wait (5 s at most) for `condition`."""
    deadline = time.monotonic() + 5
    while not condition():
        assert time.monotonic() < deadline, "the condition never came"
        await asyncio.sleep(0.01)


async def test_a_continued_stream_the_engines_cut_is_its_tenants_too(tmp_path: Path) -> None:
    """As `test_a_stream_the_engine_cuts_...`, at temperature 0, where a cut stream is continued on another
    replica (mid-stream failover): each continuation the other engine cut counted as that replica's own
    fault (no tenant, whether it served others meanwhile or not), so eve's prompts opened every replica's
    breaker. A continuation is now judged as a first attempt: cut while its replica served bob, it is
    eve's; cut with no one served meanwhile, the replica's."""
    release = {"first": asyncio.Event(), "continued": asyncio.Event()}
    seen = {"first": 0, "continued": 0}

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if "eve's" not in str(body["messages"]):
            return web.json_response(_OK)
        which = "continued" if body["messages"][-1]["role"] == "assistant" else "first"
        seen[which] += 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
        chunk["choices"] = [{"index": 0, "delta": {"content": "tok"}, "finish_reason": None}]
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await release[which].wait()
        assert request.transport is not None
        request.transport.close()  # eve's prompt makes every engine cut its stream
        return response

    runners = [await _engine(chat) for _ in range(2)]
    urls = [f"http://127.0.0.1:{r.addresses[0][1]}" for r in runners]
    settings = GatewaySettings(port=0, retries=1)
    server, replicas, ask = await _gateway(tmp_path, urls, settings, policy="round_robin")
    eve = server._parts.keys.create("eve")[0]  # (another key of eve's)

    async def streamed(session: aiohttp.ClientSession) -> bytes:
        body = {
            "model": "m",
            "stream": True,
            "temperature": 0,
            "messages": [{"role": "user", "content": "eve's"}],
        }
        url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
        async with session.post(url, json=body, headers={"Authorization": f"Bearer {eve}"}) as r:
            return await r.read()

    async def six_cut_twice(session: aiohttp.ClientSession, bob_served_meanwhile: bool) -> None:
        """Six of eve's streams, three on each replica, each cut there and then where it was continued;
        bob served on both replicas while the first halves ran, and (if so) while the second halves did."""
        for event in release.values():
            event.clear()
        counts = dict(seen)
        streams = asyncio.gather(*(streamed(session) for _ in range(6)))
        await _until(lambda: seen["first"] == counts["first"] + 6)
        assert [await ask(session, "bob", "hello") for _ in range(2)] == [200, 200]  # (round robin: each)
        release["first"].set()
        await _until(lambda: seen["continued"] == counts["continued"] + 6)  # each went on on the other
        if bob_served_meanwhile:
            assert [await ask(session, "bob", "hello") for _ in range(2)] == [200, 200]
        release["continued"].set()
        assert all(b"stream_truncated" in told for told in await streams)

    try:
        async with aiohttp.ClientSession() as session:
            await six_cut_twice(session, bob_served_meanwhile=True)
            assert [r.breaker.state for r in replicas.of("m")] == [CircuitState.CLOSED] * 2
            assert [await ask(session, "bob", "hello") for _ in range(2)] == [200, 200]
            await six_cut_twice(session, bob_served_meanwhile=False)
            # (three continuations cut on each with no one served meanwhile: the replicas' fault)
            assert [r.breaker.state for r in replicas.of("m")] == [CircuitState.OPEN] * 2
    finally:
        await server.stop()
        for runner in runners:
            await runner.cleanup()


async def test_a_tenants_refused_requests_do_not_keep_a_failing_replica_in_routing(tmp_path: Path) -> None:
    """The engine fails every real request (a 500, bob's and eve's alike) and refuses eve's invalid ones (a
    400). Each 400 counted as the replica's success: it reset the breaker's streak and made the replica look
    alive (to the rules for cut streams and timeouts), so eve's cheap invalid requests between the others
    kept a replica that fails everyone in routing. A 4xx now says nothing of the replica: the breaker
    opens."""

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        if "bogus" in str(body["messages"]):  # the engine validates it: the client's fault
            return web.json_response({"error": {"message": "bogus is not a parameter"}}, status=400)
        return web.json_response({"error": {"message": "CUDA error: an illegal memory access"}}, status=500)

    runner = await _engine(chat)
    settings = GatewaySettings(port=0, retries=0)
    server, replicas, ask = await _gateway(tmp_path, [f"http://127.0.0.1:{runner.addresses[0][1]}"], settings)
    (replica,) = replicas.of("m")
    try:
        async with aiohttp.ClientSession() as session:
            told = []
            for tenant in ("bob", "eve", "bob"):
                told += [await ask(session, tenant, "hello"), await ask(session, "eve", "bogus")]
            assert told[:5] == [502, 400, 502, 400, 502]
            assert replica.succeeded == 0
            assert replica.breaker.state is CircuitState.OPEN
    finally:
        await server.stop()
        await runner.cleanup()
