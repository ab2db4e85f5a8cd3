"""What a client is told when no replica answered: the model, how many replicas were tried and how the last
failed, never a replica's id or address (the log keeps them, beside the request's id); an adapter every
replica refuses to load is a 503 naming it, and its refusals spend none of the router-wide retry budget."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from corral.cluster import free_port
from corral.config import GatewaySettings
from corral.gateway import GatewayServer
from corral.routing import Replica, ReplicaSet, ReplicaState, RetryBudget, Router
from corral.routing.adapters import Adapter, AdapterCatalogue

from .conftest import ScriptedUpstream, make_services

MESSAGES = [{"role": "user", "content": "hi"}]
BROKEN = Adapter(name="broken", base="m", engine_name="broken@1", path="/adapters/broken")


async def _gateway(
    tmp_path: Path, urls: list[str], router_budget: RetryBudget | None = None
) -> AsyncIterator[tuple[str, Router]]:
    """A gateway that hides which replica answers (x-corral-replica off, as a closed gateway's default)
    over replicas of model m at `urls`, serving adapter `broken` on m."""
    replicas = ReplicaSet(["m"])
    for i, url in enumerate(urls):
        replica = Replica(id=f"m-{i}", model="m", engine="vllm", url=url, state=ReplicaState.READY)
        replica.adapter_slots = 2  # (loads adapters at run time, as vLLM)
        replicas.add(replica)
    parts = replace(make_services(replicas, tmp_path / "corral.db"), adapters=AdapterCatalogue([BROKEN]))
    router = Router(replicas)
    if router_budget is not None:
        router.retry_budget = router_budget
    settings = GatewaySettings(port=0, routing_headers=False, connect_timeout=1.0, read_timeout=2.0)
    server = GatewayServer(settings, router, parts)
    await server.start()
    try:
        yield f"http://127.0.0.1:{server.port}", router
    finally:
        await server.stop()


async def _ask(url: str, model: str) -> tuple[int, dict, dict[str, str]]:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 5}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/chat/completions", json=body) as got,
    ):
        return got.status, await got.json(), {k.lower(): v for k, v in got.headers.items()}


@pytest.fixture
async def refused_connections(tmp_path: Path) -> AsyncIterator[tuple[str, list[str]]]:
    """A gateway over two replicas whose addresses refuse connections (nothing listens there)."""
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    async for url, _ in _gateway(tmp_path, [f"http://{a}" for a in addresses]):
        yield url, addresses


@pytest.mark.parametrize("model", ["m", "broken"])
async def test_a_client_is_told_no_replica_address_or_id(
    refused_connections: tuple[str, list[str]], model: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Engines that refuse connections, asked for the base (EngineUnreachable) and for an adapter (its load
    cannot connect: AdapterLoadFailed): the 502 said `cannot connect to 127.0.0.1:<port>` and `m-0`."""
    url, addresses = refused_connections
    with caplog.at_level(logging.WARNING, logger="corral.gateway.relay"):
        status, answer, headers = await _ask(url, model)
    assert status == 502, answer
    text = str(answer)
    for hidden in (*addresses, "127.0.0.1", "m-0", "m-1"):
        assert hidden not in text, answer
    message = answer["error"]["message"]
    assert f"'{model}'" in message and "2 replicas tried" in message and "could not be reached" in message
    assert "x-corral-replica" not in headers
    # the operator reads which replica failed, and why, beside the request's id
    logged = [r.getMessage() for r in caplog.records if headers["x-request-id"] in r.getMessage()]
    assert any(addresses[0] in line or addresses[1] in line for line in logged), logged


async def test_an_adapter_every_replica_refuses_is_a_503_that_spends_no_retry_budget(tmp_path: Path) -> None:
    """Both replicas answer the adapter's load with a refusal (a 404 here: no such route). With a retry
    budget of one token the request tried both replicas for free and told the client which adapter could
    not be loaded (503 adapter_unavailable, Retry-After); the token is still there for another model's
    retry. It was spent on the second replica, and the client told 502 `AdapterRefused: replica m-1 could not
    load adapter broken`. (Asked again within seconds, routing itself may answer the 503: no replica is
    asked to load a revision it refused a moment ago.)"""
    engines = [ScriptedUpstream(), ScriptedUpstream()]
    for engine in engines:
        await engine.start()
    try:
        budget = RetryBudget(ratio=0.0, floor_per_s=0.0, cap=1.0)
        async for url, router in _gateway(tmp_path, [e.url for e in engines], budget):
            for attempt in range(3):
                status, answer, headers = await _ask(url, "broken")
                assert status == 503, answer
                error = answer["error"]
                assert error["code"] == "adapter_unavailable" and error["type"] == "service_unavailable"
                assert "'broken'" in error["message"], error
                assert "m-0" not in error["message"] and "m-1" not in error["message"], error
                assert int(headers["retry-after"]) >= 1
                if attempt == 0:  # (both replicas asked, and both refused)
                    assert "2 replicas" in error["message"], error
            assert router.retry_budget.try_spend()  # (none spent by the refusals)
            status, answer, _ = await _ask(url, "m")  # the base serves on
            assert status == 200, answer
    finally:
        for engine in engines:
            await engine.stop()
