"""The scheduler model: budgets, prefix caching with LRU eviction, and preemption."""

from __future__ import annotations

import random

import pytest

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


def test_reserving_whole_lives_admits_only_what_fits_and_preempts_nobody() -> None:
    """TensorRT-LLM's GUARANTEED_NO_EVICT: the same oversubscribed load as above runs two sequences at a
    time (five blocks each for 40 + 40 tokens, in twelve), the others waiting for a finish, none preempted."""
    s = Scheduler(SchedulerConfig(num_blocks=12, max_num_batched_tokens=512, reserve_whole=True))
    seqs = [seq(i, list(range(i * 1000, i * 1000 + 40)), max_tokens=40) for i in range(4)]
    for q in seqs:
        s.add(q)
    most = steps = 0
    while (batch := s.schedule()) is not None:
        most = max(most, len(s.running))
        s.complete(batch, float(steps))
        steps += 1
    assert most == 2 and s.preemptions == 0
    assert all(q.finished for q in seqs) and not s.running and not s.waiting
    first, later = seqs[0].first_token_at, seqs[2].first_token_at
    assert first is not None and later is not None and seqs[0].finished_at is not None
    assert later > seqs[0].finished_at  # the third waited for the first two to end


def _snapshot(s: Scheduler, seqs: list[EngineSequence]) -> tuple[object, ...]:
    return (
        [(q.computed, q.generated, q.blocks, q.active, q.preemptions) for q in seqs],
        [q.id for q in s.running],
        [q.id for q in s.waiting],
        s.pool.available,
        s.preemptions,
    )


@pytest.mark.parametrize(("caching", "reserve_whole"), [(True, False), (False, False), (False, True)])
def test_a_decode_run_taken_at_once_leaves_the_scheduler_as_stepping_through_it(
    caching: bool, reserve_whole: bool
) -> None:
    """The virtual clocks take decode-only stretches in one go (`decode_run`, `advance`): the same
    batches, block by block the same KV, and the stretch stops before a finish, a preemption or an
    admission (a queue may wait through it where no slot, budget or KV lets its head in)."""
    rng = random.Random(7)
    docs = [[rng.randrange(50) for _ in range(rng.choice([40, 200]))] for _ in range(4)]
    runs = stopped_by_blocks = behind_a_blocked_queue = 0
    for trial in range(30):
        config = SchedulerConfig(
            max_num_seqs=rng.choice([4, 16]),
            max_num_batched_tokens=256,
            num_blocks=rng.choice([40, 120, 600]),
            enable_prefix_caching=caching,
            reserve_whole=reserve_whole,
        )
        taken, stepped = Scheduler(config), Scheduler(config)
        both: tuple[list[EngineSequence], list[EngineSequence]] = ([], [])
        for step in range(400):
            if rng.random() < 0.05:
                tokens = [*rng.choice(docs), *range(trial * 10_000 + step, trial * 10_000 + step + 9)]
                max_tokens = rng.choice([3, 60, 200])
                for s, seqs in zip((taken, stepped), both, strict=True):
                    seqs.append(seq(step, tokens, max_tokens))
                    s.add(seqs[-1])
            run = taken.decode_run(rng.choice([2, 50, 1000]))
            if run is None:
                for s in (taken, stepped):
                    if (batch := s.schedule()) is not None:
                        s.complete(batch, float(step))
            else:
                runs += 1
                behind_a_blocked_queue += bool(taken.waiting)
                steps = rng.choice([run.steps, rng.randrange(1, run.steps + 1)])  # all of it, or its start
                taken.advance(run, steps)
                for j in range(steps):
                    batch = stepped.schedule()
                    assert batch is not None and batch.prefill_tokens == 0
                    assert (batch.decode_tokens, batch.decode_context) == (
                        run.sequences,
                        run.context + j * run.sequences,
                    )
                    produced = stepped.complete(batch, float(step))
                    assert not any(q.finished for q in produced)
                if steps == run.steps and (batch := stepped.schedule()) is not None:
                    # what ended the stretch: a finish, a preemption (blocks ran out), or the limit
                    stopped_by_blocks += stepped.preemptions > taken.preemptions
                    stepped.complete(batch, float(step))
                    taken.complete(taken.schedule(), float(step))  # type: ignore[arg-type]
            assert _snapshot(taken, both[0]) == _snapshot(stepped, both[1])
    assert runs > 100 and behind_a_blocked_queue > 0
    assert stopped_by_blocks > 0 if not reserve_whole else taken.preemptions == stepped.preemptions == 0
