"""Who may do what: every administrative route against every role (a matrix made from the route table in
gateway/access.py: a route served without a permission there fails here), the audit trail (one record per
action, refusals included, never changed through the API), key expiry and rotation, and a tenant-admin
managing its own tenant's keys within its own limits."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from urllib.parse import urlencode

import aiohttp
import pytest

from corral.config import GatewaySettings
from corral.gateway.access import ROLES, ROUTES
from corral.gateway.app import build_app
from corral.routing import Router

from ..gateway.conftest import ScriptedUpstream
from .test_gateway_admission import ADMIN, Cluster, start

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
async def closed(tmp_path: Path, upstream: ScriptedUpstream) -> AsyncIterator[Cluster]:
    server, cluster = await start(tmp_path, upstream)
    yield cluster
    await server.stop()


async def call(cluster: Cluster, method: str, path: str, key: str, body: object = None) -> tuple[int, dict]:
    async with (
        aiohttp.ClientSession() as session,
        session.request(
            method,
            cluster.url + path,
            data=body if isinstance(body, str) else json.dumps(body) if body is not None else None,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        ) as answer,
    ):
        text = await answer.text()
        return answer.status, json.loads(text) if text.startswith("{") else {"text": text}


async def asked(cluster: Cluster, key: str) -> str:
    """A chat request with `key`; the id its answer told (x-request-id)."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            cluster.url + "/v1/chat/completions", json=BODY, headers={"Authorization": f"Bearer {key}"}
        ) as answer,
    ):
        assert answer.status == 200, await answer.text()
        return answer.headers["x-request-id"]


async def key(cluster: Cluster, tenant: str = "acme", **fields: object) -> dict:
    status, made = await cluster.admin("POST", "/admin/keys", {"tenant": tenant, **fields})
    assert status == 201, made
    return made


def test_every_admin_route_the_app_serves_names_its_permission(tmp_path: Path) -> None:
    from corral.config import AuthSettings
    from corral.routing import ReplicaSet

    from .test_gateway_admission import make_services

    replicas = ReplicaSet(["m"])
    parts = make_services(replicas, tmp_path / "c.db", auth=AuthSettings(open=False), admin_key=ADMIN)

    async def served() -> set[tuple[str, str]]:
        app = build_app(GatewaySettings(), Router(replicas), parts)
        routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource is not None}
        await app.cleanup()
        return routes

    routes = asyncio.run(served())
    admin = {(m, p) for m, p in routes if p.startswith("/admin/") and m != "HEAD"}
    assert admin <= set(ROUTES), admin - set(ROUTES)  # a new admin route must say who may use it
    assert set(ROUTES) <= routes, set(ROUTES) - routes


@pytest.mark.parametrize("role", sorted(ROLES))
async def test_each_role_on_each_admin_route(closed: Cluster, role: str) -> None:
    mine = await key(closed, role=role)
    for (method, route), permission in sorted(ROUTES.items()):
        target = await key(closed)  # a key of its tenant for the routes that name one
        path = (
            route.replace("{key_id}", target["id"])
            .replace("{replica_id}", "m-0")
            .replace("{node}", "nowhere")
            .replace("{model}", "m")
            .replace("{action}", "pause")
        )
        body: object = None
        if (method, route) == ("POST", "/admin/keys"):
            body = {"tenant": "acme"}
        elif method == "PATCH":
            body = {"rpm": 5}
        elif route == "/admin/spec":
            body = "not: [a spec"
        status, answer = await call(closed, method, path, mine["key"], body)
        allowed = permission in ROLES[role]
        if allowed:
            assert status not in (401, 403), (role, method, route, answer)
        else:
            assert status == 403 and answer["error"]["code"] == "role_not_allowed", (role, method, route)


