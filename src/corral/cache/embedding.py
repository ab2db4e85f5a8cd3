"""How the semantic cache asks its embedder for a question's vector without holding requests up.

The embedding replicas are shared with tenants, and the cache's calls to them wait in no queue: a gateway
that sent one for every exact miss would pile onto busy replicas, and every cacheable request would wait
out `cache.embedding_timeout`. So a gateway process asks at most `max_in_flight` at once, and a tenant
past `_TENANT_IN_FLIGHT` of them only while it leaves as many free as the other tenants have in flight,
and `_TENANT_IN_FLIGHT` at least (past that a question is a miss at once, without a vector: one tenant's
questions cannot take every call and make everyone's lookups `busy`; alone, it may use all but those).
After a tenant's question got no vector in time, that tenant's questions are not embedded for `_PAUSE_S`
(its texts may be what is slow: long ones); once questions of two tenants timed out within `_PAUSE_S`,
the embedder itself is taken to be busy or hung and no one's are: it costs a timeout or two, not one per
request, and one tenant's slow questions never pause another's. An embedder that fails at once is passed
by its replicas' circuit breakers, and one that refuses a text (too long for it) is not failing: neither
pauses the asking. Failures are logged at WARNING at most once every `_WARN_EVERY_S` (the rest at DEBUG);
each is told by name (`corral_cache_embed_errors_total`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from corral.cache.semantic import Embedder, Vector

__all__ = ["MAX_EMBEDDINGS", "EmbeddingCalls"]

logger = logging.getLogger(__name__)

MAX_EMBEDDINGS = 8  # the cache's embedding calls one gateway process makes at once
_TENANT_IN_FLIGHT = 2  # ... of which for one tenant's questions
_PAUSE_S = 5.0  # after a timeout, the tenant's (two tenants': everyone's) questions are not embedded
_WARN_EVERY_S = 10.0


class EmbeddingCalls:
    """A question's vector, asked of an embedder within a timeout, a cap on calls at once and a pause
    after a timeout (see the module docstring)."""

    def __init__(
        self,
        timeout: float,
        max_in_flight: int = MAX_EMBEDDINGS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._timeout = timeout
        self._max_in_flight = max_in_flight
        self._clock = clock
        self._tenant_max = min(_TENANT_IN_FLIGHT, max_in_flight)
        self._in_flight = 0
        self._tenants: dict[str, int] = {}  # tenant → its calls in flight (none: absent)
        self._paused: dict[str, float] = {}  # tenant → until when its questions are not embedded
        self._paused_until = -math.inf  # everyone's (two tenants' questions timed out)
        self._warned_at = -math.inf

    async def vector(
        self, embedder: Embedder, model: str, text: str, tenant: str = ""
    ) -> tuple[Vector | None, str | None]:
        """The text's unit vector, or None and why there is none: `busy` (the calls at their cap, the
        process's or the tenant's), `paused` (after a timeout), `timeout` or `error`."""
        mine = self._tenants.get(tenant, 0)
        if self._in_flight >= self._max_in_flight or (mine >= self._tenant_max and self._crowded(mine)):
            return None, "busy"
        now = self._clock()
        if now < self._paused_until or now < self._paused.get(tenant, -math.inf):
            return None, "paused"
        self._in_flight += 1
        self._tenants[tenant] = mine + 1
        try:
            async with asyncio.timeout(self._timeout):
                return await embedder.embed(model, text), None
        except TimeoutError:
            self._timed_out(tenant)
            return None, "timeout"
        except Exception as exc:  # the embedder's failure is a miss, never the request's error
            self._failed(str(exc))
            return None, "error"
        finally:
            self._in_flight -= 1
            left = self._tenants.pop(tenant) - 1
            if left:
                self._tenants[tenant] = left

    def _crowded(self, mine: int) -> bool:
        """Whether a tenant at its own cap (`mine` in flight) would take a call other tenants' questions
        may need: it takes a free one while more stay free than the other tenants have in flight, and
        than its own cap (alone, a tenant uses all calls but that many: kept for another's questions)."""
        others = self._in_flight - mine
        return self._max_in_flight - self._in_flight <= max(self._tenant_max, others)

    def _timed_out(self, tenant: str) -> None:
        """Pause the tenant's questions; everyone's when another tenant's timed out within the pause."""
        now = self._clock()
        self._paused = {t: until for t, until in self._paused.items() if until > now and t != tenant}
        whom = "everyone's" if self._paused else "the tenant's"
        if self._paused:
            self._paused_until = now + _PAUSE_S
        self._paused[tenant] = now + _PAUSE_S
        self._failed(
            f"no vector within {self._timeout:g} s; {whom} questions not embedded for {_PAUSE_S:g} s"
        )

    def _failed(self, what: str) -> None:
        now = self._clock()
        quiet = now - self._warned_at < _WARN_EVERY_S
        if not quiet:
            self._warned_at = now
        level = logging.DEBUG if quiet else logging.WARNING
        logger.log(level, "semantic cache: embedding the question failed (a miss): %s", what)
