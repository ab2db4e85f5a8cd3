"""Gateways (closed, keys by the admin API) in front of simulated replicas that answer tool calls and
structured output on a seeded schedule (sim/tools.py); and an open gateway in front of a scripted engine
that answers what a test has it answer (`scripted`: the engine's whole answer or stream, as is)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from corral.config import CacheSettings, GatewaySettings, ModelCacheSpec, StoreSettings
from corral.engines import EngineFeatures
from corral.gateway import GatewayServer
from corral.perf import load_catalog
from corral.perf.calibration import calibrated_efficiency
from corral.routing import Replica, ReplicaSet, ReplicaState, Router
from corral.sim import SimFleet, SimOptions, build_server
from tests.gateway.conftest import Gateway as ScriptedGateway
from tests.gateway.conftest import ScriptedUpstream, make_services, start_closed_gateway

ADMIN = "dialects-admin"


@dataclass
class Gateway:
    url: str
    server: GatewayServer
    replicas: ReplicaSet

    async def key(self, tenant: str, **limits: object) -> str:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                self.url + "/admin/keys",
                json={"tenant": tenant, **limits},
                headers={"Authorization": f"Bearer {ADMIN}"},
            ) as answer,
        ):
            assert answer.status == 201, await answer.text()
            return str((await answer.json())["key"])


@dataclass
class Cluster:
    fleet: SimFleet
    store: str
    gateways: list[Gateway] = field(default_factory=list)

    async def gateway(
        self,
        store: StoreSettings | None = None,
        cache: bool = False,
        tools: bool = True,
        max_body_bytes: int = 4 * 1024 * 1024,
    ) -> Gateway:
        """Another gateway on the same store and replicas (`cache`: model m keeps exact answers; without
        `tools` the replicas are taken for an engine that makes no tool calls: the gateway asks for them as
        JSON, which the simulator answers from the schema)."""
        replicas = ReplicaSet()
        features = EngineFeatures(tools=tools)
        for i, url in enumerate(self.fleet.urls):
            replica = Replica(id=f"m-{i}", model="m", engine="sim", url=url, state=ReplicaState.READY)
            replica.features = features
            replicas.add(replica)
        gateway_url, server, _ = await start_closed_gateway(
            replicas,
            self.store,
            ADMIN,
            GatewaySettings(port=0, routing_headers=True, max_body_bytes=max_body_bytes),
            store=store,
            cache=CacheSettings() if cache else None,
            cache_policies={"m": ModelCacheSpec(exact=True)} if cache else None,
        )
        gateway = Gateway(gateway_url, server, replicas)
        self.gateways.append(gateway)
        return gateway


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    options = SimOptions(model="llama-3.1-8b", gpu="h100-sxm", time_scale=50, served_name="m")
    catalog, efficiency = load_catalog(), calibrated_efficiency()
    fleet = SimFleet([build_server(options, catalog, efficiency) for _ in range(2)])
    await fleet.start([0, 0])
    running = Cluster(fleet, f"sqlite:///{tmp_path / 'corral.db'}")
    yield running
    for gateway in running.gateways:
        await gateway.server.stop()
    await fleet.stop()


@pytest.fixture
async def scripted(tmp_path: Path) -> AsyncIterator[tuple[ScriptedGateway, ScriptedUpstream]]:
    """An open gateway whose one replica of model m is a scripted engine (mode "answer": what a test sets)."""
    upstream = ScriptedUpstream()
    await upstream.start()
    upstream.mode = "answer"
    replicas = ReplicaSet(["m"])
    server = GatewayServer(
        GatewaySettings(port=0), Router(replicas), make_services(replicas, tmp_path / "c.db")
    )
    await server.start()
    gateway = ScriptedGateway(f"http://127.0.0.1:{server.port}", replicas, server)
    gateway.add_replica(upstream.url)
    yield gateway, upstream
    await server.stop()
    await upstream.stop()


_HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
USAGE = {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16}


def whole_answer(message: dict[str, Any], finish: str) -> tuple[int, str, bytes]:
    """A scripted engine's whole chat completion (`upstream.answer`)."""
    choice = {"index": 0, "message": message, "finish_reason": finish}
    body = {**_HEAD, "object": "chat.completion", "choices": [choice], "usage": USAGE}
    return 200, "application/json", orjson.dumps(body)


def streamed_answer(deltas: list[dict[str, Any]], finish: str) -> tuple[int, str, bytes]:
    """A scripted engine's chat completion stream (`upstream.answer`): a chunk a delta, the finish, usage."""
    chunks = [{**_HEAD, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    chunks.append({**_HEAD, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    chunks.append({**_HEAD, "choices": [], "usage": USAGE})
    events = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    return 200, "text/event-stream", events