async def test_every_administrative_action_leaves_one_audit_record(closed: Cluster) -> None:
    viewer = await key(closed, tenant="ops", role="viewer")
    operator = await key(closed, tenant="ops", role="operator")
    made = await key(closed, tenant="acme", monthly_token_budget=1000)
    taken = [
        (await call(closed, "PATCH", f"/admin/keys/{made['id']}", ADMIN, {"monthly_token_budget": 5000}))[0],
        (await call(closed, "POST", f"/admin/keys/{made['id']}/rotate?grace=0", ADMIN))[0],
        (await call(closed, "DELETE", f"/admin/keys/{made['id']}", ADMIN))[0],
        (await call(closed, "POST", "/admin/spec", viewer["key"], "models: []"))[0],  # refused: a viewer
        (await call(closed, "POST", "/admin/replicas/m-0/drain", operator["key"]))[0],  # no supervisor: 501
        (await call(closed, "GET", "/admin/keys", ADMIN))[0],  # a read: not an action
    ]
    assert taken == [200, 200, 200, 403, 501, 200]
    status, trail = await call(closed, "GET", "/admin/audit", operator["key"])
    assert status == 200
    entries = list(reversed(trail["entries"]))
    assert [(e["action"], e["actor"], e["role"], e["status"]) for e in entries] == [
        ("key.create", "admin-key", "admin", 201),
        ("key.create", "admin-key", "admin", 201),
        ("key.create", "admin-key", "admin", 201),
        ("key.update", "admin-key", "admin", 200),
        ("key.rotate", "admin-key", "admin", 200),
        ("key.revoke", "admin-key", "admin", 200),
        ("spec.apply", f"key:{viewer['id']}", "viewer", 403),
        ("replica.drain", f"key:{operator['id']}", "operator", 501),
    ]
    update = entries[3]
    assert update["target"] == made["id"] and update["source"] == "127.0.0.1"
    assert update["detail"]["before"] == {"monthly_token_budget": 1000}
    assert update["detail"]["after"] == {"monthly_token_budget": 5000}
    assert all(made.get("key", "") not in json.dumps(e) for e in entries)  # no secret on record
    filtered = (await call(closed, "GET", "/admin/audit?action=key.*&limit=2", ADMIN))[1]["entries"]
    assert [e["action"] for e in filtered] == ["key.revoke", "key.rotate"]
    async with (  # a record names its request: the id its answer told (x-request-id)
        aiohttp.ClientSession() as session,
        session.patch(
            closed.url + f"/admin/keys/{viewer['id']}",
            json={"rpm": 7},
            headers={"Authorization": f"Bearer {ADMIN}"},
        ) as answer,
    ):
        assert answer.status == 200
        told = answer.headers["x-request-id"]
    latest = (await call(closed, "GET", "/admin/audit?action=key.update&limit=1", ADMIN))[1]["entries"][0]
    assert latest["target"] == viewer["id"] and latest["request_id"] == told and told.startswith("req_")
    (by_id,) = (await call(closed, "GET", f"/admin/audit?request_id={told}", ADMIN))[1]["entries"]
    assert by_id == latest
    at = datetime.fromisoformat(latest["at"])  # `since` in another zone is the same moment
    for zone, kept in ((2, True), (-5, True), (2, False)):
        since = (at + timedelta(seconds=-60 if kept else 60)).astimezone(timezone(timedelta(hours=zone)))
        path = "/admin/audit?action=key.update&" + urlencode({"since": since.isoformat()})
        assert ((await call(closed, "GET", path, ADMIN))[1]["entries"][:1] == [latest]) is kept, since
    for method in ("POST", "PUT", "PATCH", "DELETE"):  # the trail cannot be edited through the API
        assert (await call(closed, method, "/admin/audit", ADMIN))[0] == 405


