"""Routing policies, the prefix index, circuit breakers and the retry budget."""

from __future__ import annotations

import time

import pytest

from corral.config import RoutingPolicyName
from corral.engines import EngineLoad
from corral.protocol import NoCapacity
from corral.routing import (
    POLICIES,
    CircuitBreaker,
    CircuitState,
    PrefixAffinity,
    Replica,
    ReplicaSet,
    ReplicaState,
    RetryBudget,
    Router,
    RouteRequest,
    policy_named,
)


def fleet(n: int) -> list[Replica]:
    return [Replica(id=f"r{i}", model="m", engine="sim", state=ReplicaState.READY) for i in range(n)]


def test_spec_names_every_policy() -> None:
    assert set(RoutingPolicyName.__args__) == set(POLICIES)  # type: ignore[attr-defined]


def test_round_robin_cycles() -> None:
    replicas, policy = fleet(3), policy_named("round_robin")
    assert [policy.pick(replicas, RouteRequest("m")).replica.id for _ in range(6)] == ["r0", "r1", "r2"] * 2


def test_least_outstanding_tokens_prefers_the_lightest() -> None:
    replicas = fleet(3)
    replicas[0].outstanding_tokens, replicas[1].outstanding_tokens, replicas[2].outstanding_tokens = (
        900,
        10,
        500,
    )
    assert policy_named("least_outstanding_tokens").pick(replicas, RouteRequest("m")).replica.id == "r1"


def test_power_of_two_never_picks_the_busiest_of_two() -> None:
    replicas = fleet(2)
    replicas[0].outstanding = 10
    policy = policy_named("power_of_two")
    assert {policy.pick(replicas, RouteRequest("m")).replica.id for _ in range(20)} == {"r1"}


def test_session_affinity_is_sticky_and_moves_little_when_a_replica_goes() -> None:
    replicas, policy = fleet(4), policy_named("session_affinity")
    sessions = [f"user-{i}" for i in range(200)]
    before = {s: policy.pick(replicas, RouteRequest("m", session=s)).replica.id for s in sessions}
    assert before == {s: policy.pick(replicas, RouteRequest("m", session=s)).replica.id for s in sessions}
    after = {s: policy.pick(replicas[1:], RouteRequest("m", session=s)).replica.id for s in sessions}
    moved = [s for s in sessions if before[s] != after[s]]
    assert all(before[s] == "r0" for s in moved)  # only r0's sessions move


def test_prefix_affinity_follows_the_prefix_within_the_load_bound() -> None:
    replicas, policy = fleet(4), PrefixAffinity()
    document = "system: you are a contracts lawyer. " * 40
    first = policy.pick(replicas, RouteRequest("m", prompt=document + "question A")).replica
    first.outstanding += 1
    again = policy.pick(replicas, RouteRequest("m", prompt=document + "question B"))
    assert again.replica is first and again.reason.startswith("prefix match")
    first.outstanding = 40  # far past the bound (1.5 × mean + 16): the prefix is not worth the queue
    assert policy.pick(replicas, RouteRequest("m", prompt=document + "question C")).replica is not first


def test_prefix_affinity_avoids_a_replica_with_a_full_kv_cache() -> None:
    replicas, policy = fleet(2), PrefixAffinity()
    document = "shared context " * 100
    first = policy.pick(replicas, RouteRequest("m", prompt=document + "1")).replica
    first.load = EngineLoad(running=4, waiting=0, kv_usage=0.99)
    assert policy.pick(replicas, RouteRequest("m", prompt=document + "2")).replica is not first


def test_prefix_index_is_bounded_per_replica() -> None:
    policy = PrefixAffinity(max_blocks=50)
    replicas = fleet(2)
    for i in range(40):
        policy.pick(replicas, RouteRequest("m", prompt=f"{i:04d}" + "x" * 2000))
    assert len(policy.index) == 100  # 50 blocks on each replica


