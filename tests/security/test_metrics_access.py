"""What /metrics tells whom: on a closed gateway it names every tenant, key and model, so only the admin
key or the scraper's `gateway.metrics_token` reads it; tenant and key labels can be left out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from corral.config import AuthSettings, GatewaySettings
from corral.gateway import GatewayServer
from corral.routing import Replica, ReplicaSet, ReplicaState, Router

from ..gateway.conftest import ScriptedUpstream, make_services

ADMIN, TOKEN = "admin-key", "scrape-token"


async def gateway(tmp_path: Path, upstream: ScriptedUpstream, settings: GatewaySettings, open_: bool):
    replicas = ReplicaSet(["m"])
    replicas.add(Replica(id="m-0", model="m", engine="x", url=upstream.url, state=ReplicaState.READY))
    parts = make_services(replicas, tmp_path / "c.db", auth=AuthSettings(open=open_), admin_key=ADMIN)
    server = GatewayServer(settings, Router(replicas), parts)
    await server.start()
    return server, parts, f"http://127.0.0.1:{server.port}"


async def get(url: str, key: str | None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as response:
        return response.status, await response.text()


async def chat(url: str, key: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as response:
            assert response.status == 200


@pytest.fixture
async def closed(tmp_path: Path, upstream: ScriptedUpstream) -> AsyncIterator[tuple[str, str]]:
    server, parts, url = await gateway(
        tmp_path, upstream, GatewaySettings(port=0, metrics_token=TOKEN), False
    )
    bob, _ = parts.keys.create("bob-corp", monthly_token_budget=1_000_000)
    await chat(url, bob)
    eve, _ = parts.keys.create("eve")
    yield url, eve
    await server.stop()


async def test_a_closed_gateways_metrics_answer_the_scraper_and_the_admin_only(
    closed: tuple[str, str],
) -> None:
    url, eve = closed
    for key in (None, eve, "guess"):
        status, text = await get(url + "/metrics", key)
        assert status == 401 and "bob-corp" not in text, (key, status)
    for key in (TOKEN, ADMIN):
        status, text = await get(url + "/metrics", key)
        assert status == 200 and 'tenant="bob-corp"' in text
    # the replicas' addresses for Prometheus's discovery: the scraper's token too, so the admin key need
    # not sit on the monitoring host
    for key in (TOKEN, ADMIN):
        status, text = await get(url + "/corral/sd", key)
        assert status == 200 and '"replica": "m-0"' in text.replace('":"', '": "'), (key, text)
    for key in (None, eve, "guess"):
        assert (await get(url + "/corral/sd", key))[0] in (401, 403), key


async def test_an_open_gateways_metrics_need_no_key(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    server, _, url = await gateway(tmp_path, upstream, GatewaySettings(port=0), True)
    try:
        status, text = await get(url + "/metrics", None)
        assert status == 200 and "corral_requests_total" in text
    finally:
        await server.stop()


async def test_tenant_labels_can_be_left_out(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    settings = GatewaySettings(port=0, metrics_tenant_labels=False)
    server, parts, url = await gateway(tmp_path, upstream, settings, False)
    try:
        bob, record = parts.keys.create("bob-corp", monthly_token_budget=1_000_000)
        await chat(url, bob)
        status, text = await get(url + "/metrics", ADMIN)
        assert status == 200 and 'corral_tenant_requests_total{status="200",tenant="-"} 1.0' in text
        assert "bob-corp" not in text and record.id not in text
    finally:
        await server.stop()
