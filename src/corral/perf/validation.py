"""The planner's error on published measurements, honestly measured: leave one source out.

`data/published.yaml` holds measurements copied from public pages (each with its URL, table, date and
workload as published). Every point the planner can state (one replica, fixed input and output lengths,
a closed loop of N clients or an offline run) is predicted with the planner's own model: the scheduler
model stepped with the step-time roofline (`trace.py` records the steps once; the efficiency factors only
rescale them). The factors (bandwidth and compute efficiency, per-step overhead, and the overlap p of a
kernel's reads and compute) are fitted per engine family (TensorRT-LLM and NIM; vLLM; the CPU engines) by
least squares on log errors over the published metrics of the point but TTFT (output tokens/s, TPOT,
end-to-end latency).

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
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

import yaml

from corral.perf.catalog import Catalog
from corral.perf.memory import BLOCK_SIZE, memory_plan
from corral.perf.scheduler import SchedulerConfig
from corral.perf.timing import Efficiency, PerfModel
from corral.perf.trace import Timed, Trace, trace_closed_loop

__all__ = ["METRICS", "Prediction", "PublishedPoint", "Validation", "load_published", "validate"]

# published metric → the trace figure it is compared with (times published in ms)
METRICS = {
    "output_tokens_per_s": ("output tokens/s", "output_tokens_per_s", 1.0),
    "tpot_ms_mean": ("TPOT", "tpot_mean", 1e-3),
    "itl_ms_mean": ("TPOT", "tpot_mean", 1e-3),
    "ttft_ms_mean": ("TTFT", "ttft_mean", 1e-3),
    "ttft_ms_p50": ("TTFT", "ttft_p50", 1e-3),
    "e2e_ms_mean": ("E2E latency", "e2e_mean", 1e-3),
}


@dataclass(frozen=True)
class _Engine:
    """An engine family's batch limits, memory share and KV-cache precision in the published runs' usual
    configuration: TensorRT-LLM's FP8 checkpoints (NVIDIA's, NIM's) quantize the KV cache to FP8 too
    (`kv_cache_quant_algo: FP8`); vLLM keeps it in the model's dtype unless told otherwise."""

    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    fp8_kv: bool = False


_ENGINES = {
    "tensorrt-llm": _Engine(2048, 8192, 0.95, fp8_kv=True),
    "vllm": _Engine(256, 2048, 0.9),
    "sglang": _Engine(1024, 8192, 0.88),
    # as benchmarks/cpu_calibration.py runs them: 16 slots; llama.cpp's logical batch, vLLM CPU's default
    "llamacpp": _Engine(16, 2048, 0.9),
    "vllm-cpu": _Engine(16, 4096, 0.9),
}
_BOUNDS = {"bandwidth": (0.2, 0.95), "compute": (0.1, 0.95), "step_overhead_s": (0.0, 0.03)}


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


def trace_point(point: PublishedPoint, catalog: Catalog) -> Trace | None:
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
        )
        # Identical requests: two rounds of every client's request measure the steady state (the
        # planner's default of at least 32 would make a batch-1 run 32 requests long).
        return trace_closed_loop(
            perf,
            config,
            clients,
            point.input_len,
            point.output_len,
            measured_requests=max(2 * clients, 4),
            stagger=point.concurrency is not None,
        )
    return None


def _errors(point: PublishedPoint, timed: Timed) -> dict[str, float]:
    """Relative error of each published metric (predicted / measured − 1)."""
    return {
        name: getattr(timed, figure) / (value * scale) - 1
        for name, value in point.metrics.items()
        for _, figure, scale in [METRICS[name]]
    }


_OVERLAPS = (1.0, 1.5, 2.0, 3.0, 4.0, 8.0, 32.0)  # p-norm exponents tried: a sum (none) to about a max