def test_the_prefix_index_evicts_a_chain_from_its_end_and_keeps_its_first_blocks() -> None:
    from corral.routing.prefix import PrefixIndex
    from corral.routing.request import prefix_hashes

    index, (r0, r1) = PrefixIndex(max_blocks=12), fleet(2)
    document = prefix_hashes("".join(f"{i:03d}" * 43 for i in range(10)))  # 10 blocks
    index.record(document, r0)
    index.record(prefix_hashes("another tenant's text " * 30), r1)  # r1's own room: r0 keeps all 10
    assert index.depths(document, [r0, r1]) == {"r0": 10, "r1": 0}
    index.record(prefix_hashes("another tenant's text " * 30), r0)  # 5 blocks: 3 of the document's go
    assert index.depths(document, [r0, r1]) == {"r0": 7, "r1": 0}  # its first 7 blocks still match
    index.record(document[:4], r1)
    assert index.depths(document, [r0, r1]) == {"r0": 7, "r1": 4}


def test_a_replica_whose_engine_reports_a_small_kv_cache_stops_counting_as_holding_what_it_evicted() -> None:
    """The index holds as much of a replica's prompts as its engine's KV cache does (vLLM's
    cache_config_info, in tokens, over the engine's tokens per 128-byte block, learnt from usage)."""
    small, large = fleet(2)
    small.load = EngineLoad(running=0, waiting=0, kv_capacity_tokens=3 * 1500)  # about 3 documents
    large.load = EngineLoad(running=0, waiting=0, kv_capacity_tokens=100 * 1500)
    documents = ["".join(f"tenant {t} line {i}. " for i in range(300))[:4000] for t in range(5)]
    policy = PrefixAffinity()
    for document in documents:  # each document once to each replica, then the answer's usage
        for replica in (small, large):
            request = RouteRequest("m", prompt=document, prompt_tokens=1500)
            assert policy.index.depths(request.hash_prompt(policy.hasher), [replica]) == {replica.id: 0}
            policy.index.record(request.hashes, replica, policy.cache_blocks(replica))
            policy.observe(request, 1500)
    assert policy.block_tokens == pytest.approx(1500 / (4000 / 128))  # 48 tokens per block
    first = RouteRequest("m", prompt=documents[0]).hashes
    last = RouteRequest("m", prompt=documents[-1]).hashes
    blocks = len(first)
    assert policy.index.depths(first, [small, large]) == {"r0": 0, "r1": blocks}  # evicted on the small one
    assert policy.index.depths(last, [small, large]) == {"r0": blocks, "r1": blocks}
    # so the first document's next request goes where it is still cached, though both are idle
    request = RouteRequest("m", prompt=documents[0] + "?", prompt_tokens=1500)
    assert policy.pick([small, large], request).replica is large


def test_the_index_forgets_what_the_engine_s_kv_events_say_it_evicted() -> None:
    """An engine's cache frees its least recently freed blocks first: when its events say it evicted a
    block it had cached at time T, every block whose last request ended before T is gone, while blocks of
    a request still running (also one sharing a prefix with a request that ended), and those freed after T,
    are not; a cleared cache leaves nothing."""
    (replica,) = fleet(1)
    replica.load = EngineLoad(running=0, waiting=0, kv_cached_tokens=0)
    policy = PrefixAffinity()
    old, running, recent = (RouteRequest("m", prompt=f"tenant {t}: " + "w " * 700) for t in "abc")
    again = RouteRequest("m", prompt=recent.prompt + " and a question of its own" * 8)  # a block more
    for use, request in enumerate((old, running, recent, again), start=1):
        request.hash_prompt(policy.hasher)
        policy.index.record(request.hashes, replica, use=-use)
    policy.index.ended(old.hashes, replica, 100.0, -1)
    policy.index.ended(again.hashes, replica, 120.0, -4)  # `recent`'s document, until 120
    policy.index.ended(recent.hashes, replica, 110.0, -3)  # its document was used since: still until 120
    policy.describe([replica])  # the events' state first seen: nothing to forget yet
    assert [policy.index.depths(r.hashes, [replica])["r0"] for r in (old, running, recent)] == [
        len(old.hashes)
    ] * 3

    replica.load = EngineLoad(running=0, waiting=0, kv_cached_tokens=4096, kv_evicted_through=115.0)
    policy.describe([replica])
    depths = [policy.index.depths(r.hashes, [replica])["r0"] for r in (old, running, recent, again)]
    assert depths == [0, len(running.hashes), len(recent.hashes), len(recent.hashes) + 1]

    replica.load = EngineLoad(running=0, waiting=0, kv_cached_tokens=4096, kv_evicted_through=130.0)
    policy.describe([replica])
    assert policy.index.held() == {"r0": len(running.hashes)}  # the one still running

    replica.load = EngineLoad(running=0, waiting=0, kv_cached_tokens=0, kv_cleared_total=1)
    policy.describe([replica])
    assert policy.index.held() == {}


