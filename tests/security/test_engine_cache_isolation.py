"""Tenant eve probes the engine's own prefix cache: she sends a document bob sent and the engine finds its
blocks cached (a first token sooner than a cold prompt's: vLLM's docs warn of it). With
`prefix_isolation: tenant` the gateway sends each tenant's requests with its own vLLM `cache_salt` (an HMAC
of the tenant's name under a server secret, whatever the client sent), and the engine shares nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from corral.config import AuthSettings, GatewaySettings
from corral.engines import EngineFeatures
from corral.gateway import GatewayServer
from corral.perf import load_catalog
from corral.perf.calibration import calibrated_efficiency
from corral.routing import Replica, ReplicaSet, ReplicaState, Router
from corral.sim import SimFleet, SimOptions, build_server

from ..gateway.conftest import ScriptedUpstream, make_services

DOCUMENT = "The merger terms, strictly confidential: " + "clause after clause of terms. " * 60


@pytest.fixture
async def engine() -> AsyncIterator[str]:
    """One simulated vLLM replica with its prefix cache (100× real time)."""
    server = build_server(
        SimOptions(model="llama-3.1-8b", gpu="h100-sxm", time_scale=100, served_name="m"),
        load_catalog(),
        calibrated_efficiency(),
    )
    fleet = SimFleet([server])
    await fleet.start([0])
    yield fleet.urls[0]
    await fleet.stop()


async def cached_tokens(session: aiohttp.ClientSession, engine: str) -> float:
    async with session.get(engine + "/metrics") as response:
        text = await response.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prefix_cache_hits_total")
    )


async def eve_finds_bobs_blocks(tmp_path: Path, upstream_url: str, isolation: str, engine: str) -> float:
    """Bob sends the document, then eve; the tokens the engine found cached for eve's request."""
    replicas = ReplicaSet(["m"])
    features = EngineFeatures(
        cache_salt=True, prompt_lists=False, echo=False, images=False, continuation=False
    )
    replicas.add(
        Replica(
            id="m-0", model="m", engine="sim", url=upstream_url, state=ReplicaState.READY, features=features
        )
    )
    parts = make_services(
        replicas, tmp_path / f"{isolation}.db", auth=AuthSettings(open=False), isolation={"m": isolation}
    )
    server = GatewayServer(GatewaySettings(port=0), Router(replicas), parts)
    await server.start()
    bob, _ = parts.keys.create("bob")
    eve, _ = parts.keys.create("eve")
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": DOCUMENT}]}
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    try:
        async with aiohttp.ClientSession() as session:
            for key in (bob, eve):
                before = await cached_tokens(session, engine)
                headers = {"Authorization": f"Bearer {key}"}
                async with session.post(url, json=body, headers=headers) as answer:
                    assert answer.status == 200, await answer.text()
            return await cached_tokens(session, engine) - before
    finally:
        await server.stop()


async def test_with_a_shared_prefix_the_engine_serves_eve_bobs_cached_blocks(
    tmp_path: Path, engine: str
) -> None:
    assert await eve_finds_bobs_blocks(tmp_path, engine, "shared", engine) > 300


async def test_with_tenant_isolation_the_engine_shares_no_block(tmp_path: Path, engine: str) -> None:
    assert await eve_finds_bobs_blocks(tmp_path, engine, "tenant", engine) == 0


async def test_the_salt_is_the_tenants_whatever_the_client_sends(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    replicas = ReplicaSet(["m"])
    replicas.add(
        Replica(
            id="m-0",
            model="m",
            engine="x",
            url=upstream.url,
            state=ReplicaState.READY,
            features=EngineFeatures(cache_salt=True),
        )
    )
    parts = make_services(  # prefix_isolation unset: tenant, on a closed gateway
        replicas,
        tmp_path / "c.db",
        auth=AuthSettings(open=False),
        admin_key="server-secret",
        isolation={"m": None},
    )
    server = GatewayServer(GatewaySettings(port=0), Router(replicas), parts)
    await server.start()
    keys = {tenant: parts.keys.create(tenant)[0] for tenant in ("bob", "eve")}
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    sent = [("bob", None), ("eve", None), ("eve", "bobs-guess"), ("bob", None)]
    try:
        async with aiohttp.ClientSession() as session:
            for tenant, own in sent:
                body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                if own is not None:
                    body["cache_salt"] = own
                async with session.post(
                    url, json=body, headers={"Authorization": f"Bearer {keys[tenant]}"}
                ) as r:
                    assert r.status == 200
    finally:
        await server.stop()
    salts = [b["cache_salt"] for b in upstream.bodies]
    assert salts[0] == salts[3] != salts[1] == salts[2]  # one per tenant; the client's own is replaced
    assert "bob" not in salts[0] and len(salts[0]) == 32
