"""The virtual clocks (`open_loop`, `closed_loop`): stretches taken at once give what stepping gives."""

from __future__ import annotations

import pytest

from corral.perf import EngineSequence, PerfModel, Scheduler, SchedulerConfig, StepPipeline, load_catalog
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
            open_loop(perf, config, 4.0, 300, 120, requests=120, stretches=stretches),
            open_loop(perf, config, 40.0, 700, 60, requests=120, seed=3, stretches=stretches),
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
