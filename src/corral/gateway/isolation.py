"""Keeping tenants apart on shared replicas (`models[].prefix_isolation: tenant`, the default on a closed
gateway).

The prompt routing hashes starts with its tenant's name: the prefix index never finds one tenant's prompt
blocks on the replica another tenant's went to, so where a request goes tells nothing of other tenants'
prompts. An engine that takes vLLM's `cache_salt` gets the tenant's (an HMAC of its name under a server
secret, whatever the client sent), so its own prefix cache shares no blocks between tenants either, and
the time to a first token tells nothing. On a closed gateway every request also names its tenant to
routing, so a replica's breaker tells one tenant's failed requests from many (routing/circuit.py).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from corral.gateway.bodies import with_member
from corral.gateway.context import RequestContext
from corral.protocol import EmbeddingRequest

__all__ = ["TenantIsolation"]


@dataclass(frozen=True)
class TenantIsolation:
    isolated: set[str]  # models kept apart (a live apply adds new models')
    salt_key: bytes  # the server secret the tenants' salts are derived from
    tenants_apart: bool  # a closed gateway: tenants may be hostile to each other

    @classmethod
    def of(cls, isolated: set[str], admin_key: str | None, open_access: bool) -> TenantIsolation:
        key = hashlib.sha256(b"corral cache_salt\0" + (admin_key or "").encode()).digest()
        return cls(isolated, key, not open_access)

    def apply(self, ctx: RequestContext, tenant: str) -> None:
        """Mark the request's routing prompt and engine body with its tenant, where its model says."""
        if self.tenants_apart:
            ctx.route.tenant = tenant
        if ctx.route.model not in self.isolated:  # (an adapter's: its base's setting)
            return
        if ctx.route.prompt:
            ctx.route.prompt = f"{len(tenant)}:{tenant}\n{ctx.route.prompt}"
        if ctx.features.cache_salt and not isinstance(ctx.body, EmbeddingRequest):
            salt = hmac.new(self.salt_key, tenant.encode(), hashlib.sha256).hexdigest()[:32]
            member = b',"cache_salt":"' + salt.encode() + b'"'
            ctx.upstream_body = with_member(ctx.upstream_body, "cache_salt", salt, member)