def test_an_engine_whose_kv_events_are_not_followed_keeps_the_index_s_own_bound() -> None:
    (replica,) = fleet(1)
    replica.load = EngineLoad(running=0, waiting=0, kv_evicted_through=1e12)  # kv_cached_tokens None
    policy = PrefixAffinity()
    request = RouteRequest("m", prompt="w " * 700)
    policy.index.record(request.hash_prompt(policy.hasher), replica, use=-1)
    policy.index.ended(request.hashes, replica, 100.0, -1)
    policy.describe([replica])
    policy.describe([replica])
    assert policy.index.held() == {"r0": len(request.hashes)}


def test_gateway_workers_learn_each_other_s_placements_and_request_ends() -> None:
    import orjson

    routers = []
    for _ in range(2):
        replicas = ReplicaSet(["m"])
        for replica in fleet(3):  # each worker's own mirror of the same replicas, KV events followed
            replica.load = EngineLoad(running=0, waiting=0, kv_cached_tokens=0)
            replicas.add(replica)
        routers.append(Router(replicas))
    first, second = routers
    lines: list[bytes] = []
    first.share_placements(lines.append)
    document = RouteRequest("m", prompt="a tenant's handbook. " * 100, prompt_tokens=500, tokens=520)
    replica = first.acquire(document)
    assert len(lines) == 1  # (no event loop here: sent at once)
    second.learn_placements(orjson.loads(lines[0]))
    index = second.policy_for("m").index  # type: ignore[attr-defined]
    others = [r for r in second.replicas.of("m") if r.id != replica.id]
    assert index.depths(document.hashes, second.replicas.of("m")) == {
        replica.id: len(document.hashes),
        **{r.id: 0 for r in others},
    }
    first.release(replica, document, ok=True)  # its end, at the policy's clock
    second.learn_placements(orjson.loads(lines[1]))
    ended = orjson.loads(lines[1])["placements"]["m"][0][2]
    mirror = next(r for r in second.replicas.of("m") if r.id == replica.id)
    index.evict_through(mirror.id, ended)  # an engine that evicted blocks cached when it ended: kept
    assert index.depths(document.hashes, [mirror]) == {mirror.id: len(document.hashes)}
    index.evict_through(mirror.id, ended + 0.001)  # cached after it ended: its blocks are gone
    assert index.depths(document.hashes, [mirror]) == {mirror.id: 0}


def test_the_router_hands_the_engines_usage_to_the_prefix_policy() -> None:
    replicas = ReplicaSet(["m"])
    replicas.add(fleet(1)[0])
    router = Router(replicas)
    policy = router.policy_for("m")
    assert isinstance(policy, PrefixAffinity)
    request = RouteRequest("m", prompt="w " * 1280, prompt_tokens=640)
    replica = router.acquire(request)
    router.release(replica, request, ok=True, usage={"prompt_tokens": 100, "completion_tokens": 3})
    assert policy.block_tokens == pytest.approx(5)  # 100 tokens over 20 blocks
    request = RouteRequest("m", prompt="w " * 1280, prompt_tokens=640)
    replica = router.acquire(request)
    router.release(replica, request, ok=False)  # a failure carries no usage: nothing learnt
    assert policy.block_tokens == pytest.approx(5)


