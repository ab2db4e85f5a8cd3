"""Requests read before a live `corral apply` changed their adapter, served after it (they waited in the
admission queue, or were placed and then waited): a replaced adapter is served under its current revision,
a removed one, or one taken from the request's tenant, is a 404 in OpenAI's shape, and neither leaves the
old revision loaded or holding a slot. Through the real router, placement, loader and relay
(gateway/adapters.py, routing/adapters.py), to engines faked here."""

from __future__ import annotations

from dataclasses import replace
from typing import cast

import orjson
import pytest

from corral.gateway.context import RequestContext
from corral.gateway.relay import Relay
from corral.protocol import ChatCompletionRequest, ModelNotFound, parse_body
from corral.routing import Replica, ReplicaState, Router, RouteRequest
from corral.routing.adapters import Adapter, AdapterCatalogue

from ..adapter_relay import EngineAnswer, relay_over

OLD = Adapter("support", "m", "support@1", "/adapters/support-1", tenants=frozenset({"acme"}))
NEW = Adapter("support", "m", "support@2", "/adapters/support-2", tenants=frozenset({"acme"}))


class _Engines:
    """vLLM engines that load whatever they are asked and answer a chat naming the model it named."""

    def __init__(self) -> None:
        self.loads: list[str] = []  # the revisions loaded, in order
        self.asked: list[str] = []  # the `model` each chat named

    async def post(
        self, url: str, path: str, body: bytes, authorization: str | None, extra: bytes = b""
    ) -> EngineAnswer:
        data = orjson.loads(body)
        if path == "/v1/load_lora_adapter":
            self.loads.append(data["lora_name"])
        if path.endswith("_lora_adapter"):
            return EngineAnswer(200, b"Success")
        self.asked.append(data["model"])
        choice = {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
        return EngineAnswer(
            200, orjson.dumps({"object": "chat.completion", "model": data["model"], "choices": [choice]})
        )


def _served(engines: _Engines) -> tuple[Router, Relay, list[Replica]]:
    """Two vLLM replicas of m (4 slots each) serving adapter `support` at its first revision."""
    replicas = []
    for i in range(2):
        replica = Replica(f"m-{i}", "m", "vllm", url=f"http://10.0.0.{i}:8000", state=ReplicaState.READY)
        replica.adapter_slots, replica.started_at = 4, 1.0
        replicas.append(replica)
    router, relay = relay_over(replicas, engines, AdapterCatalogue([OLD]))
    return router, relay, replicas


def _request(tenant: str = "acme") -> RequestContext:
    """A chat request for `support` as intake read it before the apply: routed with the old revision."""
    raw = orjson.dumps({"model": "support", "messages": [{"role": "user", "content": "hi"}]})
    route = RouteRequest(model="m", tokens=2, tenant=tenant, adapter=OLD)
    return RequestContext("/v1/chat/completions", parse_body(ChatCompletionRequest, raw), raw, 0.0, route)


async def _answer(
    router: Router, relay: Relay, ctx: RequestContext, apply: list[Adapter], placed: bool
) -> bytes:
    """The request's answer, the apply (`support`'s adapters now `apply`) made while it waited: before it
    was placed (`placed` False: in the admission queue), or after (placed, its load not yet begun)."""
    if not placed:
        relay.adapters.replace("m", apply)
        response = await relay.forward(ctx, None)
        assert response.status == 200
        return cast(bytes, response.body)
    replica = router.acquire(ctx.route)
    relay.adapters.replace("m", apply)
    try:
        await relay.loader.ready(replica, ctx.route)
    finally:
        router.release(replica, ctx.route, None)
    return b""


@pytest.mark.parametrize("placed", [False, True])
async def test_a_request_waiting_through_an_apply_that_replaced_its_adapter_is_served_by_the_new_revision(
    placed: bool,
) -> None:
    """The old revision, loaded by an earlier request, is unloaded at the apply; the waiting request loads
    the new one (never the old one again), the engine is asked for it, and the client sees the name it
    sent; another such request goes where the new revision is (it is not loaded on every replica); no
    replica holds the old revision afterwards."""
    engines = _Engines()
    router, relay, replicas = _served(engines)
    await relay.forward(_request(), None)  # an earlier request: the old revision is loaded
    assert engines.loads == ["support@1"]
    ctx = _request()
    answer = await _answer(router, relay, ctx, [NEW], placed)
    assert engines.loads == ["support@1", "support@2"]
    assert ctx.route.adapter == NEW
    if not placed:
        assert engines.asked[-1] == "support@2" and orjson.loads(answer)["model"] == "support"
        # another request that waited alike goes where the new revision is: it is not loaded again
        await relay.forward(_request(), None)
        assert engines.loads == ["support@1", "support@2"] and engines.asked[-1] == "support@2"
    assert not any(router.adapters.holds(r, OLD) for r in replicas)
    assert sum(router.adapters.holds(r, NEW) for r in replicas) == 1


@pytest.mark.parametrize("placed", [False, True])
@pytest.mark.parametrize(
    "apply",
    [
        pytest.param([], id="removed"),
        pytest.param([replace(OLD, tenants=frozenset({"globex"}))], id="kept-for-another-tenant"),
    ],
)
async def test_a_request_waiting_through_an_apply_that_took_its_adapter_away_is_a_404_keeping_no_slot(
    placed: bool, apply: list[Adapter]
) -> None:
    """Removed (apply: none), or kept for other tenants only (the request's tenant, acme, left out): the
    waiting request is a 404 model_not_found, as it would be if sent now; no load is asked, and no replica
    keeps a slot for it."""
    engines = _Engines()
    router, relay, replicas = _served(engines)
    ctx = _request()
    with pytest.raises(ModelNotFound) as refused:
        await _answer(router, relay, ctx, apply, placed)
    error = refused.value
    assert error.status == 404 and error.to_dict()["error"]["code"] == "model_not_found"
    assert "support" in error.message
    assert engines.loads == [] and engines.asked == []
    assert all(router.adapters.resident(r) == [] for r in replicas)
