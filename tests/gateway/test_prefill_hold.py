"""A request held for another's prefill of its prefix (`gateway.prefill_coalescing`) is sent only where it
may still go when the hold ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest

from corral.config import GatewaySettings
from corral.gateway import GatewayServer
from corral.routing import Replica, ReplicaSet, ReplicaState, Router, RouteRequest

from .conftest import ScriptedUpstream, make_services

DOCUMENT = "the same long system prompt, word for word. " * 60


async def _poll(condition: Callable[[], bool], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "the condition never came"
        await asyncio.sleep(0.01)


@pytest.fixture
async def upstreams() -> AsyncIterator[list[ScriptedUpstream]]:
    servers = [ScriptedUpstream(), ScriptedUpstream()]
    for server in servers:
        await server.start()
    yield servers
    for server in servers:
        await server.stop()


@pytest.mark.parametrize("leaves", ["draining", "removed", "breaker open"])
async def test_a_request_held_for_a_prefill_goes_elsewhere_when_its_replica_left_meanwhile(
    tmp_path: Path, upstreams: list[ScriptedUpstream], leaves: str
) -> None:
    replicas = ReplicaSet(["m"])
    for i, upstream in enumerate(upstreams):
        replicas.add(Replica(id=f"m-{i}", model="m", engine="x", url=upstream.url, state=ReplicaState.READY))
    upstream_of = dict(zip(replicas.of("m"), upstreams, strict=True))
    router = Router(replicas, coalesce_prefills=True)  # the default policy: prefix_affinity
    server = GatewayServer(
        GatewaySettings(port=0, routing_headers=True), router, make_services(replicas, tmp_path / "c.db")
    )
    await server.start()
    # another request is computing the document on one replica (as the gateway writes a chat's prompt)
    first = RouteRequest("m", prompt="user:" + DOCUMENT + "first question", prompt_tokens=700)
    busy = router.acquire(first)
    idle = next(r for r in replicas.of("m") if r is not busy)
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": DOCUMENT + "second"}]}
    try:
        async with aiohttp.ClientSession() as session:
            sent = asyncio.ensure_future(
                session.post(f"http://127.0.0.1:{server.port}/v1/chat/completions", json=body)
            )
            await _poll(lambda: busy.outstanding == 2)  # routed where the document is, and held there
            if leaves == "draining":
                busy.state = ReplicaState.DRAINING
            elif leaves == "removed":
                replicas.remove(busy)
            else:
                for _ in range(3):
                    busy.breaker.on_failure()
            router.prefilled(busy, first)  # the first request's first token: the hold ends
            async with await sent as answer:
                assert answer.status == 200, await answer.text()
                assert answer.headers["x-corral-replica"] == idle.id
    finally:
        router.release(busy, first, ok=None)
        await server.stop()
    assert (len(upstream_of[busy].bodies), len(upstream_of[idle].bodies)) == (0, 1)
    assert busy.outstanding == 0 and idle.outstanding == 0
