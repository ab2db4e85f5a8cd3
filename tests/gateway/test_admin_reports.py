"""The admin API's reports through a real gateway: a tenant-admin polling its usage report from many loops
cannot slow another tenant's requests (their key lookups have threads of their own, and reports are read a
few at a time), and a usage report spans this calendar month unless asked for another span."""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from corral.config import AuthSettings, GatewaySettings
from corral.gateway import GatewayParts, GatewayServer
from corral.gateway.reports import month_start
from corral.routing import Replica, ReplicaSet, ReplicaState, Router
from corral.store import UsageRecord

from .conftest import ScriptedUpstream, make_services

ADMIN = "admin-secret"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class _Gateway:
    def __init__(self, url: str, parts: GatewayParts, session: aiohttp.ClientSession) -> None:
        self.url, self.parts, self.session = url, parts, session

    async def call(self, method: str, path: str, key: str, body: Any = None) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {key}"}
        async with self.session.request(method, self.url + path, json=body, headers=headers) as answer:
            return answer.status, await answer.json()


@pytest.fixture
async def gateway(tmp_path: Path, upstream: ScriptedUpstream) -> AsyncIterator[_Gateway]:
    replicas = ReplicaSet(["m"])
    replicas.add(Replica(id="m-0", model="m", engine="x", url=upstream.url, state=ReplicaState.READY))
    # keys looked up again every half second (5 s by default): each request's lookup is timed often
    auth = AuthSettings(open=False, cache_ttl=0.5)
    parts = make_services(replicas, tmp_path / "corral.db", auth=auth, admin_key=ADMIN)
    server = GatewayServer(GatewaySettings(port=0), Router(replicas, default_policy="round_robin"), parts)
    await server.start()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        yield _Gateway(f"http://127.0.0.1:{server.port}", parts, session)
    await server.stop()


def _records(tenant: str, key_id: str | None, times: list[datetime]) -> list[UsageRecord]:
    return [UsageRecord(at, key_id, tenant, "m", 5, 5, 1.0, 2.0, 200, "m-0", "chat", None) for at in times]


async def test_a_tenant_admin_polling_usage_from_many_loops_leaves_other_tenants_requests_fast(
    gateway: _Gateway,
) -> None:
    """150,000 usage rows of its own tenant this month, polled by day from more loops than asyncio's default
    executor has threads: another tenant's requests, each second looking its key up in the store, stay
    fast (they waited seconds for a thread while the reports held them all)."""
    _, boss = await gateway.call("POST", "/admin/keys", ADMIN, {"tenant": "evil", "role": "tenant-admin"})
    _, other = await gateway.call("POST", "/admin/keys", ADMIN, {"tenant": "good"})
    start, now = month_start(), datetime.now(UTC)
    rows = 150_000
    spread = [start + (now - start) * i / rows for i in range(rows)]
    await asyncio.to_thread(gateway.parts.usage_store.write, _records("evil", boss["id"], spread))
    answered: Counter[int] = Counter()
    stop = asyncio.Event()

    async def poll() -> None:
        while not stop.is_set():
            status, _ = await gateway.call("GET", "/admin/usage?by=day", boss["key"])
            answered[status] += 1

    loops = min(32, (os.cpu_count() or 1) + 4) + 6
    polling = [asyncio.create_task(poll()) for _ in range(loops)]
    try:
        deadline = time.monotonic() + 30
        while answered[200] < 4:  # the reports are being read
            assert time.monotonic() < deadline, answered
            await asyncio.sleep(0.05)
        took, end = [], time.monotonic() + 6
        while time.monotonic() < end:
            began = time.monotonic()
            status, body = await gateway.call("POST", "/v1/chat/completions", other["key"], CHAT)
            took.append(time.monotonic() - began)
            assert status == 200, body
    finally:
        stop.set()
        await asyncio.gather(*polling)
    assert len(took) > 20 and max(took) < 0.5, (len(took), sorted(took)[-5:])
    # (one of its reports at a time: the others refused at once, 429)
    assert set(answered) <= {200, 429} and answered[200] >= 8 and answered[429], answered


async def test_a_usage_report_spans_this_month_unless_asked_for_another_span(gateway: _Gateway) -> None:
    start = month_start()
    before = [start - timedelta(days=3)]
    during = [start + timedelta(seconds=1), datetime.now(UTC)]
    await asyncio.to_thread(gateway.parts.usage_store.write, _records("acme", None, before + during))

    async def requests(query: str) -> int:
        status, body = await gateway.call("GET", "/admin/usage?by=tenant" + query, ADMIN)
        assert status == 200, body
        return sum(row["requests"] for row in body["rows"] if row["tenant"] == "acme")

    status, body = await gateway.call("GET", "/admin/usage?by=tenant", ADMIN)
    assert body["since"] == start.isoformat() and body["until"] is None
    assert await requests("") == 2  # this month's
    assert await requests("&since=0") == 3  # all of it
    last_month = (start - timedelta(days=5)).date().isoformat()
    assert await requests(f"&since={last_month}&until={int(start.timestamp())}") == 1
    up_to = start.isoformat().replace("+", "%2B")
    assert await requests(f"&until={up_to}") == 1  # (until alone: everything before it)
    status, body = await gateway.call("GET", "/admin/usage?by=tenant&since=yesterday", ADMIN)
    assert status == 400 and body["error"]["param"] == "since", body
