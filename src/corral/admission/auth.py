"""Authentication: an API key becomes a principal (tenant, allowed models, limits, priority).

With open access, requests without a key, or with a key corral does not know (clients insist on sending
one), are served as the anonymous tenant; a revoked key is refused either way. Keys are looked up by their
SHA-256 hash in the key store, off the event loop (on the store's lookup threads: no admin report or budget
read holds them), and cached for `ttl` seconds (misses too), so the database is never on the hot path; a
revoked key stops working within `ttl`.
Known keys and misses are cached apart, each bounded and dropping its oldest entry when full: a flood of
random keys churns the misses only and never pushes a working key out to the database.

When the store does not answer (a PostgreSQL failover or restart), a key looked up before is served as it
was last found, and looked up again `ttl` later; a key this gateway has not looked up yet is answered 503
with Retry-After (`store_unavailable`), never a 500. A key revoked during the outage is therefore refused
only once the store answers again (the revocation itself needs the store); a key's expiry, and a
rotated-out secret's grace period, still end on time. A query's own error (a bug) is not taken for an
outage (`store_is_down`).

A key a tenant-admin made is limited by its maker too: the keys above it (its `parent`, that key's parent,
up to `MAX_GENERATIONS`; revoked or expired ones included: their limits, not their access) are looked up
with it, in the same thread, and kept in the cache with it as its principal's `parents`; a key made by a
signed-in tenant-admin has its tenant's signed-in people (`oidc:<tenant>`, `auth.oidc.tenants`) above it.
The gateway counts each request against each of them as well (gateway/above.py, budget.py).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from corral.protocol import PermissionDenied, StoreUnavailable, Unauthorized
from corral.store import PRIORITIES, KeyRecord, KeyStore, StoreThreads, hash_key, store_is_down
from corral.store.keys import MAX_GENERATIONS

if TYPE_CHECKING:
    from corral.admission.oidc import OIDCVerifier

__all__ = [
    "ANONYMOUS",
    "SIGNED_IN",
    "Authenticator",
    "Principal",
    "looks_like_jwt",
    "parents_of",
    "token_digest",
    "whose",
]

logger = logging.getLogger(__name__)

SIGNED_IN = "oidc:"  # the key id of a tenant's people signed in with the identity provider: oidc:<tenant>
_MAX_CACHED = 100_000
_STORE_RETRY_S = 5.0  # Retry-After of a key refused because the store did not answer


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is asking, and what they may do."""

    key_id: str | None
    tenant: str
    models: frozenset[str] = frozenset()  # empty: every model
    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None
    priority: int = PRIORITIES["normal"]
    monthly_token_budget: int | None = None
    max_files: int | None = None  # files its tenant may hold when it uploads (None: the spec's)
    max_file_bytes: int | None = None
    role: str = "user"  # what it may do beyond inference (gateway/access.py)
    expires_at: float | None = None  # epoch seconds; None: never
    subject: str | None = None  # who signed in (a token from the identity provider), for the audit trail
    # the keys above it, nearest first (its maker, that one's maker, ...): their limits hold over it too
    parents: tuple[Principal, ...] = ()

    def check_model(self, model: str) -> None:
        if self.models and model not in self.models:
            raise PermissionDenied(
                f"This API key may not use the model '{model}'.", param="model", code="model_not_allowed"
            )

    @classmethod
    def of(cls, record: KeyRecord, parents: tuple[Principal, ...] = ()) -> Principal:
        return cls(
            record.id,
            record.tenant,
            frozenset(record.models),
            record.rpm,
            record.tpm,
            record.max_concurrency,
            PRIORITIES.get(record.priority, 1),
            record.monthly_token_budget,
            record.max_files,
            record.max_file_bytes,
            record.role,
            record.expires_at.timestamp() if record.expires_at is not None else None,
            parents=parents,
        )


ANONYMOUS = Principal(key_id=None, tenant="anonymous")