async def test_keys_expire_and_rotate_with_a_grace_period(closed: Cluster) -> None:
    short = await key(closed, expires_in_s=1)
    assert (await call(closed, "POST", "/v1/chat/completions", short["key"], BODY))[0] == 200
    await asyncio.sleep(1.1)
    status, refused = await call(closed, "POST", "/v1/chat/completions", short["key"], BODY)
    assert status == 401 and refused["error"]["code"] == "expired_api_key"

    old = await key(closed)
    status, rotated = await call(closed, "POST", f"/admin/keys/{old['id']}/rotate?grace=1", ADMIN)
    assert status == 200 and rotated["key"] != old["key"] and rotated["id"] == old["id"]
    for secret in (old["key"], rotated["key"]):  # both, within the grace period
        assert (await call(closed, "POST", "/v1/chat/completions", secret, BODY))[0] == 200
    await asyncio.sleep(1.1)
    assert (await call(closed, "POST", "/v1/chat/completions", old["key"], BODY))[0] == 401
    assert (await call(closed, "POST", "/v1/chat/completions", rotated["key"], BODY))[0] == 200


async def test_a_tenant_admin_manages_its_own_tenants_keys_within_its_own_limits(closed: Cluster) -> None:
    boss = await key(closed, tenant="acme", role="tenant-admin", rpm=100, monthly_token_budget=10_000)
    other = await key(closed, tenant="globex")
    made = await call(
        closed, "POST", "/admin/keys", boss["key"], {"tenant": "acme", "rpm": 10, "monthly_token_budget": 500}
    )
    assert made[0] == 201
    assert (await call(closed, "POST", "/v1/chat/completions", made[1]["key"], BODY))[0] == 200
    for refused in (
        {"tenant": "globex", "rpm": 10, "monthly_token_budget": 500},  # another tenant
        {"tenant": "acme", "monthly_token_budget": 500},  # no rpm: more than its own 100
        {"tenant": "acme", "rpm": 1000, "monthly_token_budget": 500},  # more than its own
        {"tenant": "acme", "rpm": 10, "monthly_token_budget": 500, "role": "admin"},  # a role above its own
    ):
        status, answer = await call(closed, "POST", "/admin/keys", boss["key"], refused)
        assert status == 403, (refused, answer)
    listed = (await call(closed, "GET", "/admin/keys", boss["key"]))[1]["keys"]
    assert {k["tenant"] for k in listed} == {"acme"}
    assert (await call(closed, "GET", f"/admin/keys/{other['id']}", boss["key"]))[0] == 404
    assert (await call(closed, "DELETE", f"/admin/keys/{other['id']}", boss["key"]))[0] == 404
    assert (await call(closed, "PATCH", f"/admin/keys/{made[1]['id']}", boss["key"], {"rpm": 1000}))[0] == 403
    assert (await call(closed, "PATCH", f"/admin/keys/{made[1]['id']}", boss["key"], {"rpm": 50}))[0] == 200
    theirs, ours = await asked(closed, other["key"]), await asked(closed, made[1]["key"])
    await asyncio.sleep(1.2)  # (usage is written every flush interval)
    rows = (await call(closed, "GET", "/admin/usage?by=tenant", boss["key"]))[1]["rows"]
    assert {r["tenant"] for r in rows} <= {"acme"}
    found = (await call(closed, "GET", f"/admin/usage?request_id={ours}", boss["key"]))[1]["rows"]
    assert [(r["tenant"], r["key_id"], r["status"]) for r in found] == [("acme", made[1]["id"], 200)]
    assert (await call(closed, "GET", f"/admin/usage?request_id={theirs}", boss["key"]))[1]["rows"] == []
    found = (await call(closed, "GET", f"/admin/usage?request_id={theirs}", ADMIN))[1]["rows"]
    assert [(r["tenant"], r["api"]) for r in found] == [("globex", "chat")]  # the admin sees any tenant's
    assert (await call(closed, "DELETE", "/admin/cache", boss["key"]))[0] == 403


