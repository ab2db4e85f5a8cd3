"""The engine adapter interface: how to start an engine's replicas and read their load."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client.parser import text_string_to_metric_families

from corral.artifacts import Progress
from corral.config import DeploymentSpec, ModelSpec, Paths
from corral.routing import EngineFeatures, EngineLoad

__all__ = ["EngineAdapter", "LaunchPlan", "read_gauges"]


@dataclass(frozen=True)
class LaunchPlan:
    """How to run one replica. `argv` may hold `{host}` and `{port}`, filled in by the runtime.

    A plan with `url` set describes a server that is already running: there is nothing to launch.
    """

    argv: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    health_path: str = "/health"
    metrics_path: str | None = "/metrics"
    url: str | None = None
    capacity: int | None = None  # sequences the engine runs at once; the gateway queues beyond it
    context_length: int | None = None  # tokens per sequence (prompt + output); the gateway refuses more
    features: EngineFeatures = field(default_factory=EngineFeatures)  # what the gateway must make up for
    api_key: str | None = None  # the engine's own API key, which the gateway sends upstream
    startup_s: float | None = None  # how long the engine may take to become ready (default: the supervisor's)


def visible_gpus(deployment: DeploymentSpec, index: int) -> str:
    """Replica `index`'s GPUs (CUDA_VISIBLE_DEVICES): the next TP × PP of the deployment's `gpus`, or of
    0, 1, 2, … when it lists none."""
    per_replica = deployment.gpus_per_replica
    devices = deployment.gpus or list(range(per_replica * (index + 1)))
    return ",".join(str(d) for d in devices[index * per_replica : (index + 1) * per_replica])


class EngineAdapter(Protocol):
    """Knows one engine: its command line, its readiness and its metrics."""

    name: str

    def prepare(
        self, model: ModelSpec, deployment: DeploymentSpec, paths: Paths, progress: Progress
    ) -> list[LaunchPlan]:
        """Fetch or build what the engine needs (blocking, may take minutes); one plan per replica."""
        ...

    def parse_load(self, metrics_text: str) -> EngineLoad:
        """The engine's Prometheus text as the common load shape."""
        ...


def read_gauges(metrics_text: str) -> dict[str, float]:
    """Every sample in Prometheus text, by sample name (labels summed)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    return values
