"""Tokens from an OpenID Connect provider, accepted on the API like keys (`auth.oidc`).

The provider is found by discovery (`issuer/.well-known/openid-configuration`); its signing keys come from
its `jwks_uri` and are fetched again when a token names a key not among them (the provider rotated its
keys), at most every `_REFETCH_S`. Both are held for their Cache-Control max-age (within five minutes and a
day; an hour where none is given) and then read again, so a key the provider withdrew stops being trusted;
a failed refresh keeps what is held and is tried again after `_STALE_RETRY_S`. A provider that cannot be
asked while nothing is held is an UpstreamError (502, `identity_provider_failed`), remembered for `_RETRY_S`
so that a failing provider is not asked again by every sign-in.

A token (a JWT: an ID token, or an access token the provider issues as one) is accepted when joserfc finds
its signature good under one of those keys, with an asymmetric algorithm, and its claims good: `iss` the
issuer, `aud` naming `auth.oidc.audience` (else the client id), `exp` not past and `nbf`/`iat` not ahead,
each within `clock_skew_s`. Signature and claims checks are the library's; corral only maps claims to a
tenant and role (`tenant_claim`, `role_claim`, else the first of the person's groups in `auth.oidc.groups`
that names one, else `default_role`).

A signed-in person acts for their tenant: rate limits and budgets are the tenant's (`auth.oidc.tenants`),
shared by its people as one key's would be (usage rows name `oidc:<tenant>` as the key), and by the keys its
signed-in tenant-admins create (their `parent` is `oidc:<tenant>`: `signed_in`); the audit trail names the
person (`oidc:<subject>`).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeGuard

import aiohttp
import orjson
from joserfc import jwt
from joserfc.errors import ExpiredTokenError, InvalidClaimError, JoseError, MissingClaimError
from joserfc.jwk import KeySet

from corral.admission.auth import SIGNED_IN, Principal, looks_like_jwt, token_digest
from corral.config import OIDCSettings
from corral.protocol import APIError, Unauthorized, UpstreamError
from corral.store import PRIORITIES

__all__ = ["PROVIDER_FAILED", "OIDCVerifier", "ProviderMetadata", "looks_like_jwt", "token_digest"]

logger = logging.getLogger(__name__)

_ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")
_ROLES = ("admin", "operator", "viewer", "tenant-admin", "user")
_REFETCH_S = 1.0  # a token naming an unknown key id refetches the key set at most this often
_RETRY_S = 2.0  # a provider that failed while nothing was held is not asked again for this long
_STALE_RETRY_S = 60.0  # a failed refresh: what is held serves on, and the provider is asked again after this
_HELD_S, _HELD_LEAST_S, _HELD_MOST_S = 3600.0, 300.0, 86400.0  # discovery and keys: without max-age, bounds
_TIMEOUT = aiohttp.ClientTimeout(total=10)
PROVIDER_FAILED = "identity_provider_failed"  # the error code of a provider that could not be asked


@dataclass(frozen=True)
class ProviderMetadata:
    issuer: str
    jwks_uri: str
    authorization_endpoint: str
    token_endpoint: str
    end_session_endpoint: str | None = None


class OIDCVerifier:
    """Checks the provider's tokens; one per gateway process."""

    def __init__(self, settings: OIDCSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock
        self._metadata: ProviderMetadata | None = None
        self._metadata_due = -math.inf  # when discovery is read again (or, after a failure, may be)
        self._metadata_failure = ""  # why the last reading of discovery failed
        self._discovery_lock = asyncio.Lock()
        self._keys: KeySet | None = None
        self._keys_due = -math.inf  # when the keys held are fetched again for their age
        self._fetched_at = -_REFETCH_S
        self._failure: str | None = None  # why the last fetch failed (None: it did not)
        self._lock = asyncio.Lock()
        self._claims = self._registry(settings.audience or settings.client_id)
        self._id_claims = self._registry(settings.client_id)  # an ID token names the client

    def _registry(self, audience: str) -> jwt.JWTClaimsRegistry:
        return jwt.JWTClaimsRegistry(
            leeway=int(self.settings.clock_skew_s),
            iss={"essential": True, "value": self.settings.issuer},  # (exactly: Auth0's ends with /)
            aud={"essential": True, "value": audience},
            exp={"essential": True},
            sub={"essential": True},
        )

    async def metadata(self) -> ProviderMetadata:
        """The provider's discovery document, held for its max-age. UpstreamError (502) when the provider
        cannot be asked and no document is held: remembered for `_RETRY_S`, in which it is not asked again.
        A refresh that fails keeps the document held; others meanwhile take the held one without waiting."""
        held = self._metadata
        if held is not None and (self._clock() < self._metadata_due or self._discovery_lock.locked()):
            return held
        async with self._discovery_lock:
            held = self._metadata
            if self._clock() < self._metadata_due:  # (read, or failed, while this one waited)
                if held is None:
                    raise self._provider_failed(self._metadata_failure)
                return held
            try:
                found, held_for = await self._discover()
            except UpstreamError as exc:
                self._metadata_failure = exc.message
                self._metadata_due = self._clock() + (_RETRY_S if held is None else _STALE_RETRY_S)
                if held is None:
                    raise
                logger.warning("oidc: %s The document held serves on.", exc.message)
                return held
            self._metadata, self._metadata_due = found, self._clock() + held_for
            return found

    async def _discover(self) -> tuple[ProviderMetadata, float]:
        """The discovery document read now, and how long to hold it."""
        issuer = self.settings.issuer
        url = issuer.rstrip("/") + "/.well-known/openid-configuration"
        try:
            document, held_for = await _get_json(url)
            named, ending = document.get("issuer"), document.get("end_session_endpoint")
            if not isinstance(named, str) or named.rstrip("/") != issuer.rstrip("/"):
                raise self._provider_failed(
                    f"The identity provider {issuer} names another issuer in its discovery document."
                )
            found = ProviderMetadata(
                issuer=named,
                jwks_uri=_url(document, "jwks_uri"),
                authorization_endpoint=_url(document, "authorization_endpoint"),
                token_endpoint=_url(document, "token_endpoint"),
                end_session_endpoint=ending if _is_url(ending) else None,
            )
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as exc:
            raise self._provider_failed(
                f"The identity provider {issuer} could not be asked for its configuration "
                f"({type(exc).__name__})."
            ) from None
        return found, held_for

    def _provider_failed(self, message: str) -> UpstreamError:
        return UpstreamError(message, code=PROVIDER_FAILED, retry_after=_RETRY_S)

    async def _key_set(self, refresh: bool = False) -> KeySet:
        """The provider's keys, held for their max-age; then the first token checked fetches them again while
        others take the keys held, and a fetch that fails keeps them (tried again after `_STALE_RETRY_S`).
        `refresh`: a token named a key id they lack, so they are fetched again unless they were (or a fetch
        was tried) within `_REFETCH_S`. Tokens under known keys never wait on another token's fetch, and
        random key ids cannot queue fetches behind a slow provider."""
        keys = self._keys
        if keys is not None and (self._held(refresh) or (not refresh and self._lock.locked())):
            return keys
        async with self._lock:
            keys, tried = self._keys, self._clock() - self._fetched_at < _REFETCH_S
            if keys is not None and self._held(refresh):
                return keys
            if keys is None and tried and self._failure is not None:
                raise Unauthorized(self._failure)  # (the provider failed a moment ago: not asked again yet)
            self._fetched_at = self._clock()  # (before asking: a failed fetch waits its turn too)
            try:
                metadata = await self.metadata()
                document, held_for = await _get_json(metadata.jwks_uri)
                self._keys = KeySet.import_key_set(document)  # type: ignore[arg-type]
            except (APIError, aiohttp.ClientError, TimeoutError, KeyError, ValueError, JoseError) as exc:
                self._failure = (
                    exc.message
                    if isinstance(exc, APIError)
                    else f"The identity provider could not be asked ({type(exc).__name__})."
                )
                if keys is not None and not refresh:  # (fetched for their age: the keys held serve on)
                    self._keys_due = self._clock() + _STALE_RETRY_S
                    logger.warning("oidc: refreshing the provider's keys failed: %s", self._failure)
                    return keys
                raise Unauthorized(self._failure) from None
            finally:  # (as it ends too: those that waited for it take its answer, not a fetch of their own)
                self._fetched_at = self._clock()
            self._failure = None
            self._keys_due = self._clock() + held_for
            return self._keys

    def _held(self, refresh: bool) -> bool:
        """Whether the keys held serve as they are: for a token under an unknown key id, when they were
        fetched (or a fetch was tried) within `_REFETCH_S`; for any other, until their age is up."""
        if refresh:
            return self._clock() - self._fetched_at < _REFETCH_S
        return self._clock() < self._keys_due

    async def claims(self, token: str, id_token: bool = False) -> dict[str, Any]:
        """The token's claims once its signature and claims check out (`id_token`: a console sign-in's ID
        token, whose audience is the client id); Unauthorized (saying which check failed, never the
        token) otherwise."""
        keys = await self._key_set()
        kid = _key_id(token)
        if kid is not None and not any(key.kid == kid for key in keys.keys):
            keys = await self._key_set(refresh=True)  # a key id it does not know: the provider rotated
        try:
            decoded = jwt.decode(token, keys, algorithms=_ALGORITHMS)
        except Exception:  # (anyone's bytes, read by the library: whatever it raises, the token is bad)
            raise Unauthorized("The token's signature does not check out.", code="invalid_token") from None
        try:
            (self._id_claims if id_token else self._claims).validate(decoded.claims)
        except ExpiredTokenError:
            raise Unauthorized("The token has expired.", code="expired_token") from None
        except (InvalidClaimError, MissingClaimError) as exc:
            raise Unauthorized(f"The token's claims do not check out: {exc.description}.") from None
        except Exception:  # (a claim of a type the registry cannot compare: a number as a list, ...)
            raise Unauthorized("The token's claims do not check out.", code="invalid_token") from None
        audience, party = decoded.claims.get("aud"), decoded.claims.get("azp")
        if isinstance(audience, list) and len(audience) > 1 and party != self.settings.client_id:
            raise Unauthorized("The token was issued to another client (azp).")  # (OIDC Core 3.1.3.7)
        return dict(decoded.claims)

    def principal(self, claims: dict[str, Any]) -> Principal:
        """Who the claims say: their tenant (its limits), their role, their subject."""
        settings = self.settings
        tenant, role = claims.get(settings.tenant_claim), claims.get(settings.role_claim)
        if isinstance(role, list):  # (Entra ID's `roles`: the first that is one of corral's)
            role = next((r for r in role if r in _ROLES), None)
        if isinstance(tenant, list):
            tenant = next((t for t in tenant if isinstance(t, str) and t), None)
        groups = claims.get(settings.groups_claim) or []
        listed = groups if isinstance(groups, list) else []
        mapped = [settings.groups[str(g)] for g in listed if str(g) in settings.groups]
        if not tenant:
            named = {m.tenant for m in mapped if m.tenant}
            if len(named) > 1:
                raise Unauthorized(
                    "The token's groups name more than one tenant (auth.oidc.groups); a tenant claim "
                    f"('{settings.tenant_claim}') must say which."
                )
            tenant = next(iter(named), None)
        if not role:  # a group's role holds in its own tenant only (or, naming none, in any)
            role = next((m.role for m in mapped if m.role and m.tenant in (None, tenant)), None)
        if isinstance(tenant, str) and tenant and tenant not in settings.tenants:
            raise Unauthorized(f"The tenant '{tenant[:64]}' is not one of auth.oidc.tenants.")
        if not isinstance(tenant, str) or not tenant:
            raise Unauthorized(
                f"The token names no tenant (claim '{settings.tenant_claim}', or a group in "
                "auth.oidc.groups)."
            )
        if role not in _ROLES:
            role = settings.default_role
        expires = float(claims["exp"]) + settings.clock_skew_s
        return self.principal_of(str(claims["sub"]), tenant, str(role), expires)

    def principal_of(self, subject: str, tenant: str, role: str, expires_at: float | None) -> Principal:
        """A signed-in person of `tenant` with `role`, with the tenant's limits (a token's, or a console
        session's)."""
        people = self.signed_in(tenant)
        if people is None:  # (a console session of a tenant taken out of the list since: it ends)
            raise Unauthorized(f"The tenant '{tenant[:64]}' is not one of auth.oidc.tenants.")
        return replace(people, role=role, expires_at=expires_at, subject=subject)

    def signed_in(self, tenant: str) -> Principal | None:
        """The limits `tenant`'s signed-in people share, as one key's (`oidc:<tenant>`); also those of the
        keys its signed-in tenant-admins made. None: not one of `auth.oidc.tenants`."""
        limits = self.settings.tenants.get(tenant)
        if limits is None:
            return None
        return Principal(
            key_id=SIGNED_IN + tenant,
            tenant=tenant,
            models=frozenset(limits.models),
            rpm=limits.rpm,
            tpm=limits.tpm,
            max_concurrency=limits.max_concurrency,
            priority=PRIORITIES["normal"],
            monthly_token_budget=limits.monthly_token_budget,
        )

    @property
    def client_secret(self) -> str | None:
        """corral's secret at the provider: CORRAL_OIDC_CLIENT_SECRET, else the spec's."""
        return os.environ.get("CORRAL_OIDC_CLIENT_SECRET") or self.settings.client_secret


def _key_id(token: str) -> str | None:
    """The `kid` of a JWT's header (unverified: it only says which key to check the signature with)."""
    try:
        header = orjson.loads(base64.urlsafe_b64decode(token.split(".", 1)[0] + "=="))
    except (ValueError, orjson.JSONDecodeError):
        return None
    kid = header.get("kid") if isinstance(header, dict) else None
    return kid if isinstance(kid, str) else None


def _url(document: dict[str, Any], name: str) -> str:
    """A URL the discovery document must give."""
    value = document.get(name)
    if not _is_url(value):
        raise KeyError(name)
    return value


def _is_url(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and value.startswith(("https://", "http://"))


async def _get_json(url: str) -> tuple[dict[str, Any], float]:
    """A JSON object from the provider, and how long to hold it (its Cache-Control max-age, within
    five minutes and a day; an hour without one)."""
    async with aiohttp.ClientSession(timeout=_TIMEOUT) as session, session.get(url) as answer:
        answer.raise_for_status()
        document = await answer.json(content_type=None)
        if not isinstance(document, dict):
            raise ValueError("not a JSON object")
        return document, _held_for(answer.headers.get("Cache-Control", ""))


def _held_for(cache_control: str) -> float:
    """Seconds to hold a document the provider sent with `cache_control`."""
    held = _HELD_S
    for directive in cache_control.lower().split(","):
        name, _, value = directive.strip().partition("=")
        if name in ("no-cache", "no-store"):
            return _HELD_LEAST_S
        if name == "max-age" and value.strip().isdigit():
            held = float(value.strip())
    return min(max(held, _HELD_LEAST_S), _HELD_MOST_S)
