"""The virtual clocks (`open_loop`, `closed_loop`): stretches taken at once give what stepping gives, and
an open loop's verdict on whether a replica keeps up."""

from __future__ import annotations

import math

import pytest

from corral.perf import (
    BLOCK_SIZE,
    EngineSequence,
    PerfModel,
    Scheduler,
    SchedulerConfig,
    StepPipeline,
    load_catalog,
    memory_plan,
    saturated_rate,
)
from corral.perf.calibration import calibrated_efficiency
from corral.perf.workload import closed_loop, open_loop

CATALOG = load_catalog()


def _perf(pp: int) -> PerfModel:
    return PerfModel(
        CATALOG.models.get("llama-3.1-8b"),
        CATALOG.gpus.get("l40s"),
        CATALOG.quantizations.get("bf16"),
        tp=1,
        pp=pp,
        efficiency=calibrated_efficiency(),
    )


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize(
    "config",
    [
        SchedulerConfig(max_num_seqs=64, num_blocks=4096, enable_prefix_caching=False),
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, num_blocks=90),  # preempts
        SchedulerConfig(max_num_seqs=64, num_blocks=150, reserve_whole=True),  # a queue behind KV
    ],
    ids=["roomy", "preempting", "reserving"],
)
def test_pipelined_decode_rounds_taken_at_once_give_the_stepped_figures(
    pp: int, config: SchedulerConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under pipeline parallelism the decode batches relaunched round after round are taken without
    scheduling each (`StepPipeline.decode_rounds`): every figure is the same float as stepping gives,
    in open and closed loops, with arrivals, finishes, preemptions and a queue waiting for KV."""
    schedules = 0
    stepping = Scheduler.schedule

    def counted(self: Scheduler) -> object:
        nonlocal schedules
        schedules += 1
        return stepping(self)

    monkeypatch.setattr(Scheduler, "schedule", counted)
    perf = _perf(pp)
    calls = {}
    for stretches in (True, False):
        schedules = 0
        results = (
            open_loop(perf, config, 4.0, 300, 120, requests=120, stretches=stretches, ceiling=math.inf),
            open_loop(
                perf, config, 40.0, 700, 60, requests=120, seed=3, stretches=stretches, ceiling=math.inf
            ),
            closed_loop(perf, config, 12, 500, 90, stretches=stretches),
        )
        calls[stretches] = (results, schedules)
    (taken, fewer), (stepped, every) = calls[True], calls[False]
    assert taken == stepped
    # rounds were taken at once (most of them where KV is roomy and nobody queues)
    assert fewer < (every / 2 if config.num_blocks == 4096 else every)
    if config.num_blocks == 90:
        assert stepped[1].preemptions > 0


def test_a_free_batch_larger_than_the_token_budget_is_left_to_the_scheduler() -> None:
    """Five sequences decoding under a budget of two tokens a step at pp = 2: batches of two, one left
    over, and after each batch comes out three sequences are free, more than one step takes; the rounds
    are then not taken at once (`schedule` splits them), and every sequence finishes when stepping says."""

    def run(stretches: bool) -> tuple[list[tuple[float | None, int, list[int]]], int]:
        scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2, num_blocks=64))
        pipeline = StepPipeline(_perf(2))
        seqs = [
            EngineSequence(id=i, prompt_len=16, max_tokens=20 + i, arrival=0.0, computed=16, generated=1)
            for i in range(5)
        ]
        for seq in seqs:
            seq.active, seq.blocks = True, [scheduler.pool.allocate() for _ in range(2)]
            scheduler.running.append(seq)
        now, refused = 0.0, 0
        while scheduler.running or pipeline.busy:
            if stretches:
                rounds = pipeline.decode_rounds(scheduler, now)
                refused += rounds is None and sum(not s.in_flight for s in scheduler.running) > 2
                now = rounds[0] if rounds is not None else now
            while pipeline.has_room and (batch := scheduler.schedule()) is not None:
                pipeline.launch(batch, now)
            now, batch = pipeline.pop()
            scheduler.complete(batch, now)
        return [(s.finished_at, s.generated, s.blocks) for s in seqs], refused

    (taken, refused), (stepped, _) = run(True), run(False)
    assert taken == stepped and refused > 10


def _h100_8b() -> tuple[PerfModel, SchedulerConfig]:
    """Llama 3.1 8B in bf16 on one H100 with vLLM's default limits (`corral plan`'s replica)."""
    model, gpu, quant = (
        CATALOG.models.get("llama-3.1-8b"),
        CATALOG.gpus.get("h100-sxm"),
        CATALOG.quantizations.get("bf16"),
    )
    perf = PerfModel(model, gpu, quant, efficiency=calibrated_efficiency())
    blocks = memory_plan(model, gpu, quant).kv_tokens // BLOCK_SIZE
    return perf, SchedulerConfig(num_blocks=blocks, enable_prefix_caching=False)


def test_a_replica_keeping_up_with_long_outputs_serves_the_rate_offered() -> None:
    """2 requests/s of 2048 output tokens on one H100: about 66 in flight, under three quarters of what it
    finishes saturated (2.7/s), the first token as quick at the end of the run as at its start. Throughput
    was once measured up to the last request's finish, the drain after the last arrival included: 1.71
    requests/s, and the replica called overloaded (`corral plan` then asked for two GPUs)."""
    perf, config = _h100_8b()
    result = open_loop(perf, config, 2.0, 1024, 2048)
    assert not result.overloaded
    assert result.requests_per_s == pytest.approx(2.0, rel=0.03)
    assert result.output_tokens_per_s == pytest.approx(2.0 * 2048, rel=0.03)


def test_a_rate_above_the_saturated_throughput_is_overloaded_though_a_short_run_looks_steady() -> None:
    """10% above what the replica finishes saturated, a run of 400 requests ends before its queue shows
    (its p95 TTFT as at 10% below); a run ten times as long shows it growing (the reference), so the
    verdict comes from the saturated rate, and the throughput is that rate."""
    perf, config = _h100_8b()
    ceiling = saturated_rate(perf, config, 1024, 256)

    def p95(rate: float, requests: int) -> float:
        return open_loop(perf, config, rate, 1024, 256, requests=requests, ceiling=math.inf).ttft_p95

    below, above = 0.9 * ceiling, 1.1 * ceiling
    assert p95(above, 3000) > 4 * p95(above, 400) and p95(below, 3000) < 1.5 * p95(below, 400)
    over, under = open_loop(perf, config, above, 1024, 256), open_loop(perf, config, below, 1024, 256)
    assert over.overloaded and over.requests_per_s == pytest.approx(ceiling)
    assert not under.overloaded and under.requests_per_s == pytest.approx(below)
    # nearer the ceiling than KEEPS_UP, a longer run's queue grows: taken as not keeping up (a short run of
    # it looked steady, and the autoscaler's and the planner's replicas were filled to 0.999 of the ceiling)
    assert p95(0.99 * ceiling, 3000) > 1.5 * p95(0.99 * ceiling, 400)
    assert open_loop(perf, config, 0.95 * ceiling, 1024, 256).overloaded
