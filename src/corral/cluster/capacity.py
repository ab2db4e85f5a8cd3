"""What one replica sustains, from the performance model: the feed-forward autoscaler's divisor.

The highest Poisson arrival rate at which one replica of a deployment keeps up (its backlog does not grow)
and, when the model has a TTFT objective, keeps TTFT p95 within it: found by bisection over the scheduler
model in virtual time, for the measured mean prompt and output lengths. Results are cached per rounded
workload, so the autoscaler asks once per workload shape.
"""

from __future__ import annotations

import functools
import math

from corral.config import DeploymentSpec, ModelSpec
from corral.perf import CatalogError, closed_loop, load_catalog, open_loop
from corral.perf.calibration import calibrated_efficiency
from corral.perf.replica import ReplicaLayout, replica_model

__all__ = ["replica_request_rate"]

_BISECTIONS = 10
_REQUESTS = 240  # per simulated open-loop run


def replica_request_rate(
    model: ModelSpec, deployment: DeploymentSpec, lengths: tuple[float, float], ttft_p95: float | None
) -> float | None:
    """Requests/s (wall clock: a simulator's `time_scale` included) one replica sustains; None when the
    deployment has no performance model (no GPU type, or a model the catalog lacks)."""
    arch = _catalog_model(model.catalog_names)
    if deployment.gpu is None or arch is None:
        return None
    layout = ReplicaLayout(
        model=arch,
        gpu=deployment.gpu,
        quant=deployment.quantization,
        tp=deployment.tensor_parallel,
        pp=deployment.pipeline_parallel,
        max_num_seqs=deployment.max_num_seqs,
        max_num_batched_tokens=deployment.max_num_batched_tokens,
        gpu_memory_utilization=deployment.gpu_memory_utilization,
    )
    scale = deployment.time_scale if deployment.engine == "sim" else 1.0
    prompt, output = (_bucket(x) for x in lengths)
    try:
        rate = _sustained_rate(layout, prompt, output, ttft_p95)
    except (ValueError, KeyError, RuntimeError):
        return None
    return rate * scale


@functools.lru_cache(maxsize=64)
def _catalog_model(names: tuple[str, ...]) -> str | None:
    """The catalog's name of the first of `names` it knows (arch, the source's Hugging Face id, the model's
    name: `ModelSpec.catalog_names`), or None."""
    models = load_catalog().models
    for name in names:
        try:
            return models.get(name).name
        except CatalogError:
            continue
    return None


def _bucket(tokens: float) -> int:
    """Lengths rounded to a quarter power of two: near workloads share one cached answer."""
    return max(1, round(2 ** (round(math.log2(max(tokens, 1.0)) * 4) / 4)))


@functools.lru_cache(maxsize=256)
def _sustained_rate(layout: ReplicaLayout, prompt: int, output: int, ttft_p95: float | None) -> float:
    replica = replica_model(layout, load_catalog(), calibrated_efficiency())
    full = closed_loop(replica.perf, replica.config, layout.max_num_seqs, prompt, output, drift=False)
    ceiling = full.requests_per_s
    low, high = 0.0, ceiling
    for _ in range(_BISECTIONS):
        rate = (low + high) / 2
        result = open_loop(replica.perf, replica.config, rate, prompt, output, requests=_REQUESTS)
        meets = not result.overloaded and (ttft_p95 is None or result.ttft_p95 <= ttft_p95)
        low, high = (rate, high) if meets else (low, rate)
    return low
