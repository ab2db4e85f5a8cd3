"""Calibrating the efficiency factors against measured points, and reporting the error on each point.

The fit searches (bandwidth efficiency, compute efficiency, per-step overhead) to minimise the squared log
error of predicted vs measured output tokens/s, predicting each point with the same closed-loop model the
planner uses. The fitted factors are stored per engine backend in `data/calibration.yaml`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

import yaml

from corral.perf.catalog import Catalog
from corral.perf.memory import BLOCK_SIZE, memory_plan
from corral.perf.scheduler import SchedulerConfig
from corral.perf.timing import Efficiency, PerfModel
from corral.perf.workload import closed_loop

# Above this, a fit is explaining measurement noise with physics no GPU reaches (datasheet peaks).
_MAX_EFFICIENCY = 0.9

__all__ = ["CalibrationPoint", "FitResult", "calibrated_efficiency", "fit", "load_points", "predict"]


@dataclass(frozen=True)
class CalibrationPoint:
    backend: str
    model: str
    gpu: str
    quant: str
    tp: int
    input_len: int
    output_len: int
    concurrency: int
    output_tokens_per_s: float
    source: str


@dataclass(frozen=True)
class FitResult:
    backend: str
    efficiency: Efficiency
    errors: list[tuple[CalibrationPoint, float, float]]  # point, predicted tokens/s, relative error

    @property
    def max_error(self) -> float:
        return max(abs(e) for _, _, e in self.errors)


def _document() -> dict[str, Any]:
    text = (resources.files("corral.perf") / "data" / "calibration.yaml").read_text()
    data: dict[str, Any] = yaml.safe_load(text)
    return data


def load_points(backend: str | None = None) -> list[CalibrationPoint]:
    points = [CalibrationPoint(**p) for p in _document()["points"]]
    return [p for p in points if backend is None or p.backend == backend]


def calibrated_efficiency(backend: str = "vllm") -> Efficiency:
    """The stored fitted factors for an engine backend."""
    return Efficiency(**_document()["fitted"][backend])


def predict(point: CalibrationPoint, catalog: Catalog, efficiency: Efficiency) -> float:
    model, gpu = catalog.models.get(point.model), catalog.gpus.get(point.gpu)
    quant = catalog.quantizations.get(point.quant)
    memory = memory_plan(model, gpu, quant, tp=point.tp)
    perf = PerfModel(model, gpu, quant, tp=point.tp, efficiency=efficiency)
    config = SchedulerConfig(num_blocks=memory.kv_tokens // BLOCK_SIZE, enable_prefix_caching=False)
    result = closed_loop(perf, config, point.concurrency, point.input_len, point.output_len)
    return result.output_tokens_per_s


def fit(catalog: Catalog, backend: str = "vllm") -> FitResult:
    """A coarse grid, then a pattern search from its best cell (factors capped at _MAX_EFFICIENCY)."""
    points = load_points(backend)
    if not points:
        raise ValueError(f"no calibration points for backend {backend!r}")
    base = Efficiency()

    def loss(eff: Efficiency) -> float:
        return sum(math.log(predict(p, catalog, eff) / p.output_tokens_per_s) ** 2 for p in points)

    grid = {
        "bandwidth": [0.5, 0.7, 0.9],
        "compute": [0.2, 0.45, 0.7, 0.9],
        "step_overhead_s": [0.0, 0.001, 0.004, 0.008],
    }
    best = min(
        (
            replace(base, **dict(zip(grid, values, strict=True)))
            for values in itertools.product(*grid.values())
        ),
        key=loss,
    )
    best_loss = loss(best)
    steps = {"bandwidth": 0.1, "compute": 0.1, "step_overhead_s": 0.001}
    for _ in range(40):
        improved = False
        for name, step in steps.items():
            for sign in (1, -1):
                value = min(
                    _MAX_EFFICIENCY if name != "step_overhead_s" else 1.0,
                    max(0.0, getattr(best, name) + sign * step),
                )
                candidate = replace(best, **{name: value})
                candidate_loss = loss(candidate)
                if candidate_loss < best_loss - 1e-12:
                    best, best_loss, improved = candidate, candidate_loss, True
        if not improved:
            steps = {k: v / 2 for k, v in steps.items()}
            if steps["bandwidth"] < 0.005:
                break
    best = replace(
        best,
        bandwidth=round(best.bandwidth, 3),
        compute=round(best.compute, 3),
        step_overhead_s=round(best.step_overhead_s, 5),
    )
    errors = [
        (p, pred, pred / p.output_tokens_per_s - 1) for p in points for pred in [predict(p, catalog, best)]
    ]
    return FitResult(backend, best, errors)