async def test_a_tenant_admin_cannot_take_keys_above_itself(closed: Cluster) -> None:
    """Its tenant's admin key, or a peer tenant-admin's, is not its to rotate (which would hand it the
    secret), revoke or change; a key beyond
    its own limits is not its to rotate either; no priority, file quota or lifetime above its own (and no
    file quota at all where its own key has none: the spec's applies)."""
    boss = await key(closed, tenant="acme", role="tenant-admin", rpm=100, expires_in_s=3600)
    chief = await key(closed, tenant="acme", role="admin")
    fast = await key(closed, tenant="acme", rpm=100_000)
    for method, path in (
        ("POST", f"/admin/keys/{chief['id']}/rotate?grace=0"),
        ("DELETE", f"/admin/keys/{chief['id']}"),
        ("GET", f"/admin/keys/{chief['id']}"),
    ):
        assert (await call(closed, method, path, boss["key"]))[0] == 404, (method, path)
    assert chief["id"] not in {
        k["id"] for k in (await call(closed, "GET", "/admin/keys", boss["key"]))[1]["keys"]
    }
    assert (await call(closed, "POST", f"/admin/keys/{fast['id']}/rotate", boss["key"]))[0] == 403
    # a peer tenant-admin's key is seen, not changed: rotating it would hand over its secret
    peer = await key(closed, tenant="acme", role="tenant-admin", rpm=50, expires_in_s=600)
    for method, path, body in (
        ("POST", f"/admin/keys/{peer['id']}/rotate?grace=0", None),
        ("DELETE", f"/admin/keys/{peer['id']}", None),
        ("PATCH", f"/admin/keys/{peer['id']}", {"rpm": 1}),
    ):
        assert (await call(closed, method, path, boss["key"], body))[0] == 403, (method, path)
    assert (await call(closed, "GET", f"/admin/keys/{peer['id']}", boss["key"]))[0] == 200
    base = {"tenant": "acme", "rpm": 10, "expires_in_s": 600}
    for beyond in (
        {"priority": "high"},
        {"expires_in_s": 86400},
        {"expires_in_s": None},
        {"max_files": 10**9},  # a key's file quota replaces the spec's for the tenant: not the boss's to lift
        {"max_file_bytes": 10**15},
    ):
        status, _ = await call(closed, "POST", "/admin/keys", boss["key"], {**base, **beyond})
        assert status == 403, beyond
    child = await call(closed, "POST", "/admin/keys", boss["key"], base)
    assert child[0] == 201
    # a key that ends with its tenant-admin's own (or before it) is its to change and rotate, itself too
    assert (await call(closed, "POST", f"/admin/keys/{child[1]['id']}/rotate", boss["key"]))[0] == 200
    assert (await call(closed, "PATCH", f"/admin/keys/{boss['id']}", boss["key"], {"rpm": 90}))[0] == 200
    rotated = await call(closed, "POST", f"/admin/keys/{boss['id']}/rotate?grace=60", boss["key"])
    assert rotated[0] == 200 and rotated[1]["expires_at"] == boss["expires_at"]
    trail = (await call(closed, "GET", "/admin/audit?action=key.create&limit=8", ADMIN))[1]["entries"]
    assert any(e["status"] == 403 and e["detail"]["asked"].get("priority") == "high" for e in trail)
    assert (await call(closed, "HEAD", "/admin/keys", boss["key"]))[0] == 200  # (HEAD: as GET, no 500)


async def test_a_revoked_tenant_admin_makes_no_key_while_gateways_still_cache_it(closed: Cluster) -> None:
    """A tenant-admin's key changes are checked against its key as stored now: revoked a moment ago (its
    lookup still cached, `auth.cache_ttl`), it makes no key that would outlive the revocation; cut back,
    it makes none with what it had."""
    boss = await key(closed, role="tenant-admin", rpm=100)
    base = {"tenant": "acme", "rpm": 50}
    assert (await call(closed, "POST", "/admin/keys", boss["key"], base))[0] == 201  # (its lookup cached)
    assert (await closed.admin("PATCH", f"/admin/keys/{boss['id']}", {"rpm": 10}))[0] == 200
    assert (await call(closed, "POST", "/admin/keys", boss["key"], base))[0] == 403
    assert (await closed.admin("DELETE", f"/admin/keys/{boss['id']}"))[0] == 200
    assert (await call(closed, "POST", "/admin/keys", boss["key"], {**base, "rpm": 5}))[0] == 401
    assert (await call(closed, "POST", "/admin/keys", ADMIN, {**base, "name": "x" * 129}))[0] == 400


