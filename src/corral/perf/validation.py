"""The planner's error on published measurements, honestly measured: leave one source out.

`data/published.yaml` holds measurements copied from public pages (each with its URL, table, date and
workload as published). Every point the planner can state (one replica, fixed input and output lengths,
a closed loop of N clients or an offline run) is predicted with the planner's own model: the scheduler
model stepped with the step-time roofline (`trace.py` records the steps once; the efficiency factors only
rescale them). The factors (bandwidth and compute efficiency, per-step overhead, the overlap p of a
kernel's reads and compute, and a request's fixed cost outside the engine: its own, and its share of the
API server's work for each other request in flight) are fitted per engine family (TensorRT-LLM and NIM;
vLLM; the CPU engines) by least squares on log errors: first the step's factors on output tokens/s, TPOT
and latency; then all six with TTFT too (weight `_TTFT_WEIGHT`, Huber past `_TTFT_HUBER`), each TTFT
predicted as the run made it:

- one client: its prefill chunks and the fixed cost;
- N clients in a closed loop: an arrival sees the other N − 1 clients' load (the arrival theorem; see
  `workload.seen_by_arrivals`), the queue before its first chunk and the decodes it shares steps with
  included, and the API server's work for those N − 1 streams (`stream_overhead_s` each);
- a run of a stated number of requests (`num_prompts`: benchmark_serving, `corral bench`): its first wave
  of clients starting at once, queueing behind each other's prefills, and the steady state for the rest.

Leave-one-source-out: for each source, the factors are fitted on the other sources of its engine family
and the source's points predicted with them; the error a user should expect on a configuration nobody
measured is that one, not the in-sample fit's. The CPU engines have one source each (measured here by
benchmarks/cpu_calibration.py, `data/measured_cpu.yaml`): their points are predicted leaving one workload out.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Any

import numpy as np
import numpy.typing as npt
import yaml

from corral.perf.catalog import Catalog
from corral.perf.memory import BLOCK_SIZE, memory_plan
from corral.perf.scheduler import SchedulerConfig
from corral.perf.timing import Efficiency, PerfModel
from corral.perf.trace import TIMED_FIGURES, Trace, trace_closed_loop
from corral.perf.workload import arrivals_view

__all__ = ["METRICS", "Case", "Prediction", "PublishedPoint", "Validation", "load_published", "validate"]

# published metric → (kind it is reported under, the predicted figure, the unit it was published in)
METRICS = {
    "output_tokens_per_s": ("output tokens/s", "output_tokens_per_s", 1.0),
    "tpot_ms_mean": ("TPOT", "tpot_mean", 1e-3),
    "tpot_ms_p50": ("TPOT", "tpot_mean", 1e-3),  # identical requests: every request's TPOT about the mean
    "itl_ms_mean": ("TPOT", "tpot_mean", 1e-3),
    "ttft_ms_mean": ("TTFT", "ttft_mean", 1e-3),
    "ttft_ms_p50": ("TTFT", "ttft_p50", 1e-3),
    "ttft_ms_p90": ("TTFT p90–p99", "ttft_p90", 1e-3),
    "ttft_ms_p95": ("TTFT p90–p99", "ttft_p95", 1e-3),
    "ttft_ms_p99": ("TTFT p90–p99", "ttft_p99", 1e-3),
    "e2e_ms_mean": ("E2E latency", "e2e_mean", 1e-3),
}
_TTFT = ("TTFT", "TTFT p90–p99")
_TTFT_FIGURES = ("ttft_mean", "ttft_p50", "ttft_p90", "ttft_p95", "ttft_p99")
_TTFT_WEIGHT = 1.0  # a TTFT's squared log error against one of throughput, TPOT or latency
_FEW_WAVES = 4  # a run of at most this many requests per client: too short for clients to drift apart
_TTFT_HUBER = 0.3  # TTFT log errors past this (35%) count linearly: queues the model lacks stay outliers


@dataclass(frozen=True)
class _Engine:
    """An engine family's batch limits, memory share and KV-cache precision in the published runs' usual
    configuration: TensorRT-LLM's FP8 checkpoints (NVIDIA's, NIM's) quantize the KV cache to FP8 too
    (`kv_cache_quant_algo: FP8`); vLLM keeps it in the model's dtype unless told otherwise.

    TensorRT-LLM's default capacity scheduler (`GUARANTEED_NO_EVICT`) admits a request only with KV reserved
    for its whole length (`reserve_whole`). (Its KV share, `kv_cache_free_gpu_mem_fraction`, is of the memory
    left free once the engine is loaded; modelled so, with its default 0.9, the published GPU points' output
    tokens/s came out 13.3% off instead of 12.0%, so the planner keeps 0.95 of the whole GPU.)"""

    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    fp8_kv: bool = False
    reserve_whole: bool = False


_ENGINES = {
    "tensorrt-llm": _Engine(2048, 8192, 0.95, fp8_kv=True, reserve_whole=True),
    "vllm": _Engine(256, 2048, 0.9),
    "sglang": _Engine(1024, 8192, 0.88),
    # as benchmarks/cpu_calibration.py runs them: 16 slots; llama.cpp's logical batch (--batch-size), the
    # max_num_batched_tokens corral passes vLLM CPU
    "llamacpp": _Engine(16, 2048, 0.9),
    "vllm-cpu": _Engine(16, 2048, 0.9),
}
_BOUNDS = {
    "bandwidth": (0.2, 0.95),
    "compute": (0.1, 0.95),
    "step_overhead_s": (0.0, 0.03),
    "request_overhead_s": (0.0, 1.0),
    "stream_overhead_s": (0.0, 0.05),
    "kv_reads": (1.0, 1.0),
}
_CPU_BOUNDS = {"compute": (0.1, 4.0), "kv_reads": (0.005, 1.0)}


@dataclass(frozen=True)
class PublishedPoint:
    index: int
    source: str
    url: str
    engine: str  # family: tensorrt-llm (NIM included), vllm, sglang
    model: str
    gpu: str
    quant: str
    tp: int
    input_len: int | None
    output_len: int | None
    concurrency: int | None  # None: an offline run (every request queued at once)
    metrics: dict[str, float]
    num_prompts: int | None  # requests the run sent and measured, its clients starting at once
    unused: str | None  # why the planner cannot state this point's configuration

    @property
    def on_cpu(self) -> bool:
        return self.engine == "llamacpp" or self.engine.endswith("-cpu")

    @property
    def label(self) -> str:
        load = f"c={self.concurrency}" if self.concurrency else "offline"
        return (
            f"{self.model} {self.quant} on {self.tp}x{self.gpu}, {self.input_len}/{self.output_len}, {load}"
        )


def _family(engine: str, gpu: str) -> str:
    lowered = engine.lower()
    if "tensorrt" in lowered or "nim" in lowered:
        return "tensorrt-llm"
    if "llama.cpp" in lowered:
        return "llamacpp"
    family = "sglang" if "sglang" in lowered else "vllm"
    return f"{family}-cpu" if gpu.startswith("cpu") else family


CORPUS = ("published.yaml", "measured_cpu.yaml")  # copied from public pages; measured here


def load_published() -> list[PublishedPoint]:
    raws = []
    for name in CORPUS:
        text = (resources.files("corral.perf") / "data" / name).read_text()
        raws += yaml.safe_load(text)["points"]
    points = []
    for index, raw in enumerate(raws):
        catalog = raw.get("catalog") or {}
        points.append(
            PublishedPoint(
                index=index,
                source=raw["source_id"],
                url=raw["url"] or raw.get("command", ""),
                engine=_family(raw["engine"], catalog.get("gpu", "")),
                model=catalog.get("model", ""),
                gpu=catalog.get("gpu", ""),
                quant=catalog.get("quant", "bf16"),
                tp=raw.get("tp") or raw.get("gpus") or 1,  # null: one replica across `gpus`
                input_len=raw.get("input_len"),
                output_len=raw.get("output_len"),
                concurrency=raw.get("concurrency"),
                metrics=_metrics(raw),
                num_prompts=raw.get("num_prompts"),
                unused=raw.get("unused"),
            )
        )
    return points


def _metrics(raw: dict[str, Any]) -> dict[str, float]:
    """The point's metrics the planner predicts; per-GPU throughput made the replica's."""
    metrics = {k: float(v) for k, v in raw["metrics"].items() if k in METRICS}
    if raw.get("per_gpu") and "output_tokens_per_s" in metrics:
        metrics["output_tokens_per_s"] *= raw.get("tp") or raw.get("gpus") or 1
    return metrics


@dataclass
class Case:
    """A usable point in the planner's model: its closed loop recorded once (`trace`), the replica and
    scheduler that ran it (for the open loop its arrivals see), and `queue`: what waiting behind other
    clients adds to its times to first token at the factors last fitted (see `seen_by_arrivals`).

    A run of a stated number of requests (`num_prompts`: vLLM's benchmark_serving, `corral bench`) starts
    its clients at once and measures every request. A run of a few waves (at most `_FEW_WAVES` requests
    per client) is recorded whole, its clients in lockstep (`whole`): identical requests finish together
    and start again together. A longer one is its first wave (`start`, recorded from the start), queueing
    behind each other's prefills, and for the other requests the steady state, clients drifted apart
    (`steady`: the open loop's TTFTs less the trace's mean, at the factors last fitted)."""

    point: PublishedPoint
    trace: Trace
    perf: PerfModel
    config: SchedulerConfig
    start: Trace | None = None
    whole: bool = False  # a run of a few waves, recorded from its start to its end
    queue: dict[str, float] = field(default_factory=dict)
    steady: Floats = field(default_factory=lambda: np.zeros(0))

    def figures(self, efficiency: Efficiency) -> dict[str, float]:
        """The predicted figures with the queue as last computed (cheap: what a fit evaluates)."""
        timed = self.trace.timed(efficiency)
        figures = {name: getattr(timed, name) + self.queue.get(name, 0.0) for name in TIMED_FIGURES}
        if self.start is not None and self.steady.size:
            figures.update(self._whole_run(efficiency, timed.ttft_mean))
        return figures

    def _whole_run(self, efficiency: Efficiency, mean: float) -> dict[str, float]:
        """TTFT figures over every request of the run: the first wave's and the steady state's."""
        assert self.start is not None and self.point.num_prompts is not None
        first = self.start.first_wave(efficiency)
        later = max(0, self.point.num_prompts - len(first))
        values = np.concatenate((first, mean + self.steady))
        weights = np.concatenate((np.ones(len(first)), np.full(self.steady.size, later / self.steady.size)))
        order = np.argsort(values)
        values, cumulative = values[order], np.cumsum(weights[order])
        total = cumulative[-1]

        def quantile(q: float) -> float:
            return float(values[min(len(values) - 1, int(np.searchsorted(cumulative, q * total, "right")))])

        mixed = {f"ttft_p{round(q * 100)}": quantile(q) for q in (0.5, 0.9, 0.95, 0.99)}
        return {"ttft_mean": float(values @ weights[order] / total), **mixed}

    def predict(self, efficiency: Efficiency) -> dict[str, float]:
        """The predicted figures, the queue computed afresh at `efficiency`."""
        self.refresh(efficiency)
        return self.figures(efficiency)

    def refresh(self, efficiency: Efficiency) -> None:
        """Compute what waiting behind the other clients adds to each TTFT figure (and the latency)."""
        self.queue, self.steady = {}, np.zeros(0)
        point = self.point
        if not point.concurrency or point.concurrency <= 1 or self.whole:
            return  # one client waits for nobody; a run recorded whole holds its queue
        if not any(METRICS[name][0] in _TTFT for name in point.metrics):
            return
        assert point.input_len is not None and point.output_len is not None
        timed = self.trace.timed(efficiency)
        perf = replace(self.perf, efficiency=efficiency)
        seen = arrivals_view(
            perf,
            self.config,
            point.concurrency,
            timed.e2e_mean,
            timed.ttft_mean,
            point.input_len,
            point.output_len,
        )
        self.queue = {name: getattr(seen, name) - getattr(timed, name) for name in _TTFT_FIGURES}
        self.queue["e2e_mean"] = seen.ttft_mean - timed.ttft_mean  # the latency waits as its first token does
        self.steady = np.array(seen.ttfts) - timed.ttft_mean


Floats = npt.NDArray[np.float64]


def trace_point(point: PublishedPoint, catalog: Catalog) -> Case | None:
    """The point's run in the planner's model, recorded once (at the engine family's limits; with
    gpu_memory_utilization raised to 0.95 where the model only fits so, as the planner's fit search
    does). None where the planner says the configuration does not fit."""
    assert point.input_len is not None and point.output_len is not None
    limits = _ENGINES[point.engine]
    model, gpu = catalog.models.get(point.model), catalog.gpus.get(point.gpu)
    quant = catalog.quantizations.get(point.quant)
    kv_bytes = 1.0 if limits.fp8_kv and quant.compute == "fp8" else 2.0
    perf = PerfModel(model, gpu, quant, tp=point.tp, kv_dtype_bytes=kv_bytes)
    for utilization in sorted({limits.gpu_memory_utilization, 0.95}):
        memory = memory_plan(
            model,
            gpu,
            quant,
            tp=point.tp,
            gpu_memory_utilization=utilization,
            kv_dtype_bytes=kv_bytes,
            max_num_batched_tokens=limits.max_num_batched_tokens,
        )
        fits = memory.kv_tokens // (point.input_len + point.output_len)
        if fits < 1:
            continue
        clients = point.concurrency or min(limits.max_num_seqs, fits)  # offline: as many as fit
        config = SchedulerConfig(
            max_num_seqs=max(limits.max_num_seqs, clients),
            max_num_batched_tokens=limits.max_num_batched_tokens,
            num_blocks=memory.kv_tokens // BLOCK_SIZE,
            enable_prefix_caching=False,
            reserve_whole=limits.reserve_whole,
        )
        start = None
        if point.num_prompts and point.concurrency and point.concurrency > 1:
            first = min(point.concurrency, point.num_prompts)
            if point.num_prompts <= _FEW_WAVES * point.concurrency:  # recorded whole, in lockstep
                trace = trace_closed_loop(
                    perf, config, first, point.input_len, point.output_len,
                    measured_requests=point.num_prompts, warmup=0,
                )  # fmt: skip
                return Case(point, trace, perf, config, whole=True)
            start = trace_closed_loop(  # its first wave
                perf, config, first, point.input_len, point.output_len, measured_requests=first, warmup=0
            )
        # Identical requests: two rounds of every client's request measure the steady state (the
        # planner's default of at least 32 would make a batch-1 run 32 requests long).
        trace = trace_closed_loop(
            perf,
            config,
            clients,
            point.input_len,
            point.output_len,
            measured_requests=max(2 * clients, 4),
            stagger=point.concurrency is not None,
        )
        return Case(point, trace, perf, config, start)
    return None


def _errors(point: PublishedPoint, figures: dict[str, float]) -> dict[str, float]:
    """Relative error of each published metric (predicted / measured − 1)."""
    return {
        name: figures[figure] / (value * scale) - 1
        for name, value in point.metrics.items()
        for _, figure, scale in [METRICS[name]]
    }


_OVERLAPS = (1.0, 1.5, 2.0, 3.0, 4.0, 8.0, 32.0)  # p-norm exponents tried: a sum (none) to about a max


def fit(cases: list[Case]) -> Efficiency:
    """Factors minimising the squared log error over the metrics of `cases`, each source weighing the same
    whatever its number of points (the question is how a new source fares). Two rounds: first the step's
    factors on throughput, TPOT and latency alone (a coarse grid over (bandwidth, compute, overhead) at
    each overlap exponent, then a pattern search from the two best overlaps' best cells); then, with the
    queue each TTFT point's arrivals meet computed at those factors, a pattern search from them over all
    six factors (the request's fixed cost, its own and per other stream, too) with every metric, TTFT
    weighing `_TTFT_WEIGHT`."""
    points_of = Counter(case.point.source for case in cases)

    def loss_with(ttft: bool) -> Callable[[Efficiency], float]:
        def loss(eff: Efficiency) -> float:
            total = 0.0
            for case in cases:
                for name, error in _errors(case.point, case.figures(eff)).items():
                    timing = METRICS[name][0] in _TTFT
                    if timing and not ttft:
                        continue
                    log = math.log1p(error)
                    if timing:  # Huber: a TTFT the model cannot explain counts, but not squared
                        size = abs(log)
                        square = size**2 if size <= _TTFT_HUBER else _TTFT_HUBER * (2 * size - _TTFT_HUBER)
                        total += _TTFT_WEIGHT * square / points_of[case.point.source]
                    else:
                        total += log**2 / points_of[case.point.source]
            return total

        return loss

    steps = loss_with(ttft=False)
    cpu = all(case.point.on_cpu for case in cases)
    for case in cases:
        case.queue, case.steady = {}, np.zeros(0)
    cells = sorted((_grid_best(steps, overlap, cpu) for overlap in _OVERLAPS), key=steps)
    best = min((_pattern_search(steps, cell, cpu=cpu) for cell in cells[:2]), key=steps)
    if any(METRICS[name][0] in _TTFT for case in cases for name in case.point.metrics):
        for case in cases:
            case.refresh(best)
        best = _pattern_search(loss_with(ttft=True), best, request=True, cpu=cpu)
    return Efficiency(
        round(best.bandwidth, 3),
        round(best.compute, 3),
        round(best.step_overhead_s, 5),
        best.overlap,
        round(best.request_overhead_s, 4),
        round(best.kv_reads, 3),
        round(best.stream_overhead_s, 5),
    )


def _grid_best(loss: Callable[[Efficiency], float], overlap: float, cpu: bool = False) -> Efficiency:
    """The best cell of a coarse grid. On the CPU engines compute may pass the catalog's figure (a
    one-thread numpy matmul measured here, not a datasheet peak: the engines' kernels beat it) and KV
    reads are fitted apart."""
    computes = (0.15, 0.35, 0.55, 0.75, 0.95) + ((1.5, 2.5) if cpu else ())
    caches = (1.0, 0.3, 0.1, 0.03) if cpu else (1.0,)
    grid = itertools.product((0.3, 0.5, 0.7, 0.9), computes, (0.0, 0.003, 0.01), caches)
    return min(
        (Efficiency(b, c, o, overlap, kv_reads=k) for b, c, o, k in grid),
        key=loss,
    )


def _pattern_search(
    loss: Callable[[Efficiency], float], best: Efficiency, request: bool = False, cpu: bool = False
) -> Efficiency:
    best_loss = loss(best)
    steps = {"bandwidth": 0.08, "compute": 0.08, "step_overhead_s": 0.002}
    if request:
        steps["request_overhead_s"] = 0.04
        steps["stream_overhead_s"] = 0.002
    if cpu:
        steps["kv_reads"] = 0.04
    bounds = {**_BOUNDS, **(_CPU_BOUNDS if cpu else {})}
    while steps["bandwidth"] > 0.004:
        improved = False
        for name, step in steps.items():
            for sign in (1, -1):
                low, high = bounds[name]
                candidate = replace(best, **{name: min(high, max(low, getattr(best, name) + sign * step))})
                candidate_loss = loss(candidate)
                if candidate_loss < best_loss - 1e-12:
                    best, best_loss, improved = candidate, candidate_loss, True
        if not improved:
            steps = {k: v / 2 for k, v in steps.items()}
    return best


@dataclass(frozen=True)
class Prediction:
    point: PublishedPoint
    errors: dict[str, float]  # metric → relative error, predicted with factors fitted without its source
    fitted_on: tuple[str, ...]


@dataclass(frozen=True)
class Validation:
    predictions: list[Prediction]
    factors: dict[str, Efficiency]  # per engine family, fitted on every source
    in_sample: list[Prediction]  # the same points, predicted by those (for contrast)
    unused: list[PublishedPoint]
    refused: list[PublishedPoint]  # usable, but the planner says they do not fit (a planner error too)

    def mape(self, out_of_sample: bool = True, by: str = "gpu") -> dict[str, dict[str, tuple[float, int]]]:
        """MAPE and point count per GPU class (`by="engine"`: per engine family) and metric kind, and over
        all GPUs ("all": the CPU engines measured here are shown on their own row, not in it)."""
        found: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for prediction in self.predictions if out_of_sample else self.in_sample:
            for name, error in prediction.errors.items():
                kind = METRICS[name][0]
                found[getattr(prediction.point, by)][kind].append(abs(error))
                if not prediction.point.on_cpu:
                    found["all"][kind].append(abs(error))
        return {
            gpu: {kind: (statistics.fmean(errors), len(errors)) for kind, errors in kinds.items()}
            for gpu, kinds in found.items()
        }


def validate(
    catalog: Catalog,
    points: list[PublishedPoint] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Validation:
    """Fit on every source, then predict each source's points from a fit without it; `progress` hears
    (fits done, fits in all) as it goes (each fit takes seconds)."""
    points = load_published() if points is None else points
    usable = [p for p in points if p.unused is None]
    traced = [(p, trace_point(p, catalog)) for p in usable]
    cases = [case for _, case in traced if case is not None]
    refused = [p for p, case in traced if case is None]
    families = sorted({case.point.engine for case in cases})
    folds = list(_folds(cases))
    total, done = len(families) + len(folds), 0
    factors = {}
    for family in families:
        factors[family] = fit([case for case in cases if case.point.engine == family])
        done += 1
        if progress is not None:
            progress(done, total)
    in_sample = [
        Prediction(c.point, _errors(c.point, c.predict(factors[c.point.engine])), ("all",)) for c in cases
    ]
    predictions = []
    for test, train, fitted_on in folds:
        without = fit(train)
        predictions += [Prediction(c.point, _errors(c.point, c.predict(without)), fitted_on) for c in test]
        done += 1
        if progress is not None:
            progress(done, total)
    predictions.sort(key=lambda prediction: prediction.point.index)
    return Validation(predictions, factors, in_sample, [p for p in points if p.unused is not None], refused)


def _folds(cases: list[Case]) -> Iterator[tuple[list[Case], list[Case], tuple[str, ...]]]:
    """(points predicted, points fitted on, what those are): each source of an engine family left out in
    turn; a family with one source (measured here) leaves out one workload at a time instead."""
    for family in sorted({case.point.engine for case in cases}):
        mine = [case for case in cases if case.point.engine == family]
        sources = sorted({case.point.source for case in mine})
        if len(sources) > 1:
            for source in sources:
                rest = tuple(s for s in sources if s != source)
                yield (
                    [c for c in mine if c.point.source == source],
                    [c for c in mine if c.point.source != source],
                    rest,
                )
            continue
        for workload in sorted({(c.point.input_len, c.point.output_len) for c in mine}):
            test = [c for c in mine if (c.point.input_len, c.point.output_len) == workload]
            train = [c for c in mine if (c.point.input_len, c.point.output_len) != workload]
            if train:
                yield test, train, (f"{sources[0]} without {workload[0]}/{workload[1]}",)


def report(validation: Validation) -> dict[str, Any]:
    """What `corral plan --validate --json` prints and docs/concepts/performance-model.md quotes."""
    return {
        "factors": {f: vars(e) for f, e in validation.factors.items()},
        "mape_leave_one_source_out": _mape_json(validation.mape()),
        "mape_in_sample": _mape_json(validation.mape(out_of_sample=False)),
        # per engine family: `vllm` is the family whose factors the planner and the simulator use
        "mape_leave_one_source_out_by_engine": _mape_json(validation.mape(by="engine")),
        "points": [
            {
                "index": p.point.index,
                "source": p.point.source,
                "point": p.point.label,
                "errors": {k: round(v, 4) for k, v in p.errors.items()},
                "fitted_on": list(p.fitted_on),
            }
            for p in validation.predictions
        ],
        "unused": len(validation.unused),
        "refused": [p.label for p in validation.refused],
    }


def _mape_json(table: dict[str, dict[str, tuple[float, int]]]) -> dict[str, dict[str, Any]]:
    return {
        gpu: {kind: {"mape": round(mape, 4), "n": n} for kind, (mape, n) in kinds.items()}
        for gpu, kinds in table.items()
    }
