"""Keys a tenant-admin makes stay within its own limits together: each names its maker (`parent`), and every
request of it counts against the maker's rpm, max_concurrency and monthly budget too (and its maker's
maker's), in the maker's own windows, through a real gateway on a real SQLite store (and one with the
Redis limiter). Before, each key was only as large as its maker's, and fifty of them got fifty times its
limits."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from corral.admission import BudgetTracker, Principal
from corral.config import LimitsSettings
from corral.protocol import RateLimited
from corral.store import KeyStore, UsageRecord, UsageStore, open_database

from ..gateway.conftest import ScriptedUpstream
from .test_gateway_admission import ADMIN, Cluster, start

REDIS = "redis://127.0.0.1:6379/12"  # (a database the suite's other Redis tests leave alone)
CREATOR = "the key that created this one"


@pytest.fixture
async def closed(tmp_path: Path, upstream: ScriptedUpstream) -> AsyncIterator[Cluster]:
    server, cluster = await start(tmp_path, upstream)
    yield cluster
    await server.stop()


async def ask(cluster: Cluster, key: str, max_tokens: int = 2) -> tuple[int, dict[str, Any], Any]:
    """(status, body, headers) of a chat request with `key`."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            cluster.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as answer,
    ):
        return answer.status, await answer.json(), answer.headers


async def make(cluster: Cluster, by: str = ADMIN, **fields: object) -> dict[str, Any]:
    status, made = await cluster.admin("POST", "/admin/keys", {"tenant": "acme", **fields}, key=by)
    assert status == 201, made
    return made


async def test_the_keys_a_tenant_admin_makes_share_its_rpm(closed: Cluster) -> None:
    """Two keys of rpm 3 made by a tenant-admin of rpm 3 get 3 requests a minute together, then a 429 that
    names the creator's limit (not its id or secret) with an honest Retry-After; its own key is out too."""
    admin = await make(closed, role="tenant-admin", rpm=3)
    first = await make(closed, by=admin["key"], rpm=3)
    second = await make(closed, by=admin["key"], rpm=3)
    assert (first["parent"], second["parent"]) == (admin["id"], admin["id"])
    statuses = [(await ask(closed, k["key"]))[0] for k in (first, first, second)]
    assert statuses == [200, 200, 200]
    status, refused, headers = await ask(closed, second["key"])
    assert status == 429, refused
    message = refused["error"]["message"]
    assert f"3 requests per minute for {CREATOR}" in message
    assert admin["id"] not in message and admin["key"][10:16] not in message
    assert 40 <= int(headers["Retry-After"]) <= 60  # (the creator's oldest request leaves its window then)
    assert not any(name.startswith(("x-ratelimit-limit", "x-ratelimit-remaining")) for name in headers)
    assert (await ask(closed, first["key"]))[0] == 429
    assert (await ask(closed, admin["key"]))[0] == 429  # (its own key's window holds its keys' requests)
    _, listed = await closed.admin("GET", "/admin/keys")
    parents = {k["id"]: k["parent"] for k in listed["keys"]}
    assert parents == {admin["id"]: None, first["id"]: admin["id"], second["id"]: admin["id"]}


async def test_the_keys_a_tenant_admin_makes_share_its_concurrency(
    closed: Cluster, upstream: ScriptedUpstream
) -> None:
    admin = await make(closed, role="tenant-admin", max_concurrency=2)
    first = await make(closed, by=admin["key"], max_concurrency=2)
    second = await make(closed, by=admin["key"], max_concurrency=2)
    upstream.delay = 3.0
    held = [asyncio.create_task(ask(closed, first["key"])) for _ in range(2)]
    deadline = time.monotonic() + 10
    while upstream.active < 2:
        assert time.monotonic() < deadline, "the first key's two requests never reached the engine"
        await asyncio.sleep(0.02)
    status, refused, _ = await ask(closed, second["key"])
    assert status == 429 and f"at most 2 for {CREATOR}" in refused["error"]["message"], refused
    assert [answer[0] for answer in await asyncio.gather(*held)] == [200, 200]
    upstream.delay = 0.0
    assert (await ask(closed, second["key"]))[0] == 200  # (their slots were given back)


