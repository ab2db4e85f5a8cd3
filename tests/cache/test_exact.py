"""The exact response cache, through gateways in front of a simulated vLLM replica, with the openai client:
hits return the same content (streamed replays parse chunk by chunk and end with [DONE]; a stream answers
a whole request and the other way round), Cache-Control no-cache/no-store are honoured, sampled requests
are not cached, tenants never share an entry and neither do conversations that differ before their last
question, a purge empties it, and Redis shares it between two gateways. Entries: a truncated stream or an
error is never kept."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import openai
import orjson
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from corral.cache import ExactCache, MemoryStore
from corral.cache.entry import Entry, entry_from_stream, entry_from_whole
from corral.cache.store import RedisStore
from corral.config import CacheSettings, ModelCacheSpec
from corral.gateway import GatewayParts, GatewayServer
from corral.perf import load_catalog
from corral.perf.calibration import calibrated_efficiency
from corral.routing import Replica, ReplicaSet, ReplicaState
from corral.sim import SimFleet, SimOptions, build_server
from tests.gateway.conftest import start_closed_gateway

ADMIN = "cache-admin"
HI = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass
class Gateway:
    url: str
    server: GatewayServer
    services: GatewayParts


@pytest.fixture
async def engine() -> AsyncIterator[str]:
    options = SimOptions(model="llama-3.1-8b", gpu="h100-sxm", time_scale=50, served_name="m")
    fleet = SimFleet([build_server(options, load_catalog(), calibrated_efficiency())])
    await fleet.start([0])
    yield fleet.urls[0]
    await fleet.stop()


async def gateway(
    engine: str, tmp_path: Path, cache: CacheSettings, policy: ModelCacheSpec | None = None
) -> Gateway:
    replicas = ReplicaSet()
    replicas.add(Replica(id="m-0", model="m", engine="sim", url=engine, state=ReplicaState.READY))
    return Gateway(
        *await start_closed_gateway(
            replicas,
            f"sqlite:///{tmp_path / f'{uuid.uuid4().hex}.db'}",
            ADMIN,
            cache=cache,
            cache_policies={"m": policy or ModelCacheSpec(exact=True)},
        )
    )


async def key_for(gw: Gateway, tenant: str, **limits: int) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.post(
            gw.url + "/admin/keys",
            json={"tenant": tenant, **limits},
            headers={"Authorization": f"Bearer {ADMIN}"},
        ) as response:
            return str((await response.json())["key"])


def client(gw: Gateway, key: str, headers: dict[str, str] | None = None) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=gw.url + "/v1", api_key=key, max_retries=0, default_headers=headers or {}
    )


async def ask(c: openai.AsyncOpenAI, messages: list[dict[str, str]], stream: bool, **extra: object) -> tuple:
    """(content, the x-corral-cache header, number of content chunks)."""
    args = {"model": "m", "messages": messages, "max_tokens": 24, "temperature": 0, **extra}
    raw = await c.chat.completions.with_raw_response.create(stream=stream, **args)  # type: ignore[call-overload]
    state = raw.headers.get("x-corral-cache")
    if not stream:
        return raw.parse().choices[0].message.content, state, 1
    parts = [chunk.choices[0].delta.content async for chunk in raw.parse() if chunk.choices]
    return "".join(p or "" for p in parts), state, sum(1 for p in parts if p)


async def test_hits_replay_either_kind_and_honour_cache_control(engine: str, tmp_path: Path) -> None:
    gw = await gateway(engine, tmp_path, CacheSettings())
    try:
        c = client(gw, await key_for(gw, "acme"))
        first, state, chunks = await ask(c, HI, stream=True)
        assert state == "miss" and chunks > 1
        await gw.services.cache.flush()  # type: ignore[union-attr]
        again, state, replayed = await ask(c, HI, stream=True)
        assert (again, state, replayed) == (first, "hit", chunks)  # the engine's own chunking
        whole, state, _ = await ask(c, HI, stream=False)
        assert (whole, state) == (first, "hit")  # a whole answer made from the stored stream

        other = [{"role": "user", "content": "Name a colour."}]
        made, state, _ = await ask(c, other, stream=False)
        assert state == "miss"
        await gw.services.cache.flush()  # type: ignore[union-attr]
        streamed, state, _ = await ask(c, other, stream=True, stream_options={"include_usage": True})
        assert (streamed, state) == (made, "hit")  # a stream made from the stored whole answer

        fresh = client(gw, c.api_key, {"Cache-Control": "no-cache"})
        assert (await ask(fresh, HI, stream=False))[1] == "bypass"
        third = [{"role": "user", "content": "Count to three."}]
        unkept = client(gw, c.api_key, {"Cache-Control": "no-store"})
        assert (await ask(unkept, third, stream=False))[1] == "miss"
        await gw.services.cache.flush()  # type: ignore[union-attr]
        assert (await ask(c, third, stream=False))[1] == "miss"  # no-store kept nothing
        assert (await ask(c, HI, stream=False, temperature=0.8))[1] is None  # sampled: not cached
        assert (await ask(c, HI, stream=False, temperature=0.8, seed=7))[1] == "miss"  # a seed: cached
    finally:
        await gw.server.stop()


async def test_tenants_and_conversations_never_share_an_entry_and_purge(engine: str, tmp_path: Path) -> None:
    gw = await gateway(engine, tmp_path, CacheSettings())
    try:
        a, b = client(gw, await key_for(gw, "a")), client(gw, await key_for(gw, "b"))
        assert (await ask(a, HI, stream=False))[1] == "miss"
        await gw.services.cache.flush()  # type: ignore[union-attr]
        assert (await ask(b, HI, stream=False))[1] == "miss"  # the other tenant does not see it
        earlier = [
            {"role": "user", "content": "Talk like a pirate."},
            {"role": "assistant", "content": "Arr."},
        ]
        assert (await ask(a, earlier + HI, stream=False))[1] == "miss"  # same last question, other talk
        assert (await ask(a, HI, stream=False))[1] == "hit"
        async with aiohttp.ClientSession() as session:
            auth = {"Authorization": f"Bearer {ADMIN}"}
            async with session.delete(gw.url + "/admin/cache?tenant=a", headers=auth) as response:
                assert (await response.json())["removed"] == 2
            async with session.get(gw.url + "/admin/cache", headers=auth) as response:
                stats = await response.json()
        assert stats["models"] == ["m"] and stats["store"]["entries"] == 1  # b's entry stays
        assert (await ask(a, HI, stream=False))[1] == "miss"
    finally:
        await gw.server.stop()


async def test_redis_shares_the_cache_between_two_gateways(engine: str, tmp_path: Path) -> None:
    redis = CacheSettings(backend="redis")
    one, two = await gateway(engine, tmp_path, redis), await gateway(engine, tmp_path, redis)
    try:
        question = [{"role": "user", "content": f"Shared question {uuid.uuid4()}"}]
        tenant = f"t-{uuid.uuid4().hex}"
        key_one, key_two = await key_for(one, tenant), await key_for(two, tenant)
        content, state, _ = await ask(client(one, key_one), question, stream=True)
        assert state == "miss"
        await one.services.cache.flush()  # type: ignore[union-attr]
        assert await ask(client(two, key_two), question, stream=True) == (content, "hit", _)
        removed = await two.services.cache.store.purge(tenant, None)  # type: ignore[union-attr]
        assert removed == 1
    finally:
        await one.server.stop()
        await two.server.stop()


def test_only_an_answer_that_ended_well_is_kept_and_conversions_lose_nothing() -> None:
    def event(data: dict) -> bytes:
        return b"data: " + orjson.dumps(data) + b"\n\n"

    head = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    words = event({**head, "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]})
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    last = event({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": usage})
    done = b"data: [DONE]\n\n"
    entry = entry_from_stream([words, last, done], True, usage)
    assert entry is not None and b"usage" not in b"".join(entry.events)  # usage on a chunk kept apart
    assert (entry.sse(with_usage=False) or b"").count(b'"usage"') == 0
    assert (entry.sse(with_usage=True) or b"").count(b'"usage"') == 1
    assert entry_from_stream([words, last], True, None) is None  # cut: no [DONE]
    assert entry_from_stream([words, done], True, None) is None  # never said it ended
    failed = event({"error": {"message": "the engine failed", "type": "internal_error"}})
    assert entry_from_stream([words, failed, done], True, None) is None  # vLLM: error, then [DONE]
    choice = {"index": 0, "delta": {"content": "a"}, "logprobs": {"content": []}, "finish_reason": "stop"}
    with_logprobs = event({**head, "choices": [choice]})
    stored = entry_from_stream([with_logprobs, done], True, None)
    assert stored is not None and stored.whole() is None  # a whole answer would lose the logprobs
    message = {"role": "assistant", "content": "hi"}
    answer = {"id": "y", "object": "chat.completion", "model": "m", "usage": usage,
              "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}  # fmt: skip
    whole = entry_from_whole(orjson.dumps(answer), True)
    assert whole is not None and whole.sse(with_usage=False) is not None
    message["tool_calls"] = [{"id": "t", "type": "function"}]  # type: ignore[list-item]
    calls = entry_from_whole(orjson.dumps(answer), True)
    assert calls is not None and calls.sse(with_usage=False) is None  # told only the way it was stored
    unfinished = b'{"choices": [{"index": 0, "message": {}, "finish_reason": null}]}'
    assert entry_from_whole(unfinished, True) is None


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tenants=st.lists(st.text(min_size=1, max_size=12), min_size=2, max_size=12, unique=True),
    questions=st.lists(st.text(max_size=30), min_size=1, max_size=4),
)
def test_no_lookup_ever_finds_another_tenants_answer(tenants: list[str], questions: list[str]) -> None:
    """Each tenant stores an answer naming itself for every question; every lookup finds its own."""

    async def run() -> None:
        cache = ExactCache(MemoryStore(1 << 24), {"m": ModelCacheSpec(exact=True)})
        for tenant in tenants:
            for question in questions:
                raw = _body(question)
                found = await cache.lookup(tenant, "m", "/v1/chat/completions", raw, None)
                assert found is not None
                if found.hit is not None:
                    assert found.hit.body == tenant.encode()  # its own answer, never another tenant's
                    continue
                await cache.store.put(found.key, Entry("whole", True, body=tenant.encode()).encode(), 60)
        for tenant in tenants:
            for question in questions:
                found = await cache.lookup(tenant, "m", "/v1/chat/completions", _body(question), None)
                assert found is not None and found.hit is not None and found.hit.body == tenant.encode()

    asyncio.run(run())


def _body(question: str) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": question}], "temperature": 0})


async def test_what_a_hit_costs_follows_the_charge_policy(engine: str, tmp_path: Path) -> None:
    """A key allowed 400 tokens a minute: each answer here costs about 60 (its prompt and 24 output
    tokens, reserved as prompt + max_tokens). Hits charged by their tokens run the budget out; hits
    charged as requests only do not."""
    for charge, limited in (("tokens", True), ("request", False)):
        gw = await gateway(engine, tmp_path, CacheSettings(), ModelCacheSpec(exact=True, charge=charge))
        try:
            c = client(gw, await key_for(gw, f"t-{charge}", tpm=400))
            await ask(c, HI, stream=False)
            await gw.services.cache.flush()  # type: ignore[union-attr]
            refused = 0
            for _ in range(12):
                try:
                    assert (await ask(c, HI, stream=False))[1] == "hit"
                except openai.RateLimitError:
                    refused += 1
            assert (refused > 0) is limited, (charge, refused)
        finally:
            await gw.server.stop()


async def test_sampled_requests_cache_when_the_model_allows_and_a_dead_redis_is_a_miss(
    engine: str, tmp_path: Path
) -> None:
    sampled = ModelCacheSpec(exact=True, deterministic_only=False)
    gw = await gateway(engine, tmp_path, CacheSettings(), sampled)
    try:
        c = client(gw, await key_for(gw, "s"))
        assert (await ask(c, HI, stream=False, temperature=0.9))[1] == "miss"
        await gw.services.cache.flush()  # type: ignore[union-attr]
        assert (await ask(c, HI, stream=False, temperature=0.9))[1] == "hit"
    finally:
        await gw.server.stop()
    dead = CacheSettings(backend="redis", redis_url="redis://127.0.0.1:1/0", redis_timeout=0.2)
    gw = await gateway(engine, tmp_path, dead)
    try:
        c = client(gw, await key_for(gw, "d"))
        content, state, _ = await ask(c, HI, stream=False)
        assert content and state == "miss"  # answered by the engine; the cache's failure is logged
        await gw.services.cache.flush()  # type: ignore[union-attr]
        assert gw.services.cache.store.stats()["failures"] >= 1  # type: ignore[union-attr]
        assert (await ask(c, HI, stream=False))[1] == "miss"  # Redis skipped a while: no wait again
    finally:
        await gw.server.stop()


async def test_the_memory_store_keeps_its_byte_bound_and_entries_expire() -> None:
    store = MemoryStore(max_bytes=100)
    for i in range(5):
        await store.put(f"t/m/{i}", b"x" * 30, ttl_s=60)
    assert store.stats()["bytes"] == 90 and store.stats()["entries"] == 3  # the oldest two went
    assert await store.get("t/m/0") is None and await store.get("t/m/4") == b"x" * 30
    await store.put("t/m/big", b"y" * 101, ttl_s=60)  # larger than the whole store: not kept
    assert await store.get("t/m/big") is None
    await store.put("t/m/short", b"z", ttl_s=0.05)
    await asyncio.sleep(0.1)
    assert await store.get("t/m/short") is None


async def test_a_tenant_filling_the_memory_store_evicts_its_own_entries_not_anothers() -> None:
    """Eve stores answers no one asks again; bob's entry, older than all of hers, stays: when the store
    is full the tenant holding the most bytes gives up its least recently used entry (a global LRU
    evicted bob's first)."""
    store = MemoryStore(max_bytes=300)
    await store.put("bob/m/1", b"b" * 30, ttl_s=60)
    for i in range(20):
        await store.put(f"eve/m/{i}", b"e" * 30, ttl_s=60)
    assert await store.get("bob/m/1") == b"b" * 30
    assert await store.get("eve/m/19") == b"e" * 30 and await store.get("eve/m/0") is None
    assert store.stats()["bytes"] <= 300
    await store.purge("eve", None)
    assert store.stats() == {"backend": "memory", "entries": 1, "bytes": 30, "max_bytes": 300}


async def test_a_tenant_past_its_cache_share_loses_its_own_oldest_answers_in_either_store() -> None:
    """`cache.tenant_max_bytes`: eve's answers past her share push out her own oldest, in memory and in
    Redis (where, before, a tenant could fill Redis and its maxmemory eviction took anyone's)."""
    memory = MemoryStore(max_bytes=1000, tenant_max_bytes=100)
    prefix = f"test:{uuid.uuid4().hex[:8]}:"
    redis_store = RedisStore("redis://127.0.0.1:6379/0", 0.5, prefix=prefix, tenant_max_bytes=100)
    for store in (memory, redis_store):
        await store.put("bob/m/1", b"b" * 30, ttl_s=60)
        for i in range(10):
            await store.put(f"eve/m/{i}", b"e" * 30, ttl_s=60)
        assert await store.get("bob/m/1") == b"b" * 30
        kept = [i for i in range(10) if await store.get(f"eve/m/{i}") is not None]
        assert kept == [7, 8, 9], store.stats()  # 90 of her 100 bytes: her three newest
        # over her whole share: not kept, and said so (its question's vector is then not indexed: a refused
        # entry's vector held index memory past every byte bound)
        assert await store.put("eve/m/big", b"e" * 101, ttl_s=60) is False
        assert await store.get("eve/m/big") is None and await store.get("eve/m/9") is not None
        assert await store.purge("eve", None) == 3
        assert await store.put("eve/m/new", b"e" * 100, ttl_s=60)  # the purge took her entries off the books
        assert await store.get("eve/m/new") is not None
    client = aioredis.from_url("redis://127.0.0.1:6379/0")
    assert int(await client.hget(f"{prefix.rstrip(':')}-books:eve:sizes", "")) == 100
    await client.delete(*[k async for k in client.scan_iter(f"{prefix.rstrip(':')}*")])
    await client.aclose()


async def test_the_tenant_share_holds_through_a_gateway_on_redis(engine: str, tmp_path: Path) -> None:
    """End to end: a gateway with `cache: {backend: redis, tenant_max_bytes}`; eve's flood of questions
    leaves bob's answer cached and keeps her own books within the share."""
    tenant_max = 4000
    gw = await gateway(engine, tmp_path, CacheSettings(backend="redis", tenant_max_bytes=tenant_max))
    bob, eve = f"bob-{uuid.uuid4().hex[:8]}", f"eve-{uuid.uuid4().hex[:8]}"
    try:
        bob_client, eve_client = client(gw, await key_for(gw, bob)), client(gw, await key_for(gw, eve))
        question = [{"role": "user", "content": f"Bob's question {uuid.uuid4()}"}]
        answer, state, _ = await ask(bob_client, question, stream=False)
        assert state == "miss"
        for i in range(12):
            await ask(eve_client, [{"role": "user", "content": f"Eve's question {i}"}], stream=False)
        await gw.services.cache.flush()  # type: ignore[union-attr]
        assert await ask(bob_client, question, stream=False) == (answer, "hit", 1)
        assert (await ask(eve_client, [{"role": "user", "content": "Eve's question 0"}], False))[1] == "miss"
        books = aioredis.from_url("redis://127.0.0.1:6379/0")
        assert 0 < int(await books.hget(f"corral:cache-books:{eve}:sizes", "")) <= tenant_max
        await books.aclose()
    finally:
        for tenant in (bob, eve):
            await gw.services.cache.store.purge(tenant, None)  # type: ignore[union-attr]
        await gw.server.stop()


async def test_a_new_deployment_of_the_model_starts_its_cache_afresh() -> None:
    cache = ExactCache(MemoryStore(1 << 20), {"m": ModelCacheSpec(exact=True)}, {"m": "weights-1"})
    found = await cache.lookup("t", "m", "/v1/chat/completions", _body("q"), None)
    assert found is not None
    await cache.store.put(found.key, Entry("whole", True, body=b"{}").encode(), 60)
    assert (await cache.lookup("t", "m", "/v1/chat/completions", _body("q"), None)).hit is not None  # type: ignore[union-attr]
    cache.versions["m"] = "weights-2"  # a rollout: the gateway is told the new deployment's digest
    assert (await cache.lookup("t", "m", "/v1/chat/completions", _body("q"), None)).hit is None  # type: ignore[union-attr]
    await cache.store.put(found.key, b"not an entry", 60)  # e.g. another corral version's, in a shared Redis
    cache.versions["m"] = "weights-1"
    again = await cache.lookup("t", "m", "/v1/chat/completions", _body("q"), None)
    assert again is not None and again.key == found.key and again.hit is None  # a miss, not an error


async def test_a_stream_cut_by_its_replica_is_not_kept(tmp_path: Path) -> None:
    """An engine that dies mid-answer the first time (it closes the connection after three tokens) and
    answers whole the second: the client sees the truncation, and the same request afterwards is a miss the
    engine answers again, not a replay of the cut stream; that whole answer is then kept."""
    calls = 0

    async def chat(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        head = {"id": f"c{calls}", "object": "chat.completion.chunk", "created": 1, "model": "m"}
        for word in ("Paris ", "is ", "the "):
            delta = {"index": 0, "delta": {"content": word}, "finish_reason": None}
            await response.write(b"data: " + orjson.dumps({**head, "choices": [delta]}) + b"\n\n")
        if calls == 1:
            assert request.transport is not None
            request.transport.close()  # the engine dies mid-answer
            return response
        end = {"index": 0, "delta": {}, "finish_reason": "stop"}
        await response.write(b"data: " + orjson.dumps({**head, "choices": [end]}) + b"\n\n")
        usage = {"prompt_tokens": 8, "completion_tokens": 4}  # (an answer without usage is not kept)
        await response.write(b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    gw = await gateway(f"http://127.0.0.1:{runner.addresses[0][1]}", tmp_path, CacheSettings())
    try:
        c = client(gw, await key_for(gw, "cut"))
        with pytest.raises(openai.APIError, match="cut short"):
            await ask(c, HI, stream=True)
        await gw.services.cache.flush()  # type: ignore[union-attr]
        assert (await ask(c, HI, stream=True))[1:] == ("miss", 3)
        await gw.services.cache.flush()  # type: ignore[union-attr]
        assert (await ask(c, HI, stream=True))[1] == "hit"
        assert calls == 2
    finally:
        await gw.server.stop()
        await runner.cleanup()


class _CountingStore(MemoryStore):
    """A memory store that counts the sweep's questions."""

    def __init__(self) -> None:
        super().__init__(max_bytes=1 << 30)
        self.present_calls = 0

    async def present(self, keys: list[str]) -> set[str]:
        self.present_calls += 1
        return await super().present(keys)


async def test_a_sweep_asks_the_store_once_for_all_vectors_and_forgets_the_gone() -> None:
    """4,000 indexed vectors: the sweep asked the store about every key once per key (n² work on the
    event loop, 2 s at 4,000 vectors; with Redis n²/500 round trips); it asks once."""
    store = _CountingStore()
    cache = ExactCache(store, {})
    rng = np.random.default_rng(0)
    for i in range(4_000):
        key = f"t:m:{i}"
        if i % 4:  # every fourth entry is gone (expired or evicted); its vector stays until a sweep
            await store.put(key, b"x", ttl_s=600)
        await cache.index.add("t:m", key, rng.standard_normal(8).astype(np.float32))
    assert await cache.sweep() == 1_000
    assert store.present_calls == 1
    assert len(cache.index) == 3_000 and set(cache.index.keys()) == {
        f"t:m:{i}" for i in range(4_000) if i % 4
    }
