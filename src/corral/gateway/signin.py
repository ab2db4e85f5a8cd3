"""Signing in to the console through the identity provider (`auth.oidc`): OpenID Connect's
authorization-code flow with PKCE.

- `GET /console/signin` sends the browser to the provider with a fresh `state`, `nonce` and PKCE challenge
  (S256 of a 64-character verifier: RFC 7636 asks for 43 to 128); the verifier, state and nonce wait in a
  short-lived cookie of this browser's (HttpOnly, SameSite=Lax, signed), so any gateway worker can finish
  the flow. Over HTTPS it is `__Host-corral_signin`, which a browser lets only this host set (Secure,
  Path=/, no Domain): a sibling host cannot plant its own sign-in in the browser (login CSRF).
- `GET /console/callback` checks the state, trades the code (with the verifier) for tokens at the
  provider's token endpoint, has the ID token checked as the API's tokens are (admission/oidc.py: signature,
  issuer, audience, expiry), and its nonce; then starts a session in the store: the `corral_session` cookie
  (HttpOnly, SameSite=Lax, Secure over HTTPS) carries a random secret, the store its hash, the person's
  tenant and role, a CSRF token that every change the console makes must send back (`X-CSRF-Token`), and
  the ID token sealed under the cookie's secret (where sign-out will name it). The sign-in is audited.
- `POST /console/signout` ends the session (CSRF-checked; audited) and clears its cookie, and names the
  provider's end-session URL (with `id_token_hint`, `client_id` and `post_logout_redirect_uri`, the console)
  for the browser to end the provider's session too; null where the provider has none or cannot be asked.
  `GET /console/me` says who is signed in, and gives the console its CSRF token.

A provider that cannot be asked (down, slow, a discovery document without its endpoints) is a 502
`identity_provider_failed` naming it, from sign-in and from the code's trade; sign-out goes on without it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import secrets
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from corral.admission import Principal
from corral.admission.oidc import PROVIDER_FAILED, OIDCVerifier
from corral.gateway.clients import ClientAddresses
from corral.protocol import APIError, InvalidRequest, PermissionDenied, Unauthorized, UpstreamError
from corral.store import SessionStore, StoreThreads

__all__ = ["CSRF_HEADER", "SESSION_COOKIE", "SignInViews", "session_secret"]

logger = logging.getLogger(__name__)

SESSION_COOKIE = "corral_session"
CSRF_HEADER = "X-CSRF-Token"
_PENDING_COOKIE = "corral_signin"
_HOST_ONLY = "__Host-"  # a browser keeps such a cookie to this host (Secure, Path=/, no Domain)
_PENDING_S = 600  # a sign-in must come back from the provider within this long
_TIMEOUT = aiohttp.ClientTimeout(total=15)

Audit = Callable[[web.Request, str, str, str | None, str, int], Awaitable[None]]  # admin.py's record


def session_secret(request: web.Request, secure: bool) -> str | None:
    """The secret of the session cookie the request carries: `__Host-corral_session` (written over HTTPS:
    a sibling host can neither set nor shadow it) where there is one, the plain name only where the request
    came over plain HTTP (browsers refuse a `__Host-` cookie without Secure)."""
    found = request.cookies.get(_HOST_ONLY + SESSION_COOKIE)
    if found is None and not secure:
        found = request.cookies.get(SESSION_COOKIE)
    return found or None


def _same(given: str, expected: str) -> bool:
    """A constant-time comparison of two strings a client may have sent in any characters."""
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode())


@dataclass(frozen=True)
class _Pending:
    """A sign-in under way, as its signed cookie holds it."""

    state: str
    nonce: str
    verifier: str
    redirect: str
    until: float

    @classmethod
    def of(cls, data: dict[str, Any] | None) -> _Pending | None:
        """The sign-in a cookie's payload describes; None where it is not one (a payload signed by an
        earlier corral, or with a field missing or of another type)."""
        if data is None:
            return None
        texts = [data.get(name) for name in ("state", "nonce", "verifier", "redirect")]
        until = data.get("until")
        if isinstance(until, bool) or not isinstance(until, (int, float)):
            return None
        if not all(isinstance(text, str) for text in texts):
            return None
        state, nonce, verifier, redirect = (str(text) for text in texts)
        return cls(state, nonce, verifier, redirect, float(until))


class SignInViews:
    """The console's sign-in routes (only with `auth.oidc`)."""

    def __init__(
        self,
        verifier: OIDCVerifier,
        sessions: SessionStore,
        secret_key: bytes,
        audit: Audit,
        clients: ClientAddresses | None = None,
        threads: StoreThreads | None = None,
    ) -> None:
        self._clients = clients or ClientAddresses([])  # (whose X-Forwarded-Proto to believe)
        self._verifier = verifier
        self._settings = verifier.settings
        self._sessions = sessions
        self._threads = threads or StoreThreads.default_executor()
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
        state, nonce = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
        verifier = secrets.token_urlsafe(48)  # 64 characters (RFC 7636: 43 to 128; providers refuse fewer)
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
        name, path = self._pending_cookie(request)
        response.set_cookie(
            name,
            self._sign(pending),
            max_age=_PENDING_S,
            path=path,
            httponly=True,
            samesite="Lax",
            secure=self.secure(request),
        )
        return response

    async def callback(self, request: web.Request) -> web.StreamResponse:
        name, path = self._pending_cookie(request)
        pending = _Pending.of(self._unsigned(request.cookies.get(name, "")))
        if pending is None or pending.until < time.time():
            raise InvalidRequest("The sign-in took too long or was not started here: sign in again.")
        if not _same(pending.state, request.query.get("state", "")):
            raise InvalidRequest("The sign-in's state does not match: sign in again.", param="state")
        if "code" not in request.query:
            error = request.query.get("error_description") or request.query.get("error") or "no code"
            raise Unauthorized(f"The identity provider did not sign you in: {error[:200]}.")
        tokens = await self._trade(request.query["code"], pending.redirect, pending.verifier)
        id_token = tokens.get("id_token")
        id_token = id_token if isinstance(id_token, str) else ""
        claims = await self._verifier.claims(id_token, id_token=True)
        principal = await self._principal(request, claims, pending.nonce)
        # a session lasts session_ttl_s, and no longer than the ID token (a role taken away at the
        # provider then ends at the next sign-in)
        lasts = min(self._settings.session_ttl_s, max(60.0, float(claims["exp"]) - time.time()))
        hint = id_token if self._hints() else None  # (kept only where sign-out will send it)
        secret, session = await self._threads.call(
            self._sessions.create, str(claims["sub"]), principal.tenant, principal.role, lasts, hint
        )
        await self._audit(request, f"oidc:{session.subject}", session.role, session.tenant, "signin", 303)
        response = web.HTTPSeeOther("/console")
        secure = self.secure(request)
        response.set_cookie(
            _HOST_ONLY + SESSION_COOKIE if secure else SESSION_COOKIE,
            secret,
            max_age=int(lasts),
            path="/",
            httponly=True,
            samesite="Lax",
            secure=secure,
        )
        response.del_cookie(name, path=path, secure=secure)  # (a browser drops a __Host- one only so)
        return response

    async def _principal(self, request: web.Request, claims: dict[str, Any], nonce: str) -> Principal:
        """Who the verified ID token names, signing in with this sign-in's `nonce`. A refusal of a token
        the provider signed (another sign-in's nonce, a tenant not in auth.oidc.tenants, groups naming two
        tenants) is on the audit trail, as the admin API's refusals are (no role was given: `none`)."""
        try:
            if not _same(str(claims.get("nonce", "")), nonce):
                raise Unauthorized("The ID token's nonce does not match this sign-in.")
            return self._verifier.principal(claims)
        except APIError as exc:
            await self._audit(request, f"oidc:{claims.get('sub', '')}", "none", None, "signin", exc.status)
            raise

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
            raise UpstreamError(
                f"The identity provider's token endpoint {metadata.token_endpoint} failed "
                f"({type(exc).__name__}).",
                code=PROVIDER_FAILED,
            ) from None
        if answer.status != 200 or not isinstance(body, dict):
            raise Unauthorized(f"The identity provider refused the sign-in's code ({answer.status}).")
        return body

    async def signout(self, request: web.Request) -> web.StreamResponse:
        secret = session_secret(request, self.secure(request))
        session = await self._threads.lookup(self._sessions.get, secret) if secret else None
        if session is None:
            raise Unauthorized("No one is signed in.")
        if not _same(request.headers.get(CSRF_HEADER, ""), session.csrf):
            refusal = PermissionDenied("The request lacks the console's CSRF token.", code="csrf_failed")
            who = f"oidc:{session.subject}"
            await self._audit(request, who, session.role, session.tenant, "signout", refusal.status)
            raise refusal
        id_token = await self._threads.call(self._sessions.end, secret or "")
        await self._audit(request, f"oidc:{session.subject}", session.role, session.tenant, "signout", 200)
        ending = await self._end_session(request, id_token)
        response = web.json_response({"signed_out": True, "end_session": ending})
        secure = self.secure(request)
        name = _HOST_ONLY + SESSION_COOKIE if secure else SESSION_COOKIE
        response.del_cookie(name, path="/", secure=secure)
        return response

    async def _end_session(self, request: web.Request, id_token: str | None) -> str | None:
        """Where the browser ends the provider's session too (OpenID Connect RP-Initiated Logout): its
        end_session_endpoint with the ID token as hint, the client id, and the console to come back to.
        None where the provider has no such endpoint (Google) or cannot be asked now: the person stays
        signed in at the provider."""
        try:
            metadata = await self._verifier.metadata()
        except UpstreamError as exc:
            logger.warning("sign-out: %s The provider's own session is left as it is.", exc.message)
            return None
        endpoint = metadata.end_session_endpoint
        if endpoint is None:
            return None
        query = {
            "client_id": self._settings.client_id,
            "post_logout_redirect_uri": self._console_url(request),
        }
        if id_token and self._hints():
            query["id_token_hint"] = id_token
        return endpoint + ("&" if "?" in endpoint else "?") + urllib.parse.urlencode(query)

    def _hints(self) -> bool:
        """Whether sign-out names the ID token as hint: only where the API does not take ID tokens (the
        hint travels in a URL, into the browser's history and the provider's logs, and an ID token of the
        client id's audience is a bearer credential on the API until it expires)."""
        audience = self._settings.audience
        return audience is not None and audience != self._settings.client_id

    async def me(self, request: web.Request) -> web.Response:
        secret = session_secret(request, self.secure(request))
        session = await self._threads.lookup(self._sessions.get, secret) if secret else None
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

    def _console_url(self, request: web.Request) -> str:
        """The console as the browser reaches it, beside the sign-in's callback."""
        callback = self._redirect_uri(request)
        if callback.endswith("/console/callback"):
            return callback.removesuffix("/callback")
        return urllib.parse.urljoin(callback, "/console")

    def _pending_cookie(self, request: web.Request) -> tuple[str, str]:
        """The pending sign-in cookie's name and path: over HTTPS a `__Host-` cookie on `/` (a sibling
        host can neither set nor shadow it), else (browsers refuse `__Host-` without Secure) a plain one on
        the console's paths. It is read only under the name the request's scheme gives."""
        if self.secure(request):
            return _HOST_ONLY + _PENDING_COOKIE, "/"
        return _PENDING_COOKIE, "/console"

    def secure(self, request: web.Request) -> bool:
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
