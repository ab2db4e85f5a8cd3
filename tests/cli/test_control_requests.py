"""The requests `corral drain` and `corral rollout` send, and the mistakes they refuse before sending: a
model's name may hold a slash (`org/model`), which went into the path as it was (a 404); a URL or key that
cannot be sent was an "unexpected error"."""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.test_utils import TestServer

from .test_errors import corral, one_error


async def test_drain_and_rollout_actions_reach_a_model_named_with_a_slash() -> None:
    asked: list[dict[str, str]] = []

    async def drain(request: web.Request) -> web.Response:
        asked.append(dict(request.match_info))
        replica = request.match_info["replica_id"]
        return web.json_response({"replica": replica, "model": "org/m", "waited_s": 0.1, "idle": True})

    async def rollout(request: web.Request) -> web.Response:
        asked.append(dict(request.match_info))
        state = {"model": request.match_info["model"], "revision": 2, "strategy": "canary", "phase": "paused"}
        return web.json_response(state)

    app = web.Application()
    app.router.add_post("/admin/replicas/{replica_id}/drain", drain)
    app.router.add_post("/admin/rollouts/{model}/{action}", rollout)
    async with TestServer(app, host="127.0.0.1") as server:
        url = str(server.make_url("")).rstrip("/")
        drained = await asyncio.to_thread(corral, "drain", "org/m-0", "--url", url)
        paused = await asyncio.to_thread(corral, "rollout", "pause", "org/m", "--url", url)
    assert drained.returncode == 0 and "drained org/m-0 (org/m)" in drained.stderr, drained.stderr
    assert paused.returncode == 0 and "rollout org/m revision 2" in paused.stderr, paused.stderr
    assert asked == [{"replica_id": "org/m-0"}, {"model": "org/m", "action": "pause"}]


def test_a_url_or_key_that_cannot_be_sent_is_one_error_line() -> None:
    one_error(corral("status", "--url", "nourl"), 2, "--url 'nourl'", "http://HOST:PORT")
    one_error(corral("status", "--url", "http://[::1"), 2, "--url", "Invalid IPv6 URL")
    one_error(corral("status", env={"CORRAL_URL": "ftp://gateway"}), 2, "$CORRAL_URL", "ftp://gateway")
    newline = corral("status", "--url", "http://127.0.0.1:9", "--admin-key", "abc\n")
    one_error(newline, 2, "--admin-key", "trailing newline")
