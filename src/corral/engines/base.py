"""The engine adapter interface: how to start an engine's replicas and read their load."""

from __future__ import annotations

import functools
import math
import os
import re
import signal
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from corral.artifacts import Progress
from corral.config import DeploymentSpec, ModelSpec, Paths
from corral.engines.features import EngineFeatures
from corral.engines.load import EngineLoad

__all__ = ["EngineAdapter", "LaunchPlan", "read_gauges"]


@dataclass(frozen=True)
class Resources:
    """What one replica reserves where a runtime places it (Ray: a placement group; a local process takes
    the devices its plan's environment names). `engine_workers`: the engine places a worker of its own on
    each GPU (vLLM's Ray executor); `span_nodes`: those workers may sit on different nodes (pipeline
    stages)."""

    gpus: int = 0
    cpus: float = 1.0
    engine_workers: bool = False
    span_nodes: bool = False

    @classmethod
    def of(cls, deployment: DeploymentSpec) -> Resources:
        """A deployment's replica: `ray_gpus` where given, else vLLM on GPUs holds its TP × PP GPUs."""
        gpus = deployment.ray_gpus
        if gpus is None:
            on_gpus = deployment.engine == "vllm" and deployment.device == "gpu"
            gpus = deployment.gpus_per_replica if on_gpus else 0
        return cls(gpus, float(deployment.threads), deployment.ray_workers, deployment.span_nodes)


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
    # where the engine reads an API key from (its environment), guarding its routes with it while probes and
    # metrics still answer without: a runtime that puts it on a network (Ray) gives it one of its own
    key_env: str | None = None
    # how long the engine may take to become ready at least (the supervisor's ready_timeout where longer)
    startup_s: float | None = None
    # the engine's KV-cache events (engines/kv_events.py): the flags that make it publish to `{events}` (an
    # endpoint the supervisor binds, one port per data-parallel rank), or a running server's publishers
    kv_events_args: tuple[str, ...] = ()
    kv_events_ranks: int = 1
    kv_events_urls: tuple[str, ...] = ()
    adapters: tuple[str, ...] = ()  # LoRA adapters the engine starts with (model ids, in its order)
    adapter_slots: int = 0  # LoRA adapters it may load at run time (vLLM's --max-cpu-loras); 0: none
    max_loras: int = 0  # distinct LoRA adapters it runs in one batch (vLLM's --max-loras); 0: unknown
    # the signal the kernel sends the engine if corral dies without stopping it: SIGTERM lets vLLM end the
    # workers it spawned; an engine that may hang shutting down (llama.cpp's server) is sent SIGKILL
    death_signal: signal.Signals = signal.SIGTERM
    resources: Resources = field(default_factory=Resources)  # what a runtime that places replicas reserves


