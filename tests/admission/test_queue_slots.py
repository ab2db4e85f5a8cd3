"""The fair queue weighing requests by the slots they take (their sequences), on a real replica set: a
request larger than its tenant's share still starts while others are active, the next in turn keeps the
slots it waits for, and a replica counts a request's sequences up to its capacity."""

from __future__ import annotations

import asyncio

import pytest

from corral.admission import Principal
from corral.admission.queue import FairQueue
from corral.protocol import NoCapacity
from corral.routing import Replica, ReplicaSet, ReplicaState, Router, RouteRequest


def _replicas(*capacities: int) -> ReplicaSet:
    replicas = ReplicaSet(["m"])
    for i, capacity in enumerate(capacities):
        replicas.add(
            Replica(f"m-{i}", "m", "x", url="http://127.0.0.1:9", state=ReplicaState.READY, capacity=capacity)
        )
    return replicas


class Running:
    """Requests on the replica as the router counts them while they run."""

    def __init__(self, replicas: ReplicaSet, queue: FairQueue) -> None:
        self.replica, self.queue = replicas.of("m")[0], queue

    async def start(self, tenant: str, sequences: int = 1) -> int:
        _, slots = await self.queue.enter("m", Principal(key_id=tenant, tenant=tenant), sequences)
        self.replica.outstanding += slots
        return slots

    def end(self, tenant: str, slots: int) -> None:
        self.replica.outstanding -= slots
        self.queue.done("m", tenant, slots)


async def test_a_request_larger_than_its_tenants_share_starts_while_another_tenant_is_active() -> None:
    """Eight slots, bob active (he asked a moment ago): eve's `n: 5` is over her share of four but she
    runs nothing; it starts at once rather than waiting for a share it can never fit in."""
    replicas = _replicas(8)
    queue = FairQueue(replicas, max_queued=8, timeout=1.0)
    running = Running(replicas, queue)
    running.end("bob", await running.start("bob"))
    assert await asyncio.wait_for(running.start("eve", 5), 0.5) == 5


async def test_the_request_next_in_turn_keeps_the_slots_it_waits_for() -> None:
    """Four slots, bob runs one. Eve's `n: 4` waits for all four; carol's single request, sent after it,
    does not take the three free slots meanwhile (eve would wait for ever behind such requests): eve
    starts when bob ends, carol when eve ends."""
    replicas = _replicas(4)
    queue = FairQueue(replicas, max_queued=8, timeout=5.0)
    queue.start()
    running = Running(replicas, queue)
    try:
        bob = await running.start("bob")
        eve = asyncio.create_task(running.start("eve", 4))
        await asyncio.sleep(0.05)
        carol = asyncio.create_task(running.start("carol"))
        await asyncio.sleep(0.3)  # (past a tick of the queue)
        assert not eve.done() and not carol.done()
        running.end("bob", bob)
        assert await asyncio.wait_for(eve, 1) == 4
        await asyncio.sleep(0.3)
        assert not carol.done()
        running.end("eve", 4)
        assert await asyncio.wait_for(carol, 1) == 1
    finally:
        await queue.stop()


async def test_a_request_never_takes_more_slots_than_its_largest_replica_holds() -> None:
    """Two replicas of four slots: an embeddings request of 100 inputs takes four (one replica runs it)
    and starts; on the replica it counts four, not 100."""
    replicas = _replicas(4, 4)
    queue = FairQueue(replicas, max_queued=8, timeout=1.0)
    _, slots = await queue.enter("m", Principal(key_id="k", tenant="acme"), 100)
    assert slots == 4
    router = Router(replicas, default_policy="round_robin")
    request = RouteRequest("m", tokens=100, sequences=100)
    replica = router.acquire(request)
    assert replica.outstanding == 4
    router.release(replica, request, True)
    assert replica.outstanding == 0


async def test_a_fanned_out_request_takes_slots_on_every_replica() -> None:
    """llama.cpp's `n: 8` goes out as eight single-choice requests over the replicas: two replicas of
    four slots, it takes all eight (not one replica's four)."""
    queue = FairQueue(_replicas(4, 4), max_queued=8, timeout=1.0)
    _, slots = await queue.enter("m", Principal(key_id="k", tenant="acme"), 8, spread=True)
    assert slots == 8


async def test_a_waiter_that_leaves_hands_its_kept_slots_on_at_once() -> None:
    """Eve's `n: 4` waits for the slot bob holds, keeping the three others from carol; eve leaves (her
    client went away): carol starts then, not at the next tick or bob's end."""
    replicas = _replicas(4)
    queue = FairQueue(replicas, max_queued=8, timeout=5.0)
    running = Running(replicas, queue)
    await running.start("bob")
    eve = asyncio.create_task(running.start("eve", 4))
    await asyncio.sleep(0.05)
    carol = asyncio.create_task(running.start("carol"))
    await asyncio.sleep(0.05)
    assert not carol.done()
    eve.cancel()
    with pytest.raises(asyncio.CancelledError):
        await eve
    assert await asyncio.wait_for(carol, 0.2) == 1  # (the queue's ticker is not running here)


async def test_a_queue_deadline_still_holds_for_a_heavy_request() -> None:
    """A request that needs every slot while another tenant's hold them leaves at the queue's deadline."""
    replicas = _replicas(2)
    queue = FairQueue(replicas, max_queued=8, timeout=0.2)
    running = Running(replicas, queue)
    await running.start("bob")
    with pytest.raises(NoCapacity):
        await running.start("eve", 2)


