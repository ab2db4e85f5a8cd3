"""What a tenant-admin reads of its tenant's usage (the console's tenant panel, `/admin/usage`): a request
made with a key above it (an admin's or operator's key of its tenant) is found by its id, but without that
key's id, as usage by key merges those keys into one row with no key."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.admission.test_gateway_admission import ADMIN, Cluster, start
from tests.admission.test_roles import asked, call, key
from tests.gateway.conftest import ScriptedUpstream


@pytest.fixture
async def closed(tmp_path: Path, upstream: ScriptedUpstream) -> AsyncIterator[Cluster]:
    server, cluster = await start(tmp_path, upstream)
    yield cluster
    await server.stop()


async def recorded(cluster: Cluster, request_id: str) -> list[dict]:
    """The usage rows of `request_id`, as the admin key reads them, once written (every flush interval)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = (await call(cluster, "GET", f"/admin/usage?request_id={request_id}", ADMIN))[1]["rows"]
        if rows:
            return list(rows)
        await asyncio.sleep(0.1)
    raise AssertionError(f"no usage recorded for {request_id}")


async def test_a_tenant_admin_reads_a_request_of_a_key_above_it_without_that_keys_id(closed: Cluster) -> None:
    boss = await key(closed, tenant="acme", role="tenant-admin", rpm=100)
    chief = await key(closed, tenant="acme", role="admin")
    staff = await key(closed, tenant="acme")
    above, ours = await asked(closed, chief["key"]), await asked(closed, staff["key"])
    assert [r["key_id"] for r in await recorded(closed, above)] == [chief["id"]]  # the admin sees it
    assert [r["key_id"] for r in await recorded(closed, ours)] == [staff["id"]]

    found = (await call(closed, "GET", f"/admin/usage?request_id={above}", boss["key"]))[1]["rows"]
    assert [(r["tenant"], r["key_id"], r["status"]) for r in found] == [("acme", None, 200)]
    found = (await call(closed, "GET", f"/admin/usage?request_id={ours}", boss["key"]))[1]["rows"]
    assert [(r["tenant"], r["key_id"]) for r in found] == [("acme", staff["id"])]  # its tenant's user key
    # usage by key tells the same: the admin's key is in the one row with no key
    by_key = (await call(closed, "GET", "/admin/usage?by=key", boss["key"]))[1]["rows"]
    assert chief["id"] not in {r["key"] for r in by_key} and None in {r["key"] for r in by_key}
