"""Failover: a replica that hangs (accepts connections, never answers) is detected and routed around."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import openai

from corral.cluster import LocalProcessRuntime, Supervisor
from corral.config import GatewaySettings, SupervisorSettings
from corral.engines import ExternalEngine, LaunchPlan
from corral.gateway import GatewayServer
from corral.routing import CircuitState, Replica, ReplicaSet, ReplicaState, Router

from .conftest import ScriptedUpstream, make_services

MESSAGES = [{"role": "user", "content": "hi"}]


async def test_hung_replica_leaves_routing_within_one_probe_interval(tmp_path: Path) -> None:
    good, hung = ScriptedUpstream(), ScriptedUpstream(mode="hang")
    await good.start()
    await hung.start()
    replicas = ReplicaSet()
    settings = SupervisorSettings(probe_interval=0.5, probe_timeout=0.3, unhealthy_after=3)
    supervisor = Supervisor(replicas, LocalProcessRuntime(tmp_path), settings)
    engine = ExternalEngine()
    supervisor.add(
        "m",
        engine,
        [LaunchPlan(url=hung.url, metrics_path=None), LaunchPlan(url=good.url, metrics_path=None)],
    )
    hung.mode = "ok"  # healthy at first
    await supervisor.start()
    gateway = GatewayServer(
        GatewaySettings(port=0, read_timeout=1.0),
        Router(replicas, default_policy="round_robin"),
        make_services(replicas, tmp_path / "corral.db"),
    )
    await gateway.start()
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="none", max_retries=0)
    try:
        assert await supervisor.wait_ready(5)
        await asyncio.sleep(0.6)
        hung_replica = replicas.of("m")[0]
        hung.mode = "hang"
        started = time.monotonic()
        while hung_replica.state is ReplicaState.READY:  # noqa: ASYNC110 - polling state the supervisor sets
            await asyncio.sleep(0.02)
        # the first probe left unanswered takes it out of routing (counted, not timed: a loaded machine's
        # timers fire late, but no second probe may be needed); and in about one interval and timeout
        assert hung.hung_probes == 1
        assert time.monotonic() - started <= 2 * (settings.probe_interval + settings.probe_timeout)
        for _ in range(6):
            reply = await client.chat.completions.create(model="m", messages=MESSAGES)
            assert reply.choices[0].message.content
        assert hung.bodies == [] or len(hung.bodies) <= 1
    finally:
        await gateway.stop()
        await supervisor.stop()
        await good.stop()
        await hung.stop()


async def test_timeouts_open_the_breaker_and_traffic_moves(tmp_path: Path) -> None:
    good, hung = ScriptedUpstream(), ScriptedUpstream(mode="hang")
    await good.start()
    await hung.start()
    replicas = ReplicaSet(["m"])
    slow = Replica(id="m-0", model="m", engine="x", url=hung.url, state=ReplicaState.READY)
    fine = Replica(id="m-1", model="m", engine="x", url=good.url, state=ReplicaState.READY)
    replicas.add(slow)
    replicas.add(fine)
    gateway = GatewayServer(
        GatewaySettings(port=0, read_timeout=0.3),
        Router(replicas, default_policy="round_robin"),
        make_services(replicas, tmp_path / "corral.db"),
    )
    await gateway.start()
    try:
        statuses = []
        async with aiohttp.ClientSession() as session:
            for _ in range(10):
                async with session.post(
                    f"http://127.0.0.1:{gateway.port}/v1/chat/completions",
                    json={"model": "m", "messages": MESSAGES},
                ) as response:
                    statuses.append(response.status)
        assert statuses.count(504) == 3  # three timeouts open the breaker...
        assert statuses[-4:] == [200] * 4  # ...and then everything goes to the healthy replica
        assert slow.breaker.state is CircuitState.OPEN
    finally:
        await gateway.stop()
        await good.stop()
        await hung.stop()
