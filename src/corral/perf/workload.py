"""Latency and throughput of one replica under load, in virtual time: the scheduler model stepped with
the step-time model. The planner's predictions come from here; the simulator runs the same in real time.
"""

from __future__ import annotations

import functools
import math
import random
import statistics
from dataclasses import dataclass, replace

import numpy as np

from corral.perf.scheduler import EngineSequence, Scheduler, SchedulerConfig
from corral.perf.steps import StepPipeline
from corral.perf.timing import Efficiency, PerfModel

__all__ = ["KEEPS_UP", "LoadResult", "closed_loop", "open_loop", "saturated_rate"]

# The share of its saturated rate a replica is taken to keep up with: nearer the ceiling, a queue that a
# run of a few hundred requests does not show grows over a longer one (8B on an H100 at 1,024/256 tokens:
# at 0.99 of it, p95 time to first token 0.97 s over 400 requests, 3.9 s over 12,000; at 0.9, within 1.5x)
KEEPS_UP = 0.9


@dataclass(frozen=True)
class LoadResult:
    """Steady-state figures of one replica at a fixed concurrency (times in seconds)."""

    concurrency: int
    ttft_p50: float
    ttft_p95: float
    ttft_mean: float
    ttft_p90: float
    ttft_p99: float
    itl_mean: float  # mean time per output token after the first (TPOT; one token per step)
    e2e_p50: float
    e2e_mean: float
    output_tokens_per_s: float
    requests_per_s: float
    preemptions: int
    overloaded: bool = False  # open loop: requests arrive faster than the replica finishes them
    ttfts: tuple[float, ...] = ()  # every measured request's, sorted
    streams_s: float = 0.0  # of the mean TTFT: the API server's work for the others (stream_overhead_s)


def closed_loop(
    perf: PerfModel,
    config: SchedulerConfig,
    concurrency: int,
    input_len: int,
    output_len: int,
    measured_requests: int | None = None,
    drift: bool = True,
    stretches: bool = True,
) -> LoadResult:
    """`concurrency` clients each sending the next request as soon as the last one ends. Throughput and
    time per token come from the loop; its times to first token from `seen_by_arrivals` (`drift=False`:
    the loop's own, its clients in lockstep). `stretches=False`: every step scheduled one by one, the
    reference the stretches taken at once are tested against."""
    scheduler = Scheduler(config)
    measured = measured_requests or max(2 * concurrency, 32)
    warmup = concurrency
    next_id = 0
    now = 0.0

    def submit(at: float) -> None:
        nonlocal next_id
        scheduler.add(
            EngineSequence(
                id=next_id, prompt_len=input_len, max_tokens=output_len, arrival=at, others=concurrency - 1
            )
        )
        next_id += 1

    for _ in range(concurrency):
        submit(0.0)
    done: list[EngineSequence] = []
    window_start: float | None = None
    tokens_in_window = 0
    pipeline = StepPipeline(perf)
    while len(done) < warmup + measured:
        if stretches and perf.pp == 1 and not pipeline.busy:
            if (run := scheduler.decode_run(output_len)) is not None:
                scheduler.advance(run)  # decode-only steps until the next finish: taken at once
                now += float(perf.decode_seconds(run.sequences, run.context, run.steps).sum())
                if window_start is not None:
                    tokens_in_window += run.steps * run.sequences
                continue
        elif stretches and (rounds := pipeline.decode_rounds(scheduler, now)) is not None:
            now, made = rounds  # pipelined decode batches until the next finish: then stepped on
            if window_start is not None:
                tokens_in_window += sum(len(group) * count for group, count in made)
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
    window = now - window_start
    result = _summarise(
        concurrency,
        sample,
        tokens_in_window / window,
        len(sample) / window,
        scheduler.preemptions,
        perf.efficiency,
    )
    return seen_by_arrivals(perf, config, result, input_len, output_len, stretches) if drift else result


