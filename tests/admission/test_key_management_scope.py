"""What a tenant-admin may change of its tenant's keys, now that its keys count against its limits: the keys
below it, and keys no one made, which it then adopts. It raised and rotated any user key of its tenant: a
peer's key (spending the peer's allowance with the secret it took) or an admin's (outside every tenant-admin's
limits: 8 requests a minute through keys it raised, for a tenant-admin of 2). A real gateway, SQLite."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ..gateway.conftest import ScriptedUpstream
from .test_gateway_admission import Cluster, start
from .test_key_lineage import CREATOR, ask, make


@pytest.fixture
async def closed(tmp_path: Path, upstream: ScriptedUpstream) -> AsyncIterator[Cluster]:
    server, cluster = await start(tmp_path, upstream)
    yield cluster
    await server.stop()


async def test_a_tenant_admin_changes_no_peers_keys(closed: Cluster) -> None:
    mine = await make(closed, role="tenant-admin", rpm=3)
    peer = await make(closed, role="tenant-admin", rpm=3)
    peers = await make(closed, by=peer["key"], rpm=3)
    own = await make(closed, by=mine["key"], rpm=1)
    for method, path, body in (
        ("PATCH", f"/admin/keys/{peers['id']}", {"rpm": 2}),
        ("POST", f"/admin/keys/{peers['id']}/rotate", {}),
        ("DELETE", f"/admin/keys/{peers['id']}", None),
    ):
        status, refused = await closed.admin(method, path, body, key=mine["key"])
        assert status == 403 and "made by another of the tenant's keys" in refused["error"]["message"]
    assert (await closed.admin("PATCH", f"/admin/keys/{own['id']}", {"rpm": 3}, key=mine["key"]))[0] == 200
    assert (await closed.admin("PATCH", f"/admin/keys/{peers['id']}", {"rpm": 2}, key=peer["key"]))[0] == 200


async def test_a_key_no_one_made_is_adopted_by_the_tenant_admin_that_changes_it(closed: Cluster) -> None:
    mine = await make(closed, role="tenant-admin", rpm=2)
    orphan = await make(closed, rpm=1)  # (an admin's: no maker)
    assert orphan["parent"] is None
    status, changed = await closed.admin("PATCH", f"/admin/keys/{orphan['id']}", {"rpm": 2}, key=mine["key"])
    assert status == 200 and changed["parent"] == mine["id"]
    assert (await ask(closed, mine["key"]))[0] == 200
    assert (await ask(closed, orphan["key"]))[0] == 200
    status, refused, _ = await ask(closed, orphan["key"])  # (its own window has room: its maker's has none)
    assert status == 429 and f"2 requests per minute for {CREATOR}" in refused["error"]["message"]


async def test_a_refused_change_adopts_nothing(closed: Cluster) -> None:
    """A key no one made was adopted before the change was checked: a tenant-admin of rpm 1 tied an
    operator's key of rpm 1000 to its own limits with refused requests (and took it down)."""
    mine = await make(closed, role="tenant-admin", rpm=1)
    orphan = await make(closed, rpm=1000)
    for method, path, body, status in (
        ("PATCH", f"/admin/keys/{orphan['id']}", {"rpm": 5000}, 403),
        ("PATCH", f"/admin/keys/{orphan['id']}", {"rpm": "x"}, 400),
        ("POST", f"/admin/keys/{orphan['id']}/rotate", {}, 403),
        ("DELETE", f"/admin/keys/{orphan['id']}", None, 200),
    ):
        assert (await closed.admin(method, path, body, key=mine["key"]))[0] == status
    _, shown = await closed.admin("GET", f"/admin/keys/{orphan['id']}")
    assert shown["parent"] is None
