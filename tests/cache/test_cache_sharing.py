"""What tenants sharing the cache can do to each other: a tenant filling the memory store evicts its own
answers (another's only while it holds less than an equal share); Redis's tenant cap says when it took
the entry just put; one tenant's embedding calls neither take every call nor pause everyone's; a gateway
indexing a shared store lets the event loop go and passes unreadable entries by; and under `charge:
tokens` an answer without usage is not kept (its hits would be free)."""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
import orjson
import redis.asyncio as aioredis

from corral.cache import ExactCache, MemoryStore, RedisStore, Vector
from corral.cache.entry import Entry
from corral.cache.exact import encode_vector
from corral.cache.store import entry_key
from corral.config import ModelCacheSpec

CHAT = "/v1/chat/completions"
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


async def _present(store: MemoryStore, tenant: str, count: int) -> int:
    return len(await store.present([entry_key(tenant, "m", str(i)) for i in range(count)]))


async def test_a_full_memory_store_takes_the_putting_tenants_own_oldest_above_its_share() -> None:
    """max_bytes 100, tenant_max_bytes unset. B holds 10 or 45: A's flood never takes B's (it took them
    all before, from whoever held most). B holds 80: the store takes B's oldest while B holds more than
    its equal share (50), then A's own."""
    for b_holds, b_keeps in ((10, 10), (45, 45), (80, 50)):
        store = MemoryStore(100)
        for i in range(b_holds):
            await store.put(entry_key("B", "m", str(i)), b"b", 3600)
        for i in range(100):
            assert await store.put(entry_key("A", "m", str(i)), b"a", 3600)
        assert await _present(store, "B", b_holds) == b_keeps
        assert await _present(store, "A", 100) == 100 - b_keeps
        assert await store.get(entry_key("A", "m", "99")) == b"a"  # A's newest stays: its oldest went


async def test_redis_says_when_its_tenant_cap_took_the_entry_just_put() -> None:
    """The cap deletes the tenant's entries that expire first: a new entry with a shorter TTL than the
    tenant's others is the one to go. put() said True, and the semantic index added its vector."""
    prefix = f"test-cap-{uuid.uuid4().hex[:8]}:cache:"
    store = RedisStore("redis://127.0.0.1:6379/0", 2.0, prefix=prefix, tenant_max_bytes=3000)
    try:
        for name in ("old", "x"):
            assert await store.put(entry_key("A", "long", name), b"o" * 1000, 3600)
        assert await store.put(entry_key("A", "short", "0"), b"n" * 1000, 60)  # (at the cap: kept)
        gone = entry_key("A", "short", "1")
        assert await store.put(gone, b"n" * 1000, 30) is False
        assert await store.present([gone]) == set()
    finally:
        client = aioredis.from_url("redis://127.0.0.1:6379/0")
        keys = [k async for k in client.scan_iter(f"{prefix.split(':')[0]}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


class SlowFor:
    """Embeds at once, except questions starting `SLOW`, held until `release`."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def embed(self, model: str, text: str) -> Vector:
        if text.startswith("SLOW"):
            await self.release.wait()
        return np.ones(4, dtype=np.float32) / 2


def _ask(question: str) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": question}], "temperature": 0})


async def test_one_tenants_embedding_calls_neither_fill_the_cap_nor_pause_the_others() -> None:
    policy = ModelCacheSpec(semantic=True, embedding_model="e", guard=False)
    embedder = SlowFor()
    cache = ExactCache(MemoryStore(1 << 20), {"m": policy}, embed_timeout=5.0)
    cache.embedder = embedder
    held = [asyncio.create_task(cache.lookup("A", "m", CHAT, _ask(f"SLOW {i}"), None)) for i in range(8)]
    await asyncio.sleep(0.05)
    b = await cache.lookup("B", "m", CHAT, _ask("a question"), None)
    assert b is not None and b.vector is not None  # (A's 8 took every call: B's lookup was "busy")
    busy = [await task for task in held[6:]]  # alone, A took all but 2 (capped at 2 it took 2 of 8)
    assert all(f is not None and f.embedding_failure == "busy" for f in busy)  # A's own past 6
    assert not any(task.done() for task in held[:6])  # (in flight: embedding)
    embedder.release.set()
    await asyncio.gather(*held)

    slow = ExactCache(MemoryStore(1 << 20), {"m": policy}, embed_timeout=0.05)
    slow.embedder = SlowFor()
    a = await slow.lookup("A", "m", CHAT, _ask("SLOW question"), None)
    assert a is not None and a.embedding_failure == "timeout"
    a = await slow.lookup("A", "m", CHAT, _ask("next"), None)
    assert a is not None and a.embedding_failure == "paused"
    b = await slow.lookup("B", "m", CHAT, _ask("next"), None)
    assert b is not None and b.vector is not None  # (A's timeout paused everyone's lookups 5 s)
    # a second tenant's question timing out too: the embedder is what is slow, everyone's pause
    b = await slow.lookup("B", "m", CHAT, _ask("SLOW too"), None)
    assert b is not None and b.embedding_failure == "timeout"
    c = await slow.lookup("C", "m", CHAT, _ask("next"), None)
    assert c is not None and c.embedding_failure == "paused"


async def test_indexing_a_shared_store_lets_the_loop_go_and_passes_unreadable_entries_by() -> None:
    """Rebuilding the index decoded every entry in one go, holding the event loop (710 ms beside a Redis
    of 300 entries of 1 MB); an entry another version wrote (events not text) raised out of it."""
    cache = ExactCache(MemoryStore(1 << 26), {"m": ModelCacheSpec(semantic=True, embedding_model="e")})
    vector = encode_vector(np.ones(4, dtype=np.float32) / 2)
    events = tuple(b'data: {"choices":[{"delta":{"content":"w%d"}}]}' % i for i in range(2000))
    for i in range(20):
        exact_only = Entry("stream", True, events=events, usage=USAGE)
        await cache.store.put(entry_key("t", "m", f"e{i}"), exact_only.encode(), 60)
    semantic = Entry("whole", True, body=b"{}", usage=USAGE, group="g", vector=vector, question="q")
    await cache.store.put(entry_key("t", "m", "s"), semantic.encode(), 60)
    odd = {"kind": "stream", "chat": True, "events": [1], "body": "", "group": "g", "vector": vector}
    await cache.store.put(entry_key("t", "m", "odd"), orjson.dumps(odd), 60)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    ticks = 0
    try:
        assert await cache.rebuild() == 1
    finally:
        task.cancel()
    assert ticks >= 20  # the loop ran between entries
    assert cache.index.keys() == [entry_key("t", "m", "s")]


async def test_under_charge_tokens_an_answer_without_usage_is_not_kept() -> None:
    """An engine that reports no usage: the miss is charged its reservation, but the entry kept with no
    usage made every hit cost 0 tokens (TPM and budgets never saw them). Under `charge: request` hits cost
    the request only, so such an entry is kept."""
    answer = {"id": "c", "object": "chat.completion", "created": 1, "model": "m"}
    message = {"role": "assistant", "content": "hi"}
    body = orjson.dumps({**answer, "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})
    for charge, kept in (("tokens", False), ("request", True)):
        cache = ExactCache(MemoryStore(1 << 20), {"m": ModelCacheSpec(exact=True, charge=charge)})
        found = await cache.lookup("t", "m", CHAT, _ask("q"), None)
        assert found is not None
        cache.keep_whole(found, body, True)
        await cache.flush()
        again = await cache.lookup("t", "m", CHAT, _ask("q"), None)
        assert again is not None and (again.hit is not None) is kept, charge