class Authenticator:
    """Who a request's credentials name: an API key (looked up by its hash, cached for `ttl`), or with
    `auth.oidc` a token from the identity provider (admission/oidc.py: cached until it expires)."""

    def __init__(
        self,
        keys: KeyStore,
        open_access: bool,
        ttl: float,
        max_cached: int = _MAX_CACHED,
        oidc: OIDCVerifier | None = None,
        threads: StoreThreads | None = None,
    ) -> None:
        self._keys = keys
        self._threads = threads or StoreThreads.default_executor()
        self.oidc = oidc
        self._open = open_access
        self._ttl = ttl
        self._max = max_cached
        self._cache: dict[str, tuple[Principal | None, float]] = {}  # keys found in the store
        self._misses: dict[str, tuple[Principal | None, float]] = {}  # unknown or revoked keys
        self.on_store_error: Callable[[], None] | None = None  # told of each lookup the store did not answer
        self._store_down = False  # (logged once an outage, not once a lookup)

    async def authenticate(self, authorization: str | None) -> Principal:
        if not authorization:
            if self._open:
                return ANONYMOUS
            raise Unauthorized("Missing API key: send it as 'Authorization: Bearer <key>'.")
        scheme, _, secret = authorization.partition(" ")
        # (a header that is not UTF-8 arrives with its bytes as lone surrogates; keys are ASCII)
        if scheme.lower() != "bearer" or not secret.strip() or not secret.isascii():
            raise Unauthorized("Malformed Authorization header: expected 'Bearer <key>'.")
        if self.oidc is not None and looks_like_jwt(secret.strip()):
            return await self._token(secret.strip())
        key_hash = hash_key(secret.strip())
        now = time.monotonic()
        cached = self._cache.get(key_hash) or self._misses.get(key_hash)
        if cached is not None and cached[1] > now:
            principal = cached[0]
        else:
            try:
                record, ancestors = await self._threads.lookup(self._look_up, key_hash)
            except Exception as exc:
                if not store_is_down(exc):
                    raise
                principal = self._as_last_found(key_hash, cached, now, exc)
            else:
                if self._store_down:
                    self._store_down = False
                    logger.warning("the key store answers again")
                if record is None:
                    principal = ANONYMOUS if self._open else None  # open access: any placeholder key will do
                else:
                    principal = self._principal(record, ancestors) if record.revoked_at is None else None
                found = record is not None and record.revoked_at is None
                self._cache.pop(key_hash, None)
                self._misses.pop(key_hash, None)
                entry = (principal, now + self._ttl)
                _remember(self._cache if found else self._misses, key_hash, entry, self._max)
        if principal is None:
            raise Unauthorized("Incorrect or revoked API key.")
        if principal.expires_at is not None and principal.expires_at <= time.time():
            raise Unauthorized("This API key has expired.", code="expired_api_key")
        return principal

    def _look_up(self, key_hash: str) -> tuple[KeyRecord | None, list[KeyRecord]]:
        """The key whose secret this is, and the keys above it (blocking: run off the loop)."""
        record = self._keys.by_secret_hash(key_hash)
        if record is None or record.parent is None or record.revoked_at is not None:
            return record, []
        return record, self._keys.ancestors(record.parent)

    def _principal(self, record: KeyRecord, ancestors: list[KeyRecord]) -> Principal:
        if record.parent is None:
            return Principal.of(record)
        return Principal.of(record, parents_of(record, ancestors, self.oidc))

    def _as_last_found(
        self,
        key_hash: str,
        last: tuple[Principal | None, float] | None,
        now: float,
        error: Exception,
    ) -> Principal | None:
        """The store did not answer: the key as last found (kept `ttl` more before asking again), or 503."""
        if self.on_store_error is not None:
            self.on_store_error()
        if not self._store_down:
            self._store_down = True
            logger.error("the key store does not answer (%s): keys are served as last found", error)
        if last is None:
            raise StoreUnavailable(
                "corral's key store is not answering; try again shortly.", retry_after=_STORE_RETRY_S
            ) from None
        for cache in (self._cache, self._misses):
            if key_hash in cache:
                cache[key_hash] = (last[0], now + self._ttl)
        return last[0]

    async def _token(self, token: str) -> Principal:
        """The person a provider's token names (its checks: admission/oidc.py), remembered until it expires;
        a refused token is not remembered (a retry after the provider rotated its keys may pass)."""
        assert self.oidc is not None
        digest = token_digest(token)
        cached = self._cache.get(digest)
        if cached is not None and cached[0] is not None and (cached[0].expires_at or 0) > time.time():
            return cached[0]
        principal = self.oidc.principal(await self.oidc.claims(token))
        _remember(self._cache, digest, (principal, time.monotonic() + self._ttl), self._max)
        return principal


def parents_of(
    record: KeyRecord, ancestors: list[KeyRecord], oidc: OIDCVerifier | None
) -> tuple[Principal, ...]:
    """The principals above a key (`ancestors`: `KeyStore.ancestors(record.parent)`): the keys that made
    it, nearest first, and (where a signed-in tenant-admin made the topmost) its tenant's signed-in people."""
    parents = [Principal.of(ancestor) for ancestor in ancestors]
    top = ancestors[-1].parent if ancestors else record.parent
    if top is not None and top.startswith(SIGNED_IN) and len(parents) < MAX_GENERATIONS:
        signed_in = oidc.signed_in(top.removeprefix(SIGNED_IN)) if oidc is not None else None
        if signed_in is not None:  # (a tenant taken out of auth.oidc.tenants since: its keys' own limits)
            parents.append(signed_in)
    return tuple(parents)


def whose(principal: Principal, above: Principal) -> str:
    """How a refusal names `above`, one of the principals above `principal` (never by its secret)."""
    if above.key_id is not None and above.key_id.startswith(SIGNED_IN):
        return f"the signed-in people of tenant '{above.tenant}' (shared with the keys they created)"
    generation = next((i for i, parent in enumerate(principal.parents) if parent is above), 0)
    if generation == 0:
        return "the key that created this one (shared by all the keys it created)"
    if generation == 1:
        return "the key that created this key's creator (shared by all the keys below it)"
    return f"a key {generation + 1} generations above this one (shared by all the keys below it)"


def looks_like_jwt(token: str) -> bool:
    """Three base64url parts, the first a JSON header (`eyJ`): not one of corral's keys."""
    return token.startswith("eyJ") and token.count(".") == 2


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _remember(
    cache: dict[str, tuple[Principal | None, float]],
    key: str,
    entry: tuple[Principal | None, float],
    most: int,
) -> None:
    """Keep `entry`, dropping the oldest one of a full cache (dicts keep insertion order)."""
    if len(cache) >= most:
        del cache[next(iter(cache))]
    cache[key] = entry
