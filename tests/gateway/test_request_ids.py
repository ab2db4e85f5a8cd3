"""Every answer names its request: `x-request-id` (as OpenAI's API does; the official client reads it as
`_request_id` and an error's `request_id`), on whole answers, streams, the dialects' routes and errors; an
edge's own id (`X-Request-Id`) is taken only from a trusted proxy, and only where it cannot break a log
line."""

from __future__ import annotations

import asyncio
import re
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest
from typer.testing import CliRunner

from corral.cli import app
from corral.config import GatewaySettings
from corral.gateway import GatewayServer
from corral.routing import ReplicaSet, Router

from .conftest import Gateway, ScriptedUpstream, make_services

OWN = re.compile(r"req_[0-9a-f]{24}")  # random: a counter would tell how many requests others sent
HI = [{"role": "user", "content": "hi"}]


async def test_whole_answers_streams_and_errors_tell_their_request_id(
    gateway: Gateway, upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    gateway.add_replica(upstream.url)
    client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="none", max_retries=0)
    raw = await client.chat.completions.with_raw_response.create(model="m", messages=HI)  # type: ignore[arg-type]
    whole = raw.headers["x-request-id"]
    assert OWN.fullmatch(whole) and raw.parse()._request_id == whole
    async with client.chat.completions.with_streaming_response.create(
        model="m",
        messages=HI,  # type: ignore[arg-type]
        stream=True,
    ) as streamed:
        streamed_id = streamed.headers["x-request-id"]
        assert [line async for line in streamed.iter_lines()]
    with pytest.raises(openai.NotFoundError) as missing:
        await client.chat.completions.create(model="nope", messages=HI)  # type: ignore[arg-type]
    failed = missing.value.request_id
    async with aiohttp.ClientSession() as session:  # a dialect's stream, and an unknown path
        body = {"model": "m", "max_tokens": 8, "messages": HI, "stream": True}
        async with session.post(gateway.url + "/v1/messages", json=body) as messages:
            assert messages.status == 200 and await messages.read()
            dialect = messages.headers["x-request-id"]
        async with session.get(gateway.url + "/v1/nowhere") as nowhere:
            assert nowhere.status == 404
            unknown = nowhere.headers["x-request-id"]
    ids = [whole, streamed_id, failed, dialect, unknown]
    assert all(i and OWN.fullmatch(i) for i in ids) and len(set(ids)) == 5, ids
    assert upstream.request_ids == [whole, streamed_id, dialect]  # the engine is told it (X-Request-Id)
    recorded: dict[str, int] = {}  # each answer's usage row names it (written in batches: awaited)
    for _ in range(100):
        with sqlite3.connect(tmp_path / "corral.db") as db:
            recorded = dict(db.execute("SELECT request_id, status FROM corral_usage").fetchall())
        if len(recorded) >= 3:
            break
        await asyncio.sleep(0.05)
    assert recorded == {whole: 200, streamed_id: 200, dialect: 200}  # (a model it does not serve: no row)
    async with aiohttp.ClientSession() as session:  # an operator finds a request by the id its client has
        async with session.get(gateway.url + f"/admin/usage?request_id={dialect}") as found:
            (row,) = (await found.json())["rows"]
    assert (row["request_id"], row["api"], row["status"], row["model"]) == (dialect, "messages", 200, "m")
    store = f"sqlite:///{tmp_path / 'corral.db'}"
    done = CliRunner().invoke(app, ["usage", "--request-id", whole, "--store", store], env={"COLUMNS": "80"})
    assert done.exit_code == 0 and whole in done.output and "chat" in done.output, done.output
    done = CliRunner().invoke(app, ["usage", "--request-id", "req_nothing", "--store", store])
    assert done.exit_code == 1 and "no usage record of request req_nothing" in done.output


@pytest.fixture
async def behind_a_proxy(tmp_path: Path) -> AsyncIterator[Gateway]:
    """A gateway that trusts its loopback peer as its edge (gateway.trusted_proxies)."""
    replicas = ReplicaSet(["m"])
    settings = GatewaySettings(port=0, trusted_proxies=["127.0.0.1"])
    server = GatewayServer(settings, Router(replicas), make_services(replicas, tmp_path / "corral.db"))
    await server.start()
    yield Gateway(f"http://127.0.0.1:{server.port}", replicas, server)
    await server.stop()


async def id_for(gateway: Gateway, given: str) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.get(gateway.url + "/v1/models", headers={"X-Request-Id": given}) as response:
            assert response.status == 200
            return response.headers["x-request-id"]


async def test_an_edge_s_request_id_is_taken_from_a_trusted_proxy_only(
    gateway: Gateway, behind_a_proxy: Gateway
) -> None:
    edge = "5f2b8c0e9d7a41c3b6e2f01a9c8d7e6b"  # NGINX's $request_id
    assert await id_for(behind_a_proxy, edge) == edge
    assert await id_for(behind_a_proxy, "trace:01.b-2_c") == "trace:01.b-2_c"
    for unusable in ("two words", "x" * 129, 'quote"d', ""):  # would break or flood a log line: replaced
        assert OWN.fullmatch(await id_for(behind_a_proxy, unusable)), unusable
    assert OWN.fullmatch(await id_for(gateway, edge))  # no trusted proxies: a client does not choose it


async def test_a_client_s_trace_context_reaches_the_engine(
    gateway: Gateway, upstream: ScriptedUpstream
) -> None:
    """W3C trace context passes to the engine (vLLM tracing with OpenTelemetry puts its spans in the
    client's trace); a malformed one does not."""
    gateway.add_replica(upstream.url)
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    sent = [
        {"traceparent": parent, "tracestate": "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"},
        {"traceparent": parent},
        {"traceparent": "00-not-a-trace-01", "tracestate": "rojo=1"},
        {},
    ]
    async with aiohttp.ClientSession() as session:
        for headers in sent:
            body = {"model": "m", "messages": HI}
            async with session.post(
                gateway.base_url + "/chat/completions", json=body, headers=headers
            ) as answer:
                assert answer.status == 200
    assert upstream.traces == [
        (parent, "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"),
        (parent, None),
        (None, None),
        (None, None),
    ]
