"""What the gateway holds of the identity provider (admission/oidc.py), on a provider of the test's own (a
real server on localhost) and a clock the test moves: the signing keys and the discovery document are read
again once their max-age is up (an hour without one, within five minutes and a day), so a key the provider
withdrew stops being trusted; a refresh that fails keeps what is held and is tried again later, never on
every token; a provider that fails while nothing is held is not asked again for a moment."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from joserfc import jwt
from joserfc.jwk import KeySet, RSAKey

from corral.admission.oidc import OIDCVerifier
from corral.config import OIDCSettings
from corral.protocol import Unauthorized, UpstreamError


@dataclass
class FakeProvider:
    """Discovery and a key set, answering as the test says; counts what it is asked."""

    keys: list[RSAKey]
    keys_cache_control: str = ""  # the key set's Cache-Control
    failing: set[str] = field(default_factory=set)  # paths answered 500
    asked: Counter[str] = field(default_factory=Counter)
    issuer: str = ""

    async def discovery(self, request: web.Request) -> web.Response:
        return self._answer(request, {"issuer": self.issuer, "jwks_uri": self.issuer + "/jwks"})

    async def jwks(self, request: web.Request) -> web.Response:
        answer = self._answer(request, KeySet(self.keys).as_dict(private=False))
        if self.keys_cache_control:
            answer.headers["Cache-Control"] = self.keys_cache_control
        return answer

    def _answer(self, request: web.Request, document: dict[str, object]) -> web.Response:
        self.asked[request.path] += 1
        if request.path in self.failing:
            return web.Response(status=500)
        endpoints = {"authorization_endpoint": self.issuer + "/a", "token_endpoint": self.issuer + "/t"}
        return web.json_response({**endpoints, **document} if "issuer" in document else document)

    def token(self, key: RSAKey) -> str:
        now = int(time.time())
        claims = {"iss": self.issuer, "aud": "corral", "sub": "s", "iat": now, "exp": now + 300}
        return jwt.encode({"alg": "RS256", "kid": key.kid}, claims, key)


@pytest.fixture
async def provider() -> AsyncIterator[FakeProvider]:
    fake = FakeProvider([RSAKey.generate_key(2048, parameters={"kid": "one"})])
    app = web.Application()
    app.router.add_get("/.well-known/openid-configuration", fake.discovery)
    app.router.add_get("/jwks", fake.jwks)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "localhost", 0).start()
    fake.issuer = f"http://localhost:{runner.addresses[0][1]}"
    yield fake
    await runner.cleanup()


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


def verifier_of(provider: FakeProvider, clock: Clock) -> OIDCVerifier:
    return OIDCVerifier(OIDCSettings(issuer=provider.issuer, client_id="corral", clock_skew_s=0), clock)


async def test_a_key_the_provider_withdrew_stops_being_trusted_once_the_keys_age_is_up(
    provider: FakeProvider,
) -> None:
    clock = Clock()
    verifier = verifier_of(provider, clock)
    one, two = provider.keys[0], RSAKey.generate_key(2048, parameters={"kid": "two"})
    assert (await verifier.claims(provider.token(one)))["sub"] == "s"
    provider.keys = [two]  # the provider withdraws key one
    clock.now += 3500
    assert (await verifier.claims(provider.token(one)))["sub"] == "s"  # (held for an hour)
    assert provider.asked == {"/.well-known/openid-configuration": 1, "/jwks": 1}
    clock.now += 101
    with pytest.raises(Unauthorized):
        await verifier.claims(provider.token(one))
    assert provider.asked == {"/.well-known/openid-configuration": 2, "/jwks": 2}  # both read again
    for _ in range(20):
        assert (await verifier.claims(provider.token(two)))["sub"] == "s"
    assert provider.asked == {"/.well-known/openid-configuration": 2, "/jwks": 2}  # not per token


async def test_a_failed_refresh_keeps_the_keys_and_is_tried_again_a_minute_later_not_per_token(
    provider: FakeProvider,
) -> None:
    clock = Clock()
    verifier = verifier_of(provider, clock)
    one = provider.keys[0]
    assert (await verifier.claims(provider.token(one)))["sub"] == "s"
    provider.failing = {"/.well-known/openid-configuration", "/jwks"}
    clock.now += 3601
    for _ in range(10):
        assert (await verifier.claims(provider.token(one)))["sub"] == "s"  # the keys held serve on
    assert provider.asked == {"/.well-known/openid-configuration": 2, "/jwks": 2}
    clock.now += 59
    assert (await verifier.claims(provider.token(one)))["sub"] == "s"
    assert provider.asked == {"/.well-known/openid-configuration": 2, "/jwks": 2}
    clock.now += 2
    assert (await verifier.claims(provider.token(one)))["sub"] == "s"
    assert provider.asked == {"/.well-known/openid-configuration": 3, "/jwks": 3}
    provider.failing = set()
    provider.keys = [RSAKey.generate_key(2048, parameters={"kid": "two"})]  # one withdrawn meanwhile
    clock.now += 61
    with pytest.raises(Unauthorized):
        await verifier.claims(provider.token(one))
    assert provider.asked == {"/.well-known/openid-configuration": 4, "/jwks": 4}


@pytest.mark.parametrize(
    ("cache_control", "held_s"),
    [("max-age=10", 300), ("public, max-age=7200", 7200), ("max-age=100000000", 86400), ("no-cache", 300)],
)
async def test_the_key_sets_max_age_says_how_long_it_is_held_within_five_minutes_and_a_day(
    provider: FakeProvider, cache_control: str, held_s: float
) -> None:
    provider.keys_cache_control = cache_control
    clock = Clock()
    verifier = verifier_of(provider, clock)
    token = provider.token(provider.keys[0])
    await verifier.claims(token)
    clock.now += held_s - 1
    await verifier.claims(token)
    assert provider.asked["/jwks"] == 1
    clock.now += 2
    await verifier.claims(token)
    assert provider.asked["/jwks"] == 2


async def test_a_provider_that_failed_with_nothing_held_is_asked_again_after_two_seconds(
    provider: FakeProvider,
) -> None:
    clock = Clock()
    verifier = verifier_of(provider, clock)
    provider.failing = {"/.well-known/openid-configuration"}
    for _ in range(5):
        with pytest.raises(UpstreamError) as failed:
            await verifier.metadata()
        assert failed.value.status == 502 and provider.issuer in failed.value.message
    assert provider.asked["/.well-known/openid-configuration"] == 1
    clock.now += 2.1
    provider.failing = set()
    assert (await verifier.metadata()).jwks_uri == provider.issuer + "/jwks"
    assert provider.asked["/.well-known/openid-configuration"] == 2
