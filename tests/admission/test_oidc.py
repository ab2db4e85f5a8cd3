"""Tokens from a real OpenID provider (oidc-provider-mock: Authlib's authorization server, started here)
on the API: a token whose issuer, audience, expiry and signature check out is accepted like a key, with its
tenant and role from its claims (or its groups) and its tenant's limits; a tampered, expired or
wrong-audience one is refused with 401; roles from the token hold on the admin API."""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import aiohttp
import httpx
import pytest
from oidc_provider_mock import User, run_server_in_thread

from corral.config import AuthSettings, GatewaySettings, OIDCSettings
from corral.gateway import GatewayServer
from corral.protocol import Unauthorized
from corral.routing import Replica, ReplicaSet, ReplicaState, Router

from ..conftest import free_port
from ..gateway.conftest import ScriptedUpstream, make_services

ADMIN = "oidc-test-admin"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
PEOPLE = [
    User(sub="alice", claims={"tenant": "acme", "role": "user"}),
    User(sub="bob", claims={"tenant": "acme", "role": "tenant-admin"}),
    User(sub="carol", claims={"groups": ["ops-team"]}),  # tenant and role from her group
    User(sub="dave", claims={"role": "admin"}),  # no tenant: refused
]


@dataclass
class Provider:
    url: str

    def token(self, sub: str, client_id: str = "corral") -> str:
        """An ID token for `sub`, by the authorization-code flow (the provider's own login form)."""
        conf = httpx.get(self.url + "/.well-known/openid-configuration").json()
        redirect = "http://127.0.0.1:9/callback"
        query = {"client_id": client_id, "redirect_uri": redirect, "response_type": "code", "scope": "openid"}
        signed_in = httpx.post(
            conf["authorization_endpoint"] + "?" + urllib.parse.urlencode(query), data={"sub": sub}
        )
        code = urllib.parse.parse_qs(urllib.parse.urlsplit(signed_in.headers["location"]).query)["code"][0]
        answer = httpx.post(
            conf["token_endpoint"],
            data={"grant_type": "authorization_code", "code": code, "redirect_uri": redirect},
            auth=(client_id, "secret"),
        )
        return str(answer.json()["id_token"])


@pytest.fixture(scope="module")
def provider() -> Iterator[Provider]:
    with run_server_in_thread(user_claims=PEOPLE) as server:
        yield Provider(f"http://localhost:{server.server_port}")


@pytest.fixture(scope="module")
def short_lived() -> Iterator[Provider]:
    with run_server_in_thread(user_claims=PEOPLE, access_token_max_age=timedelta(seconds=4)) as server:
        yield Provider(f"http://localhost:{server.server_port}")


async def gateway(
    tmp_path: Path, upstream: ScriptedUpstream, provider: Provider
) -> tuple[GatewayServer, str]:
    replicas = ReplicaSet(["m"])
    replicas.add(Replica(id="m-0", model="m", engine="x", url=upstream.url, state=ReplicaState.READY))
    oidc = OIDCSettings.model_validate(
        {
            "issuer": provider.url,
            "client_id": "corral",
            "clock_skew_s": 0,
            "groups": {"ops-team": {"tenant": "ops", "role": "viewer"}},
            "tenants": {"acme": {"rpm": 3}, "ops": {}},
        }
    )
    parts = make_services(
        replicas, tmp_path / "c.db", auth=AuthSettings(open=False, oidc=oidc), admin_key=ADMIN
    )
    server = GatewayServer(GatewaySettings(port=0), Router(replicas), parts)
    await server.start()
    return server, f"http://127.0.0.1:{server.port}"


@pytest.fixture
async def url(tmp_path: Path, upstream: ScriptedUpstream, provider: Provider) -> AsyncIterator[str]:
    server, address = await gateway(tmp_path, upstream, provider)
    yield address
    await server.stop()


async def call(url: str, method: str, path: str, token: str, body: object = None) -> tuple[int, dict]:
    async with (
        aiohttp.ClientSession() as session,
        session.request(
            method,
            url + path,
            data=body if isinstance(body, str) else json.dumps(body) if body is not None else None,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        ) as answer,
    ):
        text = await answer.text()
        return answer.status, json.loads(text) if text.startswith("{") else {"text": text}


