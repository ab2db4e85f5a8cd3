"""Tenant eve probes whether tenant bob sent a document: she sends it herself and watches which replica
answers (x-corral-replica). With a prefix index shared across tenants her copy goes where bob's went, every
time; with `prefix_isolation: tenant` (the default on a closed gateway) where it goes says nothing."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from corral.config import AuthSettings, GatewaySettings
from corral.gateway import GatewayServer
from corral.routing import Replica, ReplicaSet, ReplicaState, Router

from ..gateway.conftest import ScriptedUpstream, make_services

DOCUMENTS = [
    f"Document {i}: " + f"the confidential plan number {i} reads as follows. " * 40 for i in range(12)
]


def _only(members: list[Replica], chosen: Replica | None) -> None:
    """Only `chosen` takes requests (the others kept out of routing), or every one again (None)."""
    for replica in members:
        replica.state = ReplicaState.READY if chosen in (None, replica) else ReplicaState.UNHEALTHY


async def ask(session: aiohttp.ClientSession, url: str, key: str, document: str) -> str:
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": document}]}
    headers = {"Authorization": f"Bearer {key}"}
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as answer:
        assert answer.status == 200, await answer.text()
        return answer.headers.get("x-corral-replica", "")


async def probe(tmp_path: Path, isolation: str | None, routing_headers: bool | None) -> tuple[int, str]:
    """Bob's twelve documents, three on each of four replicas (the others kept out of routing while he
    sends them); then eve sends each one. (How many of eve's went where bob's went, the header eve saw on
    her last answer.)"""
    upstreams = [ScriptedUpstream() for _ in range(4)]
    for upstream in upstreams:
        await upstream.start()
    replicas = ReplicaSet(["m"])
    for i, upstream in enumerate(upstreams):
        replicas.add(Replica(id=f"m-{i}", model="m", engine="x", url=upstream.url, state=ReplicaState.READY))
    members = replicas.of("m")
    parts = make_services(
        replicas, tmp_path / f"{isolation}.db", auth=AuthSettings(open=False), isolation={"m": isolation}
    )
    settings = GatewaySettings(port=0, routing_headers=routing_headers)
    server = GatewayServer(settings, Router(replicas), parts)
    await server.start()
    url = f"http://127.0.0.1:{server.port}"
    bob, _ = parts.keys.create("bob")
    eve, _ = parts.keys.create("eve")
    try:
        async with aiohttp.ClientSession() as session:
            bobs = []
            for i, document in enumerate(DOCUMENTS):
                _only(members, members[i // 3])
                bobs.append(await ask(session, url, bob, document))
            _only(members, None)
            eves = [await ask(session, url, eve, d) for d in DOCUMENTS]
    finally:
        await server.stop()
        for upstream in upstreams:
            await upstream.stop()
    return sum(b == e != "" for b, e in zip(bobs, eves, strict=True)), eves[-1]


async def test_with_a_shared_prefix_index_the_probe_finds_every_document(tmp_path: Path) -> None:
    found, _ = await probe(tmp_path, "shared", routing_headers=True)
    assert found == 12


async def test_with_tenant_isolation_the_probe_is_at_chance(tmp_path: Path) -> None:
    found, _ = await probe(tmp_path, "tenant", routing_headers=True)
    assert found <= 6  # four replicas: chance is 3 of 12


@pytest.mark.parametrize("isolation", [None, "shared"])
async def test_a_closed_gateway_names_no_replica_unless_told_to(
    tmp_path: Path, isolation: str | None
) -> None:
    found, header = await probe(tmp_path, isolation, routing_headers=None)
    assert (found, header) == (0, "")


async def test_a_base_prompt_cannot_pass_for_an_adapters(tmp_path: Path) -> None:
    """With the prefix index shared (an open gateway), bob's chats with the adapter `bot` go to their
    replicas; eve's completions to the base, whose prompts are bob's as routing writes them (`lora:bot`, a
    newline, `user:` and the text), would follow them there if the base's prompts were not tagged too."""
    from corral.routing.adapters import Adapter

    upstreams = [ScriptedUpstream() for _ in range(4)]
    for upstream in upstreams:
        await upstream.start()
    replicas = ReplicaSet(["m"])
    for i, upstream in enumerate(upstreams):
        replica = Replica(id=f"m-{i}", model="m", engine="llamacpp", url=upstream.url, adapters=("bot",))
        replica.state = ReplicaState.READY
        replicas.add(replica)
    members = replicas.of("m")
    parts = make_services(replicas, tmp_path / "c.db", auth=AuthSettings(open=True))
    parts.adapters.replace("m", [Adapter("bot", "m", "bot@0", "")])
    server = GatewayServer(GatewaySettings(port=0, routing_headers=True), Router(replicas), parts)
    await server.start()
    url = f"http://127.0.0.1:{server.port}"

    async def send(session: aiohttp.ClientSession, path: str, body: dict) -> str:
        async with session.post(url + path, json={"max_tokens": 4, **body}) as answer:
            assert answer.status == 200, await answer.text()
            return answer.headers.get("x-corral-replica", "")

    try:
        async with aiohttp.ClientSession() as session:
            bobs = []
            for i, document in enumerate(DOCUMENTS):
                _only(members, members[i // 3])
                chat = {"model": "bot", "messages": [{"role": "user", "content": document}]}
                bobs.append(await send(session, "/v1/chat/completions", chat))
            _only(members, None)
            eves = [
                await send(session, "/v1/completions", {"model": "m", "prompt": f"lora:bot\nuser:{d}"})
                for d in DOCUMENTS
            ]
    finally:
        await server.stop()
        for upstream in upstreams:
            await upstream.stop()
    assert len(set(bobs)) == 4
    assert sum(b == e for b, e in zip(bobs, eves, strict=True)) < 8  # (12 when the prompts match)