def test_tokens_per_block_are_learnt_from_long_prompts_only() -> None:
    policy = PrefixAffinity()
    before = policy.block_tokens
    policy.observe(RouteRequest("m", prompt="short question"), 40)  # the chat template's tokens dominate
    assert policy.block_tokens == before
    policy.observe(RouteRequest("m", prompt="w " * 1280), 800)  # 20 blocks, 800 tokens
    assert policy.block_tokens == pytest.approx(40)
    policy.observe(RouteRequest("m", prompt="w " * 1280), 320)  # the plain mean of the first answers
    assert policy.block_tokens == pytest.approx(28)
    policy.observe(RouteRequest("m", prompt="é" * 1280), 640)  # 2,560 bytes: 20 blocks, 32 a block
    assert policy.block_tokens == pytest.approx(29.33, abs=0.01)
    policy.observe(RouteRequest("m", prompt="data:image/png;base64," + "A" * 40_000), 300)  # out of range
    assert policy.block_tokens == pytest.approx(29.33, abs=0.01)  # not text as a tokenizer reads it: unlearnt


def test_replicas_that_leave_leave_the_prefix_index() -> None:
    replicas = ReplicaSet(["m"])
    first, second = fleet(2)
    replicas.add(first)
    replicas.add(second)
    router = Router(replicas)
    policy = router.policy_for("m")
    assert isinstance(policy, PrefixAffinity)
    for replica in (first, second):
        policy.index.record(RouteRequest("m", prompt="x" * 1280).hashes, replica)
    replicas.remove(first)
    router.release(router.acquire(RouteRequest("m", prompt="y" * 1280)), RouteRequest("m"), ok=True)
    assert set(policy.index.held()) == {"r1"}


def test_breaker_opens_after_consecutive_failures_and_half_opens_after_cooldown() -> None:
    breaker = CircuitBreaker(failures=3, cooldown=0.05)
    for _ in range(2):
        breaker.on_failure()
    assert breaker.state is CircuitState.CLOSED
    breaker.on_failure()
    assert breaker.state is CircuitState.OPEN and not breaker.allows()
    time.sleep(0.06)
    assert breaker.state is CircuitState.HALF_OPEN and breaker.allows()
    breaker.on_dispatch()
    assert not breaker.allows()  # one trial at a time
    breaker.on_failure()
    assert breaker.state is CircuitState.OPEN  # reopened, longer cool-down
    time.sleep(0.11)
    breaker.on_dispatch()
    breaker.on_success()
    assert breaker.state is CircuitState.CLOSED and breaker.consecutive_failures == 0


def test_a_trial_that_says_nothing_of_the_replica_lets_the_next_one_try() -> None:
    """A half-open replica's trial request that ends with no outcome (its engine full: a 429; an adapter
    it refused; the client gone) once left the trial out for good: the replica never routed again."""
    replicas = ReplicaSet(["m"])
    (replica,) = fleet(1)
    replicas.add(replica)
    replica.breaker = CircuitBreaker(failures=1, cooldown=0.01)
    router = Router(replicas)
    older, first = RouteRequest("m"), RouteRequest("m")
    router.acquire(older)  # in flight before the breaker opened
    router.release(router.acquire(first), first, False)  # opens it
    time.sleep(0.02)
    trial = RouteRequest("m")
    router.acquire(trial)  # half-open: the one trial
    with pytest.raises(NoCapacity):
        router.acquire(RouteRequest("m"))
    router.release(replica, older, None)  # an older request's end says nothing of the trial
    with pytest.raises(NoCapacity):
        router.acquire(RouteRequest("m"))
    router.release(replica, trial, None)  # the trial's engine was full (429): no word on the replica
    assert router.acquire(RouteRequest("m")) is replica  # the next request is the trial


