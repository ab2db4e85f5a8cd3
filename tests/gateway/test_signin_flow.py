"""The console's sign-in against a provider that checks what real ones check, driven as a browser would
(the provider's login form posted as the person, cookies sent back by hand so that `__Host-` ones can be
sent over the test's plain HTTP): the PKCE verifier is one RFC 7636 allows, sign-out names the provider's
end-session URL with the ID token as hint, a provider that cannot be asked is a 502 naming it (and sign-out
still signs out), a pending sign-in's cookie is `__Host-` over HTTPS and cannot be forged or malformed."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import io
import json
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import ExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from http.cookies import Morsel
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import oidc_provider_mock
import pytest
import werkzeug.serving
from aiohttp import web
from authlib.oauth2.rfc7636.challenge import CODE_VERIFIER_PATTERN, compare_s256_code_challenge
from joserfc import jwt
from joserfc.jwk import KeySet
from oidc_provider_mock import User
from sqlalchemy import create_engine, text

from corral.cluster import free_port
from corral.config import AuthSettings, GatewaySettings, OIDCSettings
from corral.gateway import GatewayServer
from corral.routing import ReplicaSet, Router

from .conftest import make_services

ADMIN = "signin-flow-admin"
SECRET = "signin-flow-client-secret"
PEOPLE = [User(sub="bob", claims={"tenant": "acme", "role": "tenant-admin"})]
HTTPS = {"X-Forwarded-Proto": "https"}  # (the gateway trusts 127.0.0.1 as its TLS-ending edge)

StartResponse = Callable[..., Any]


@dataclass
class PKCEChecks:
    """A WSGI layer before oidc-provider-mock (Authlib's server, which does not check PKCE itself) that
    checks it as RFC 7636 asks, with Authlib's own functions: a code is traded only with a verifier of 43 to
    128 unreserved characters whose S256 is the challenge its authorization request carried."""

    app: Callable[[dict[str, Any], StartResponse], Iterable[bytes]]
    challenges: dict[str, str] = field(default_factory=dict)  # code → the challenge it was issued under
    verifiers: list[str] = field(default_factory=list)  # as the token endpoint received them

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path, method = environ.get("PATH_INFO", ""), environ["REQUEST_METHOD"]
        if path == "/oauth2/token" and method == "POST":
            body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
            environ["wsgi.input"] = io.BytesIO(body)
            form = urllib.parse.parse_qs(body.decode())
            code, verifier = form.get("code", [""])[0], form.get("code_verifier", [""])[0]
            self.verifiers.append(verifier)
            challenge = self.challenges.pop(code, None)
            if (
                challenge is None
                or not CODE_VERIFIER_PATTERN.match(verifier)
                or not compare_s256_code_challenge(verifier, challenge)
            ):
                start_response("400 Bad Request", [("Content-Type", "application/json")])
                return [b'{"error": "invalid_grant", "error_description": "code_verifier"}']
        if path == "/oauth2/authorize" and method == "POST":
            asked = urllib.parse.parse_qs(environ.get("QUERY_STRING", ""))

            def issued(status: str, headers: list[tuple[str, str]], *rest: Any) -> Any:
                location = dict((k.lower(), v) for k, v in headers).get("location", "")
                code = urllib.parse.parse_qs(urllib.parse.urlsplit(location).query).get("code")
                if code and asked.get("code_challenge_method") == ["S256"]:
                    self.challenges[code[0]] = asked["code_challenge"][0]
                return start_response(status, headers, *rest)

            return self.app(environ, issued)
        return self.app(environ, start_response)


@dataclass
class Provider:
    url: str
    checks: PKCEChecks

    def discovery(self) -> dict[str, Any]:
        return dict(httpx.get(self.url + "/.well-known/openid-configuration").json())


@contextmanager
def pkce_provider() -> Iterator[Provider]:
    """oidc-provider-mock behind the PKCE checks, on a thread; its port refuses connections once it ends."""
    app = oidc_provider_mock.app(user_claims=PEOPLE)
    checks = PKCEChecks(app.wsgi_app)
    app.wsgi_app = checks  # type: ignore[method-assign]
    server = werkzeug.serving.make_server("localhost", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1})
    thread.start()
    try:
        yield Provider(f"http://localhost:{server.server_port}", checks)
    finally:
        server.shutdown()
        thread.join(5)
        server.server_close()


@pytest.fixture(scope="module")
def provider() -> Iterator[Provider]:
    with pkce_provider() as running:
        yield running


@asynccontextmanager
async def gateway(
    database: Path,
    issuer: str,
    admin_key: str | None = ADMIN,
    client_secret: str | None = SECRET,
    audience: str | None = None,
    redirect_url: str | None = None,
) -> AsyncIterator[str]:
    oidc = OIDCSettings.model_validate(
        {"issuer": issuer, "client_id": "corral", "client_secret": client_secret, "tenants": {"acme": {}}}
        | ({"audience": audience} if audience else {})
        | ({"redirect_url": redirect_url} if redirect_url else {})
    )
    replicas = ReplicaSet(["m"])
    parts = make_services(replicas, database, auth=AuthSettings(open=False, oidc=oidc), admin_key=admin_key)
    server = GatewayServer(GatewaySettings(port=0, trusted_proxies=["127.0.0.1"]), Router(replicas), parts)
    await server.start()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.stop()


@dataclass
class Answer:
    status: int
    body: dict[str, Any]
    headers: dict[str, str]
    cookies: dict[str, Morsel[str]]


async def ask(
    method: str, url: str, cookies: dict[str, str] | None = None, headers: dict[str, str] | None = None
) -> Answer:
    """One request with the cookies given (a browser's), redirects not followed."""
    sent = dict(headers or {})
    if cookies:
        sent["Cookie"] = "; ".join(f"{name}={value}" for name, value in cookies.items())
    async with (
        aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as client,
        client.request(method, url, headers=sent, allow_redirects=False) as answer,
    ):
        text_ = await answer.text()
        body = json.loads(text_) if text_.startswith("{") else {}
        return Answer(answer.status, body, dict(answer.headers), dict(answer.cookies.items()))


async def sign_in(url: str, who: str, headers: dict[str, str] | None = None) -> tuple[Answer, Answer]:
    """`who` signs in: (the sign-in's start, the callback's answer)."""
    started = await ask("GET", url + "/console/signin", headers=headers)
    assert started.status == 303, started.body
    login = started.headers["Location"]
    back = await asyncio.to_thread(lambda: httpx.post(login, data={"sub": who}).headers["location"])
    pending = {name: morsel.value for name, morsel in started.cookies.items()}
    query = urllib.parse.urlsplit(back).query
    return started, await ask("GET", f"{url}/console/callback?{query}", pending, headers)


def signing_key(*material: str) -> bytes:
    """The pending sign-in cookie's key as app.py derives it from its material."""
    return hashlib.sha256(b"corral sign-in\0" + "\0".join(material).encode()).digest()


def signed(key: bytes, data: dict[str, Any]) -> str:
    """A pending sign-in cookie's value as signin.py signs one."""
    payload = base64.urlsafe_b64encode(json.dumps(data).encode()).decode()
    return f"{payload}.{hmac.new(key, payload.encode(), hashlib.sha256).hexdigest()}"


async def test_the_pkce_verifier_is_one_that_a_provider_checking_rfc_7636_accepts(
    tmp_path: Path, provider: Provider
) -> None:
    async with gateway(tmp_path / "c.db", provider.url) as url:
        started, done = await sign_in(url, "bob")
    asked = urllib.parse.parse_qs(urllib.parse.urlsplit(started.headers["Location"]).query)
    verifier = provider.checks.verifiers[-1]
    assert 43 <= len(verifier) <= 128 and CODE_VERIFIER_PATTERN.match(verifier), verifier
    assert compare_s256_code_challenge(verifier, asked["code_challenge"][0])
    assert done.status == 303 and done.headers["Location"] == "/console", done.body
    assert done.cookies["corral_session"].value


@pytest.mark.parametrize("audience", ["corral-api", None])
async def test_signing_out_names_the_providers_end_session_with_the_id_token_as_hint(
    tmp_path: Path, provider: Provider, audience: str | None
) -> None:
    """The end-session URL carries client_id and post_logout_redirect_uri (the console), and id_token_hint
    (Okta needs it; Keycloak without it asks for confirmation) where the API takes no ID token: with
    `auth.oidc.audience` unset an ID token is a bearer credential on the API until it expires, and the URL
    lands in the browser's history and the provider's logs (and the store keeps none). The store keeps the
    ID token only sealed, so its rows give no one a token the API would accept."""
    async with gateway(tmp_path / "c.db", provider.url, audience=audience) as url:
        _, done = await sign_in(url, "bob")
        session = {"corral_session": done.cookies["corral_session"].value}
        me = await ask("GET", url + "/console/me", session)
        with create_engine(f"sqlite:///{tmp_path / 'c.db'}").connect() as db:
            sealed = db.execute(text("SELECT id_token FROM corral_sessions")).scalar_one()
        out = await ask("POST", url + "/console/signout", session, {"X-CSRF-Token": me.body["csrf"]})
        assert out.status == 200 and out.body["signed_out"] is True, out.body
        ending = urllib.parse.urlsplit(out.body["end_session"])
        said = urllib.parse.parse_qs(ending.query)
        endpoint = (await asyncio.to_thread(provider.discovery))["end_session_endpoint"]
        assert urllib.parse.urlunsplit(ending._replace(query="")) == endpoint
        assert said["client_id"] == ["corral"] and said["post_logout_redirect_uri"] == [url + "/console"]
        if audience is None:  # the ID token would be an API credential: not put in a URL, nor kept
            assert "id_token_hint" not in said and sealed is None
            return
        hint = said["id_token_hint"][0]
        published = await asyncio.to_thread(lambda: httpx.get(provider.url + "/jwks").json())
        keys = KeySet.import_key_set(published)
        claims = jwt.decode(hint, keys).claims  # signed by the provider: the ID token bob signed in with
        assert (claims["sub"], claims["aud"], claims["iss"]) == ("bob", ["corral"], provider.url)
        assert sealed and hint not in sealed and hint.split(".")[1] not in sealed
        assert out.cookies["corral_session"].value == ""  # the cookie is cleared
        assert (await ask("GET", url + "/console/me", session)).body["signed_in"] is False


async def test_a_provider_that_cannot_be_asked_is_a_502_naming_it_and_asked_again_only_after_a_moment(
    tmp_path: Path,
) -> None:
    """Down (a 503), then up with a discovery document that lacks its endpoints: each sign-in is a 502 in
    the OpenAI error shape naming the provider (they were 500s with a traceback), and the provider is not
    asked again by every sign-in while it fails (it was, by each)."""
    asked: list[float] = []

    async def discovery(request: web.Request) -> web.Response:
        asked.append(time.monotonic())
        if len(asked) == 1:
            return web.Response(status=503)
        return web.json_response({"issuer": issuer, "token_endpoint": issuer + "/token"})

    app = web.Application()
    app.router.add_get("/.well-known/openid-configuration", discovery)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "localhost", 0)
    await site.start()
    issuer = f"http://localhost:{runner.addresses[0][1]}"
    refused = f"http://127.0.0.1:{free_port()}"  # (nothing listens there)
    try:
        async with gateway(tmp_path / "c.db", issuer) as url, gateway(tmp_path / "d.db", refused) as other:
            for _ in range(5):
                answer = await ask("GET", url + "/console/signin")
                assert answer.status == 502, answer.body
                assert answer.body["error"]["code"] == "identity_provider_failed"
                assert issuer in answer.body["error"]["message"] and "Retry-After" in answer.headers
            assert len(asked) == 1
            deadline = time.monotonic() + 10
            while len(asked) < 2 and time.monotonic() < deadline:
                answer = await ask("GET", url + "/console/signin")
                assert answer.status == 502 and issuer in answer.body["error"]["message"], answer.body
                await asyncio.sleep(0.1)
            assert len(asked) == 2 and asked[1] - asked[0] >= 1.9  # (the failure is remembered for 2 s)
            answer = await ask("GET", other + "/console/signin")
            assert answer.status == 502 and refused in answer.body["error"]["message"], answer.body
    finally:
        await runner.cleanup()


async def test_a_provider_gone_down_fails_the_callback_with_a_502_and_signing_out_still_signs_out(
    tmp_path: Path,
) -> None:
    """Two gateways on one store; the provider goes down after bob signed in on the first. A sign-in the
    first started (it holds the provider's discovery) comes back to the second, which cannot read it now:
    502, not a 500. Bob signs out on the second: 200, the cookie cleared, the session over, no end-session
    URL (it was a 500 that left the cookie, the session already deleted)."""
    with ExitStack() as up:
        provider = up.enter_context(pkce_provider())
        async with gateway(tmp_path / "c.db", provider.url) as first:
            _, done = await sign_in(first, "bob")
            session = {"corral_session": done.cookies["corral_session"].value}
            csrf = (await ask("GET", first + "/console/me", session)).body["csrf"]
            up.close()  # the provider goes down
            started = await ask("GET", first + "/console/signin")
            assert started.status == 303  # (the first gateway holds the provider's discovery)
            pending = {name: morsel.value for name, morsel in started.cookies.items()}
            state = urllib.parse.parse_qs(urllib.parse.urlsplit(started.headers["Location"]).query)["state"]
            async with gateway(tmp_path / "c.db", provider.url) as second:
                back = await ask("GET", f"{second}/console/callback?state={state[0]}&code=c0de", pending)
                assert back.status == 502, back.body
                assert back.body["error"]["code"] == "identity_provider_failed"
                assert provider.url in back.body["error"]["message"]
                out = await ask("POST", second + "/console/signout", session, {"X-CSRF-Token": csrf})
                assert out.status == 200 and out.body == {"signed_out": True, "end_session": None}, out.body
                assert out.cookies["corral_session"].value == ""
                assert (await ask("GET", second + "/console/me", session)).body["signed_in"] is False


async def test_a_public_client_without_an_admin_key_signs_pending_sign_ins_with_the_stores_secret(
    tmp_path: Path, provider: Provider
) -> None:
    """With no admin key and no client secret the pending sign-in's key came from the client id alone,
    which is public: anyone could sign a cookie the callback took. The store's secret signs it now."""
    async with gateway(tmp_path / "c.db", provider.url, admin_key=None, client_secret=None) as url:
        started = await ask("GET", url + "/console/signin")
        state = urllib.parse.parse_qs(urllib.parse.urlsplit(started.headers["Location"]).query)["state"][0]
        own = {"corral_signin": started.cookies["corral_signin"].value}
        answer = await ask("GET", f"{url}/console/callback?state={state}&code=c0de", own)
        assert answer.status == 401, answer.body  # (its own cookie is read: the provider refuses the code)
        pending = {"state": "s", "nonce": "n", "verifier": "v" * 64, "redirect": url + "/console/callback"}
        forged = signed(signing_key("", "", "corral"), {**pending, "until": time.time() + 600})
        answer = await ask("GET", f"{url}/console/callback?state=s&code=c0de", {"corral_signin": forged})
        assert answer.status == 400 and "not started here" in answer.body["error"]["message"], answer.body


async def test_a_validly_signed_pending_sign_in_of_another_shape_is_a_400(
    tmp_path: Path, provider: Provider
) -> None:
    """A field missing or of another type (a cookie an earlier corral signed, say) is a 400: they were
    500s (KeyError, ValueError, TypeError)."""
    async with gateway(tmp_path / "c.db", provider.url) as url:
        key = signing_key(ADMIN, SECRET, "corral")
        good = {"state": "s", "nonce": "n", "verifier": "v" * 64, "redirect": url + "/console/callback"}
        good["until"] = time.time() + 600
        callback = f"{url}/console/callback?state=s&code=c0de"
        # the key is the gateway's: the well-formed cookie gets to the provider, which refuses the code
        answer = await ask("GET", callback, {"corral_signin": signed(key, good)})
        assert answer.status == 401 and "refused the sign-in's code" in answer.body["error"]["message"]
        shapes = [
            {name: value for name, value in good.items() if name != "state"},
            {**good, "until": "soon"},
            {**good, "until": None},
            {**good, "until": [1]},
            {**good, "redirect": ["x"]},
            {name: value for name, value in good.items() if name != "verifier"},
        ]
        for shape in shapes:
            answer = await ask("GET", callback, {"corral_signin": signed(key, shape)})
            assert answer.status == 400 and "not started here" in answer.body["error"]["message"], shape


async def test_over_https_the_pending_sign_in_is_a_host_only_cookie_read_under_that_name_alone(
    tmp_path: Path, provider: Provider
) -> None:
    """Over HTTPS (here an edge that ends TLS says so) the pending sign-in is `__Host-corral_signin`
    (Secure, Path=/, no Domain), which a sibling host cannot set; one under the plain name, which it can
    set for the whole domain, is not read. Over plain HTTP the plain name stays (browsers refuse `__Host-`
    without Secure)."""
    async with gateway(tmp_path / "c.db", provider.url) as url:
        started, done = await sign_in(url, "bob", HTTPS)
        assert list(started.cookies) == ["__Host-corral_signin"]
        pending = started.cookies["__Host-corral_signin"]
        assert pending["secure"] and pending["path"] == "/" and not pending["domain"]
        assert done.status == 303 and list(done.cookies) == ["__Host-corral_session", "__Host-corral_signin"]
        session = done.cookies["__Host-corral_session"]  # the session too: no sibling host may shadow it
        assert session["secure"] and session["path"] == "/" and not session["domain"], done.body
        assert done.cookies["__Host-corral_signin"].value == ""  # (spent)
        assert done.cookies["__Host-corral_signin"]["secure"]  # (a browser drops a __Host- one only so)
        me = await ask("GET", url + "/console/me", {"__Host-corral_session": session.value}, HTTPS)
        assert me.body["signed_in"] and me.body["who"] == "bob"
        planted = await ask("GET", url + "/console/me", {"corral_session": session.value}, HTTPS)
        assert not planted.body["signed_in"]  # the plain name over HTTPS: a sibling host's, not read
        keys = await ask("GET", url + "/admin/keys", {"__Host-corral_session": session.value}, HTTPS)
        assert keys.status != 401, keys.body  # the admin API reads it under the same name
        gone = await ask(
            "POST",
            url + "/console/signout",
            {"__Host-corral_session": session.value},
            {**HTTPS, "X-CSRF-Token": me.body["csrf"]},
        )
        assert gone.status == 200 and gone.cookies["__Host-corral_session"]["secure"]

        started = await ask("GET", url + "/console/signin", headers=HTTPS)
        value = started.cookies["__Host-corral_signin"].value
        state = urllib.parse.parse_qs(urllib.parse.urlsplit(started.headers["Location"]).query)["state"][0]
        callback = f"{url}/console/callback?state={state}&code=c0de"
        answer = await ask("GET", callback, {"corral_signin": value}, HTTPS)
        assert answer.status == 400 and "not started here" in answer.body["error"]["message"], answer.body
        answer = await ask("GET", callback, {"__Host-corral_signin": value}, HTTPS)
        assert answer.status == 401  # (read: the provider refuses the made-up code)

        plain = await ask("GET", url + "/console/signin")
        assert list(plain.cookies) == ["corral_signin"]
        assert (
            plain.cookies["corral_signin"]["path"] == "/console"
            and not plain.cookies["corral_signin"]["secure"]
        )


async def test_behind_an_https_redirect_url_the_admin_api_reads_the_session_under_its_host_only_name_alone(
    tmp_path: Path, provider: Provider
) -> None:
    """An edge that ends TLS without being a trusted proxy: the sign-in knows HTTPS from its https
    `redirect_url` and writes `__Host-corral_session`; the admin API decides as the sign-in does, so a plain
    `corral_session` a sibling site planted (holding a session of its own) is read by neither."""
    https = "https://corral.example/console/callback"
    async with gateway(tmp_path / "c.db", provider.url, redirect_url=https) as url:
        _, done = await sign_in(url, "bob")
        secret = done.cookies["__Host-corral_session"].value
        assert secret and done.cookies["__Host-corral_session"]["secure"]
        planted = await ask("GET", url + "/admin/keys", {"corral_session": secret})
        assert planted.status == 401, planted.body
        read = await ask("GET", url + "/admin/keys", {"__Host-corral_session": secret})
        assert read.status != 401, read.body


async def test_refused_sign_ins_and_sign_outs_are_on_the_audit_trail(
    tmp_path: Path, provider: Provider
) -> None:
    """An ID token the provider signed that corral refuses (its tenant not in auth.oidc.tenants, another
    sign-in's nonce) and a sign-out without the console's CSRF token left no record, where the admin API's
    refusals leave one."""
    put = f"{provider.url}/users/mallory"
    await asyncio.to_thread(lambda: httpx.put(put, json={"tenant": "globex"}).raise_for_status())
    async with gateway(tmp_path / "c.db", provider.url) as url:
        _, outsider = await sign_in(url, "mallory")
        assert outsider.status == 401 and "globex" in outsider.body["error"]["message"], outsider.body
        started = await ask("GET", url + "/console/signin")
        back = await asyncio.to_thread(
            lambda: httpx.post(started.headers["Location"], data={"sub": "bob"}).headers["location"]
        )
        payload = started.cookies["corral_signin"].value.rpartition(".")[0]
        pending = json.loads(base64.urlsafe_b64decode(payload)) | {"nonce": "another sign-in's"}
        forged = {"corral_signin": signed(signing_key(ADMIN, SECRET, "corral"), pending)}
        query = urllib.parse.urlsplit(back).query
        replayed = await ask("GET", f"{url}/console/callback?{query}", forged)
        assert replayed.status == 401 and "nonce" in replayed.body["error"]["message"], replayed.body
        _, done = await sign_in(url, "bob")
        session = {"corral_session": done.cookies["corral_session"].value}
        out = await ask("POST", url + "/console/signout", session, {"X-CSRF-Token": "not-it"})
        assert (out.status, out.body["error"]["code"]) == (403, "csrf_failed"), out.body
        trail = await ask("GET", url + "/admin/audit", headers={"Authorization": f"Bearer {ADMIN}"})
    entries = [(e["action"], e["actor"], e["role"], e["status"]) for e in reversed(trail.body["entries"])]
    assert entries == [
        ("signin", "oidc:mallory", "none", 401),
        ("signin", "oidc:bob", "none", 401),
        ("signin", "oidc:bob", "tenant-admin", 303),
        ("signout", "oidc:bob", "tenant-admin", 403),
    ], entries
