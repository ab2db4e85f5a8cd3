"""An emulated tool-call stream (an engine without a tool parser: the gateway holds the whole answer to tell
it as calls) whose client leaves before the answer is told: the events the engine streamed meanwhile are
charged, as a relayed stream's are (they were read where nothing charged them: the 256-token estimate)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from corral.config import AuthSettings, GatewaySettings
from corral.engines import EngineFeatures
from corral.gateway import GatewayServer
from corral.routing import Replica, ReplicaSet, ReplicaState, Router

from .conftest import ScriptedUpstream, make_services

ADMIN = "held-admin"
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


async def test_a_held_stream_left_before_its_answer_is_charged_the_events_read(tmp_path: Path) -> None:
    engine = ScriptedUpstream(chunks=3000, gap=0.002)  # (6 s of tokens, a read each)
    await engine.start()
    replicas = ReplicaSet(["m"])
    without_tools = EngineFeatures(tools=False)
    replicas.add(Replica("m-0", "m", "x", url=engine.url, state=ReplicaState.READY, features=without_tools))
    parts = make_services(replicas, tmp_path / "c.db", auth=AuthSettings(open=False), admin_key=ADMIN)
    server = GatewayServer(GatewaySettings(port=0), Router(replicas), parts)
    await server.start()
    url = f"http://127.0.0.1:{server.port}"
    key, _ = parts.keys.create("mallory")
    body = {"model": "m", "stream": True, "tools": TOOLS, "messages": [{"role": "user", "content": "hi"}]}
    try:
        async with aiohttp.ClientSession() as session:
            try:
                async with session.post(
                    url + "/v1/chat/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {key}"},
                    timeout=aiohttp.ClientTimeout(total=2.5),
                ) as answer:
                    await answer.read()
                raise AssertionError("the held answer came before the client left")
            except TimeoutError:
                pass
            rows: list[dict[str, int]] = []
            for _ in range(100):
                async with session.get(
                    url + "/admin/usage?by=key", headers={"Authorization": f"Bearer {ADMIN}"}
                ) as usage:
                    rows = (await usage.json())["rows"]
                if rows:
                    break
                await asyncio.sleep(0.1)
        assert rows and rows[0]["output_tokens"] > 300, rows  # (not the estimate of 256)
    finally:
        await server.stop()
        await engine.stop()
