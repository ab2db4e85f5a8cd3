"""The scrape-time series: replicas (readiness, state, restarts, in flight, circuit), each replica's engine
load in one shape for every engine, queue depths and budget use.

They are read from the live replica set when Prometheus scrapes and written straight to the text format
(prometheus_client's generic renderer took ~50 ms for 8 models × 64 replicas, which the gateway's event
loop would pay on every scrape; benchmarks/metrics_render.py). With several gateway workers they are published
once a second as multiprocess gauges instead (`PublishedState`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from prometheus_client import CollectorRegistry, Gauge

from corral.routing import CircuitState, Router

__all__ = ["WORKERS_OWN", "BudgetsSpent", "Family", "PublishedState", "StateSeries"]

BudgetsSpent = Callable[[], list[tuple[str, str, float]]]  # (tenant, key id, share of the monthly budget)

_CIRCUIT = {CircuitState.CLOSED: 0, CircuitState.HALF_OPEN: 1, CircuitState.OPEN: 2}
# With several gateway workers, the families each worker knows its own part of (its requests in flight and
# queued, its breakers, the budgets of the keys that asked it): published as multiprocess gauges, summed or
# the highest. Every other family is the supervisor's snapshot, the same in every worker: the worker that
# answers the scrape writes it itself, so a replica that left leaves the output (a multiprocess gauge
# cannot be removed: it stayed at 0, "not ready", paging for a replica drained long ago).
WORKERS_OWN = frozenset(
    {
        "corral_replica_outstanding",
        "corral_queue_depth",
        "corral_circuit_state",
        "corral_key_budget_used_ratio",
    }
)
_PER_REPLICA = ("model", "replica")
_ENGINE_GAUGES = (
    ("running", "Sequences the engine is running (its own figure).", "running"),
    ("waiting", "Sequences waiting inside the engine.", "waiting"),
    ("kv_cache_usage_ratio", "Share of the engine's KV cache in use (0-1).", "kv_usage"),
)
_ENGINE_COUNTERS = (
    ("prompt_tokens", "Prompt tokens the engine processed since it started.", "prompt_tokens_total"),
    ("generated_tokens", "Tokens the engine generated since it started.", "generated_tokens_total"),
    (
        "prefix_cache_queries",
        "Prompt tokens looked up in the engine's prefix cache.",
        "prefix_cache_queries_total",
    ),
    ("prefix_cache_hits", "Prompt tokens found in the engine's prefix cache.", "prefix_cache_hits_total"),
    ("preemptions", "Sequences the engine preempted.", "preemptions_total"),
)


@dataclass(slots=True)
class Family:
    """One metric family: its exposed name (counters end in `_total`), type, help and samples."""

    name: str
    kind: str  # "gauge" | "counter"
    doc: str
    labels: tuple[str, ...]
    samples: list[tuple[tuple[str, ...], float]] = field(default_factory=list)

    def text(self, quoted: Callable[[str], str]) -> str:
        head = f"# HELP {self.name} {self.doc}\n# TYPE {self.name} {self.kind}\n"
        names = self.labels
        body = [
            f"{self.name}{{{','.join(f'{n}={quoted(v)}' for n, v in zip(names, values, strict=True))}}} "
            f"{float(value)!r}\n"
            for values, value in self.samples
        ]
        return head + "".join(body)


def quote_label(value: str) -> str:
    """A label value in the text format: quoted, with backslash, quote and newline escaped."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


