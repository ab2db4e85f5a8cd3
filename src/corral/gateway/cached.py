"""The exact (and semantic) cache as a stage of a generation's path (see ../cache): the request looked up,
a hit told the way the request asks (a stored stream with its own chunking, or either kind made from the
other; a dialect's stream told in its events) under an id and a time of its own, and an answer that ended
well kept, where what answered it is what the key names."""

from __future__ import annotations

import logging
import time
import uuid

from aiohttp import web

from corral.admission import Principal
from corral.cache import CacheLookup, ExactCache
from corral.gateway.context import RequestContext
from corral.gateway.metrics import GatewayMetrics
from corral.gateway.relay import SSE_HEADERS, EventStream
from corral.protocol import ChatCompletionRequest
from corral.routing import ReplicaSet
from corral.routing.adapters import AdapterCatalogue

__all__ = ["CacheStage"]

logger = logging.getLogger(__name__)


class CacheStage:
    """The gateway's exact cache between admission and the queue (`Pipeline._answer`)."""

    def __init__(
        self,
        cache: ExactCache,
        metrics: GatewayMetrics,
        replicas: ReplicaSet,
        adapters: AdapterCatalogue | None = None,
    ) -> None:
        """`adapters`: the LoRA adapters served now (an answer of one replaced meanwhile is not kept)."""
        self._cache = cache
        self._metrics = metrics
        self._replicas = replicas
        self._adapters = adapters or AdapterCatalogue()
        store_errors = metrics.cache_store_errors
        cache.store.on_error = lambda operation: store_errors.labels(operation).inc()

    async def look_up(
        self, ctx: RequestContext, principal: Principal, request: web.Request
    ) -> CacheLookup | None:
        """The exact cache's view of the request: None where the model does not cache or the request may
        not be (sampled, several choices fanned out); a miss asks the relay to keep what it writes."""
        cache = self._cache
        if not cache.enabled(ctx.model) or ctx.fanout:
            return None
        lookup = await cache.lookup(
            principal.tenant, ctx.model, ctx.path, ctx.upstream_body, request.headers.get("Cache-Control")
        )
        if lookup is None:
            return None
        if lookup.embedding_failure is not None:
            self._metrics.cache_embed_errors.labels(lookup.embedding_failure).inc()
        ctx.headers["x-corral-cache"] = lookup.state
        if lookup.group is not None and lookup.vector is not None and lookup.read:
            result = "hit" if lookup.neighbour and lookup.hit else "explore" if lookup.check else "miss"
            result = "vetoed" if lookup.vetoed else result
            self._metrics.cache_semantic.labels(ctx.model, result).inc()
            if lookup.neighbour is not None:
                ctx.headers["x-corral-cache-similarity"] = f"{lookup.neighbour.similarity:.4f}"
        if lookup.hit is None and lookup.keep:
            ctx.written = cache.collector()  # (up to cache.max_entry_bytes: past it, nothing is kept)
        return lookup

    async def replay(
        self, ctx: RequestContext, lookup: CacheLookup, request: web.Request
    ) -> web.StreamResponse | None:
        """Answer from the cache: a stored stream with its own chunking, or either kind made from the
        other, under this request's id (in the engine's shape) and time; None when the entry cannot be told
        the way this request asks, or not at all (then the engine answers)."""
        entry = lookup.hit
        assert entry is not None
        chat = isinstance(ctx.body, ChatCompletionRequest)
        if entry.chat != chat:
            return None
        try:
            entry = entry.answering(ctx.request_id or uuid.uuid4().hex, int(time.time()))
            data = entry.sse(ctx.client_wants_usage) if ctx.stream else entry.whole()
        except Exception as exc:  # an entry of a shape this gateway cannot tell (another version's): a miss
            logger.warning(
                "response cache: entry %s cannot be told (%s: %s)", lookup.key, type(exc).__name__, exc
            )
            data = None
        if data is None:  # stored the other way and cannot be told this way: the engine answers
            lookup.hit = None
            ctx.headers["x-corral-cache"] = "miss"
            ctx.written = self._cache.collector() if lookup.keep else None
            return None
        headers = {**ctx.headers, "x-corral-cache": "hit"}
        ctx.usage, ctx.cached = entry.usage, True
        if ctx.stream:
            exchange, headers = ctx.exchange, {**SSE_HEADERS, **headers}
            response: web.StreamResponse = (
                exchange.stream_response(headers) if exchange is not None else EventStream(headers=headers)
            )
            try:
                await response.prepare(request)
                await response.write(data)
                ctx.delivered = True
                await response.write_eof()
            except ConnectionResetError:
                ctx.client_gone = not ctx.delivered  # (one that left with the whole answer: see relay.py)
        else:
            response = web.Response(body=data, content_type="application/json", headers=headers)
        self._metrics.cache_tokens_saved.labels(ctx.model).inc(entry.tokens)
        return response

    def keep(self, ctx: RequestContext, lookup: CacheLookup) -> None:
        """Keep an answer that ended well (never a truncated stream, an error, or a client that left), and
        of what the key names: not during a rollout, nor from an adapter replaced since the request was
        routed (ExactCache also checks the model's revision against the lookup's). A question's vector
        made while the embedding model is rolled out is not kept (either revision may have made it)."""
        cache = self._cache
        if ctx.written is None or ctx.client_gone or self._rolling_out(ctx.route.model):
            return
        adapter = ctx.route.adapter
        if adapter is not None:
            now = self._adapters.get(ctx.model)
            if now is None or now.engine_name != adapter.engine_name:
                return
        embedder = lookup.policy.embedding_model
        if lookup.vector is not None and embedder is not None and self._rolling_out(embedder):
            lookup.vector = None
        chat = isinstance(ctx.body, ChatCompletionRequest)
        if ctx.stream and ctx.complete:
            cache.keep_stream(lookup, ctx.written, chat, ctx.usage)
        elif not ctx.stream and ctx.whole is not None:
            cache.keep_whole(lookup, ctx.whole, chat)

    def _rolling_out(self, model: str) -> bool:
        """A rollout of the model is under way: either revision may have answered (not kept)."""
        state = self._replicas.rollouts.get(model)
        return state is not None and state.get("phase") not in ("completed", "rolled_back")
