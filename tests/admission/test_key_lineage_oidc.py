"""Keys a tenant-admin signed in through the identity provider makes share its tenant's signed-in limits
(`auth.oidc.tenants`): with a real provider (oidc-provider-mock), a real gateway and store."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from corral.config import AuthSettings, GatewaySettings, OIDCSettings
from corral.gateway import GatewayServer
from corral.routing import Replica, ReplicaSet, ReplicaState, Router

from ..gateway.conftest import ScriptedUpstream, make_services
from .test_oidc import ADMIN, BODY, Provider, call
from .test_oidc import provider as provider  # (the module's provider, started once)


@pytest.fixture
async def url(tmp_path: Path, upstream: ScriptedUpstream, provider: Provider) -> AsyncIterator[str]:
    replicas = ReplicaSet(["m"])
    replicas.add(Replica(id="m-0", model="m", engine="x", url=upstream.url, state=ReplicaState.READY))
    oidc = OIDCSettings.model_validate(
        {"issuer": provider.url, "client_id": "corral", "clock_skew_s": 0, "tenants": {"acme": {"rpm": 3}}}
    )
    parts = make_services(
        replicas, tmp_path / "c.db", auth=AuthSettings(open=False, oidc=oidc), admin_key=ADMIN
    )
    server = GatewayServer(GatewaySettings(port=0), Router(replicas), parts)
    await server.start()
    yield f"http://127.0.0.1:{server.port}"
    await server.stop()


async def test_keys_a_signed_in_tenant_admin_makes_share_its_tenants_signed_in_limits(
    url: str, provider: Provider
) -> None:
    """acme's people share 3 requests a minute; bob, its tenant-admin, makes two keys of 3 each: they and
    acme's people together get 3, and the refusal names acme's signed-in people."""
    bob = await asyncio.to_thread(provider.token, "bob")
    alice = await asyncio.to_thread(provider.token, "alice")
    made = [(await call(url, "POST", "/admin/keys", bob, {"tenant": "acme", "rpm": 3}))[1] for _ in range(2)]
    assert [key["parent"] for key in made] == ["oidc:acme", "oidc:acme"], made
    first, second = made[0]["key"], made[1]["key"]
    statuses = [(await call(url, "POST", "/v1/chat/completions", k, BODY))[0] for k in (first, first, second)]
    assert statuses == [200, 200, 200]
    status, refused = await call(url, "POST", "/v1/chat/completions", second, BODY)
    assert status == 429, refused
    assert "for the signed-in people of tenant 'acme'" in refused["error"]["message"], refused
    assert (await call(url, "POST", "/v1/chat/completions", alice, BODY))[0] == 429  # (her tenant's 3 too)