def seen_by_arrivals(
    perf: PerfModel,
    config: SchedulerConfig,
    loop: LoadResult,
    input_len: int,
    output_len: int,
    stretches: bool = True,
) -> LoadResult:
    """A closed loop's times to first token as its requests meet them. Identical requests of clients
    started together stay in lockstep in a model; real clients drift apart (network, tokenization,
    client work), so a request arrives at a random moment of the others' cycles. By the arrival theorem
    of closed queueing networks, an arriving request sees the replica as the other N − 1 clients keep it:
    a Poisson stream at (N − 1) / cycle, the cycle being a request's latency. So the queue before the first
    chunk, prefills that meet in one step and the decodes a prefill shares its steps with come from an
    open loop at that rate (taken once more with the cycle it gives); one client waits for nobody."""
    if loop.concurrency <= 1:
        return loop
    seen = arrivals_view(
        perf, config, loop.concurrency, loop.e2e_mean, loop.ttft_mean, input_len, output_len, stretches
    )
    return replace(
        loop,
        ttft_p50=seen.ttft_p50,
        ttft_p95=seen.ttft_p95,
        ttft_mean=seen.ttft_mean,
        ttft_p90=seen.ttft_p90,
        ttft_p99=seen.ttft_p99,
        e2e_mean=loop.e2e_mean - loop.ttft_mean + seen.ttft_mean,
        e2e_p50=loop.e2e_p50 - loop.ttft_mean + seen.ttft_mean,
        ttfts=seen.ttfts,
        streams_s=seen.streams_s,
    )


def arrivals_view(
    perf: PerfModel,
    config: SchedulerConfig,
    concurrency: int,
    latency: float,
    ttft: float,
    input_len: int,
    output_len: int,
    stretches: bool = True,
) -> LoadResult:
    """The open loop an arrival of a closed loop of `concurrency` clients meets (see `seen_by_arrivals`):
    at (N − 1) / cycle, the cycle first the loop's own `latency`, then that latency with the open loop's
    mean TTFT in place of the loop's `ttft`, where the two differ by 5% of it or more. Each arrival pays
    the API server's work for N − 1 other streams, as the closed loop's own requests do (the other clients'
    requests are all in flight, in the engine or in the server)."""
    cycle = latency
    for _ in range(2):
        seen = open_loop(
            perf,
            config,
            (concurrency - 1) / cycle,
            input_len,
            output_len,
            requests=_SEEN_REQUESTS,
            stretches=stretches,
            others=concurrency - 1,
            ceiling=math.inf,  # (only its times to first token are wanted)
        )
        if abs(seen.ttft_mean - ttft) < 0.05 * latency:
            break
        cycle = latency - ttft + seen.ttft_mean
    return seen


_SEEN_REQUESTS = 300


def open_loop(
    perf: PerfModel,
    config: SchedulerConfig,
    rate: float,
    input_len: int,
    output_len: int,
    requests: int = 400,
    seed: int = 0,
    stretches: bool = True,
    others: int | None = None,
    ceiling: float | None = None,
) -> LoadResult:
    """Requests arriving as a Poisson process at `rate` per second; the first tenth is warm-up.
    `stretches`: as in `closed_loop`. Each request pays the API server's work (`stream_overhead_s`) for
    the requests in flight at its arrival, or for `others` where given.

    Overloaded: the rate is above `KEEPS_UP` of `ceiling`, the requests/s the replica finishes saturated
    (`saturated_rate`, worked out where not given; `math.inf` skips the check), or the run's later
    requests waited far longer for their first token than its earlier ones. A replica that keeps up serves
    what arrives, so its throughput is the rate; one that does not, its ceiling. (Measured in a run of a
    few hundred requests, throughput is not that: before the batch fills and after the last arrival the
    replica serves less than it could, and with outputs of thousands of tokens those stretches are a
    large part of the run.)"""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in range(requests):
        t += rng.expovariate(rate)
        arrivals.append(t)
    scheduler = Scheduler(config)
    pipeline = StepPipeline(perf)
    warmup = requests // 10
    done: list[EngineSequence] = []
    now, next_arrival = 0.0, 0
    while len(done) < requests:
        while next_arrival < requests and arrivals[next_arrival] <= now:
            scheduler.add(
                EngineSequence(
                    id=next_arrival,
                    prompt_len=input_len,
                    max_tokens=output_len,
                    arrival=arrivals[next_arrival],
                    others=len(scheduler.running) + len(scheduler.waiting) if others is None else others,
                )
            )
            next_arrival += 1
        if stretches and perf.pp > 1:
            until = arrivals[next_arrival] if next_arrival < requests else math.inf
            if (rounds := pipeline.decode_rounds(scheduler, now, until)) is not None:
                now = rounds[0]  # pipelined decode batches up to the next arrival: then stepped on
        elif stretches and not pipeline.busy and (run := scheduler.decode_run(output_len)) is not None:
            ends = now + np.cumsum(perf.decode_seconds(run.sequences, run.context, run.steps))
            # Decode-only steps until the next finish, taken at once. While nothing waits, a step may
            # start only before the next arrival (which joins the step it precedes); behind a blocked
            # queue a newcomer is blocked too.
            steps = run.steps
            if next_arrival < requests and not scheduler.waiting:
                steps = 1 + int(np.searchsorted(ends[:-1], arrivals[next_arrival], side="left"))
            scheduler.advance(run, steps)
            now = float(ends[steps - 1])
            continue
        while pipeline.has_room and (batch := scheduler.schedule()) is not None:
            pipeline.launch(batch, now)
        if pipeline.busy and (next_arrival >= requests or pipeline.next_finish <= arrivals[next_arrival]):
            now, batch = pipeline.pop()
            produced = scheduler.complete(batch, now)
            done.extend(seq for seq in produced if seq.finished)
        elif next_arrival < requests:
            now = arrivals[next_arrival]
        else:
            raise RuntimeError("a request cannot fit in the KV cache at all")
    sample = [seq for seq in done if seq.id >= warmup]
    if ceiling is None:
        ceiling = saturated_rate(perf, config, input_len, output_len, stretches)
    served = min(rate, ceiling)
    result = _summarise(0, sample, served * output_len, served, scheduler.preemptions, perf.efficiency)
    # The backlog grew within the run: later requests waited far longer than earlier ones.
    ttfts = [s.first_token_at - s.arrival for s in sorted(sample, key=lambda s: s.id)]  # type: ignore[operator]
    half = len(ttfts) // 2
    growing = statistics.fmean(ttfts[half:]) > 2 * statistics.fmean(ttfts[:half]) + 1.0
    return replace(result, overloaded=growing or rate > KEEPS_UP * ceiling)


