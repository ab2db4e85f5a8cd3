"""How the semantic cache asks its embedder for a question's vector without holding requests up.

The embedding replicas are shared with tenants, and the cache's calls to them wait in no queue: a gateway
that sent one for every exact miss would pile onto busy replicas, and every cacheable request would wait
out `cache.embedding_timeout`. So a gateway process asks at most `max_in_flight` at once (past that a
question is a miss at once, without a vector), and after a question got no vector in time none is asked
for `_PAUSE_S`: a busy or hung embedder costs one timeout, not one per request. An embedder that fails at
once is passed by its replicas' circuit breakers, and one that refuses a text (too long for it) is not
failing: neither pauses the asking. Failures are logged at WARNING at most once every `_WARN_EVERY_S` (the
rest at DEBUG); each is told by name (`corral_cache_embed_errors_total`).
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
_PAUSE_S = 5.0  # after a timeout, the embedder is not asked for this long
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
        self._in_flight = 0
        self._paused_until = -math.inf
        self._warned_at = -math.inf

    async def vector(self, embedder: Embedder, model: str, text: str) -> tuple[Vector | None, str | None]:
        """The text's unit vector, or None and why there is none: `busy` (the calls at their cap),
        `paused` (after a timeout), `timeout` or `error`."""
        if self._in_flight >= self._max_in_flight:
            return None, "busy"
        if self._clock() < self._paused_until:
            return None, "paused"
        self._in_flight += 1
        try:
            async with asyncio.timeout(self._timeout):
                return await embedder.embed(model, text), None
        except TimeoutError:
            self._paused_until = self._clock() + _PAUSE_S
            self._failed(f"no vector within {self._timeout:g} s; not asked for the next {_PAUSE_S:g} s")
            return None, "timeout"
        except Exception as exc:  # the embedder's failure is a miss, never the request's error
            self._failed(str(exc))
            return None, "error"
        finally:
            self._in_flight -= 1

    def _failed(self, what: str) -> None:
        now = self._clock()
        quiet = now - self._warned_at < _WARN_EVERY_S
        if not quiet:
            self._warned_at = now
        level = logging.DEBUG if quiet else logging.WARNING
        logger.log(level, "semantic cache: embedding the question failed (a miss): %s", what)
