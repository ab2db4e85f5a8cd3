"""Tenant eve fills the store with files and the queue with batches: she holds at most
`batch.tenant_max_files` files and `batch.tenant_max_bytes` bytes of them (429 `files_quota_exceeded`),
and `batch.tenant_max_active` unfinished batches, however often she reuses one input file (429
`batches_quota_exceeded`); bob's uploads and batches go on. Files expire (`batch.file_expiry_days`, or
sooner by OpenAI's `expires_after`) and are then gone from reads and deleted by the sweep."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
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
from corral.store import FileStore, open_database

LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}\n'


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[tuple[str, dict[str, str]]]:
    """A closed gateway whose tenants may hold 3 files of at most 300 bytes together: (url, keys)."""
    batch = BatchSettings(
        tenant_max_files=3, tenant_max_bytes=3 * len(LINE) + 10, tenant_max_active=2, file_expiry_days=2
    )
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


async def upload(
    session: aiohttp.ClientSession, url: str, key: str, content: bytes, **fields: str
) -> tuple[int, dict]:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    for name, value in fields.items():
        form.add_field(name, value)
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
        gone = f"{url}/v1/files/{made[0][1]['id']}"
        async with session.delete(gone, headers=headers) as deleted:
            assert deleted.status == 200
        for path in (gone, gone + "/content"):  # a deleted file, and its stored parts, are gone
            async with session.get(path, headers=headers) as answer:
                assert answer.status == 404
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


async def test_files_expire_and_the_sweep_deletes_them(
    gateway: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    url, keys = gateway
    headers = {"Authorization": f"Bearer {keys['eve']}"}
    async with aiohttp.ClientSession() as session:
        kept = (await upload(session, url, keys["eve"], LINE))[1]
        assert kept["expires_at"] - kept["created_at"] == 2 * 86400  # batch.file_expiry_days
        hour = {"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"}
        brief = (await upload(session, url, keys["eve"], LINE, **hour))[1]
        assert brief["expires_at"] - brief["created_at"] == 3600
        month = {"expires_after[anchor]": "created_at", "expires_after[seconds]": str(30 * 86400)}
        capped = (await upload(session, url, keys["bob"], LINE, **month))[1]
        assert capped["expires_at"] - capped["created_at"] == 2 * 86400  # never past the spec's
        for bad in (
            {**hour, "expires_after[seconds]": "60"},
            {**hour, "expires_after[anchor]": "last_active_at"},
        ):
            status, refused = await upload(session, url, keys["bob"], LINE, **bad)
            assert (status, refused["error"]["param"]) == (400, "expires_after")
        files = FileStore(open_database(f"sqlite:///{tmp_path / 'c.db'}"))
        assert files.sweep_expired(datetime.now(UTC) + timedelta(hours=2)) == 1
        async with session.get(f"{url}/v1/files/{brief['id']}", headers=headers) as answer:
            assert answer.status == 404
        async with session.get(f"{url}/v1/files", headers=headers) as answer:
            assert [f["id"] for f in (await answer.json())["data"]] == [kept["id"]]
        assert files.sweep_expired(datetime.now(UTC) + timedelta(days=3)) == 2  # eve's and bob's


async def test_a_keys_own_file_caps_replace_the_specs(gateway: tuple[str, dict[str, str]]) -> None:
    """`max_files`/`max_file_bytes` on a key (admin API, `keys create`): its tenant may hold more files
    than `batch.tenant_max_files` (3 here) when it uploads with that key, or fewer."""
    url, _ = gateway
    admin = {"Authorization": "Bearer admin"}
    async with aiohttp.ClientSession() as session:
        made = {}
        for tenant, caps in (("zed", {"max_files": 5, "max_file_bytes": 10_000}), ("yan", {"max_files": 1})):
            async with session.post(
                f"{url}/admin/keys", json={"tenant": tenant, **caps}, headers=admin
            ) as answer:
                assert answer.status == 201, await answer.text()
                made[tenant] = (await answer.json())["key"]
        statuses = [(await upload(session, url, made["zed"], LINE))[0] for _ in range(6)]
        assert statuses == [200] * 5 + [429]  # five, past the spec's three
        statuses = [(await upload(session, url, made["yan"], LINE))[0] for _ in range(2)]
        assert statuses == [200, 429]
        async with session.post(
            f"{url}/admin/keys", json={"tenant": "x", "max_files": 0}, headers=admin
        ) as answer:
            assert answer.status == 400


async def test_a_tenant_past_its_quota_makes_no_batch_and_no_upload_of_hers_is_read(
    gateway: tuple[str, dict[str, str]],
) -> None:
    """A batch's results are written as files even past the quota: a tenant at her quota may still make a
    batch of her last upload (a key allowed one file can use it), but one past it makes none (else making
    and cancelling batches in a loop, each writing an error file a line, fills the store past any quota);
    and her uploads are refused before their bodies are read (spooled to disk and parsed, they would cost
    the gateway whatever she sends)."""
    url, keys = gateway
    admin = {"Authorization": "Bearer admin"}

    async def batch_of(key: str, file_id: str) -> tuple[int, dict]:
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        async with session.post(
            url + "/v1/batches", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as answer:
            return answer.status, await answer.json()

    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{url}/admin/keys", json={"tenant": "yan", "max_files": 1}, headers=admin
        ) as made:
            one = (await made.json())["key"]
        only = (await upload(session, url, one, LINE))[1]["id"]
        assert (await batch_of(one, only))[0] == 200  # at her quota: her one file makes a batch
        made = [(await upload(session, url, keys["eve"], LINE))[1]["id"] for _ in range(3)]
        async with session.post(
            f"{url}/admin/keys", json={"tenant": "eve", "max_files": 2}, headers=admin
        ) as answer:
            smaller = (await answer.json())["key"]  # eve's key allowed 2: she holds 3, past it
        status, refused = await batch_of(smaller, made[0])
        assert (status, refused["error"]["code"]) == (429, "files_quota_exceeded")
        assert (await batch_of(keys["eve"], made[0]))[0] == 200  # at the spec's 3: not past it
        # not JSONL: read, it would be a 400 naming the line; refused first, it is the quota's 429
        status, refused = await upload(session, url, keys["eve"], b"not json\n")
        assert (status, refused["error"]["code"]) == (429, "files_quota_exceeded")
        assert (await upload(session, url, keys["bob"], b"not json\n"))[0] == 400  # bob's is read


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_concurrent_uploads_do_not_pass_the_quota_together(tmp_path: Path, database: str) -> None:
    """Each upload counts the tenant's files and adds one in one transaction: on PostgreSQL (READ
    COMMITTED) concurrent ones would each count the old total without the tenant's lock."""
    import io
    import uuid
    from concurrent.futures import ThreadPoolExecutor

    from corral.store import FileQuotaExceeded, NewFile

    url = (
        "postgresql+psycopg://postgres@127.0.0.1:5432/test"
        if database == "postgresql"
        else f"sqlite:///{tmp_path / 'c.db'}"
    )
    files = FileStore(open_database(url))
    tenant = f"eve-{uuid.uuid4().hex[:8]}"

    def add(_: int) -> bool:
        new = NewFile(tenant, "batch", "in.jsonl", io.BytesIO(LINE), len(LINE))
        try:
            files.add_file(new, (1, 10**9))
        except FileQuotaExceeded:
            return False
        return True

    with ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(add, range(16))) == 1
    for found in files.files(tenant, None, 10, None):
        files.delete_file(tenant, found.id)
