"""A closed loop's steps recorded once, timed again for any efficiency factors.

With one batch in flight (no pipeline parallelism) and clients that send their next request when the last
one ends, which sequences each step holds does not depend on how long the steps take: only the order of
events matters. So a closed loop is run once at step granularity, each step's work is kept (its parts at
datasheet rates: weight and KV reads, GEMM and attention FLOPs, communication), and its figures for any
factors are a vectorised sum: `Trace.timed(efficiency)` equals `closed_loop` with a `PerfModel`
of that efficiency (tests/perf/test_validation.py checks it). Fitting factors to many published points and
leaving each source out in turn (`validation.py`) costs milliseconds per try instead of a simulation.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import numpy.typing as npt

from corral.perf.scheduler import DecodeRun, EngineSequence, Scheduler, SchedulerConfig
from corral.perf.timing import Efficiency, PerfModel, StepParts

__all__ = ["TIMED_FIGURES", "Timed", "Trace", "trace_closed_loop"]

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Timed:
    """A trace's figures at one set of factors (seconds; means over the measured requests)."""

    output_tokens_per_s: float
    ttft_mean: float
    ttft_p50: float
    ttft_p90: float
    ttft_p95: float
    ttft_p99: float
    tpot_mean: float
    e2e_mean: float


TIMED_FIGURES = tuple(f.name for f in fields(Timed))


@dataclass(frozen=True)
class Trace:
    parts: StepParts[Floats]  # per step, at datasheet rates
    arrival: Ints  # per measured request: the step after which it arrived (-1: at the start)
    first: Ints  # the step that produced its first token
    finish: Ints  # the step that produced its last
    generated: Ints
    window: tuple[int, int]  # measured from the end of this step to the end of that one
    window_tokens: int
    others: int = 0  # the other requests in flight when one arrives (N − 1 clients: a request's overhead)
    _powers: dict[float, tuple[Floats, ...]] = field(default_factory=dict, compare=False, repr=False)
    _timed: dict[Efficiency, Timed] = field(default_factory=dict, compare=False, repr=False)

    def timed(self, efficiency: Efficiency) -> Timed:
        """The figures at `efficiency`, kept: a validation's fits leave each source out in turn, and the
        folds of an engine family try the same grid of factors on the same traces."""
        timed = self._timed.get(efficiency)
        if timed is None:
            timed = self._timed[efficiency] = self._time(efficiency)
        return timed

    def _time(self, efficiency: Efficiency) -> Timed:
        steps = self.step_seconds(efficiency)
        ends = np.concatenate(([0.0], np.cumsum(steps)))  # ends[k + 1]: when step k finished
        arrived, first, finish = ends[self.arrival + 1], ends[self.first + 1], ends[self.finish + 1]
        extra = self.overhead(efficiency)  # paid once, before the first token
        ttft = np.sort(first - arrived) + extra
        many = self.generated > 1
        tpot = (finish[many] - first[many]) / (self.generated[many] - 1)
        start, end = self.window

        def quantile(q: float) -> float:
            return float(ttft[min(len(ttft) - 1, int(q * len(ttft)))])

        return Timed(
            output_tokens_per_s=self.window_tokens / (ends[end + 1] - ends[start + 1]),
            ttft_mean=float(ttft.mean()),
            ttft_p50=quantile(0.5),
            ttft_p90=quantile(0.9),
            ttft_p95=quantile(0.95),
            ttft_p99=quantile(0.99),
            tpot_mean=float(tpot.mean()) if tpot.size else 0.0,
            e2e_mean=float((finish - arrived).mean()) + extra,
        )

    def first_wave(self, efficiency: Efficiency) -> Floats:
        """The times to first token of the requests there at the start (a run whose clients start at
        once: its first wave), the request's fixed cost included."""
        ends = np.concatenate(([0.0], np.cumsum(self.step_seconds(efficiency))))
        at_start = self.arrival < 0
        ttft: Floats = ends[self.first[at_start] + 1] - ends[0] + self.overhead(efficiency)
        return ttft

    def overhead(self, efficiency: Efficiency) -> float:
        """A request's fixed cost outside the engine, its clients' other requests in flight."""
        return efficiency.request_overhead_s + efficiency.stream_overhead_s * self.others

    def step_seconds(self, efficiency: Efficiency) -> Floats:
        """`efficiency.step_seconds(self.parts)`, with the parts' p-th powers kept per overlap p: a fit
        tries hundreds of factors at a handful of overlaps, and the powers are most of the cost."""
        p, parts = efficiency.overlap, self.parts
        powers = self._powers.get(p)
        if powers is None:
            kinds = (parts.weights, parts.gemm, parts.kv, parts.attention)
            powers = self._powers[p] = tuple(x**p for x in kinds)
        weights, gemm, kv, attention = powers
        memory, compute = efficiency.bandwidth**-p, efficiency.compute**-p
        cache = (efficiency.bandwidth * efficiency.kv_reads) ** -p
        seconds: Floats = (
            (weights * memory + gemm * compute) ** (1 / p)
            + (kv * cache + attention * compute) ** (1 / p)
            + parts.communication
            + efficiency.step_overhead_s
        )
        return seconds