def test_router_skips_open_breakers_and_logs_decisions() -> None:
    replicas = ReplicaSet(["m"])
    members = fleet(2)
    for r in members:
        replicas.add(r)
    router = Router(replicas, default_policy="round_robin")
    request = RouteRequest("m", tokens=100)
    for _ in range(3):
        members[0].breaker.on_failure()
    picked = [router.acquire(request) for _ in range(3)]
    assert {r.id for r in picked} == {"r1"}
    assert members[1].outstanding == 3 and members[1].outstanding_tokens == 300
    assert [d["replica"] for d in router.decisions] == ["r1"] * 3
    for r in picked:
        router.release(r, request, ok=True)
    assert members[1].outstanding == 0 and members[1].outstanding_tokens == 0
    members[1].breaker._opened_at = time.monotonic()  # both open now
    with pytest.raises(NoCapacity):
        router.acquire(request)


def test_retry_budget_caps_retries_to_a_share_of_requests() -> None:
    budget = RetryBudget(ratio=0.1, floor_per_s=0.0, cap=2)
    assert budget.try_spend() and budget.try_spend() and not budget.try_spend()
    for _ in range(11):  # 11 requests earn 1.1 retries
        budget.on_request()
    assert budget.try_spend() and not budget.try_spend()


def test_a_models_features_are_what_all_its_replicas_have() -> None:
    from corral.engines import EngineFeatures

    llama = EngineFeatures(multiple_choices=False, echo=False, prefill_echo=True, token_prompts=True)
    replicas = ReplicaSet(["m"])
    for i in range(2):
        replicas.add(Replica(id=f"m-{i}", model="m", engine="x", features=llama))
    assert replicas.features("m") == llama  # not weakened by a default on the way
    replicas.add(Replica(id="m-2", model="m", engine="y", features=EngineFeatures()))
    mixed = replicas.features("m")
    assert not mixed.multiple_choices and not mixed.token_prompts and mixed.prefill_echo


def test_prefix_affinity_weighs_a_cache_hit_against_the_prefill_queued_behind_it() -> None:
    replicas, policy = fleet(2), PrefixAffinity()
    document = "a long shared tenant document. " * 100  # about 3,000 characters, 24 blocks
    first = policy.pick(replicas, RouteRequest("m", prompt=document + "q1", prompt_tokens=800)).replica
    first.outstanding = 1
    first.pending_prefill = 300  # a short queue: the hit still wins
    hit = policy.pick(replicas, RouteRequest("m", prompt=document + "q2", prompt_tokens=800))
    assert hit.replica is first and hit.cached_blocks == 24
    first.pending_prefill = 5000  # a long one: computing the prompt cold elsewhere is sooner
    assert (
        policy.pick(replicas, RouteRequest("m", prompt=document + "q3", prompt_tokens=800)).replica
        is not first
    )


def test_a_shared_prefix_spreads_once_the_hit_replicas_decode_load_outweighs_computing_it_elsewhere() -> None:
    document = "one system prompt that every request starts with. " * 60  # 24 blocks

    def second_pick(in_flight: int, output: int) -> bool:
        """Whether a request goes where the prefix is, with `in_flight` like it there, the other idle."""
        replicas, policy = fleet(2), PrefixAffinity()

        def ask() -> Replica:
            request = RouteRequest("m", prompt=document + "q", prompt_tokens=3000, tokens=3000 + output)
            return policy.pick(replicas, request).replica

        first = ask()
        first.outstanding, first.outstanding_tokens = in_flight, in_flight * (3000 + output)
        return ask() is first

    assert second_pick(1, 256)  # one request in flight: the cached prefix is worth more
    # four long generations: the decode this request would share with them (and slow) is worth more than
    # computing the 3,000-token prefix once on the idle replica
    assert not second_pick(4, 256)
    assert second_pick(4, 16)  # short answers: the batch costs little, the hit still wins
    # a max_tokens of 4096 bounds the answer, it does not forecast it: priced as a typical answer at most
    assert second_pick(1, 4096)


def test_a_prefill_avoids_the_replica_whose_running_requests_it_would_stall() -> None:
    from corral.routing.request import prefix_hashes

    shared, own = "the first half, cached on the busy replica. " * 30, "this request's own second half. " * 40

    def goes_to_the_half_hit(running: int) -> bool:
        replicas, policy = fleet(2), PrefixAffinity()
        busy = replicas[0]
        policy.index.record(prefix_hashes(shared), busy)
        busy.outstanding, busy.outstanding_tokens = running, running * 100
        request = RouteRequest("m", prompt=shared + own, prompt_tokens=800, tokens=816)
        return policy.pick(replicas, request).replica is busy

    assert goes_to_the_half_hit(0)  # nothing to stall there: the half hit wins
    # computing the uncached half there stalls three requests: the whole prompt on the idle one costs less
    assert not goes_to_the_half_hit(3)