@functools.lru_cache(maxsize=128)
def saturated_rate(
    perf: PerfModel, config: SchedulerConfig, input_len: int, output_len: int, stretches: bool = True
) -> float:
    """Requests/s a replica finishes with as many requests as it admits (`max_num_seqs` clients, each
    sending its next request as its last ends): the most it serves. Requests arriving faster than this
    build a queue that grows without bound (identical requests: the batch is as full as it gets)."""
    loop = closed_loop(
        perf, config, config.max_num_seqs, input_len, output_len, drift=False, stretches=stretches
    )
    return loop.requests_per_s


def _summarise(
    concurrency: int,
    sample: list[EngineSequence],
    output_tokens_per_s: float,
    requests_per_s: float,
    preemptions: int,
    efficiency: Efficiency,
) -> LoadResult:
    """The sample's figures; a request's fixed cost outside the engine (`request_overhead_s`, and
    `stream_overhead_s` for each other request in flight when it arrived) is paid before its first token."""
    extra, each = efficiency.request_overhead_s, efficiency.stream_overhead_s
    began = [s.arrival - extra - each * s.others for s in sample]  # (its fixed cost counted before it)
    ttfts = sorted(s.first_token_at - w for s, w in zip(sample, began, strict=True))  # type: ignore[operator]
    tpots = [
        (s.finished_at - s.first_token_at) / (s.generated - 1)  # type: ignore[operator]
        for s in sample
        if s.generated > 1
    ]
    e2e = sorted(s.finished_at - w for s, w in zip(sample, began, strict=True))  # type: ignore[operator]
    streams = each * statistics.fmean(s.others for s in sample)
    return LoadResult(
        concurrency=concurrency,
        ttft_p50=_quantile(ttfts, 0.5),
        ttft_p95=_quantile(ttfts, 0.95),
        ttft_mean=statistics.fmean(ttfts),
        ttft_p90=_quantile(ttfts, 0.9),
        ttft_p99=_quantile(ttfts, 0.99),
        itl_mean=statistics.fmean(tpots) if tpots else 0.0,
        e2e_p50=_quantile(e2e, 0.5),
        e2e_mean=statistics.fmean(e2e),
        output_tokens_per_s=output_tokens_per_s,
        requests_per_s=requests_per_s,
        preemptions=preemptions,
        ttfts=tuple(ttfts),
        streams_s=streams,
    )


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]