def trace_closed_loop(
    perf: PerfModel,
    config: SchedulerConfig,
    concurrency: int,
    input_len: int,
    output_len: int,
    measured_requests: int | None = None,
    stagger: bool = False,
    warmup: int | None = None,
) -> Trace:
    """`closed_loop`'s run (same warm-up and measured requests), recorded step by step. With `stagger`
    the clients start one after another, spread over one request's decode, as clients of a real
    benchmark drift apart (identical requests started together would otherwise stay in lockstep, every
    prefill landing in the same step). `warmup`: requests finished before the measurement starts (the
    concurrency unless told; 0: measured from the start, every client starting at once, as a short
    benchmark run is)."""
    if perf.pp != 1:
        raise ValueError("a trace holds one batch at a time: pipeline parallelism overlaps steps")
    scheduler = Scheduler(config)
    measured = measured_requests or max(2 * concurrency, 32)
    warmup = concurrency if warmup is None else warmup
    next_id = 0

    def submit(step: int) -> None:
        nonlocal next_id
        scheduler.add(EngineSequence(id=next_id, prompt_len=input_len, max_tokens=output_len, arrival=step))
        next_id += 1

    starts = [i * output_len // concurrency if stagger else 0 for i in range(concurrency)]
    steps: list[tuple[int, int, int, float]] = []  # one step's work at a time, until a decode run
    work: list[Floats] = []
    done: list[EngineSequence] = []
    window_start: int | None = None if warmup else -1
    tokens, step = 0, 0
    while len(done) < warmup + measured:
        while starts and starts[0] <= step:
            starts.pop(0)
            submit(step - 1)
        run = scheduler.decode_run(starts[0] - step if starts else output_len)
        if run is not None:  # the same decode batch many steps in a row: taken at once
            scheduler.advance(run)
            work += [np.array(steps, dtype=np.float64).reshape(-1, 4), _decode_steps(run)]
            steps.clear()
            if window_start is not None:
                tokens += run.steps * run.sequences
            step += run.steps
            continue
        batch = scheduler.schedule()
        if batch is None:
            raise RuntimeError("a request cannot fit in the KV cache at all")
        steps.append((batch.decode_tokens, batch.decode_context, batch.prefill_tokens, batch.prefill_pairs))
        produced = scheduler.complete(batch, float(step))
        if window_start is not None:
            tokens += len(produced)
        for seq in produced:
            if seq.finished:
                done.append(seq)
                if len(done) == warmup:
                    window_start = step
                if warmup or next_id < measured:  # a finite run sends its requests and no more
                    submit(step)
        step += 1
    assert window_start is not None
    sample = done[warmup : warmup + measured]
    return Trace(
        parts=perf.parts(*np.concatenate([*work, np.array(steps, dtype=np.float64).reshape(-1, 4)]).T),
        arrival=np.array([int(s.arrival) for s in sample]),
        first=np.array([int(s.first_token_at or 0) for s in sample]),
        finish=np.array([int(s.finished_at or 0) for s in sample]),
        generated=np.array([s.generated for s in sample]),
        window=(window_start, step - 1),
        window_tokens=tokens,
        others=concurrency - 1,
    )


def _decode_steps(run: DecodeRun) -> Floats:
    """A decode run's steps as rows of (decode tokens, decode context, prefill tokens, prefill pairs)."""
    rows = np.zeros((run.steps, 4))
    rows[:, 0] = run.sequences
    rows[:, 1] = run.context + run.sequences * np.arange(run.steps)
    return rows
