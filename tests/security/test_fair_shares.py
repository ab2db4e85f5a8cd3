"""Tenant eve against tenant bob through a closed gateway: eve's burst cannot take bob's place in a model's
queue; over her share she gets a 429 naming it, and bob never a 503."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp

from corral.config import QueueSettings

from ..admission.test_gateway_admission import Cluster, start
from ..gateway.conftest import ScriptedUpstream

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def ask(session: aiohttp.ClientSession, cluster: Cluster, key: str) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {key}"}
    async with session.post(cluster.url + "/v1/chat/completions", json=BODY, headers=headers) as answer:
        body = await answer.json()
        return answer.status, "ok" if answer.status == 200 else body["error"]["code"]


async def until_queued(cluster: Cluster, depth: int) -> None:
    for _ in range(1000):  # 10 s
        if cluster.services.queue.depth("m") >= depth:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"fewer than {depth} requests queued")


async def until_one_refused(tasks: list[asyncio.Task[tuple[int, str]]]) -> None:
    pending = set(tasks)
    async with asyncio.timeout(10):
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if any(task.result()[0] == 429 for task in done):
                return
    raise AssertionError("no request was refused")


async def test_a_tenant_flooding_the_queue_cannot_take_an_idle_tenants_place(tmp_path: Path) -> None:
    slow = ScriptedUpstream(delay=0.2)  # one slot; each answer takes 0.2 s
    await slow.start()
    server, cluster = await start(tmp_path, slow, capacity=1, queue=QueueSettings(max_queued=8, timeout=30))
    try:
        _, eve = await cluster.admin("POST", "/admin/keys", {"tenant": "eve"})
        _, bob = await cluster.admin("POST", "/admin/keys", {"tenant": "bob"})
        async with aiohttp.ClientSession() as session:
            flood = [asyncio.create_task(ask(session, cluster, eve["key"])) for _ in range(9)]
            await until_queued(cluster, 8)  # one runs, eight wait: the queue is full, all eve's
            bob_asks = asyncio.create_task(ask(session, cluster, bob["key"]))
            await until_one_refused(flood)  # bob took the place of eve's newest waiter
            assert cluster.services.queue.depth("m") == 8
            more = await ask(session, cluster, eve["key"])  # eve at her share (4 of 8 with bob waiting)
            assert more == (429, "queue_share_exceeded")
            assert await bob_asks == (200, "ok")
            eve_answers = await asyncio.gather(*flood)
        assert sorted(eve_answers) == [(200, "ok")] * 8 + [(429, "queue_share_exceeded")]
    finally:
        await server.stop()
        await slow.stop()


async def test_a_full_queue_of_one_tenant_alone_is_still_a_503_for_it(tmp_path: Path) -> None:
    slow = ScriptedUpstream(delay=0.2)
    await slow.start()
    server, cluster = await start(tmp_path, slow, capacity=1, queue=QueueSettings(max_queued=2, timeout=30))
    try:
        _, eve = await cluster.admin("POST", "/admin/keys", {"tenant": "eve"})
        async with aiohttp.ClientSession() as session:
            flood = [asyncio.create_task(ask(session, cluster, eve["key"])) for _ in range(3)]
            await until_queued(cluster, 2)
            assert await ask(session, cluster, eve["key"]) == (503, "queue_full")  # the cluster is full
            assert sorted(await asyncio.gather(*flood)) == [(200, "ok")] * 3
    finally:
        await server.stop()
        await slow.stop()


@asynccontextmanager
async def _four_slots(tmp_path: Path) -> AsyncIterator[tuple[Cluster, ScriptedUpstream, str, str]]:
    """A closed gateway over one replica of four slots whose answers take 1 s; eve's key and bob's."""
    slow = ScriptedUpstream(delay=1.0)
    await slow.start()
    server, cluster = await start(tmp_path, slow, capacity=4, queue=QueueSettings(max_queued=32, timeout=30))
    try:
        _, eve = await cluster.admin("POST", "/admin/keys", {"tenant": "eve"})
        _, bob = await cluster.admin("POST", "/admin/keys", {"tenant": "bob"})
        yield cluster, slow, eve["key"], bob["key"]
    finally:
        await server.stop()
        await slow.stop()


async def test_a_flooding_tenant_leaves_an_active_tenants_share_of_the_slots_free(tmp_path: Path) -> None:
    """Four slots, each answer 1 s. Bob ran two requests lately (he is active, and two is what he runs at
    once); eve floods with 16 requests at once. Eve holds at most her share (2 of 4) while bob runs fewer
    than his, so two requests bob sends mid-flood start at once: they take 1 s. Before, eve took every slot
    that came free and bob's requests waited in the queue for the next wave of eve's answers to end (1.6 s
    here). (Bob keeps slots for as many as he ran at once lately, up to his share: test_queue_slots.py.)"""
    async with _four_slots(tmp_path) as (cluster, _, eve, bob), aiohttp.ClientSession() as session:

        async def timed(key: str) -> tuple[int, float]:
            started = time.monotonic()
            status, _ = await ask(session, cluster, key)
            return status, time.monotonic() - started

        first = asyncio.gather(timed(bob), timed(bob))  # bob is active, running two at once
        await asyncio.sleep(0.05)
        flood = [asyncio.create_task(timed(eve)) for _ in range(16)]
        await asyncio.sleep(2.4)  # eve's answers end in waves, at 1 s, 2 s, 3 s
        mid_flood = await asyncio.gather(timed(bob), timed(bob))
        assert [status for status, _ in mid_flood] == [200, 200]
        assert max(seconds for _, seconds in mid_flood) < 1.3, mid_flood
        assert [status for status, _ in await first] == [200, 200]
        assert {status for status, _ in await asyncio.gather(*flood)} == {200}  # eve is served, later


async def test_a_request_takes_a_slot_for_each_sequence_it_runs(tmp_path: Path) -> None:
    """Four slots (a vLLM replica's max_num_seqs), each answer 1 s. Eve's one request asks `n: 4`: the
    engine runs four sequences for it, every slot. Bob's request, sent while it runs, waits in corral's queue
    for them (before, it counted one slot, so bob's went to the engine at once and waited in the engine's
    own queue, past the fair queue: an `n: 128` request took a whole replica as one slot)."""
    async with _four_slots(tmp_path) as (cluster, slow, eve, bob), aiohttp.ClientSession() as session:
        headers = {"Authorization": f"Bearer {eve}"}
        eve_asks = asyncio.create_task(
            session.post(cluster.url + "/v1/chat/completions", json={**BODY, "n": 4}, headers=headers)
        )
        await asyncio.sleep(0.1)
        assert cluster.replicas.of("m")[0].outstanding == 4  # four sequences on the replica
        started = time.monotonic()
        assert await ask(session, cluster, bob) == (200, "ok")
        assert time.monotonic() - started > 1.5  # the rest of eve's second, then his own
        assert (await eve_asks).status == 200
    assert slow.peak_concurrency == 1