async def test_the_keys_a_tenant_admin_makes_share_its_monthly_budget(
    closed: Cluster, upstream: ScriptedUpstream
) -> None:
    """A tenant-admin's budget of 1,000 tokens: its two keys of 1,000 each use 400 apiece; a third request
    of 400 fits either key's own budget but not the creator's, which is named."""
    upstream.usage = {"prompt_tokens": 5, "completion_tokens": 395, "total_tokens": 400}
    admin = await make(closed, role="tenant-admin", monthly_token_budget=1_000)
    first = await make(closed, by=admin["key"], monthly_token_budget=1_000)
    second = await make(closed, by=admin["key"], monthly_token_budget=1_000)
    assert (await ask(closed, first["key"], 380))[0] == 200
    assert (await ask(closed, second["key"], 380))[0] == 200
    status, refused, headers = await ask(closed, first["key"], 380)
    assert status == 429 and refused["error"]["code"] == "insufficient_quota", refused
    assert refused["error"]["message"].startswith("The key that created this one"), refused
    assert "800 of its 1,000 tokens this month (200 left)" in refused["error"]["message"]
    assert int(headers["Retry-After"]) > 60  # (at the month's turn: nothing settles sooner)
    assert (await ask(closed, admin["key"], 380))[0] == 429  # its own requests count its keys' use
    assert (await ask(closed, second["key"], 100))[0] == 200  # (what is left of it, it may still use)


async def test_a_revoked_creator_still_limits_and_rotation_keeps_the_parent(closed: Cluster) -> None:
    admin = await make(closed, role="tenant-admin", rpm=2)
    first = await make(closed, by=admin["key"], rpm=2)
    second = await make(closed, by=admin["key"], rpm=2)
    status, rotated = await closed.admin(
        "POST", f"/admin/keys/{first['id']}/rotate?grace=0", key=admin["key"]
    )
    assert status == 200 and rotated["parent"] == admin["id"], rotated
    status, _ = await closed.admin("DELETE", f"/admin/keys/{admin['id']}")
    assert status == 200
    assert [(await ask(closed, k))[0] for k in (rotated["key"], second["key"])] == [200, 200]
    status, refused, _ = await ask(closed, second["key"])  # its creator's limits, not its access
    assert status == 429 and CREATOR in refused["error"]["message"], refused
    deadline = time.monotonic() + 5  # (the revoked key itself is refused once its cached entry ends)
    while (await ask(closed, admin["key"]))[0] != 401:
        assert time.monotonic() < deadline, "the revoked creator's key still worked"
        await asyncio.sleep(0.05)


async def test_a_chain_of_tenant_admins_is_limited_at_every_level_and_bounded(closed: Cluster) -> None:
    """A tenant-admin's key made by a tenant-admin: the keys below both count against both (a grandchild
    is refused by its creator's creator); eight generations below an admin's key, no key is made."""
    top = await make(closed, role="tenant-admin", rpm=3)
    middle = await make(closed, by=top["key"], role="tenant-admin", rpm=3)
    beside = await make(closed, by=top["key"], rpm=3)
    below = await make(closed, by=middle["key"], rpm=3)
    assert below["parent"] == middle["id"]
    assert [(await ask(closed, k["key"]))[0] for k in (beside, beside, below)] == [200, 200, 200]
    status, refused, _ = await ask(closed, below["key"])
    assert status == 429, refused
    assert "for the key that created this key's creator" in refused["error"]["message"]
    chain = [middle]
    while len(chain) < 8:
        chain.append(await make(closed, by=chain[-1]["key"], role="tenant-admin", rpm=3))
    wanted = {"tenant": "acme", "rpm": 3}
    status, too_deep = await closed.admin("POST", "/admin/keys", wanted, key=chain[-1]["key"])
    assert status == 403 and too_deep["error"]["code"] == "too_many_generations", too_deep


