"""Latency and throughput of one replica under load, in virtual time: the scheduler model stepped with
the step-time model. The planner's predictions come from here; the simulator runs the same in real time.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from corral.perf.scheduler import EngineSequence, Scheduler, SchedulerConfig
from corral.perf.steps import StepPipeline
from corral.perf.timing import PerfModel

__all__ = ["LoadResult", "closed_loop"]


@dataclass(frozen=True)
class LoadResult:
    """Steady-state figures of one replica at a fixed concurrency (times in seconds)."""

    concurrency: int
    ttft_p50: float
    ttft_p95: float
    itl_mean: float
    tpot_mean: float
    e2e_p50: float
    output_tokens_per_s: float
    requests_per_s: float
    preemptions: int


def closed_loop(
    perf: PerfModel,
    config: SchedulerConfig,
    concurrency: int,
    input_len: int,
    output_len: int,
    measured_requests: int | None = None,
) -> LoadResult:
    """`concurrency` clients each sending the next request as soon as the last one ends."""
    scheduler = Scheduler(config)
    measured = measured_requests or max(2 * concurrency, 32)
    warmup = concurrency
    next_id = 0
    now = 0.0

    def submit(at: float) -> None:
        nonlocal next_id
        scheduler.add(EngineSequence(id=next_id, prompt_len=input_len, max_tokens=output_len, arrival=at))
        next_id += 1

    for _ in range(concurrency):
        submit(0.0)
    done: list[EngineSequence] = []
    window_start: float | None = None
    tokens_in_window = 0
    pipeline = StepPipeline(perf)
    while len(done) < warmup + measured:
        while pipeline.has_room and (batch := scheduler.schedule()) is not None:
            pipeline.launch(batch, now)
        if not pipeline.busy:
            raise RuntimeError("a request cannot fit in the KV cache at all")
        now, batch = pipeline.pop()
        produced = scheduler.complete(batch, now)
        if window_start is not None:
            tokens_in_window += len(produced)
        for seq in produced:
            if seq.finished:
                done.append(seq)
                if len(done) == warmup:
                    window_start = now
                submit(now)
    assert window_start is not None
    sample = done[warmup:]
    ttfts = sorted(s.first_token_at - s.arrival for s in sample)  # type: ignore[operator]
    tpots = [
        (s.finished_at - s.first_token_at) / (s.generated - 1)  # type: ignore[operator]
        for s in sample
        if s.generated > 1
    ]
    e2e = sorted(s.finished_at - s.arrival for s in sample)  # type: ignore[operator]
    window = now - window_start
    return LoadResult(
        concurrency=concurrency,
        ttft_p50=_quantile(ttfts, 0.5),
        ttft_p95=_quantile(ttfts, 0.95),
        itl_mean=statistics.fmean(tpots) if tpots else 0.0,
        tpot_mean=statistics.fmean(tpots) if tpots else 0.0,
        e2e_p50=_quantile(e2e, 0.5),
        output_tokens_per_s=tokens_in_window / window,
        requests_per_s=(len(done) - warmup) / window,
        preemptions=scheduler.preemptions,
    )


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]
