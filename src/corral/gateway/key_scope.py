"""What a tenant-admin may do with its tenant's keys: no key beyond its own key's limits, budget, priority,
file quotas, models or lifetime; each key it makes names it as its maker (`parent`), so that all of them
together stay within its own limits and budget too (gateway/above.py, admission/budget.py); and what it is
shown of the usage of keys above it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from corral.gateway.access import Actor
from corral.protocol import NotFound, PermissionDenied
from corral.store import PRIORITIES, KeyRecord, KeyStore
from corral.store.keys import MAX_GENERATIONS

__all__ = [
    "LIMITS",
    "TENANT_ROLES",
    "adopt",
    "fields_of",
    "limits_of",
    "maker",
    "managed",
    "others_merged",
    "within_own",
]

TENANT_ROLES = ("user", "tenant-admin")  # the roles a tenant-admin may give its tenant's keys
LIMITS = ("rpm", "tpm", "max_concurrency", "monthly_token_budget")


def others_merged(rows: list[dict[str, Any]], seen: set[str]) -> list[dict[str, Any]]:
    """Usage by key with the rows of keys not in `seen` told as one row with no key or name (the
    tenant's totals stay whole; which keys they were, and how many, is not said)."""
    kept = [row for row in rows if row["key"] in seen]
    others = [row for row in rows if row["key"] not in seen]
    if not others:
        return kept
    requests = sum(row["requests"] for row in others)
    merged: dict[str, Any] = {"key": None, "tenant": others[0]["tenant"], "name": None}
    for name in ("requests", "input_tokens", "output_tokens", "errors", "refused"):
        merged[name] = sum(row[name] for row in others)
    latency = sum(row["mean_latency_ms"] * row["requests"] for row in others)
    merged["mean_latency_ms"] = round(latency / requests, 1) if requests else 0.0
    return [*kept, merged]


def limits_of(record: KeyRecord) -> dict[str, Any]:
    return {name: getattr(record, name) for name in LIMITS}


def fields_of(record: KeyRecord) -> dict[str, Any]:
    """A key's settings as a new key would state them (for `_within_own`)."""
    return {
        **limits_of(record),
        "models": list(record.models),
        "priority": record.priority,
        "max_files": record.max_files,
        "max_file_bytes": record.max_file_bytes,
        "expires_at": record.expires_at.timestamp() if record.expires_at is not None else None,
    }


def within_own(actor: Actor, tenant: str, role: str, wanted: dict[str, Any]) -> None:
    """A tenant-admin's key for its own tenant, with a role it may give, no model it may not use, and
    limits and budget no larger than its own (each one it has must be set, at most as large)."""
    own = actor.principal
    assert own is not None  # (a tenant-admin came with its key or token)
    if tenant != actor.tenant:
        raise PermissionDenied(
            f"A tenant-admin manages the keys of its own tenant ('{actor.tenant}') only.", param="tenant"
        )
    if role not in TENANT_ROLES:
        raise PermissionDenied(f"A tenant-admin may give the roles {', '.join(TENANT_ROLES)}.", param="role")
    models = wanted.get("models")
    if own.models and (not models or not set(models) <= own.models):
        raise PermissionDenied(
            f"The key may use only models this tenant-admin may: {', '.join(sorted(own.models))}.",
            param="models",
        )
    if PRIORITIES.get(str(wanted.get("priority", "normal")), 1) < own.priority:
        raise PermissionDenied("A tenant-admin may not give a priority above its own.", param="priority")
    limits = {"rpm": own.rpm, "tpm": own.tpm, "max_concurrency": own.max_concurrency}
    limits["monthly_token_budget"] = own.monthly_token_budget
    limits.update(max_files=own.max_files, max_file_bytes=own.max_file_bytes)
    for name in ("max_files", "max_file_bytes"):  # a key's file quota replaces the spec's tenant_max_*
        if limits[name] is None and wanted.get(name) is not None:
            raise PermissionDenied(
                f"'{name}' is the tenant's file quota: the spec's batch.tenant_* applies unless an admin "
                "gives the tenant-admin's own key one.",
                param=name,
            )
    if own.expires_at is not None and own.subject is None:  # (no key outlives the tenant-admin's own key)
        expires_by(own.expires_at, wanted)
    for name, cap in limits.items():
        if cap is not None and (wanted.get(name) is None or wanted[name] > cap):
            raise PermissionDenied(
                f"'{name}' must be set, at most {cap}: the tenant-admin's own limit.", param=name
            )


def maker(actor: Actor) -> str | None:
    """The `parent` of a key `actor` makes: a tenant-admin's key id, or a signed-in one's `oidc:<tenant>`
    (the id its tenant's signed-in people share limits under); None for an admin's. A tenant-admin's key
    `MAX_GENERATIONS` below an admin's makes none (the keys above a key are looked up that far)."""
    own = actor.principal
    if not actor.scoped or own is None:
        return None
    if len(own.parents) + 1 > MAX_GENERATIONS:
        raise PermissionDenied(
            f"This key was created {len(own.parents)} keys below an admin's, the deepest a key may be "
            f"({MAX_GENERATIONS}): it may create no key.",
            code="too_many_generations",
        )
    return own.key_id


def expires_by(cap: float, wanted: dict[str, Any]) -> None:
    """The key `wanted` describes (an existing key's `expires_at`, a new key's `expires_in_s` from now)
    ends no later than `cap` (epoch seconds), compared as times: a key that ends with its tenant-admin's
    own passes however long ago its lifetime was counted."""
    ends = wanted.get("expires_at")
    if ends is None and wanted.get("expires_in_s") is not None:
        ends = time.time() + wanted["expires_in_s"]
    if ends is None or ends > cap + 1:  # (a second for the clock read between this check and the write)
        left = max(0, int(cap - time.time()))
        raise PermissionDenied(
            f"'expires_in_s' must be set, at most {left}: no key outlives the tenant-admin's own.",
            param="expires_in_s",
        )


async def managed(keys: KeyStore, key_id: str, actor: Actor, change: bool = True) -> KeyRecord:
    """The key `key_id` as `actor` may see it: NotFound where there is none, or (a tenant-admin) another
    tenant's or one of a role above those it may give (an admin's key in its tenant is not its to rotate or
    revoke). To `change` it, a tenant-admin's key is its own or an admin's to change (403: a peer's rotation
    would hand its secret over, a peer's revocation take its access), and a tenant-admin changes the keys
    below it (it made them, or keys it made did) or a key no one made (`adopt` it once the change is
    allowed): a peer's key raised or rotated spent the peer's allowance."""
    record = await asyncio.to_thread(keys.get, key_id)
    outside = record is not None and (record.tenant != actor.tenant or record.role not in TENANT_ROLES)
    if record is None or (actor.scoped and outside):
        raise NotFound(f"No key with id {key_id}.")
    own = actor.principal is not None and actor.principal.key_id == record.id
    if not change or not actor.scoped or own:
        return record
    if record.role == "tenant-admin":
        raise PermissionDenied(
            f"Key {key_id} is a tenant-admin's: only an admin, or the key itself, may change it."
        )
    _below(record, actor, await asyncio.to_thread(keys.makers, record) if record.parent else [])
    return record


async def adopt(keys: KeyStore, record: KeyRecord, actor: Actor) -> None:
    """A tenant-admin's allowed change of a key no one made (an admin's, or one older than makers) makes the
    key its own: it counts against its limits from then on (raised or rotated, it was outside every
    tenant-admin's). Where another adopted it meanwhile, the change is that one's to make (403)."""
    mine = maker(actor)
    if mine is None or record.parent is not None or mine == record.id:
        return
    if not await asyncio.to_thread(keys.adopt, record.id, mine):
        now = await asyncio.to_thread(keys.get, record.id)
        _below(record, actor, await asyncio.to_thread(keys.makers, now) if now is not None else [])


def _below(record: KeyRecord, actor: Actor, makers: list[str]) -> None:
    mine = maker(actor)
    if mine is not None and makers and mine not in makers:
        raise PermissionDenied(
            f"Key {record.id} was made by another of the tenant's keys: only it (or one above it), or an "
            "admin, may change it."
        )
