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
    """Grid search, then a finer grid around the best cell."""
    points = load_points(backend)
    base = calibrated_efficiency(backend)

    def loss(eff: Efficiency) -> float:
        return sum(math.log(predict(p, catalog, eff) / p.output_tokens_per_s) ** 2 for p in points)

    grid = {
        "bandwidth": [0.5, 0.6, 0.7, 0.8, 0.9, 0.95],
        "compute": [0.3, 0.45, 0.6, 0.75, 0.85],
        "step_overhead_s": [0.0, 0.001, 0.002, 0.004],
    }
    best = min(
        (
            replace(base, **dict(zip(grid, values, strict=True)))
            for values in itertools.product(*grid.values())
        ),
        key=loss,
    )
    for _ in range(2):
        fine = {
            "bandwidth": [min(_MAX_EFFICIENCY, best.bandwidth * f) for f in (0.95, 1.0, 1.05)],
            "compute": [min(_MAX_EFFICIENCY, best.compute * f) for f in (0.9, 1.0, 1.1)],
            "step_overhead_s": [max(0.0, best.step_overhead_s + d) for d in (-0.0005, 0.0, 0.0005)],
        }
        best = min(
            (
                replace(base, **dict(zip(fine, values, strict=True)))
                for values in itertools.product(*fine.values())
            ),
            key=loss,
        )
    errors = [
        (p, pred, pred / p.output_tokens_per_s - 1) for p in points for pred in [predict(p, catalog, best)]
    ]
    return FitResult(backend, best, errors)
