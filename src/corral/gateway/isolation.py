"""Keeping tenants apart on shared replicas (`models[].prefix_isolation: tenant`, the default on a closed
gateway).

The prompt routing hashes starts with its tenant's routing tag, an HMAC of its name under a server secret
(derived from the admin key): the prefix index never finds one tenant's prompt blocks on the replica another
tenant's went to, so where a request goes tells nothing of other tenants' prompts. The tag is secret because
routing's hash is no cryptographic one (a sum of its blocks' hashes, for speed): with the tenant's name in
its place, a tenant who knows another's name could compute a prompt whose prefix hashes equal that tenant's
and learn, from where it is routed, whether that tenant sent a prompt it guessed. An engine that takes
vLLM's `cache_salt` gets the tenant's (another HMAC of its name under that secret, whatever the client
sent), so its own prefix cache shares no blocks between tenants either, and the time to a first token tells
nothing. On a closed gateway every request also names its tenant to routing, so a replica's breaker tells
one tenant's failed requests from many (routing/circuit.py).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field

from corral.gateway.bodies import with_member
from corral.gateway.context import RequestContext
from corral.protocol import EmbeddingRequest

__all__ = ["TenantIsolation"]


@dataclass(frozen=True)
class TenantIsolation:
    isolated: set[str]  # models kept apart (a live apply adds new models')
    salt_key: bytes  # the server secret the tenants' salts and routing tags are derived from
    tenants_apart: bool  # a closed gateway: tenants may be hostile to each other
    # per tenant, derived once: its routing tag (the line routing's prompt starts with), its cache_salt, and
    # the salt as the body's member
    _derived: dict[str, tuple[str, str, bytes]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, isolated: set[str], secret: str, open_access: bool) -> TenantIsolation:
        """`secret`: the admin key, else the store's own (GatewayParts.isolation_secret)."""
        key = hashlib.sha256(b"corral cache_salt\0" + secret.encode()).digest()
        return cls(isolated, key, not open_access)

    def apply(self, ctx: RequestContext, tenant: str) -> None:
        """Mark the request's routing prompt and engine body with its tenant, where its model says."""
        if self.tenants_apart:
            ctx.route.tenant = tenant
        if ctx.route.model not in self.isolated:  # (an adapter's: its base's setting)
            return
        tag, salt, member = self._derived.get(tenant) or self._derive(tenant)
        if ctx.route.prompt:
            ctx.route.prompt = tag + ctx.route.prompt
        if ctx.features.cache_salt and not isinstance(ctx.body, EmbeddingRequest):
            ctx.upstream_body = with_member(ctx.upstream_body, "cache_salt", salt, member)

    def _derive(self, tenant: str) -> tuple[str, str, bytes]:
        """The tenant's routing tag (a line of 32 hex digits: every tenant's prompt blocks fall alike) and
        cache_salt, each an HMAC of its name under the server secret, kept for its next requests."""
        name = tenant.encode()
        routing_key = hmac.new(self.salt_key, b"corral routing tag", hashlib.sha256).digest()  # (not a salt)
        tag = hmac.new(routing_key, name, hashlib.sha256).hexdigest()[:32] + "\n"
        salt = hmac.new(self.salt_key, name, hashlib.sha256).hexdigest()[:32]
        derived = tag, salt, b',"cache_salt":"' + salt.encode() + b'"'
        if len(self._derived) >= _TENANTS_KEPT:  # (names come from keys and tokens: bounded, but not here)
            del self._derived[next(iter(self._derived))]
        self._derived[tenant] = derived
        return derived


_TENANTS_KEPT = 65_536  # tenants whose tags and salts are kept (about 300 bytes each)
