"""The principals above a request: whose rate limits it counts against besides its key's own.

They are the keys above the key, nearest first (the tenant-admin's key that made it, that key's maker, ...,
or a tenant's signed-in people: `Principal.parents`, resolved with the key in admission/auth.py), then its
LoRA adapter's own rpm/tpm over all keys. Each is checked, reserved and settled like the key, in its own
windows (the limiter keeps them by its id as any key's), so the keys a tenant-admin makes together never
get more than its own limits. A refusal by one of them names it (never by its secret or id) and carries its
Retry-After. A key with neither (the common case) costs nothing here: `above` is an empty tuple.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from corral.admission import Limiter, LimiterUnavailable, Principal, Reservation
from corral.admission.auth import whose
from corral.admission.limits import is_limited
from corral.protocol import RateLimited
from corral.routing.adapters import Adapter

__all__ = ["above", "check_above", "refused_by", "release", "reserve_above"]

_ADAPTER = "adapter:"  # the id an adapter's limits are kept under


def above(principal: Principal, adapter: Adapter | None = None) -> tuple[Principal, ...]:
    """The principals with rate limits above a request of `principal` (for `adapter`, if any)."""
    parents = principal.parents
    limited = tuple(parent for parent in parents if is_limited(parent)) if parents else parents
    if adapter is None or not (adapter.rpm or adapter.tpm):
        return limited
    return (*limited, Principal(key_id=_ADAPTER + adapter.name, tenant="", rpm=adapter.rpm, tpm=adapter.tpm))


async def check_above(limiter: Limiter, principal: Principal, higher: tuple[Principal, ...]) -> None:
    """`limiter.check` of a request of one token against each of `higher`; RateLimited naming whose."""
    for limited in higher:
        try:
            await limiter.check(limited, 1)
        except RateLimited as exc:
            raise refused_by(exc, principal, limited) from None


async def reserve_above(
    limiter: Limiter,
    principal: Principal,
    higher: tuple[Principal, ...],
    tokens: int,
    own: Reservation | None,
) -> tuple[Reservation, ...]:
    """The request reserved against each of `higher` too. Where one refuses (or the limiter fails, or the
    client leaves meanwhile), what was reserved for it, its key's own reservation `own` included, is
    released, and a refusal names whose limit it is."""
    held: list[Reservation] = []
    limited = principal
    try:
        for limited in higher:
            reservation = await limiter.reserve(limited, tokens)
            if reservation is not None:
                held.append(reservation)
    except BaseException as exc:
        if await release(limiter, (own, *held)):
            raise asyncio.CancelledError from exc
        if isinstance(exc, RateLimited):
            raise refused_by(exc, principal, limited) from None
        raise
    return tuple(held)


async def release(limiter: Limiter, held: Iterable[Reservation | None]) -> bool:
    """Give every one of `held` back unused, even where the caller is cancelled meanwhile (a client gone:
    one left held stays in a Redis limiter's renewed leases, a concurrency slot lost for good); whether it
    was cancelled, for the caller to raise once all are given back."""
    cancelled = False
    for reservation in held:
        if reservation is None:
            continue
        try:
            await limiter.settle(reservation, 0)
        except LimiterUnavailable:
            pass
        except asyncio.CancelledError:  # (its settlement was sent: the limiter queues it before waiting)
            cancelled = True
    return cancelled


def refused_by(exc: RateLimited, principal: Principal, limited: Principal) -> RateLimited:
    """The refusal of `limited`'s limit (one above `principal`), naming it in place of "this key"."""
    key_id = limited.key_id or ""
    if key_id.startswith(_ADAPTER):  # (without the counts: others' use of it, in any tenant)
        what = "the model's" if "too large" in exc.message else f"for '{key_id.removeprefix(_ADAPTER)}'"
        message = exc.message.replace("for this key", what).replace("the key's", what)
        return RateLimited(message, code=exc.code, retry_after=exc.retry_after)
    named = whose(principal, limited)
    if "too large" in exc.message:
        message = f"Request too large: it needs more tokens than the {limited.tpm} per minute of {named}."
    else:
        message = exc.message.replace("for this key", f"for {named}")
    # (when its window frees, not its counts: its other keys' use is not this key's to read)
    resets = {name: v for name, v in exc.extra_headers.items() if name.startswith("x-ratelimit-reset")}
    return RateLimited(message, code=exc.code, retry_after=exc.retry_after, headers=resets)