async def test_a_providers_token_is_accepted_like_a_key_with_its_tenants_limits(
    url: str, provider: Provider
) -> None:
    alice = await asyncio.to_thread(provider.token, "alice")
    statuses = [(await call(url, "POST", "/v1/chat/completions", alice, BODY))[0] for _ in range(4)]
    assert statuses == [200, 200, 200, 429]  # acme's people share its 3 requests a minute
    await asyncio.sleep(0.3)  # (usage is written every flush interval)
    rows = (await call(url, "GET", "/admin/usage?by=key", ADMIN))[1]["rows"]
    assert {(r["key"], r["requests"]) for r in rows} == {("oidc:acme", 4)}


async def test_a_signed_in_persons_batch_runs_as_its_tenant(url: str, provider: Provider) -> None:
    """A batch made with a provider's token runs as its tenant's people do (it failed as "revoked": the
    runner looked the person's key id, oidc:<tenant>, up among the stored keys)."""
    alice = await asyncio.to_thread(provider.token, "alice")
    line = {"custom_id": "one", "method": "POST", "url": "/v1/chat/completions", "body": BODY}
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", json.dumps(line).encode() + b"\n", filename="in.jsonl")
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/files", data=form, headers={"Authorization": f"Bearer {alice}"}) as sent,
    ):
        uploaded = await sent.json()
        assert sent.status == 200, uploaded
    asked = {"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    status, batch = await call(url, "POST", "/v1/batches", alice, asked)
    assert status == 200, batch
    deadline = asyncio.get_running_loop().time() + 30
    while batch["status"] not in ("completed", "failed") and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.2)
        status, batch = await call(url, "GET", f"/v1/batches/{batch['id']}", alice)
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 1, batch


