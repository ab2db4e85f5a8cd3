"""Each prompt of a list the gateway fans out is routed by its own prefix, as that prompt alone would be."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from corral.config import AuthSettings, GatewaySettings
from corral.engines import EngineFeatures
from corral.gateway import GatewayServer
from corral.gateway.context import RequestContext
from corral.gateway.fanout import _route, _routing_prompts
from corral.protocol import CompletionRequest
from corral.routing import Replica, ReplicaSet, ReplicaState, Router, RouteRequest

from .conftest import ScriptedUpstream, make_services

DOCUMENTS = [f"Contract {i}: " + f"clause {i} binds the parties as follows. " * 40 for i in range(4)]


async def test_each_prompt_of_a_list_goes_where_its_own_prefix_is_cached(tmp_path: Path) -> None:
    """Bob's four documents, each sent alone while only one replica is ready; then one request listing a
    question on each (an engine without prompt lists: one request per prompt). On a closed gateway the
    routing prompt starts with bob's tag, which each part keeps."""
    upstreams = [ScriptedUpstream() for _ in range(4)]
    for upstream in upstreams:
        await upstream.start()
    replicas = ReplicaSet(["m"])
    no_lists = EngineFeatures(prompt_lists=False)
    for i, upstream in enumerate(upstreams):
        replica = Replica(id=f"m-{i}", model="m", engine="x", url=upstream.url, features=no_lists)
        replicas.add(replica)
    members = replicas.of("m")
    parts = make_services(replicas, tmp_path / "c.db", auth=AuthSettings(open=False))
    server = GatewayServer(GatewaySettings(port=0), Router(replicas), parts)
    await server.start()
    bob, _ = parts.keys.create("bob")
    url = f"http://127.0.0.1:{server.port}/v1/completions"
    headers = {"Authorization": f"Bearer {bob}"}

    async def send(session: aiohttp.ClientSession, prompt: str | list[str]) -> None:
        async with session.post(
            url, json={"model": "m", "max_tokens": 4, "prompt": prompt}, headers=headers
        ) as r:
            assert r.status == 200, await r.text()

    try:
        async with aiohttp.ClientSession() as session:
            for i, document in enumerate(DOCUMENTS):
                for j, replica in enumerate(members):
                    replica.state = ReplicaState.READY if i == j else ReplicaState.UNHEALTHY
                await send(session, document)
            for replica in members:
                replica.state = ReplicaState.READY
            await send(session, [DOCUMENTS[i] + f"What does clause {i} say?" for i in (2, 0, 3, 1)])
    finally:
        await server.stop()
        for upstream in upstreams:
            await upstream.stop()
    for i, upstream in enumerate(upstreams):  # its document alone, then the question on it
        assert [body["prompt"] for body in upstream.bodies] == [
            DOCUMENTS[i],
            DOCUMENTS[i] + f"What does clause {i} say?",
        ]


def test_a_part_s_routing_prompt_keeps_the_lines_before_the_list() -> None:
    """As intake writes them: the tenant's tag, the adapter's line (`lora:NAME` or, for a base model
    with adapters, `lora:`), then the prompt as text (a token-id prompt's list too); for a list, its text."""
    for prompts, own in (
        (["first prompt", "second"], ["first prompt", "second"]),
        ([[1, 2, 3], [4, 5]], ["[1, 2, 3]", "[4, 5]"]),
    ):
        body = CompletionRequest.model_validate({"model": "m", "prompt": prompts})
        route = RouteRequest("m", prompt="0123abcd\nlora:bot\n" + str(body.prompt), prompt_tokens=10)
        ctx = RequestContext("/v1/completions", body, b"{}", 0.0, route)
        routed = _routing_prompts(ctx, body.prompts)
        assert routed == ["0123abcd\nlora:bot\n" + text for text in own]
        assert _route(ctx, routed[1]).prompt == routed[1]
    one = CompletionRequest.model_validate({"model": "m", "prompt": "one prompt", "n": 3})
    ctx = RequestContext("/v1/completions", one, b"{}", 0.0, RouteRequest("m", prompt="lora:\none prompt"))
    assert _routing_prompts(ctx, one.prompts) == ["lora:\none prompt"]  # n choices of one prompt: as it is