async def test_a_batch_lines_wait_is_no_interactive_wait_in_the_autoscalers_view() -> None:
    """The autoscaler adds a replica when a request waits `queue_wait_s`: a batch line waiting its turn
    (lowest class, on spare capacity only) is not such a request; an interactive one is."""
    from corral.store import BATCH_PRIORITY

    replicas = _replicas(1)
    queue = FairQueue(replicas, max_queued=8, timeout=5.0)
    queue.start()
    running = Running(replicas, queue)
    try:
        held = await running.start("bob")  # the one slot taken
        line = asyncio.create_task(
            queue.enter("m", Principal(key_id=None, tenant="acme", priority=BATCH_PRIORITY))
        )
        await asyncio.sleep(0.3)
        assert queue.pressure()["m"]["queued"] == 1 and queue.pressure()["m"]["oldest_wait_s"] == 0.0
        asked = asyncio.create_task(queue.enter("m", Principal(key_id="k", tenant="carol")))
        await asyncio.sleep(0.3)
        assert queue.pressure()["m"]["oldest_wait_s"] >= 0.25
        running.end("bob", held)
        for task, tenant in ((asked, "carol"), (line, "acme")):  # (carol's first: her class is above)
            _, slots = await asyncio.wait_for(task, 2)
            replicas.of("m")[0].outstanding += slots
            running.end(tenant, slots)
    finally:
        await queue.stop()


async def test_the_autoscaler_reads_queued_requests_as_the_slots_they_would_take() -> None:
    """Four slots, all running: an `n: 3` request and a single one wait. The queue's pressure says 4 slots
    queued (as the replicas and the batch runner count sequences), not 2 requests: a waiting batch line of
    n: 3 (counted 3 in `batch_in_flight`) took more than its share off the autoscaler's demand."""
    replicas = _replicas(4)
    queue = FairQueue(replicas, max_queued=8, timeout=5.0)
    running = Running(replicas, queue)
    held = await running.start("bob", 4)
    eve = asyncio.create_task(running.start("eve", 3))
    carol = asyncio.create_task(running.start("carol"))
    await asyncio.sleep(0.05)
    assert queue.pressure()["m"]["queued"] == 4
    running.end("bob", held)
    assert await asyncio.wait_for(eve, 1) == 3 and await asyncio.wait_for(carol, 1) == 1
    assert queue.pressure()["m"]["queued"] == 0


async def test_a_tenant_asking_now_and_then_keeps_no_more_slots_idle_than_it_ran() -> None:
    """Eight slots. Eve (a high key, weight 4 against bob's 2) ran one small request a moment ago, and no
    more: she is still active for 10 s, but keeps one slot for her next request, not her share of 5.3.
    Bob's eight long requests take the other seven at once (before: three, five slots idle for as long as
    eve asked one request every 9 s); eve's next request starts at once in the slot kept."""
    replicas = _replicas(8)
    queue = FairQueue(replicas, max_queued=16, timeout=5.0)
    queue.start()
    eve, bob = Principal(key_id="eve", tenant="eve", priority=0), Principal(key_id="bob", tenant="bob")
    replica = replicas.of("m")[0]

    async def run(principal: Principal, seconds: float) -> None:
        _, slots = await queue.enter("m", principal)
        replica.outstanding += slots
        try:
            await asyncio.sleep(seconds)
        finally:
            replica.outstanding -= slots
            queue.done("m", principal.tenant, slots)

    try:
        await run(eve, 0)
        bobs = [asyncio.create_task(run(bob, 5)) for _ in range(8)]
        await asyncio.sleep(0.3)  # (past a tick of the queue)
        assert replica.outstanding == 7 and queue.depth("m") == 1
        await asyncio.wait_for(run(eve, 0), 0.2)  # the slot kept for her
        for task in bobs:
            task.cancel()
        await asyncio.gather(*bobs, return_exceptions=True)
    finally:
        await queue.stop()


async def test_a_burst_long_past_leaves_a_trickling_tenant_only_what_it_runs_now() -> None:
    """Eight slots, tenants active for 1 s (here). Eve ran four at once, then trickles one small request
    every 0.4 s (active all the while): once her burst is more than 1 s old she keeps one slot free for her,
    not four (her most at once ever kept half the model idle while she trickled)."""
    replicas = _replicas(8)
    queue = FairQueue(replicas, max_queued=16, timeout=5.0, active_s=1.0)
    queue.start()
    eve, bob = Principal(key_id="eve", tenant="eve"), Principal(key_id="bob", tenant="bob")
    replica = replicas.of("m")[0]

    async def start(principal: Principal) -> int:
        _, slots = await queue.enter("m", principal)
        replica.outstanding += slots
        return slots

    def end(principal: Principal, slots: int) -> None:
        replica.outstanding -= slots
        queue.done("m", principal.tenant, slots)

    try:
        burst = [await start(eve) for _ in range(4)]
        for slots in burst:
            end(eve, slots)
        for _ in range(4):  # 1.6 s of trickle
            await asyncio.sleep(0.4)
            end(eve, await start(eve))
        bobs = [asyncio.create_task(start(bob)) for _ in range(8)]
        await asyncio.sleep(0.3)  # (past a tick of the queue)
        assert replica.outstanding == 7, replica.outstanding  # (her burst kept: 4)
        for task in bobs:
            task.cancel()
        await asyncio.gather(*bobs, return_exceptions=True)
    finally:
        await queue.stop()
