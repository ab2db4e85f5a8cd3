"""Secrets stay secret: keys are stored and compared as hashes, never logged or echoed; tenants are kept
apart; the admin API takes only the admin key."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from ..gateway.conftest import ScriptedUpstream
from .test_gateway_admission import ADMIN, Cluster, start


@pytest.fixture
async def closed(tmp_path: Path, upstream: ScriptedUpstream) -> AsyncIterator[Cluster]:
    server, cluster = await start(tmp_path, upstream)
    yield cluster
    await server.stop()


async def call(
    cluster: Cluster, method: str, path: str, key: str, body: dict | None = None
) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.request(
            method, cluster.url + path, json=body, headers={"Authorization": f"Bearer {key}"}
        ) as r,
    ):
        return r.status, await r.text()


async def test_keys_are_stored_only_as_hashes(closed: Cluster) -> None:
    _, made = await closed.admin("POST", "/admin/keys", {"tenant": "acme"})
    secret = made["key"]
    assert secret.encode() not in closed.database.read_bytes()
    for wal in closed.database.parent.glob("*.db-wal"):
        assert secret.encode() not in wal.read_bytes()


async def test_keys_are_never_echoed_or_logged(closed: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    made_up = "sk-corral-made-up-SECRET-0123456789"
    _, limited = await closed.admin("POST", "/admin/keys", {"tenant": "acme", "models": ["other"], "rpm": 1})
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    answers = [
        await call(closed, "POST", "/v1/chat/completions", made_up, body),  # 401
        await call(closed, "POST", "/v1/chat/completions", limited["key"], body),  # 403
        await call(closed, "GET", "/admin/keys", limited["key"]),  # 403: a user key's role may not
        await call(closed, "GET", "/corral/status", made_up),  # 401
    ]
    assert [status for status, _ in answers] == [401, 403, 403, 401]
    for secret in (made_up, limited["key"], ADMIN):
        assert all(secret not in text for _, text in answers)
        assert secret not in caplog.text


async def test_admin_routes_refuse_tenant_keys(closed: Cluster) -> None:
    _, tenant = await closed.admin("POST", "/admin/keys", {"tenant": "acme"})
    for method, path in (
        ("GET", "/admin/keys"),
        ("POST", "/admin/keys"),
        ("GET", f"/admin/keys/{tenant['id']}"),
        ("DELETE", f"/admin/keys/{tenant['id']}"),
        ("GET", "/admin/usage"),
        ("GET", "/admin/routing"),
    ):
        status, text = await call(
            closed, method, path, tenant["key"], {"tenant": "evil"} if method == "POST" else None
        )
        assert status == 403 and "role 'user' may not" in text, (method, path)
    status, key = await closed.admin("GET", f"/admin/keys/{tenant['id']}")
    assert status == 200 and key["revoked_at"] is None  # the DELETE above did nothing


async def test_a_tenant_sees_neither_other_tenants_usage_nor_their_models(closed: Cluster) -> None:
    _, acme = await closed.admin("POST", "/admin/keys", {"tenant": "acme", "models": ["m"]})
    _, globex = await closed.admin("POST", "/admin/keys", {"tenant": "globex", "models": ["other"]})
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert (await call(closed, "POST", "/v1/chat/completions", acme["key"], body))[0] == 200
    status, text = await call(closed, "GET", "/admin/usage?by=tenant", globex["key"])
    assert status == 403 and "acme" not in text
    status, text = await call(closed, "GET", "/corral/status", globex["key"])
    assert status == 200 and '"m-0"' not in text
    status, text = await call(closed, "GET", "/corral/status", acme["key"])
    (replica,) = json.loads(text)["replicas"]  # its model's replica, without where and how it runs
    assert status == 200 and replica["id"] == "m-0" and replica["state"] == "ready"
    assert not {"url", "pid", "node", "gpus", "log_tail", "last_error"} & set(replica)
