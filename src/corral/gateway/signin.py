"""Signing in to the console through the identity provider (`auth.oidc`): OpenID Connect's
authorization-code flow with PKCE.

- `GET /console/signin` sends the browser to the provider with a fresh `state`, `nonce` and PKCE challenge
  (S256); the verifier, state and nonce wait in a short-lived cookie of this browser's (HttpOnly,
  SameSite=Lax, signed), so any gateway worker can finish the flow.
- `GET /console/callback` checks the state, trades the code (with the verifier) for tokens at the
  provider's token endpoint, has the ID token checked as the API's tokens are (admission/oidc.py: signature,
  issuer, audience, expiry), and its nonce; then starts a session in the store: the `corral_session` cookie
  (HttpOnly, SameSite=Lax, Secure over HTTPS) carries a random secret, the store its hash, the person's
  tenant and role, and a CSRF token that every change the console makes must send back
  (`X-CSRF-Token`). The sign-in is on the audit trail.
- `POST /console/signout` ends the session (CSRF-checked; audited). `GET /console/me` says who is signed
  in, and gives the console its CSRF token.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import secrets
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from corral.admission.oidc import OIDCVerifier
from corral.gateway.clients import ClientAddresses
from corral.protocol import InvalidRequest, PermissionDenied, Unauthorized
from corral.store import SessionStore

__all__ = ["CSRF_HEADER", "SESSION_COOKIE", "SignInViews"]

SESSION_COOKIE = "corral_session"
CSRF_HEADER = "X-CSRF-Token"
_PENDING_COOKIE = "corral_signin"
_PENDING_S = 600  # a sign-in must come back from the provider within this long
_TIMEOUT = aiohttp.ClientTimeout(total=15)

Audit = Callable[[web.Request, str, str, str, str, int], Awaitable[None]]


def _same(given: str, expected: str) -> bool:
    """A constant-time comparison of two strings a client may have sent in any characters."""
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode())


class SignInViews:
    """The console's sign-in routes (only with `auth.oidc`)."""

    def __init__(
        self,
        verifier: OIDCVerifier,
        sessions: SessionStore,
        secret_key: bytes,
        audit: Audit,
        clients: ClientAddresses | None = None,
    ) -> None:
        self._clients = clients or ClientAddresses([])  # (whose X-Forwarded-Proto to believe)
        self._verifier = verifier
        self._settings = verifier.settings
        self._sessions = sessions
        self._key = secret_key  # signs the pending sign-in cookie
        self._audit = audit

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/console/signin", self.signin)
        app.router.add_get("/console/callback", self.callback)
        app.router.add_post("/console/signout", self.signout)
        app.router.add_get("/console/me", self.me)

    def _redirect_uri(self, request: web.Request) -> str:
        scheme = self._clients.scheme(request)  # (an edge that ends TLS says https)
        return self._settings.redirect_url or f"{scheme}://{request.host}/console/callback"

    async def signin(self, request: web.Request) -> web.StreamResponse:
        metadata = await self._verifier.metadata()
        state, nonce, verifier = (secrets.token_urlsafe(24) for _ in range(3))
        challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=")
        redirect = self._redirect_uri(request)
        query = {
            "response_type": "code",
            "client_id": self._settings.client_id,
            "redirect_uri": redirect,
            "scope": " ".join(self._settings.scopes),
            "state": state,
            "nonce": nonce,
            "code_challenge": challenge.decode(),
            "code_challenge_method": "S256",
        }
        response = web.HTTPSeeOther(metadata.authorization_endpoint + "?" + urllib.parse.urlencode(query))
        pending: dict[str, object] = {"state": state, "nonce": nonce, "verifier": verifier}
        pending.update(redirect=redirect, until=time.time() + _PENDING_S)
        response.set_cookie(
            _PENDING_COOKIE,
            self._sign(pending),
            max_age=_PENDING_S,
            path="/console",
            httponly=True,
            samesite="Lax",
            secure=self._secure(request),
        )
        return response

    async def callback(self, request: web.Request) -> web.StreamResponse:
        pending = self._unsigned(request.cookies.get(_PENDING_COOKIE, ""))
        if pending is None or float(pending["until"]) < time.time():
            raise InvalidRequest("The sign-in took too long or was not started here: sign in again.")
        if not _same(str(pending["state"]), request.query.get("state", "")):
            raise InvalidRequest("The sign-in's state does not match: sign in again.", param="state")
        if "code" not in request.query:
            error = request.query.get("error_description") or request.query.get("error") or "no code"
            raise Unauthorized(f"The identity provider did not sign you in: {error[:200]}.")
        tokens = await self._trade(request.query["code"], str(pending["redirect"]), str(pending["verifier"]))
        claims = await self._verifier.claims(str(tokens.get("id_token", "")), id_token=True)
        if not _same(str(claims.get("nonce", "")), str(pending["nonce"])):
            raise Unauthorized("The ID token's nonce does not match this sign-in.")
        principal = self._verifier.principal(claims)
        # a session lasts session_ttl_s, and no longer than the ID token (a role taken away at the
        # provider then ends at the next sign-in)
        lasts = min(self._settings.session_ttl_s, max(60.0, float(claims["exp"]) - time.time()))
        secret, session = await asyncio.to_thread(
            self._sessions.create, str(claims["sub"]), principal.tenant, principal.role, lasts
        )
        await self._audit(request, f"oidc:{session.subject}", session.role, session.tenant, "signin", 303)
        response = web.HTTPSeeOther("/console")
        response.set_cookie(
            SESSION_COOKIE,
            secret,
            max_age=int(lasts),
            path="/",
            httponly=True,
            samesite="Lax",
            secure=self._secure(request),
        )
        response.del_cookie(_PENDING_COOKIE, path="/console")
        return response

    async def _trade(self, code: str, redirect: str, verifier: str) -> dict[str, Any]:
        """The code and verifier for the provider's tokens (client_secret_basic when there is a secret,
        else a public client naming itself)."""
        metadata = await self._verifier.metadata()
        form = {"grant_type": "authorization_code", "code": code, "redirect_uri": redirect}
        form["code_verifier"] = verifier
        secret = self._verifier.client_secret
        auth = aiohttp.BasicAuth(self._settings.client_id, secret) if secret else None
        if auth is None:
            form["client_id"] = self._settings.client_id
        try:
            async with (
                aiohttp.ClientSession(timeout=_TIMEOUT) as session,
                session.post(metadata.token_endpoint, data=form, auth=auth) as answer,
            ):
                body = await answer.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise Unauthorized(
                f"The identity provider's token endpoint failed ({type(exc).__name__})."
            ) from None
        if answer.status != 200 or not isinstance(body, dict):
            raise Unauthorized(f"The identity provider refused the sign-in's code ({answer.status}).")
        return body

    async def signout(self, request: web.Request) -> web.StreamResponse:
        secret = request.cookies.get(SESSION_COOKIE)
        session = await asyncio.to_thread(self._sessions.get, secret) if secret else None
        if session is None:
            raise Unauthorized("No one is signed in.")
        if not _same(request.headers.get(CSRF_HEADER, ""), session.csrf):
            raise PermissionDenied("The request lacks the console's CSRF token.", code="csrf_failed")
        await asyncio.to_thread(self._sessions.end, secret or "")
        await self._audit(request, f"oidc:{session.subject}", session.role, session.tenant, "signout", 200)
        metadata = await self._verifier.metadata()
        response = web.json_response({"signed_out": True, "end_session": metadata.end_session_endpoint})
        response.del_cookie(SESSION_COOKIE, path="/")
        return response

    async def me(self, request: web.Request) -> web.Response:
        secret = request.cookies.get(SESSION_COOKIE)
        session = await asyncio.to_thread(self._sessions.get, secret) if secret else None
        if session is None:
            return web.json_response({"signed_in": False, "oidc": True})
        return web.json_response(
            {
                "signed_in": True,
                "oidc": True,
                "who": session.subject,
                "role": session.role,
                "tenant": session.tenant,
                "csrf": session.csrf,
            }
        )

    def _secure(self, request: web.Request) -> bool:
        """Cookies only over HTTPS: the gateway's own, or an edge's that terminates TLS (the callback the
        provider redirects to says which)."""
        return self._clients.scheme(request) == "https" or self._redirect_uri(request).startswith("https://")

    def _sign(self, data: dict[str, object]) -> str:
        payload = base64.urlsafe_b64encode(orjson.dumps(data)).decode()
        mac = hmac.new(self._key, payload.encode(), hashlib.sha256).hexdigest()
        return f"{payload}.{mac}"

    def _unsigned(self, cookie: str) -> dict[str, Any] | None:
        payload, _, mac = cookie.rpartition(".")
        expected = hmac.new(self._key, payload.encode(), hashlib.sha256).hexdigest()
        if not payload or not _same(mac, expected):
            return None
        try:
            data = orjson.loads(base64.urlsafe_b64decode(payload))
        except (ValueError, orjson.JSONDecodeError):
            return None
        return data if isinstance(data, dict) else None