class StateSeries:
    """Reads the scrape-time families from the router's replica set, the queues and the budgets."""

    def __init__(
        self, router: Router, queue_depths: Callable[[], dict[str, int]], budgets: BudgetsSpent
    ) -> None:
        self._router = router
        self._queue_depths = queue_depths
        self._budgets = budgets
        self._quoted: dict[str, str] = {}  # label values repeat every scrape: quote each once

    def text(self, leaving: frozenset[str] = frozenset()) -> bytes:
        """The families in Prometheus's text format (those named in `leaving` left out)."""
        if len(self._quoted) > 65536:  # replicas and keys come and go: start over rather than grow
            self._quoted.clear()
        families = self.families()
        return "".join(f.text(self._quote) for f in families if f.name not in leaving).encode()

    def _quote(self, value: str) -> str:
        found = self._quoted.get(value)
        if found is None:
            found = self._quoted[value] = quote_label(value)
        return found

    def families(self) -> list[Family]:
        families = self._replica_families() + self._engine_families()
        depth = Family("corral_queue_depth", "gauge", "Requests waiting for a replica slot.", ("model",))
        depth.samples = [((model,), float(size)) for model, size in self._queue_depths().items()]
        budget = Family(
            "corral_key_budget_used_ratio",
            "gauge",
            "Share of a key's monthly token budget used (keys with a budget this gateway served).",
            ("tenant", "key"),
        )
        budget.samples = [((tenant, key), ratio) for tenant, key, ratio in self._budgets()]
        return [*families, depth, budget]

    def _replica_families(self) -> list[Family]:
        outstanding = Family(
            "corral_replica_outstanding",
            "gauge",
            "Sequences in flight per replica (a request asking n choices: n).",
            _PER_REPLICA,
        )
        ready = Family("corral_replica_ready", "gauge", "1 when the replica takes traffic.", _PER_REPLICA)
        circuit = Family(
            "corral_circuit_state", "gauge", "Circuit breaker: 0 closed, 1 half-open, 2 open.", _PER_REPLICA
        )
        state = Family(
            "corral_replica_state",
            "gauge",
            "1, labelled with the replica's current state (one series per replica, not one per state)",
            (*_PER_REPLICA, "state"),
        )
        restarts = Family(
            "corral_replica_restarts_total",
            "counter",
            "Times the supervisor restarted the replica.",
            _PER_REPLICA,
        )
        for replica in self._router.replicas:
            labels = (replica.model, replica.id)
            outstanding.samples.append((labels, replica.outstanding))
            ready.samples.append((labels, 1.0 if replica.ready else 0.0))
            circuit.samples.append((labels, _CIRCUIT[replica.breaker.state]))
            restarts.samples.append((labels, replica.restarts))
            state.samples.append(((*labels, str(replica.state)), 1.0))
        return [outstanding, ready, circuit, state, restarts]

    def _engine_families(self) -> list[Family]:
        """Each replica's last scraped engine load, the same names whatever the engine."""
        fields = [
            (Family(f"corral_engine_{name}", "gauge", doc, _PER_REPLICA), attribute)
            for name, doc, attribute in _ENGINE_GAUGES
        ]
        fields += [
            (Family(f"corral_engine_{name}_total", "counter", doc, _PER_REPLICA), attribute)
            for name, doc, attribute in _ENGINE_COUNTERS
        ]
        for replica in self._router.replicas:
            load = replica.load
            if load is None:
                continue
            labels = (replica.model, replica.id)
            for family, attribute in fields:
                value = getattr(load, attribute)
                if value is not None:
                    family.samples.append((labels, value))
        return [family for family, _ in fields]


class PublishedState:
    """The scrape-time families as multiprocess gauges (several gateway workers), set once a second. A
    counter is published as a gauge under its exposed name: it is the supervisor's count, the same in
    every worker."""

    _MODES: ClassVar[dict[str, str]] = {
        "corral_replica_outstanding": "livesum",
        "corral_queue_depth": "livesum",
    }  # the circuits and budgets: the highest of the live workers (a dead worker's last values leave with
    # it; plain "max" kept them forever)

    def __init__(self, registry: CollectorRegistry) -> None:
        self._gauges: dict[str, Gauge] = {}
        self._registry = registry
        self._set: dict[str, set[tuple[str, ...]]] = {}

    def update(self, families: list[Family]) -> None:
        for family in families:
            if family.name not in WORKERS_OWN:  # (the snapshot's: written by the worker answering)
                continue
            gauge = self._gauges.get(family.name)
            if gauge is None:
                if not family.samples:
                    continue
                gauge = self._gauges[family.name] = Gauge(
                    family.name,
                    family.doc,
                    list(family.labels),
                    registry=self._registry,
                    multiprocess_mode=self._MODES.get(family.name, "livemax"),  # type: ignore[arg-type]
                )
            now = set()
            for values, value in family.samples:
                gauge.labels(*values).set(value)
                now.add(values)
            for gone in self._set.get(family.name, set()) - now:  # a replica or queue that left: 0
                gauge.labels(*gone).set(0)
            self._set[family.name] = now
