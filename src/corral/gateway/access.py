"""Who may do what on the control plane: roles, the permission each administrative route needs, and who a
request comes from.

Roles (a key's `role`, or a signed-in person's from the identity provider's claims):

| role           | may                                                                              |
|----------------|----------------------------------------------------------------------------------|
| `admin`        | everything                                                                       |
| `operator`     | apply specs, rollouts, drain, purge the cache; read status, routing, usage, audit |
| `viewer`       | read: console, status, routing, metrics, usage, rollouts, cache statistics       |
| `tenant-admin` | create, rotate, change and revoke its own tenant's keys (within its own limits), |
|                | read its tenant's usage                                                          |
| `user`         | inference only                                                                   |

The admin key (`auth.admin_key`) is the break-glass credential: `admin`, whatever else fails. Without one,
a client on this machine of an open gateway is `admin` (a laptop). Every administrative route is in
`ROUTES`; a route the app serves under the admin API that is not there fails the test suite
(tests/admission/test_roles.py), so no route is added without saying who may use it.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from corral.admission import Authenticator, Principal
from corral.gateway.clients import ClientAddresses, from_this_machine_s_pages
from corral.gateway.parts import AdminAccess
from corral.protocol import APIError, PermissionDenied, Unauthorized
from corral.store import SessionStore, StoreThreads

__all__ = ["PERMISSIONS", "ROLES", "ROUTES", "Access", "Actor", "bearer_is"]

_READ = frozenset(
    {"status:read", "routing:read", "metrics:read", "usage:read", "rollouts:read", "cache:read"}
)
_OPERATE = frozenset({"spec:apply", "replicas:drain", "rollouts:act", "cache:purge", "audit:read"})
_KEYS = frozenset({"keys:read", "keys:write"})
PERMISSIONS = _READ | _OPERATE | _KEYS
ROLES: dict[str, frozenset[str]] = {
    "admin": PERMISSIONS,
    "operator": _READ | _OPERATE,
    "viewer": _READ,
    "tenant-admin": _KEYS | {"usage:read"},  # its own tenant's (the handlers scope it)
    "user": frozenset(),
}

# (method, route as aiohttp names it) → the permission it needs
ROUTES: dict[tuple[str, str], str] = {
    ("GET", "/admin/keys"): "keys:read",
    ("POST", "/admin/keys"): "keys:write",
    ("GET", "/admin/keys/{key_id}"): "keys:read",
    ("PATCH", "/admin/keys/{key_id}"): "keys:write",
    ("DELETE", "/admin/keys/{key_id}"): "keys:write",
    ("POST", "/admin/keys/{key_id}/rotate"): "keys:write",
    ("GET", "/admin/usage"): "usage:read",
    ("GET", "/admin/routing"): "routing:read",
    ("POST", "/admin/replicas/{replica_id}/drain"): "replicas:drain",
    ("POST", "/admin/nodes/{node}/drain"): "replicas:drain",
    ("POST", "/admin/spec"): "spec:apply",
    ("GET", "/admin/rollouts"): "rollouts:read",
    ("POST", "/admin/rollouts/{model}/{action}"): "rollouts:act",
    ("GET", "/admin/cache"): "cache:read",
    ("DELETE", "/admin/cache"): "cache:purge",
    ("GET", "/admin/audit"): "audit:read",
    ("GET", "/corral/sd"): "metrics:read",
    ("GET", "/corral/console/data"): "status:read",
}


def bearer_is(request: web.Request, secret: bytes) -> bool:
    """The request's `Authorization: Bearer` is `secret` (compared in constant time; a header that is not
    UTF-8 compared as sent)."""
    scheme, _, given = (request.headers.get("Authorization") or "").partition(" ")
    sent = given.strip().encode("utf-8", "surrogateescape")
    return scheme.lower() == "bearer" and hmac.compare_digest(sent, secret)


@dataclass(frozen=True)
class Actor:
    """Who makes an administrative request: `who` as the audit trail names it, its role, and (a
    tenant-admin, or any key) its tenant; `principal`: the key or token it came with (None: the admin key)."""

    who: str
    role: str
    tenant: str | None = None
    principal: Principal | None = None
    csrf: str | None = None  # signed in to the console (a session cookie): changes must send this back

    def may(self, permission: str) -> bool:
        return permission in ROLES.get(self.role, frozenset())

    @property
    def scoped(self) -> bool:
        """It acts on its own tenant only (a tenant-admin)."""
        return self.role == "tenant-admin"


_ADMIN_KEY = Actor("admin-key", "admin")
_LOCAL = Actor("local", "admin")


class Access:
    """Resolves a request's actor and checks its permission."""

    def __init__(
        self,
        admin: AdminAccess,
        auth: Authenticator | None,
        clients: ClientAddresses,
        sessions: SessionStore | None = None,
        threads: StoreThreads | None = None,
    ) -> None:
        self._admin = admin
        self._auth = auth
        self._clients = clients
        self._sessions = sessions  # console sign-ins (auth.oidc)
        self._threads = threads or StoreThreads.default_executor()  # (a session is looked up as a key is)
        # whether a request came over HTTPS as the sign-in decides it (its cookies' names follow)
        self.https: Callable[[web.Request], bool] = lambda request: clients.scheme(request) == "https"

    def is_admin_key(self, request: web.Request) -> bool:
        """The request carries the admin key, or needs none: a client on this machine talking to an open
        gateway without an admin key (a laptop). A key minted by anyone else on an open gateway would
        outlive the gateway being closed."""
        expected = self._admin.admin_key
        if expected is None:  # behind a proxy, the client it names must be local (clients.py)
            # (and no web page of another site: a browser on this machine reaches 127.0.0.1 for any page
            # it shows, which may send a form's POST, or rebind its own name to 127.0.0.1)
            return (
                self._admin.open_access
                and self._clients.is_local(request)
                and from_this_machine_s_pages(request)
            )
        return bool(expected) and bearer_is(request, expected.encode())

    async def actor(self, request: web.Request) -> Actor | None:
        """Who the request comes from; None: no credentials, or ones that name no one."""
        if self.is_admin_key(request):
            return _ADMIN_KEY if self._admin.admin_key is not None else _LOCAL
        authorization = request.headers.get("Authorization")
        if not authorization:
            return await self._signed_in(request)
        if self._auth is None:
            return None
        try:
            principal = await self._auth.authenticate(authorization)
        except APIError:
            return None
        if principal.key_id is None and principal.subject is None:  # an open gateway's anonymous caller
            return None
        who = f"oidc:{principal.subject}" if principal.subject else f"key:{principal.key_id}"
        return Actor(who, principal.role, principal.tenant, principal)

    async def _signed_in(self, request: web.Request) -> Actor | None:
        """The person signed in to the console whose session cookie the request carries."""
        from corral.gateway.signin import session_secret  # (signin.py builds on the admission stages)

        secret = session_secret(request, self.https(request))
        verifier = self._auth.oidc if self._auth is not None else None
        if not secret or self._sessions is None or verifier is None:
            return None
        session = await self._threads.lookup(self._sessions.get, secret)
        if session is None:
            return None
        expires = session.expires_at.timestamp()
        try:
            principal = verifier.principal_of(session.subject, session.tenant, session.role, expires)
        except APIError:  # its tenant was taken out of auth.oidc.tenants: the session is over
            return None
        return Actor(f"oidc:{session.subject}", session.role, session.tenant, principal, session.csrf)

    async def require(self, request: web.Request, permission: str) -> Actor:
        """The request's actor, if its role has `permission`; else 401 (no one) or 403 (not allowed)."""
        actor = await self.actor(request)
        if actor is None:
            if self._admin.admin_key is None:
                raise PermissionDenied(
                    "The admin API needs an admin key (CORRAL_ADMIN_KEY or auth.admin_key), or a key whose "
                    "role allows it; without an admin key it answers only clients on this machine (no web "
                    "page of another site), and only while the gateway is open."
                )
            raise Unauthorized(
                "The admin API needs 'Authorization: Bearer <admin key, or a key with a role>'."
            )
        if actor.csrf is not None and request.method not in ("GET", "HEAD", "OPTIONS"):
            from corral.gateway.signin import CSRF_HEADER

            sent = request.headers.get(CSRF_HEADER, "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(sent, actor.csrf.encode()):
                raise PermissionDenied(
                    "A change from the console must send its CSRF token (X-CSRF-Token).", code="csrf_failed"
                )
        if not actor.may(permission):
            raise PermissionDenied(
                f"The role '{actor.role}' may not do this ({permission}).", code="role_not_allowed"
            )
        return actor
