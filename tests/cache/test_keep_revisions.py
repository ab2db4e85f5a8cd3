"""An answer is kept only under the revision that answered it: when what serves the model changes between
the lookup and the answer (a rollout's or a rollback's new digest, a LoRA adapter replaced), nothing is
kept, so an old revision's answer is never served as the new one's; a question's vector is kept only while
the embedding model's revision is the lookup's and no rollout of it is under way (the entry then serves
exact hits alone). The cache and its pipeline stage, with an embedder in the test's hands."""

from __future__ import annotations

import numpy as np
import orjson
from aiohttp.test_utils import make_mocked_request

from corral.admission import Principal
from corral.cache import ExactCache, MemoryStore, Vector
from corral.cache.entry import Entry
from corral.config import ModelCacheSpec
from corral.gateway.cached import CacheStage
from corral.gateway.context import RequestContext
from corral.gateway.metrics import GatewayMetrics
from corral.protocol import ChatCompletionRequest
from corral.routing import ReplicaSet, Router, RouteRequest
from corral.routing.adapters import Adapter, AdapterCatalogue

CHAT = "/v1/chat/completions"
ANSWER = orjson.dumps(
    {
        "id": "c",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Paris."}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }
)


class Embedder:
    async def embed(self, model: str, text: str) -> Vector:
        return np.ones(4, dtype=np.float32) / 2


def _body(model: str = "m") -> bytes:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    return orjson.dumps({"model": model, "messages": messages, "temperature": 0})


async def _stored(cache: ExactCache) -> list[Entry]:
    await cache.flush()
    return [Entry.decode(value) async for _, value in cache.store.scan()]


async def test_nothing_is_kept_when_the_model_is_redeployed_between_lookup_and_answer() -> None:
    cache = ExactCache(MemoryStore(1 << 20), {"m": ModelCacheSpec(exact=True)}, {"m": "digest-old"})
    found = await cache.lookup("t", "m", CHAT, _body(), None)
    assert found is not None
    cache.versions["m"] = "digest-new"  # a rollout (or a rollback) told the gateway its digest meanwhile
    cache.keep_whole(found, ANSWER, chat=True)
    assert await _stored(cache) == []
    again = await cache.lookup("t", "m", CHAT, _body(), None)  # (under the revision now: kept)
    assert again is not None
    cache.keep_whole(again, ANSWER, chat=True)
    assert len(await _stored(cache)) == 1


async def test_a_vector_made_across_the_embedding_models_redeployment_is_not_kept() -> None:
    policy = ModelCacheSpec(semantic=True, embedding_model="e")
    cache = ExactCache(MemoryStore(1 << 20), {"m": policy}, {"m": "m-1", "e": "e-1"})
    cache.embedder = Embedder()
    found = await cache.lookup("t", "m", CHAT, _body(), None)
    assert found is not None and found.vector is not None
    cache.versions["e"] = "e-2"  # the embedding model's rollout began: either revision made the vector
    cache.keep_whole(found, ANSWER, chat=True)
    (entry,) = await _stored(cache)
    assert entry.vector is None and entry.group is None and len(cache.index) == 0  # exact hits only
    cache.versions["e"] = "e-1"
    again = await cache.lookup("t", "m", CHAT, _body(), None)
    assert again is not None and again.hit is not None  # (the exact hit still answers)


def _stage(cache: ExactCache, replicas: ReplicaSet, adapters: AdapterCatalogue) -> CacheStage:
    return CacheStage(cache, GatewayMetrics(Router(replicas), dict), replicas, adapters)


def _context(model: str, route: RouteRequest) -> RequestContext:
    body = ChatCompletionRequest.model_validate(orjson.loads(_body(model)))
    return RequestContext(CHAT, body, _body(model), 0.0, route)


async def _answered(stage: CacheStage, ctx: RequestContext) -> None:
    """Look the request up, have 'the engine' answer it whole, and keep the answer."""
    lookup = await stage.look_up(ctx, Principal("k", "t"), make_mocked_request("POST", CHAT))
    assert lookup is not None and lookup.hit is None
    ctx.whole = ANSWER
    stage.keep(ctx, lookup)


async def test_an_answer_of_an_adapter_replaced_since_its_request_was_routed_is_not_kept() -> None:
    old = Adapter(name="m-fr", base="m", engine_name="m-fr@1", path="/a/1")
    new = Adapter(name="m-fr", base="m", engine_name="m-fr@2", path="/a/2")
    policy = ModelCacheSpec(exact=True)
    # the adapter was replaced after the request was routed to the old one and before its lookup
    cache = ExactCache(MemoryStore(1 << 20), {"m-fr": policy}, {"m": "d", "m-fr": "d:m-fr@2"})
    stage = _stage(cache, ReplicaSet(), AdapterCatalogue([new]))
    await _answered(stage, _context("m-fr", RouteRequest(model="m", adapter=old)))
    assert await _stored(cache) == []
    await _answered(stage, _context("m-fr", RouteRequest(model="m", adapter=new)))
    assert len(await _stored(cache)) == 1


async def test_a_vector_made_while_the_embedding_model_rolls_out_is_not_kept() -> None:
    policy = ModelCacheSpec(semantic=True, embedding_model="e")
    cache = ExactCache(MemoryStore(1 << 20), {"m": policy}, {"m": "m-1", "e": "e-2"})
    cache.embedder = Embedder()
    replicas = ReplicaSet()
    replicas.rollouts["e"] = {"phase": "shifting", "share": 0.5}
    await _answered(_stage(cache, replicas, AdapterCatalogue()), _context("m", RouteRequest(model="m")))
    (entry,) = await _stored(cache)
    assert entry.vector is None and len(cache.index) == 0
