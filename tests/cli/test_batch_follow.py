"""`corral batch` following a batch through a gateway restart: a gateway away for a while is waited for; one
away longer ends the command with its own exit code (3: the batch goes on), not a failed batch's (1)."""

from __future__ import annotations

import asyncio
import socket

import pytest
import typer
from aiohttp import web

from corral.cli.batch import _Gateway


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_gateway_away_for_a_restart_is_waited_for() -> None:
    port = _free_port()
    gateway = _Gateway(f"http://127.0.0.1:{port}", None, None)
    app = web.Application()
    app.router.add_get("/v1/batches/b", lambda _: web.json_response({"id": "b", "status": "in_progress"}))
    runner = web.AppRunner(app)
    await runner.setup()

    async def back_later() -> None:
        await asyncio.sleep(2.5)  # (the gateway restarting)
        await web.TCPSite(runner, "127.0.0.1", port).start()

    later = asyncio.create_task(back_later())
    try:
        assert (await gateway.call("GET", "/v1/batches/b", patient=20))["status"] == "in_progress"
    finally:
        await later
        await runner.cleanup()
    with pytest.raises(typer.Exit) as ended:
        await gateway.call("GET", "/v1/batches/b", patient=2)  # (gone for good now)
    assert ended.value.exit_code == 3
    with pytest.raises(typer.Exit) as once:
        await gateway.call("GET", "/v1/batches/b")  # (not following: one try, the usual error)
    assert once.value.exit_code == 1