async def test_the_router_holds_a_request_whose_prefix_another_is_prefilling_on_its_replica() -> None:
    replicas = ReplicaSet(["m"])
    for replica in fleet(2):
        replicas.add(replica)
    router = Router(replicas, coalesce_prefills=True)  # the default policy: prefix_affinity
    document = "the same long system prompt, word for word. " * 60
    first = RouteRequest("m", prompt=document + "first question", prompt_tokens=700)
    replica = router.acquire(first)
    assert replica.pending_prefill == 700 and router.shared_prefill(replica, first) is None  # not its own
    second = RouteRequest("m", prompt=document + "second question", prompt_tokens=700)
    assert router.acquire(second) is replica  # the prefix is (about to be) cached there
    assert second.prefill < 100  # only its question is new to that replica
    done = router.shared_prefill(replica, second)
    assert done is not None and not done.is_set()
    router.prefilled(replica, first)  # the first token of the first request: its prefix is now cached
    assert done.is_set() and await router.hold(done) < 0.1
    assert router.shared_prefill(replica, second) is None
    router.release(replica, first, ok=True)
    router.release(replica, second, ok=True)
    assert replica.pending_prefill == 0 and replica.outstanding == 0


async def test_a_held_request_waits_no_longer_than_its_prefill_takes_or_ends() -> None:
    replicas = ReplicaSet(["m"])
    for replica in fleet(1):
        replicas.add(replica)
    router = Router(replicas, coalesce_prefills=True)
    document = "x" * 2000
    first = RouteRequest("m", prompt=document + "a", prompt_tokens=500)
    replica = router.acquire(first)
    second = RouteRequest("m", prompt=document + "b", prompt_tokens=500)
    router.acquire(second)
    done = router.shared_prefill(replica, second)
    assert done is not None
    router.release(replica, first, ok=False)  # the first failed before its first token: nothing to wait for
    assert done.is_set()


def test_the_prefix_index_forgets_the_replica_recorded_least_recently_beyond_max_replicas() -> None:
    from corral.routing.prefix import PrefixIndex
    from corral.routing.request import prefix_hashes

    index, (r0, r1, r2) = PrefixIndex(max_replicas=2), fleet(3)
    first, second = prefix_hashes("a" * 1000), prefix_hashes("b" * 1000)
    index.record(first, r0)
    index.record(second, r1)
    index.record(second, r0)  # r0 recorded last: r1 is the least recent
    index.record(first, r2)  # a third replica: r1's blocks are forgotten
    assert index.depths(first, [r0, r1, r2]) == {"r0": 7, "r1": 0, "r2": 7}
    assert index.depths(second, [r0, r1, r2]) == {"r0": 7, "r1": 0, "r2": 0}
    index.record(first, r1)  # r1 comes back: r0 is now the least recent, and is forgotten
    assert index.depths(first, [r0, r1, r2]) == {"r0": 0, "r1": 7, "r2": 7}
    assert index.depths(second, [r0, r1, r2]) == {"r0": 0, "r1": 0, "r2": 0}
    assert len(index) == 14  # the second prompt's blocks, held by no one now, are gone


def test_the_prefix_index_adds_no_objects_for_the_garbage_collector_to_walk() -> None:
    import gc

    from corral.routing.prefix import PrefixIndex

    index, replicas = PrefixIndex(), fleet(8)
    gc.collect()
    before = len(gc.get_objects())
    for i in range(500):
        index.record(tuple(range(i * 200, i * 200 + 200)), replicas[i % 8])
    assert len(index) == 100_000
    assert len(gc.get_objects()) - before < 100  # not one per block (a set per block made 100,000)


