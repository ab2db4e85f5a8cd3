"""A fanned-out request whose last part fails with a 5xx after the others were answered: the parts that ran
are charged (usage row, limits), not refunded with the failed one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from corral.config import GatewaySettings
from corral.engines import EngineFeatures
from corral.gateway import GatewayServer
from corral.routing import Replica, ReplicaSet, ReplicaState, Router
from corral.store.schema import UsageRow

from .conftest import make_services

MESSAGES = [{"role": "user", "content": "hi"}]
USAGE = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}


class OneChoiceEngine:
    """Answers each single-choice request at once, but the one with seed 2, which it drops (the connection
    closed before any answer) once the gateway has the other two answers (its replica holds only that one
    request)."""

    def __init__(self) -> None:
        self.answered = 0
        self.url = ""
        self.replica: Replica | None = None
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._answer)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("seed") == 2:
            for _ in range(500):  # (5 s at most)
                if self.answered == 2 and self.replica is not None and self.replica.outstanding == 1:
                    break
                await asyncio.sleep(0.01)
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        self.answered += 1
        choice = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hello"}}
        return web.json_response(
            {"id": "c", "object": "chat.completion", "choices": [choice], "usage": USAGE}
        )


@pytest.fixture
async def engine() -> AsyncIterator[OneChoiceEngine]:
    server = OneChoiceEngine()
    await server.start()
    yield server
    await server.stop()


async def _usage_rows(database: Path, key_id: str) -> list[tuple[int, int, int]]:
    """(status, input tokens, output tokens) of the key's usage rows, once any is written."""
    engine = create_engine(f"sqlite:///{database}")
    deadline, rows = time.monotonic() + 5, []
    while not rows and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        with Session(engine) as db:
            found = db.execute(
                select(UsageRow.status, UsageRow.input_tokens, UsageRow.output_tokens).where(
                    UsageRow.key_id == key_id
                )
            )
            rows = [(int(status), int(tokens_in), int(tokens_out)) for status, tokens_in, tokens_out in found]
    return rows


async def test_parts_answered_before_another_part_failed_are_charged(
    tmp_path: Path, engine: OneChoiceEngine
) -> None:
    """n = 3 on an engine that makes one choice a request: two parts answered (7 tokens each, the prompt's
    5 once), then the third failed on every replica (502). The two were charged nothing: the request's
    usage was left unset on that path, and a 5xx keeps no reservation."""
    replicas = ReplicaSet(["m"])
    engine.replica = Replica(
        id="m-0",
        model="m",
        engine="llamacpp",
        url=engine.url,
        state=ReplicaState.READY,
        features=EngineFeatures(multiple_choices=False),
    )
    replicas.add(engine.replica)
    database = tmp_path / "corral.db"
    services = make_services(replicas, database)
    server = GatewayServer(GatewaySettings(port=0), Router(replicas), services)
    await server.start()
    try:
        key, record = services.keys.create("t")
        body = {"model": "m", "messages": MESSAGES, "max_tokens": 50, "n": 3, "seed": 0}
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"http://127.0.0.1:{server.port}/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {key}"},
            ) as response,
        ):
            answer = await response.json()
        assert response.status == 502, answer
        assert engine.answered == 2
        assert await _usage_rows(database, record.id) == [(502, 5, 14)]
    finally:
        await server.stop()
