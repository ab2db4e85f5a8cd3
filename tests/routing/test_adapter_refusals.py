"""Replicas that refuse to load adapters (their files missing where they run), as placement hears of them
(routing/adapters.py, told by the gateway's loader): the relay's requests go through the real router,
placement and loader to engines faked here; placement on its own, with a clock the test moves."""

from __future__ import annotations

import orjson
import pytest

from corral.gateway.context import RequestContext
from corral.gateway.relay import Relay
from corral.protocol import ChatCompletionRequest, NoCapacity, parse_body
from corral.routing import Replica, ReplicaState, RouteRequest
from corral.routing.adapters import Adapter, AdapterCatalogue, AdapterPlacement

from ..adapter_relay import EngineAnswer, relay_over

_LOAD = "/v1/load_lora_adapter"


class _Engines:
    """vLLM engines behind the replicas' addresses: those in `refusing` answer every load with vLLM's 400
    (no adapter at that path on their node); the others load, and answer a chat naming the model asked."""

    def __init__(self, refusing: set[str]) -> None:
        self.refusing = refusing
        self.loads: list[tuple[str, str]] = []  # (address, revision) of each load asked

    async def post(
        self, url: str, path: str, body: bytes, authorization: str | None, extra: bytes = b""
    ) -> EngineAnswer:
        data = orjson.loads(body)
        if path == _LOAD:
            self.loads.append((url, data["lora_name"]))
            if url in self.refusing:
                return EngineAnswer(400, b'{"error": {"message": "No adapter found at /adapters"}}')
        if path.endswith("_lora_adapter"):
            return EngineAnswer(200, b"Success: LoRA adapter loaded.")
        choice = {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        answer = {"id": "c", "object": "chat.completion", "model": data["model"], "choices": [choice]}
        return EngineAnswer(200, orjson.dumps({**answer, "usage": usage}))


class _Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _adapter(name: str) -> Adapter:
    return Adapter(name, "m", f"{name}@1", f"/adapters/{name}")


def _replicas(count: int, slots: int = 8) -> list[Replica]:
    """vLLM replicas of model m, each loading adapters at run time into `slots` slots."""
    replicas = []
    for i in range(count):
        url = f"http://10.0.0.{i}:8000"
        replica = Replica(f"m-{i}", "m", "vllm", url=url, state=ReplicaState.READY, started_at=1.0)
        replica.adapter_slots = slots
        replicas.append(replica)
    return replicas


async def _ask(relay: Relay, adapter: Adapter) -> int:
    """One chat request for `adapter` through the relay, as the gateway sends it: its answer's status."""
    raw = orjson.dumps({"model": adapter.name, "messages": [{"role": "user", "content": "hi"}]})
    body = parse_body(ChatCompletionRequest, raw)
    route = RouteRequest(model="m", tokens=2, adapter=adapter)
    ctx = RequestContext("/v1/chat/completions", body, raw, 0.0, route)
    response = await relay.forward(ctx, None)
    return response.status


async def test_a_replica_that_refuses_every_load_is_not_every_new_adapters_first_try() -> None:
    """Three replicas, the first refusing every load (its node lacks the adapters' files): eight new
    adapters asked once each are all served, and the refusing replica is asked to load once or twice, not
    eight times. (Each refusal frees its slot, so that replica, holding the fewest, looked the cheapest
    loader for every new adapter; it refused while another replica loaded the same revision, so its node is
    the trouble and placement passes it by for new loads.)"""
    replicas = _replicas(3)
    bad = replicas[0]
    engines = _Engines(refusing={bad.url})
    adapters = [_adapter(f"a{i}") for i in range(8)]
    _, relay = relay_over(replicas, engines, AdapterCatalogue(adapters))
    for adapter in adapters:
        assert await _ask(relay, adapter) == 200
    asked_bad = [revision for url, revision in engines.loads if url == bad.url]
    assert 1 <= len(asked_bad) <= 2, engines.loads
    assert len(engines.loads) - len(asked_bad) == 8  # each adapter loaded once, on a good replica
    assert bad.breaker.consecutive_failures == 0  # (the adapter's trouble to the breaker, as before)


async def test_an_adapter_every_replica_refused_is_not_asked_again_until_its_retry_after() -> None:
    """Both replicas refuse an adapter (its files are broken): the request asks each once and is a 503
    `adapter_unavailable` saying to come back in 5 s; another request within those 5 s asks no replica again
    (placement's memory of the refusals, which the loader reads: one memory); after them, both are asked."""
    clock = _Clock()
    replicas = _replicas(2)
    engines = _Engines(refusing={r.url for r in replicas})
    a = _adapter("a")
    _, relay = relay_over(replicas, engines, AdapterCatalogue([a]), clock)
    for after, loads in ((0.0, 2), (4.9, 2), (5.1, 4)):  # (the seconds since the refusals, the loads asked)
        clock.now = 1000.0 + after
        with pytest.raises(NoCapacity) as refused:
            await _ask(relay, a)
        assert refused.value.code == "adapter_unavailable" and refused.value.retry_after == 5.0
        assert len(engines.loads) == loads, (after, engines.loads)


def test_a_replica_that_refused_a_revision_is_passed_by_for_it_for_30_seconds() -> None:
    """A replica that refused a revision (no other replica has loaded it: perhaps the adapter's own fault)
    is not chosen to load that revision for 30 s, while it still loads other adapters; after 30 s it may
    be chosen again; where every replica refused it lately, none is chosen (the routing policy picks)."""
    clock = _Clock()
    placement = AdapterPlacement(min_resident_s=0, clock=clock)
    replicas = _replicas(2)
    first, second = replicas
    a, b = _adapter("a"), _adapter("b")
    assert placement.candidates(a, replicas) == [first]  # (the first of equals)
    placement.refused(first, a.engine_name)
    assert placement.candidates(a, replicas) == [second]
    assert placement.candidates(b, replicas) == [first]  # another adapter: its node is not known bad
    clock.now += 29
    assert placement.candidates(a, replicas) == [second]
    clock.now += 1
    assert placement.candidates(a, replicas) == [first]
    placement.refused(first, a.engine_name)
    placement.refused(second, a.engine_name)
    assert placement.candidates(a, replicas) == replicas


def test_a_replica_that_refused_what_another_loaded_loads_no_adapter_for_30_seconds_unless_alone() -> None:
    """A replica refused a revision that another replica loaded (before or after the refusal): its node is
    the trouble, and it is not chosen to load any adapter for 30 s, unless no other replica can load."""
    for loaded_first in (False, True):
        clock = _Clock()
        placement = AdapterPlacement(min_resident_s=0, clock=clock)
        replicas = _replicas(3)
        bad, good, other = replicas
        a, b = _adapter("a"), _adapter("b")
        if loaded_first:
            residence, load, _ = placement.use(good, a)
            assert load
            placement.loaded(good, a.engine_name, residence)
            placement.refused(bad, a.engine_name)
        else:
            placement.refused(bad, a.engine_name)
            residence, load, _ = placement.use(good, a)
            placement.loaded(good, a.engine_name, residence)
        assert placement.candidates(b, replicas) == [other]  # (the emptiest, were bad not passed by)
        assert placement.candidates(b, [bad]) == [bad]  # the only one that can load: it loads
        clock.now += 30
        assert placement.candidates(b, replicas) == [bad]


def test_a_refusal_while_another_replica_only_began_loading_blames_no_node() -> None:
    """Two replicas asked to load a revision at once, one refusing: until the other's load succeeds, the
    refusing replica may still load other adapters (both may fail: the adapter's files, not a node)."""
    placement = AdapterPlacement(min_resident_s=0)
    replicas = _replicas(2)
    first, second = replicas
    a, b = _adapter("a"), _adapter("b")
    placement.use(second, a)  # loading, not yet loaded
    placement.refused(first, a.engine_name)
    assert placement.candidates(b, replicas) == [first]