async def test_a_tenant_admin_sees_the_usage_of_keys_above_it_as_one_row(closed: Cluster) -> None:
    """Usage by key: a key above the tenant-admin in its tenant (an operator's) is not named (its key
    is a 404 to it), its counts are in one row with no key; its own tenant's user keys by name."""
    boss = await key(closed, role="tenant-admin")
    user = await key(closed, name="worker")
    chief = await key(closed, role="operator", name="ops-bot")
    await asked(closed, user["key"])
    await asked(closed, chief["key"])
    await asked(closed, chief["key"])
    await asyncio.sleep(1.2)  # (usage is written every flush interval)
    rows = (await call(closed, "GET", "/admin/usage?by=key", boss["key"]))[1]["rows"]
    assert chief["id"] not in json.dumps(rows) and "ops-bot" not in json.dumps(rows)
    named = {r["key"]: r for r in rows}
    assert named[user["id"]]["name"] == "worker" and named[user["id"]]["requests"] == 1
    assert named[None]["requests"] == 2 and named[None]["name"] is None
    everyone = (await call(closed, "GET", "/admin/usage?by=key", ADMIN))[1]["rows"]
    assert any(r["key"] == chief["id"] and r["requests"] == 2 for r in everyone)


async def test_a_key_looping_on_a_refused_route_cannot_flood_the_audit_trail(closed: Cluster) -> None:
    """Each refused admin call is a store write: an actor's first 30 refusals a minute are recorded, the
    rest counted in the log; what others do is recorded as ever. A tenant-admin's calls on keys it does
    not have (404, as another tenant's are) and bad bodies (400) are refusals too."""
    user = await key(closed)
    for _ in range(40):
        assert (await call(closed, "POST", "/admin/keys", user["key"], {"tenant": "acme"}))[0] == 403
    manager = await key(closed, role="tenant-admin")
    for _ in range(35):
        assert (await call(closed, "DELETE", "/admin/keys/nope", manager["key"]))[0] == 404
    await key(closed, tenant="globex")
    trail = (await call(closed, "GET", "/admin/audit?limit=1000", ADMIN))[1]["entries"]
    refused = [e for e in trail if e["actor"] == f"key:{user['id']}"]
    assert len(refused) == 30 and all(e["status"] == 403 for e in refused)
    missing = [e for e in trail if e["actor"] == f"key:{manager['id']}"]
    assert len(missing) == 30 and all(e["status"] == 404 for e in missing)
    assert trail[0]["action"] == "key.create" and trail[0]["status"] == 201  # the admin's, after them


async def test_the_audit_trails_filters_and_a_key_body_not_an_object_are_400s_naming_what_is_wrong(
    closed: Cluster,
) -> None:
    """A `since` by the ends of the calendar overflowed in UTC, in the store's thread after the handler's
    checks (a 500); `?limit=abc` was refused naming `since`; a key body that is a JSON array was told
    "Invalid value for 'None'"."""
    for since in ("0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00", "yesterday"):
        status, answer = await call(closed, "GET", "/admin/audit?" + urlencode({"since": since}), ADMIN)
        assert (status, answer["error"]["param"]) == (400, "since"), (since, answer)
    for since in ("0001-01-01T01:00:00+01:00", "9999-12-31T23:59:59+00:00", "0001-01-01T00:00:00"):
        status, _ = await call(closed, "GET", "/admin/audit?" + urlencode({"since": since}), ADMIN)
        assert status == 200, since  # (within the calendar in UTC)
    status, answer = await call(closed, "GET", "/admin/audit?limit=abc", ADMIN)
    assert (status, answer["error"]["param"]) == (400, "limit"), answer
    made = await key(closed)
    for method, path in (("POST", "/admin/keys"), ("PATCH", f"/admin/keys/{made['id']}")):
        status, answer = await call(closed, method, path, ADMIN, "[]")
        assert status == 400 and answer["error"]["param"] is None, answer
        assert answer["error"]["message"].startswith("The body must be a JSON object"), answer
        assert "None" not in answer["error"]["message"], answer
