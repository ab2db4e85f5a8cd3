"""Tenant eve fills the store with files and the queue with batches: she holds at most
`batch.tenant_max_files` files and `batch.tenant_max_bytes` bytes of them (429 `files_quota_exceeded`),
and `batch.tenant_max_active` unfinished batches, however often she reuses one input file (429
`batches_quota_exceeded`); bob's uploads and batches go on."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from corral.config import (
    AuthSettings,
    BatchSettings,
    GatewaySettings,
    LimitsSettings,
    QueueSettings,
    StoreSettings,
)
from corral.gateway import GatewayParts, GatewayServer
from corral.routing import ReplicaSet, Router

LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}\n'


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[tuple[str, dict[str, str]]]:
    """A closed gateway whose tenants may hold 3 files of at most 300 bytes together: (url, keys)."""
    batch = BatchSettings(tenant_max_files=3, tenant_max_bytes=3 * len(LINE) + 10, tenant_max_active=2)
    replicas = ReplicaSet(["m"])
    parts = GatewayParts.build(
        replicas,
        f"sqlite:///{tmp_path / 'c.db'}",
        AuthSettings(open=False),
        StoreSettings(),
        LimitsSettings(),
        QueueSettings(),
        admin_key="admin",
        batch=batch,
    )
    keys = {tenant: parts.keys.create(tenant)[0] for tenant in ("eve", "bob")}
    server = GatewayServer(GatewaySettings(port=0), Router(replicas), parts)
    await server.start()
    yield f"http://127.0.0.1:{server.port}", keys
    await server.stop()


async def upload(session: aiohttp.ClientSession, url: str, key: str, content: bytes) -> tuple[int, dict]:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", content, filename="in.jsonl", content_type="application/jsonl")
    headers = {"Authorization": f"Bearer {key}"}
    async with session.post(url + "/v1/files", data=form, headers=headers) as answer:
        return answer.status, await answer.json()


async def test_a_tenant_holds_at_most_its_files_and_bytes(gateway: tuple[str, dict[str, str]]) -> None:
    url, keys = gateway
    async with aiohttp.ClientSession() as session:
        made = [await upload(session, url, keys["eve"], LINE) for _ in range(3)]
        assert [status for status, _ in made] == [200, 200, 200]
        status, refused = await upload(session, url, keys["eve"], LINE)
        assert (status, refused["error"]["code"]) == (429, "files_quota_exceeded")
        assert "3 files" in refused["error"]["message"]
        assert (await upload(session, url, keys["bob"], LINE))[0] == 200  # bob's own share
        headers = {"Authorization": f"Bearer {keys['eve']}"}
        async with session.delete(f"{url}/v1/files/{made[0][1]['id']}", headers=headers) as deleted:
            assert deleted.status == 200
        assert (await upload(session, url, keys["eve"], LINE))[0] == 200  # room again


async def test_a_tenant_holds_at_most_its_bytes(gateway: tuple[str, dict[str, str]]) -> None:
    url, keys = gateway
    async with aiohttp.ClientSession() as session:
        assert (await upload(session, url, keys["eve"], LINE * 2))[0] == 200
        status, refused = await upload(session, url, keys["eve"], LINE * 2)
        assert (status, refused["error"]["code"]) == (429, "files_quota_exceeded")
        assert "bytes" in refused["error"]["message"]


async def test_one_input_file_feeds_at_most_the_tenants_unfinished_batches(
    gateway: tuple[str, dict[str, str]],
) -> None:
    url, keys = gateway
    async with aiohttp.ClientSession() as session:

        async def batch_of(tenant: str, file_id: str) -> tuple[int, dict]:
            body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
            headers = {"Authorization": f"Bearer {keys[tenant]}"}
            async with session.post(url + "/v1/batches", json=body, headers=headers) as answer:
                return answer.status, await answer.json()

        eves = (await upload(session, url, keys["eve"], LINE))[1]["id"]
        made = [await batch_of("eve", eves) for _ in range(2)]  # no replica runs them: they stay unfinished
        assert [status for status, _ in made] == [200, 200]
        status, refused = await batch_of("eve", eves)
        assert (status, refused["error"]["code"]) == (429, "batches_quota_exceeded")
        bobs = (await upload(session, url, keys["bob"], LINE))[1]["id"]
        assert (await batch_of("bob", bobs))[0] == 200
