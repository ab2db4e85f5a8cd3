"""The scheduler model: budgets, prefix caching with LRU eviction, and preemption."""

from __future__ import annotations

from corral.perf import EngineSequence, Scheduler, SchedulerConfig, block_hashes


def seq(i: int, tokens: list[int], max_tokens: int = 4) -> EngineSequence:
    return EngineSequence(
        id=i, prompt_len=len(tokens), max_tokens=max_tokens, arrival=0.0, hashes=block_hashes(tokens, 16)
    )


def run_to_end(s: Scheduler, limit: int = 10_000) -> int:
    steps = 0
    while (batch := s.schedule()) is not None and steps < limit:
        s.complete(batch, float(steps))
        steps += 1
    return steps


def test_budget_and_sequence_limits_hold_every_step() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=100, num_blocks=1000))
    for i in range(10):
        s.add(seq(i, list(range(i * 1000, i * 1000 + 70))))
    while (batch := s.schedule()) is not None:
        assert sum(n for _, n in batch.work) <= 100
        assert len(s.running) <= 4
        s.complete(batch, 0.0)
    assert not s.waiting and not s.running


def test_shared_prefix_is_computed_once() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=100))
    prefix = list(range(64))
    s.add(seq(0, [*prefix, 1000, 1001]))
    run_to_end(s)
    s.add(seq(1, [*prefix, 2000, 2001]))
    batch = s.schedule()
    assert batch is not None and batch.work[0][1] == 2  # 64 tokens reused, 2 computed
    assert s.prefix_hits == 64


def test_cached_blocks_are_evicted_least_recently_used_first() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=8))
    a, b = list(range(0, 64)), list(range(100, 164))
    s.add(seq(0, a, max_tokens=1))
    run_to_end(s)
    s.add(seq(1, b, max_tokens=1))
    run_to_end(s)  # a's blocks were evicted to make room for b's
    s.add(seq(2, [*b, 7], max_tokens=1))
    run_to_end(s)
    assert s.prefix_hits == 64  # b's prefix still cached


def test_kv_oversubscription_preempts_and_still_finishes_everything() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=12, max_num_batched_tokens=512))
    for i in range(4):
        s.add(seq(i, list(range(i * 1000, i * 1000 + 40)), max_tokens=40))
    run_to_end(s)
    assert s.preemptions > 0
    assert not s.running and not s.waiting