async def test_tampered_expired_and_wrong_audience_tokens_are_refused(
    url: str, provider: Provider, short_lived: Provider, tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    good = await asyncio.to_thread(provider.token, "alice")
    header, payload, signature = good.split(".")
    flipped = signature[:10] + ("A" if signature[10] != "A" else "B") + signature[11:]
    other = await asyncio.to_thread(provider.token, "alice", "another-client")
    refused = {
        "tampered": (await call(url, "POST", "/v1/chat/completions", f"{header}.{payload}.{flipped}", BODY)),
        "wrong audience": (await call(url, "POST", "/v1/chat/completions", other, BODY)),
        "no tenant": (await call(url, "POST", "/v1/chat/completions", provider.token("dave"), BODY)),
    }
    for what, (status, answer) in refused.items():
        assert status == 401, (what, answer)
    assert "aud" in refused["wrong audience"][1]["error"]["message"]
    server, short_url = await gateway(tmp_path / "short", upstream, short_lived)
    try:
        token = await asyncio.to_thread(short_lived.token, "alice")
        assert (await call(short_url, "POST", "/v1/chat/completions", token, BODY))[0] == 200
        await asyncio.sleep(4.1)
        status, answer = await call(short_url, "POST", "/v1/chat/completions", token, BODY)
        assert status == 401 and answer["error"]["code"] == "expired_token"
    finally:
        await server.stop()


async def test_roles_from_the_token_hold_on_the_admin_api(url: str, provider: Provider) -> None:
    bob, carol = provider.token("bob"), provider.token("carol")
    status, made = await call(url, "POST", "/admin/keys", bob, {"tenant": "acme", "rpm": 1})
    assert status == 201  # a tenant-admin makes a key for its tenant (within acme's 3 a minute)
    assert (await call(url, "POST", "/v1/chat/completions", made["key"], BODY))[0] == 200
    assert (await call(url, "POST", "/admin/keys", bob, {"tenant": "other", "rpm": 1}))[0] == 403
    assert (await call(url, "GET", "/admin/routing", carol))[0] == 200  # a viewer, by her group
    assert (await call(url, "POST", "/admin/spec", carol, "models: []"))[0] == 403
    trail = (await call(url, "GET", "/admin/audit", ADMIN))[1]["entries"]
    assert [(e["action"], e["actor"], e["role"], e["status"]) for e in reversed(trail)] == [
        ("key.create", "oidc:bob", "tenant-admin", 201),
        ("key.create", "oidc:bob", "tenant-admin", 403),
        ("spec.apply", "oidc:carol", "viewer", 403),
    ]


async def test_the_claims_corral_reads_and_the_console_flow_are_the_specs(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    """Other claim names (tenant_claim, role_claim, groups_claim), default_role, and the console's flow as a
    browser makes it: scopes, redirect_url, PKCE, state, the session cookie, session_ttl_s."""
    people = [
        User(sub="erin", claims={"org": "initech", "corral_role": "tenant-admin"}),
        User(sub="frank", claims={"org": "initech"}),  # no role: default_role
        User(sub="grace", claims={"teams": ["sre"]}),
    ]
    port = free_port()
    with run_server_in_thread(user_claims=people) as server:
        issuer = f"http://localhost:{server.server_port}"
        oidc = OIDCSettings.model_validate(
            {
                "issuer": issuer,
                "client_id": "corral",
                "client_secret": "s3cret",
                "tenant_claim": "org",
                "role_claim": "corral_role",
                "groups_claim": "teams",
                "groups": {"sre": {"tenant": "ops", "role": "operator"}},
                "tenants": {"initech": {}, "ops": {}},
                "default_role": "viewer",
                "scopes": ["openid", "email"],
                "redirect_url": f"http://127.0.0.1:{port}/console/callback",
                "session_ttl_s": 2,
            }
        )
        replicas = ReplicaSet(["m"])
        replicas.add(Replica(id="m-0", model="m", engine="x", url=upstream.url, state=ReplicaState.READY))
        parts = make_services(
            replicas, tmp_path / "c.db", auth=AuthSettings(open=False, oidc=oidc), admin_key=ADMIN
        )
        gateway = GatewayServer(GatewaySettings(port=port), Router(replicas), parts)
        await gateway.start()
        url = f"http://127.0.0.1:{port}"
        provider = Provider(issuer)
        try:
            roles = {}
            for sub in ("erin", "frank", "grace"):
                token = await asyncio.to_thread(provider.token, sub)
                paths = ("/admin/keys", "/admin/routing", "/admin/audit")
                roles[sub] = tuple([(await call(url, "GET", path, token))[0] for path in paths])
            assert roles == {
                "erin": (200, 403, 403),  # tenant-admin (corral_role)
                "frank": (403, 200, 403),  # viewer (default_role)
                "grace": (403, 200, 200),  # operator (her team's)
            }

            jar = aiohttp.CookieJar(unsafe=True)
            async with aiohttp.ClientSession(cookie_jar=jar) as browser:
                async with browser.get(url + "/console/signin", allow_redirects=False) as sent:
                    assert sent.status == 303
                    where = sent.headers["Location"]
                asked = urllib.parse.parse_qs(urllib.parse.urlsplit(where).query)
                assert asked["scope"] == ["openid email"]
                assert asked["redirect_uri"] == [f"{url}/console/callback"]
                assert asked["code_challenge_method"] == ["S256"] and asked["nonce"] and asked["state"]
                signed_in = await asyncio.to_thread(
                    lambda: httpx.post(where, data={"sub": "erin"}).headers["location"]
                )
                back = urllib.parse.parse_qs(urllib.parse.urlsplit(signed_in).query)
                forged = (
                    url
                    + "/console/callback?"
                    + urllib.parse.urlencode({"code": back["code"][0], "state": "not-the-state"})
                )
                async with browser.get(forged, allow_redirects=False) as refused:
                    assert refused.status == 400  # another sign-in's state
                async with browser.get(signed_in, allow_redirects=False) as done:
                    assert done.status == 303 and done.headers["Location"] == "/console"
                    cookie = done.cookies["corral_session"]
                    assert cookie["httponly"] and cookie["samesite"] == "Lax"
                async with browser.get(url + "/console/me") as me:
                    who = await me.json()
                assert (who["signed_in"], who["who"], who["role"], who["tenant"]) == (
                    True,
                    "erin",
                    "tenant-admin",
                    "initech",
                )
                async with browser.get(url + "/admin/keys") as listed:
                    assert listed.status == 200  # the session's role on the admin API
                await asyncio.sleep(2.2)  # session_ttl_s
                async with browser.get(url + "/console/me") as me:
                    assert (await me.json())["signed_in"] is False
                async with browser.get(url + "/admin/keys") as listed:
                    assert listed.status == 401
        finally:
            await gateway.stop()


async def test_a_rotated_signing_key_is_fetched_and_clock_skew_is_tolerated() -> None:
    """A provider that rotates its signing key: a token under the new key id makes the verifier fetch the
    key set again (joserfc checks the signature); a token issued a little in the future passes within
    clock_skew_s and fails beyond it."""
    import time as clock

    from aiohttp import web
    from joserfc import jwt
    from joserfc.jwk import KeySet, RSAKey

    from corral.admission.oidc import OIDCVerifier

    keys = {"current": RSAKey.generate_key(2048, parameters={"kid": "one"})}
    fetched = []
    slow, broken = [0.0], [False]  # the provider's key endpoint: how long it takes, whether it fails

    async def discovery(request: web.Request) -> web.Response:
        base = f"http://localhost:{request.url.port}"
        return web.json_response(
            {
                "issuer": base,
                "jwks_uri": base + "/jwks",
                "authorization_endpoint": base + "/authorize",
                "token_endpoint": base + "/token",
            }
        )

    async def jwks(request: web.Request) -> web.Response:
        fetched.append(keys["current"].kid)
        await asyncio.sleep(slow[0])
        if broken[0]:
            return web.Response(status=500)
        return web.json_response(KeySet([keys["current"]]).as_dict(private=False))

    app = web.Application()
    app.router.add_get("/.well-known/openid-configuration", discovery)
    app.router.add_get("/jwks", jwks)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "localhost", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    issuer = f"http://localhost:{port}"
    try:
        verifier = OIDCVerifier(
            OIDCSettings(issuer=issuer, client_id="corral", clock_skew_s=30, tenants={"acme": {}})
        )

        def token(key: RSAKey, skew: float = 0) -> str:
            now = int(clock.time() + skew)
            claims = {"iss": issuer, "aud": "corral", "sub": "s", "tenant": "acme", "iat": now, "nbf": now}
            return jwt.encode({"alg": "RS256", "kid": key.kid}, {**claims, "exp": now + 300}, key)

        assert (await verifier.claims(token(keys["current"])))["sub"] == "s"
        keys["current"] = RSAKey.generate_key(2048, parameters={"kid": "two"})  # the provider rotates
        await asyncio.sleep(1.1)  # (a key id it does not know refetches the set at most once a second)
        assert (await verifier.claims(token(keys["current"])))["sub"] == "s"
        assert fetched == ["one", "two"]  # fetched again for the new key id, once
        assert (await verifier.claims(token(keys["current"], skew=20)))["sub"] == "s"  # within the skew
        with pytest.raises(Unauthorized):
            await verifier.claims(token(keys["current"], skew=120))  # issued two minutes from now
        # anyone's malformed token is a 401, whatever the library raises on it (a `crit` that is no list)
        crit = _b64({"alg": "ES256", "kid": "two", "crit": 5}) + "." + _b64({}) + ".AAAA"
        with pytest.raises(Unauthorized) as refused:
            await verifier.claims(crit)
        assert refused.value.code == "invalid_token"
        # key ids it does not hold, sent at once: one fetch at most, no token waits on another's
        await asyncio.sleep(1.1)
        before = len(fetched)
        for outcome in await asyncio.gather(
            *(
                verifier.claims(token(RSAKey.generate_key(2048, parameters={"kid": f"x{i}"})))
                for i in range(8)
            ),
            return_exceptions=True,
        ):
            assert isinstance(outcome, Unauthorized)
        assert len(fetched) - before == 1
        assert (await verifier.claims(token(keys["current"])))["sub"] == "s"  # a known key: no fetch
        assert len(fetched) - before == 1
        # a slow provider: a token under a known key does not wait for another token's fetch
        await asyncio.sleep(1.1)
        slow[0] = 2.0
        unknown = asyncio.ensure_future(verifier.claims(token(RSAKey.generate_key(2048, {"kid": "y"}))))
        await asyncio.sleep(0.1)
        started = clock.monotonic()
        assert (await verifier.claims(token(keys["current"])))["sub"] == "s"
        assert clock.monotonic() - started < 1.0
        with pytest.raises(Unauthorized):
            await unknown
        # tokens under new key ids that came while a slow fetch ran wait for it, not for fetches of their own
        await asyncio.sleep(1.1)
        before = len(fetched)
        first = asyncio.ensure_future(verifier.claims(token(RSAKey.generate_key(2048, {"kid": "w"}))))
        await asyncio.sleep(1.2)  # (past the fetch's first second: these wait on the lock)
        late = [
            asyncio.ensure_future(verifier.claims(token(RSAKey.generate_key(2048, {"kid": f"w{i}"}))))
            for i in range(3)
        ]
        await asyncio.gather(first, *late, return_exceptions=True)
        assert len(fetched) - before == 1
        # a failing provider is asked again after a second at the soonest, whatever comes meanwhile
        slow[0], broken[0] = 0.0, True
        await asyncio.sleep(1.1)
        before = len(fetched)
        for i in range(5):
            with pytest.raises(Unauthorized):
                await verifier.claims(token(RSAKey.generate_key(2048, parameters={"kid": f"z{i}"})))
        assert len(fetched) - before == 1
    finally:
        await runner.cleanup()


def _b64(value: object) -> str:
    import base64

    return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()


def test_a_groups_role_holds_in_its_own_tenant_only() -> None:
    """A person in one tenant's group and another tenant's admin group is not that other tenant's admin
    in their own tenant; groups naming two tenants, with no tenant claim to say which, are refused; a group
    naming a role and no tenant gives it in any tenant; a tenant taken out of the list ends its sessions."""
    from corral.admission.oidc import OIDCVerifier

    verifier = OIDCVerifier(
        OIDCSettings.model_validate(
            {
                "issuer": "https://login.example.com",
                "client_id": "corral",
                "groups": {
                    "acme-users": {"tenant": "acme"},
                    "globex-admins": {"tenant": "globex", "role": "tenant-admin"},
                    "auditors": {"role": "viewer"},
                },
                "tenants": {"acme": {"rpm": 5}, "globex": {}},
            }
        )
    )

    def who(**claims: object) -> tuple[str, str | None]:
        principal = verifier.principal({"sub": "p", "exp": 2**31, **claims})
        return principal.tenant, principal.role

    assert who(groups=["globex-admins"]) == ("globex", "tenant-admin")
    assert who(tenant="globex", groups=["globex-admins"]) == ("globex", "tenant-admin")
    assert who(tenant="acme", groups=["globex-admins"]) == ("acme", "user")  # not acme's admin
    assert who(groups=["acme-users", "auditors"]) == ("acme", "viewer")
    with pytest.raises(Unauthorized, match="more than one tenant"):
        who(groups=["acme-users", "globex-admins"])
    assert who(tenant="acme", groups=["acme-users", "globex-admins"]) == ("acme", "user")
    assert verifier.principal_of("p", "acme", "user", None).rpm == 5
    with pytest.raises(Unauthorized, match="not one of auth"):
        verifier.principal_of(
            "p", "initech", "tenant-admin", None
        )  # (a session from before it was taken out)


async def test_a_signed_in_batch_of_a_tenant_no_longer_listed_runs_as_revoked() -> None:
    """A batch a person made runs as its tenant's people only while auth.oidc.tenants lists the tenant;
    with the list emptied since, it is refused as revoked (it raised, and its lines were leased again)."""
    from types import SimpleNamespace

    from corral.admission.oidc import OIDCVerifier
    from corral.batch.runner import BatchRunner

    for tenants, runs in (({"acme": {}}, True), ({}, False), ({"globex": {}}, False)):
        verifier = OIDCVerifier(
            OIDCSettings.model_validate(
                {"issuer": "https://login.example.com", "client_id": "corral", "tenants": tenants}
            )
        )
        runner = SimpleNamespace(_oidc=verifier, _keys=None)
        principal = await BatchRunner._principal(runner, "acme", "oidc:acme")  # type: ignore[arg-type]
        assert (principal is not None) == runs, tenants
