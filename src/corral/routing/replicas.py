"""The live replica set: what the supervisor publishes and the gateway routes over."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum

from corral.engines.features import EngineFeatures
from corral.engines.load import EngineLoad
from corral.routing.circuit import CircuitBreaker

__all__ = ["Replica", "ReplicaSet", "ReplicaState", "TrafficSplit"]

_EVENTS_KEPT = 100


class ReplicaState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"  # gave up: it failed to start `supervisor.max_start_failures` times in a row
    DRAINING = "draining"  # out of routing; stopped once its requests are done (`corral drain`)


@dataclass(slots=True, eq=False)
class Replica:
    """One engine replica. The supervisor owns its lifecycle fields; the gateway owns `outstanding`."""

    id: str
    model: str
    engine: str
    url: str = ""
    state: ReplicaState = ReplicaState.STARTING
    outstanding: int = 0
    outstanding_tokens: int = 0
    pending_prefill: int = 0  # prompt tokens routed here (from this gateway) not yet prefilled, estimated
    capacity: int | None = None  # concurrent sequences the engine runs (slots, max_num_seqs); None: unknown
    context_length: int | None = None  # tokens per sequence (prompt + output) the engine holds; None: unknown
    features: EngineFeatures = field(default_factory=EngineFeatures)
    api_key: str | None = field(
        default=None, repr=False
    )  # the engine's own key (vLLM --api-key); never shown
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    load: EngineLoad | None = None
    pid: int | None = None
    node: str | None = None  # the Ray node it runs on (None: this machine)
    gpus: str | None = None  # the GPUs its plan gives it (CUDA_VISIBLE_DEVICES; None: none, or Ray's choice)
    restarts: int = 0
    started_at: float | None = None
    last_error: str | None = None
    log_tail: tuple[str, ...] = ()  # the last lines of its log when it last failed to start
    served: int = 0
    succeeded: int = 0  # requests it served well (a request that timed out while this grew was only long)
    failures: int = 0  # requests it failed (the replica's fault), for rollout health checks
    revision: int = 0  # which rollout of its model started it (0: the first)
    admitted: bool = True  # routable once ready; a rollout's new replica is not until it passed the gate
    ready_eta: float | None = None  # when a starting/restarting replica is expected ready (epoch s)
    adapters: tuple[str, ...] = ()  # LoRA adapters it started with, in its engine's order (llama.cpp)
    adapter_slots: int = 0  # LoRA adapters it may hold loaded at run time (vLLM, sim); 0: none
    max_loras: int = 0  # distinct LoRA adapters its engine runs in one batch (vLLM, sim); 0: unknown

    @property
    def ready(self) -> bool:
        """Routable: healthy, and (a rollout's new replica) through the gate."""
        return self.state is ReplicaState.READY and self.admitted

    def snapshot(self) -> dict[str, object]:
        """A JSON-able view for status endpoints and the CLI."""
        load = self.load
        return {
            "id": self.id,
            "model": self.model,
            "engine": self.engine,
            "url": self.url,
            "state": str(self.state),
            "pid": self.pid,
            "node": self.node,
            "gpus": self.gpus,
            "restarts": self.restarts,
            "outstanding": self.outstanding,
            "capacity": self.capacity,
            "outstanding_tokens": self.outstanding_tokens,
            "pending_prefill_tokens": self.pending_prefill,
            "circuit": str(self.breaker.state),
            "consecutive_failures": self.breaker.consecutive_failures,
            "served": self.served,
            "failures": self.failures,
            "revision": self.revision,
            "admitted": self.admitted,
            "uptime_s": round(time.time() - self.started_at, 1) if self.started_at else None,
            "running": load.running if load else None,
            "waiting": load.waiting if load else None,
            "kv_usage": load.kv_usage if load else None,
            "kv_capacity_tokens": load.kv_capacity_tokens if load else None,
            "kv_cached_tokens": load.kv_cached_tokens if load else None,  # by its KV events
            "kv_evicted_tokens_total": load.kv_evicted_tokens_total if load else None,
            "prefix_cache_hit_rate": (
                round(load.prefix_cache_hits_total / load.prefix_cache_queries_total, 4)
                if load and load.prefix_cache_queries_total
                else None
            ),
            "generated_tokens_total": load.generated_tokens_total if load else None,
            "engine_ttft_mean_ms": round(load.ttft_mean_s * 1000, 2) if load and load.ttft_mean_s else None,
            "engine_itl_mean_ms": round(load.itl_mean_s * 1000, 2) if load and load.itl_mean_s else None,
            "last_error": self.last_error,
            "log_tail": list(self.log_tail),
        }


@dataclass(frozen=True, slots=True)
class TrafficSplit:
    """During a rollout: the share of a model's requests sent to replicas of `revision` (the rest go to the
    others). A share of 0 keeps the new replicas out of routing (a rollback's: they failed a check) while
    any other is ready: while the old replicas start again, the new ones that are ready serve rather than
    none (a revision over its error ratio still answers most requests)."""

    revision: int
    share: float

    def choose(self, candidates: list[Replica], draw: float, ready: list[Replica]) -> list[Replica]:
        """The replicas a request may go to, given a uniform `draw` in [0, 1); `ready`: the model's ready
        replicas (`candidates` are those of them a request may take now)."""
        new = [r for r in candidates if r.revision == self.revision]
        old = [r for r in candidates if r.revision != self.revision]
        if self.share <= 0.0:
            return old if old or any(r.revision != self.revision for r in ready) else new
        if draw < self.share:
            return new or old
        return old or new


class ReplicaSet:
    """Replicas by model, with what the control plane says about them: traffic splits during rollouts,
    models held for scale-from-zero, rollout states and the log of changes. Single event loop: no locks,
    readers see whole updates."""

    def __init__(self, models: list[str] | None = None) -> None:
        self._by_model: dict[str, list[Replica]] = {m: [] for m in models or []}
        # Per-model facts of the replicas' engines, read on every request: kept until membership changes.
        self._features: dict[str, EngineFeatures] = {}
        self._contexts: dict[str, int | None] = {}
        # What a model's engines do, from their launch plans, for a model with no replica now (scaled to
        # zero): its held requests are checked against these.
        self.declared: dict[str, tuple[EngineFeatures, int | None]] = {}
        self.splits: dict[str, TrafficSplit] = {}
        self.on_demand: dict[str, float] = {}  # model → seconds a request waits for a first replica
        self.rollouts: dict[str, dict[str, object]] = {}  # model → its latest rollout's state
        self.events: deque[dict[str, object]] = deque(maxlen=_EVENTS_KEPT)
        self.generation: dict[str, int] = {}  # model → count of its changes (membership, features)

    def record(self, kind: str, model: str, message: str) -> None:
        """One change of the running cluster (apply, rollout step, scaling, drain), for status and the
        console."""
        self.events.append({"at": round(time.time(), 3), "kind": kind, "model": model, "message": message})

    def declare(self, model: str) -> None:
        self._by_model.setdefault(model, [])

    def add(self, replica: Replica) -> None:
        self._by_model.setdefault(replica.model, []).append(replica)
        self.changed(replica.model)

    def forget(self, model: str) -> None:
        """Stop serving `model` (its replicas are gone): it leaves /v1/models."""
        self._by_model.pop(model, None)
        self.changed(model)

    def remove(self, replica: Replica) -> None:
        members = self._by_model.get(replica.model, [])
        if replica in members:
            members.remove(replica)
        self.changed(replica.model)

    def changed(self, model: str) -> None:
        """Forget what was derived from `model`'s replicas (their features or context changed)."""
        self.generation[model] = self.generation.get(model, 0) + 1
        self._features.pop(model, None)
        self._contexts.pop(model, None)

    def models(self) -> list[str]:
        return list(self._by_model)

    def has_model(self, model: str) -> bool:
        return model in self._by_model

    def of(self, model: str) -> list[Replica]:
        return self._by_model.get(model, [])

    def ready(self, model: str) -> list[Replica]:
        ready = ReplicaState.READY
        return [r for r in self._by_model.get(model, ()) if r.state is ready and r.admitted]

    def free_slots(self, model: str) -> int | None:
        """Sequences `model`'s ready replicas can still take (1 << 30 where an engine does not say its
        capacity); None while none is ready. (The admission queue's `Capacity`.)"""
        ready = self.ready(model)
        if not ready:
            return None
        free = 0
        for replica in ready:
            if replica.capacity is None:
                return 1 << 30
            free += max(0, replica.capacity - replica.outstanding)
        return free

    def slots(self, model: str) -> int | None:
        """Sequences `model`'s ready replicas hold in all; None where an engine does not say its capacity
        (or none is ready). (The admission queue's `Capacity`.)"""
        ready = self.ready(model)
        if not ready or any(replica.capacity is None for replica in ready):
            return None
        return sum(replica.capacity or 0 for replica in ready)

    def replica_slots(self, model: str) -> int | None:
        """Sequences the largest of `model`'s ready replicas holds (a request runs on one); None where an
        engine does not say its capacity (or none is ready). (The admission queue's `Capacity`.)"""
        ready = self.ready(model)
        if not ready or any(replica.capacity is None for replica in ready):
            return None
        return max(replica.capacity or 0 for replica in ready)

    def start_hold(self, model: str) -> float | None:
        """Seconds a request may wait for the first replica of a model scaled to zero (`on_demand`)."""
        return self.on_demand.get(model)

    def context_length(self, model: str) -> int | None:
        """The smallest per-sequence context among `model`'s replicas (None when no engine says)."""
        if model not in self._contexts:
            known = [r.context_length for r in self.of(model) if r.context_length is not None]
            fallback = self.declared[model][1] if model in self.declared else None
            self._contexts[model] = min(known) if known else fallback
        return self._contexts[model]

    def features(self, model: str) -> EngineFeatures:
        """What every replica of `model` does right (a feature one lacks is made up for, or refused)."""
        found = self._features.get(model)
        if found is None:
            replicas = self.of(model)
            default = self.declared[model][0] if model in self.declared else EngineFeatures()
            found = replicas[0].features if replicas else default
            for replica in replicas[1:]:
                found &= replica.features
            self._features[model] = found
        return found

    def retry_after(self, model: str, default: float = 5.0) -> float:
        """Seconds until the soonest (re)starting replica of `model` is expected to be ready."""
        now = time.time()
        etas = [r.ready_eta - now for r in self.of(model) if r.ready_eta is not None]
        return max(1.0, min(etas)) if etas else default

    def __iter__(self) -> Iterator[Replica]:
        for members in self._by_model.values():
            yield from members