def fit(traces: list[tuple[PublishedPoint, Trace]]) -> Efficiency:
    """Factors minimising the squared log error over the throughput and latency metrics of `traces`, each
    source weighing the same whatever its number of points (the question is how a new source fares), TTFT
    left out (published TTFT comes from short runs whose clients start together, a start-up the
    steady-state model does not describe; it is still reported). A coarse grid over (bandwidth, compute,
    overhead) at each overlap exponent, then a pattern search from the two best overlaps' best cells."""
    points_of = Counter(point.source for point, _ in traces)

    def loss(eff: Efficiency) -> float:
        return sum(
            math.log1p(error) ** 2 / points_of[point.source]
            for point, trace in traces
            for name, error in _errors(point, trace.timed(eff)).items()
            if METRICS[name][0] != "TTFT"
        )

    cells = sorted((_grid_best(loss, overlap) for overlap in _OVERLAPS), key=loss)
    best = min((_pattern_search(loss, cell) for cell in cells[:2]), key=loss)
    return Efficiency(
        round(best.bandwidth, 3), round(best.compute, 3), round(best.step_overhead_s, 5), best.overlap
    )


def _grid_best(loss: Callable[[Efficiency], float], overlap: float) -> Efficiency:
    grid = itertools.product((0.3, 0.5, 0.7, 0.9), (0.15, 0.35, 0.55, 0.75, 0.95), (0.0, 0.003, 0.01))
    return min((Efficiency(b, c, o, overlap) for b, c, o in grid), key=loss)


def _pattern_search(loss: Callable[[Efficiency], float], best: Efficiency) -> Efficiency:
    best_loss = loss(best)
    steps = {"bandwidth": 0.08, "compute": 0.08, "step_overhead_s": 0.002}
    while steps["bandwidth"] > 0.004:
        improved = False
        for name, step in steps.items():
            for sign in (1, -1):
                low, high = _BOUNDS[name]
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
    traces = [(p, t) for p, t in traced if t is not None]
    refused = [p for p, t in traced if t is None]
    families = sorted({p.engine for p, _ in traces})
    folds = list(_folds(traces))
    total, done = len(families) + len(folds), 0
    factors = {}
    for family in families:
        factors[family] = fit([t for t in traces if t[0].engine == family])
        done += 1
        if progress is not None:
            progress(done, total)
    in_sample = [Prediction(p, _errors(p, t.timed(factors[p.engine])), ("all",)) for p, t in traces]
    predictions = []
    for test, train, fitted_on in folds:
        without = fit(train)
        predictions += [Prediction(p, _errors(p, t.timed(without)), fitted_on) for p, t in test]
        done += 1
        if progress is not None:
            progress(done, total)
    predictions.sort(key=lambda prediction: prediction.point.index)
    return Validation(predictions, factors, in_sample, [p for p in points if p.unused is not None], refused)


Traced = tuple[PublishedPoint, Trace]


def _folds(traces: list[Traced]) -> Iterator[tuple[list[Traced], list[Traced], tuple[str, ...]]]:
    """(points predicted, points fitted on, what those are): each source of an engine family left out in
    turn; a family with one source (measured here) leaves out one workload at a time instead."""
    for family in sorted({p.engine for p, _ in traces}):
        mine = [t for t in traces if t[0].engine == family]
        sources = sorted({p.source for p, _ in mine})
        if len(sources) > 1:
            for source in sources:
                rest = tuple(s for s in sources if s != source)
                yield (
                    [t for t in mine if t[0].source == source],
                    [t for t in mine if t[0].source != source],
                    rest,
                )
            continue
        for workload in sorted({(p.input_len, p.output_len) for p, _ in mine}):
            test = [t for t in mine if (t[0].input_len, t[0].output_len) == workload]
            train = [t for t in mine if (t[0].input_len, t[0].output_len) != workload]
            if train:
                yield test, train, (f"{sources[0]} without {workload[0]}/{workload[1]}",)


def report(validation: Validation) -> dict[str, Any]:
    """What `corral plan --validate --json` prints and the README quotes."""
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