def given_gpus(environ: Mapping[str, str] = os.environ) -> list[str] | None:
    """The GPUs the operator gave corral, as its own CUDA_VISIBLE_DEVICES lists them (indexes, UUIDs, MIG
    instances: `MIG-…`), or None where it sets none (every GPU). CUDA reads the list up to its first entry
    that names no device: a negative index ends it (`-1` hides every GPU), as does an empty value."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    given = []
    for entry in (part.strip() for part in value.split(",")):
        if not entry or entry.startswith("-"):
            break
        given.append(entry)
    return given


def visible_gpus(deployment: DeploymentSpec, index: int, given: Sequence[str] | None = None) -> str:
    """Replica `index`'s GPUs (CUDA_VISIBLE_DEVICES): the next TP × PP of the deployment's `gpus`, or of
    0, 1, 2, … when it lists none. Those are indexes into the GPUs the operator gave corral (`given`, by
    default its own CUDA_VISIBLE_DEVICES: `gpus: [0]` under `CUDA_VISIBLE_DEVICES=2,3` is GPU 2, as CUDA
    numbers them for corral itself); an index past them stays as it is (`check_local_gpus` refuses it)."""
    given = given_gpus() if given is None else given
    per_replica = deployment.gpus_per_replica
    devices = deployment.gpus or list(range(per_replica * (index + 1)))
    mine = devices[index * per_replica : (index + 1) * per_replica]
    return ",".join(given[d] if given is not None and d < len(given) else str(d) for d in mine)


def launch_plans(
    engine: EngineAdapter, model: ModelSpec, deployment: DeploymentSpec, paths: Paths, progress: Progress
) -> list[LaunchPlan]:
    """The engine's plans for a deployment's replicas, each with the resources the deployment reserves."""
    resources = Resources.of(deployment)
    return [replace(plan, resources=resources) for plan in engine.prepare(model, deployment, paths, progress)]


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


def read_gauges(metrics_text: str, names: Iterable[str] | None = None) -> dict[str, float]:
    """The samples in Prometheus text (those of `names`, else every one), by sample name, labels summed.
    Raises ValueError on a sample line that holds no number; +Inf, -Inf and NaN count as absent.

    The supervisor reads each engine's page every probe interval on the gateway's event loop, so this is a
    scan, not a full parse: prometheus_client's parser took 29 ms for one vLLM page (54 KB, 614 lines,
    mostly histogram buckets: every request in flight waited that long); the lines of the named samples
    alone are found by one regular expression in about 0.1 ms. Only a sample's name and value are read; its
    labels are skipped (the last `}` on a line ends them: a value and a timestamp hold none)."""
    if names is not None:
        found: dict[str, float] = {}
        wanted = frozenset(names)
        for name, value in _samples_of(wanted).findall("\n" + metrics_text) if wanted else ():
            number = _finite(name, value)
            if number is not None:
                found[name] = found.get(name, 0.0) + number
        return found
    values: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if not line or line[0] == "#" or line.isspace():
            continue
        brace, space = line.find("{"), line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name, rest = line[:brace], line[line.rfind("}") + 1 :]
        elif space != -1:
            name, rest = line[:space], line[space:]
        else:
            raise ValueError(f"a sample without a value: {line[:80]!r}")
        fields = rest.split()
        try:
            number = float(fields[0])
        except (IndexError, ValueError):
            raise ValueError(f"a sample without a number: {line[:80]!r}") from None
        if math.isfinite(number):
            values[name] = values.get(name, 0.0) + number
    return values


def mean_gauge(metrics_text: str, name: str) -> float | None:
    """A gauge's samples averaged over their labels (a share each engine of a replica has, vLLM's data
    parallel engines: summed, two half-full caches read as one full one); None where there is none."""
    numbers = []
    for _, value in _samples_of(frozenset({name})).findall("\n" + metrics_text):
        number = _finite(name, value)
        if number is not None:
            numbers.append(number)
    return sum(numbers) / len(numbers) if numbers else None


def _finite(name: str, value: str) -> float | None:
    """A sample's value; None for +Inf, -Inf and NaN (as if not there: int() of one raised past the scrape).
    Raises ValueError where it is no number."""
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{name}: not a number: {value[:40]!r}") from None
    return number if math.isfinite(number) else None


@functools.cache
def _samples_of(names: frozenset[str]) -> re.Pattern[str]:
    """(name, value) of each sample line of `names` in a text that starts with a newline: after a newline,
    the name, its labels if any (to the line's last `}`), then the value. The names' common start is written
    out as a literal after the newline, which the regex engine searches for directly."""
    first, last = min(names), max(names)  # the common start of all is that of the first and last in order
    common = first[
        : next((i for i, (a, b) in enumerate(zip(first, last, strict=False)) if a != b), len(first))
    ]
    rests = "|".join(re.escape(n[len(common) :]) for n in sorted(names, key=len, reverse=True))
    return re.compile(rf"\n({re.escape(common)}(?:{rests}))(?:{{[^\n]*}})?[ \t]+(\S+)")
