"""Who may call the cluster: API keys, the admin key, and sign-in through an OpenID Connect provider."""

from __future__ import annotations

import re
import urllib.parse
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from corral.config.base import Strict


class OIDCGroup(Strict):
    """What membership of one identity-provider group gives: a tenant, a role, or both."""

    tenant: str | None = Field(default=None, description="the tenant its members act for")
    role: Literal["admin", "operator", "viewer", "tenant-admin", "user"] | None = Field(
        default=None, description="the role its members have"
    )


class OIDCTenant(Strict):
    """Limits of one tenant's people signed in through the identity provider (all of them together, as one
    key's)."""

    models: list[str] = Field(default_factory=list, description="models they may use (empty: all)")
    rpm: Annotated[int, Field(ge=1)] | None = Field(default=None, description="requests per minute")
    tpm: Annotated[int, Field(ge=1)] | None = Field(default=None, description="tokens per minute")
    max_concurrency: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="requests in flight at once"
    )
    monthly_token_budget: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="tokens per calendar month"
    )


class OIDCSettings(Strict):
    """Sign-in through an OpenID Connect provider: its tokens (JWTs) are accepted like keys on the API, and
    people sign in to the console with the authorization-code flow (PKCE)."""

    issuer: Annotated[str, Field(pattern=r"^https?://")] = Field(
        description="the provider's issuer URL (its discovery document is issuer/.well-known/"
        "openid-configuration); https, except on localhost"
    )
    client_id: str = Field(description="corral's client id at the provider (the console's sign-in)")
    client_secret: str | None = Field(
        default=None, description="its secret; CORRAL_OIDC_CLIENT_SECRET overrides (keep it out of files)"
    )
    audience: str | None = Field(
        default=None,
        description="the `aud` a token must name to be accepted on the API; client_id when unset",
    )
    scopes: list[str] = Field(
        default_factory=lambda: ["openid", "profile", "email"], description="scopes the console asks for"
    )
    tenant_claim: str = Field(default="tenant", description="the claim that names a person's tenant")
    role_claim: str = Field(default="role", description="the claim that names a person's role")
    groups_claim: str = Field(default="groups", description="the claim listing a person's groups")
    groups: dict[str, OIDCGroup] = Field(
        default_factory=dict,
        description="group → tenant and role, where the claims do not say them (the first group naming a "
        "role in the person's tenant, or in none, gives it; groups naming two tenants need a tenant claim)",
    )
    default_role: Literal["viewer", "tenant-admin", "user"] = Field(
        default="user", description="the role of a person no claim or group gives one"
    )
    tenants: dict[str, OIDCTenant] = Field(
        default_factory=dict, description="limits and budgets per tenant of signed-in people"
    )
    clock_skew_s: Annotated[float, Field(ge=0, le=600)] = Field(
        default=60.0, description="seconds of clock difference tolerated on exp, iat and nbf"
    )
    redirect_url: str | None = Field(
        default=None,
        description="the console's sign-in callback as the provider redirects to it (https://HOST/console/"
        "callback); the gateway's own address when unset",
    )
    session_ttl_s: Annotated[float, Field(gt=0, le=7 * 86400)] = Field(
        default=8 * 3600, description="how long a console sign-in lasts"
    )

    @model_validator(mode="after")
    def _https_or_local(self) -> OIDCSettings:
        # (the host as a URL parser reads it: in http://localhost:1@idp.example.net "localhost" is a user)
        issuer = urllib.parse.urlsplit(self.issuer)
        if "@" in issuer.netloc:
            raise ValueError("auth.oidc.issuer must not name a user or password (no '@' before the host)")
        if not issuer.hostname or "?" in self.issuer or "#" in self.issuer:
            raise ValueError("auth.oidc.issuer must name the provider's host, with no query or fragment")
        if issuer.scheme == "http" and issuer.hostname not in ("localhost", "127.0.0.1", "::1"):
            raise ValueError("auth.oidc.issuer must be https (http only for a provider on localhost)")
        return self


_BEARER_TOKEN = re.compile(r"[\x21-\x7e]+")  # visible ASCII, at least one: what a bearer token can carry


def sendable_token(key: str) -> bool:
    """`key` can be sent as a bearer token: visible ASCII, at least one character."""
    return _BEARER_TOKEN.fullmatch(key) is not None


class AuthSettings(Strict):
    """API keys. With `open: true` requests without a key are served (keys, when sent, still apply)."""

    open: bool = Field(default=False, description="serve requests without an API key (the embedded default)")
    open_to_network: bool = Field(
        default=False,
        description="let an open gateway listen beyond loopback (gateway.host); refused otherwise, since "
        "anyone reaching it could use it",
    )
    admin_key: str | None = Field(default=None, description="protects /admin; CORRAL_ADMIN_KEY overrides")
    cache_ttl: Annotated[float, Field(gt=0, description="seconds a key lookup is cached")] = 5.0
    oidc: OIDCSettings | None = Field(
        default=None, description="sign-in and API tokens from an OpenID Connect provider"
    )

    @field_validator("admin_key")
    @classmethod
    def _sendable(cls, key: str | None) -> str | None:
        """An admin key a client can send as a bearer token: an empty one (a template's unset variable)
        was met by any `Authorization: Bearer` with no token."""
        if key is not None and not sendable_token(key):
            raise ValueError(
                "auth.admin_key must be visible ASCII characters, without spaces (an empty key is refused: "
                "leave the setting out for no admin key)"
            )
        return key