async def test_an_old_store_without_parents_opens_and_its_keys_work(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    database = tmp_path / "corral.db"
    engine = open_database(f"sqlite:///{database}")
    old_key, old = KeyStore(engine).create("acme", role="tenant-admin", rpm=2)
    engine.dispose()
    with sqlite3.connect(database) as db:  # as an earlier corral made it: no column, no index
        db.execute("DROP INDEX ix_corral_api_keys_parent")
        db.execute("ALTER TABLE corral_api_keys DROP COLUMN parent")
    server, cluster = await start(tmp_path, upstream)
    try:
        assert (await ask(cluster, old_key))[0] == 200
        _, listed = await cluster.admin("GET", "/admin/keys")
        assert [(k["id"], k["parent"]) for k in listed["keys"]] == [(old.id, None)]
        made = await make(cluster, by=old_key, rpm=2)
        assert made["parent"] == old.id
        statuses = [(await ask(cluster, made["key"]))[0] for _ in range(2)]
        assert statuses == [200, 429]  # (the old key's 2 a minute, one of them its own)
    finally:
        await server.stop()


async def test_a_tenant_admins_keys_share_its_rpm_and_budget_with_the_redis_limiter(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    import redis.asyncio as aioredis

    upstream.usage = {"prompt_tokens": 5, "completion_tokens": 395, "total_tokens": 400}
    limits = LimitsSettings(backend="redis", redis_url=REDIS)
    server, cluster = await start(tmp_path, upstream, limits=limits)
    made: list[dict[str, Any]] = []
    try:
        admin = await make(cluster, role="tenant-admin", rpm=3, monthly_token_budget=1_000)
        made.append(admin)
        for _ in range(2):
            made.append(await make(cluster, by=admin["key"], rpm=3, monthly_token_budget=1_000))
        first, second = made[1:]
        assert (await ask(cluster, first["key"], 380))[0] == 200
        assert (await ask(cluster, second["key"], 380))[0] == 200
        status, refused, _ = await ask(cluster, first["key"], 380)  # (the creator's month: 800 of 1,000)
        assert status == 429 and refused["error"]["message"].startswith("The key that created"), refused
        upstream.usage = {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}
        assert (await ask(cluster, second["key"], 50))[0] == 200  # the third of the creator's 3 a minute
        status, refused, _ = await ask(cluster, first["key"], 10)
        assert status == 429 and f"3 requests per minute for {CREATOR}" in refused["error"]["message"]
    finally:
        await server.stop()
        client = aioredis.from_url(REDIS)
        for key in made:
            async for name in client.scan_iter(match=f"corral:*:{key['id']}:*"):
                await client.delete(name)
        await client.aclose()


def test_a_creators_month_counts_what_its_keys_used_before_the_gateway_started(tmp_path: Path) -> None:
    """A gateway that starts (or re-reads the store) mid-month finds a tenant-admin's month as the use of
    its keys and those below them: their 900 tokens leave 100 of its 1,000, whichever key asks."""
    engine = open_database(f"sqlite:///{tmp_path / 'corral.db'}")
    keys, usage = KeyStore(engine), UsageStore(engine)
    _, admin = keys.create("acme", role="tenant-admin", monthly_token_budget=1_000)
    _, middle = keys.create("acme", role="tenant-admin", monthly_token_budget=1_000, parent=admin.id)
    _, below = keys.create("acme", monthly_token_budget=1_000, parent=middle.id)
    _, beside = keys.create("acme", monthly_token_budget=1_000, parent=admin.id)
    _, elsewhere = keys.create("acme", monthly_token_budget=1_000)
    at = datetime.now(UTC)
    usage.write(
        [
            UsageRecord(at, key.id, "acme", "m", 0, tokens, None, 1.0, 200, None)
            for key, tokens in ((below, 500), (middle, 400), (elsewhere, 5_000))
        ]
    )
    parents = (Principal.of(admin),)
    asking = Principal.of(beside, parents)

    async def asked() -> None:
        tracker = BudgetTracker(usage, keys=keys)
        with pytest.raises(RateLimited, match=r"The key that created this one .* 900 of its 1,000"):
            await tracker.reserve(asking, 200)
        assert await tracker.reserve(asking, 100) is not None

    asyncio.run(asked())
    engine.dispose()