def test_prefix_hashes_are_equal_exactly_as_far_as_the_prompts_are() -> None:
    from corral.routing.request import PREFIX_BLOCK_CHARS, prefix_hashes

    document = "".join(f"word{i} " for i in range(3000))  # about 200 blocks: hashed by numpy
    for shared in (0, 3, 40, 150):  # whole blocks the two prompts share
        cut = shared * PREFIX_BLOCK_CHARS + 50  # they part in the middle of the next block
        first, second = prefix_hashes(document), prefix_hashes(document[:cut] + "X" + document[cut + 1 :])
        assert len(first) == len(second) > 150
        assert [a == b for a, b in zip(first, second, strict=True)] == [i < shared for i in range(len(first))]
    short = "a" * (3 * PREFIX_BLOCK_CHARS + 5)  # three blocks: hashed in Python
    assert prefix_hashes(short) == prefix_hashes(short + "b")[:3] and len(prefix_hashes(short)) == 3
    assert prefix_hashes(short)[2] != prefix_hashes("a" * 300 + "c" * 200)[2]
    assert prefix_hashes("x" * (PREFIX_BLOCK_CHARS - 1)) == ()


def test_the_hasher_reuses_recent_prompts_and_hashes_as_from_scratch() -> None:
    import random

    from corral.routing.request import PrefixHasher, prefix_hashes

    rng = random.Random(5)
    hasher = PrefixHasher(remember=4)  # fewer than the documents: entries are also evicted
    documents = ["".join(rng.choice("abc ") for _ in range(rng.randrange(100, 50_000))) for _ in range(6)]
    for _ in range(600):  # a document's start, cut anywhere, then a question of its own (or none)
        document = rng.choice(documents)
        prompt = document[: rng.randrange(len(document) + 1)] + "q" * rng.choice((0, 30, 300, 3000))
        assert hasher.hashes(prompt) == prefix_hashes(prompt)


async def test_a_prompt_routed_right_after_another_finds_its_prefix_recorded() -> None:
    replicas = ReplicaSet(["m"])
    for replica in fleet(4):
        replicas.add(replica)
    router = Router(replicas)  # the default policy, prefix_affinity; its index records on the loop's turn
    document = "a tenant's long document, the same in every request. " * 60
    asked = RouteRequest("m", prompt=document + "one", prompt_tokens=800, tokens=816)
    first = router.acquire(asked)
    router.prefilled(first, asked)  # its first token came: nothing waits there
    second = router.acquire(RouteRequest("m", prompt=document + "two", prompt_tokens=800, tokens=816))
    assert second is first  # (no await between the two: the first's record was applied by the look-up)
    index = router.policy_for("m").index  # type: ignore[attr-defined]
    assert len(index) == len(RouteRequest("m", prompt=document + "two").hashes)


def test_a_rolled_back_revision_serves_only_while_no_old_replica_can() -> None:
    """A rollback keeps the new revision's replicas out of routing (share 0) while an old one is ready; in
    the minutes the old replicas take to start again (no spare GPUs: they waited for the new ones' GPUs),
    the new ones that are ready serve rather than leave the model with none."""
    from corral.routing import TrafficSplit

    replicas = ReplicaSet(["m"])
    ready = ReplicaState.READY
    new = [Replica(id=f"m-{i}", model="m", engine="sim", state=ready, revision=1) for i in (1, 2)]
    for replica in new:
        replicas.add(replica)
    replicas.splits["m"] = TrafficSplit(1, 0.0)
    router = Router(replicas)
    assert router.acquire(RouteRequest("m")) in new
    old = Replica(id="m-0", model="m", engine="sim", state=ReplicaState.STARTING, revision=0)
    replicas.add(old)
    assert router.acquire(RouteRequest("m")) in new  # (still starting)
    old.state = ReplicaState.READY
    assert {router.acquire(RouteRequest("m")).id for _ in range(8)} == {"m-0"}
    with pytest.raises(NoCapacity):  # a retry past the old replica (or its breaker open): not to the new
        router.acquire(RouteRequest("m"), exclude=[old])
