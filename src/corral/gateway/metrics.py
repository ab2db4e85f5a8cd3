"""The gateway's Prometheus metrics (`corral_` names), served at /metrics.

Per-request figures are counted as requests end; replica and queue state is read at scrape time. With
several gateway workers (`gateway.workers`), every worker writes its figures to prometheus_client's
multiprocess files and any worker's /metrics sums them; replica and queue gauges are then published by
each worker once a second (in flight and queued summed over workers; ready and circuit state the highest).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ClassVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from corral.routing import CircuitState, ReplicaState, Router

__all__ = ["GatewayMetrics", "ModelMetrics", "TenantMetrics"]

BudgetsSpent = Callable[[], list[tuple[str, str, float]]]  # (tenant, key id, share of the monthly budget)

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0)
_CIRCUIT = {CircuitState.CLOSED: 0, CircuitState.HALF_OPEN: 1, CircuitState.OPEN: 2}


_STATE_INTERVAL_S = 1.0  # how often a worker publishes its replica and queue gauges


class GatewayMetrics:
    def __init__(
        self,
        router: Router,
        queue_depths: Callable[[], dict[str, int]],
        shared_dir: Path | None = None,
        budgets: BudgetsSpent | None = None,
    ) -> None:
        self._shared_dir = shared_dir
        self._ticker: asyncio.Task[None] | None = None
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "corral_requests", "Requests finished, by model and HTTP status.", ["model", "status"], registry=r
        )
        self.e2e = Histogram(
            "corral_request_duration_seconds",
            "End-to-end request latency.",
            ["model"],
            buckets=_LATENCY,
            registry=r,
        )
        self.ttft = Histogram(
            "corral_time_to_first_token_seconds",
            "Time to first token (streams).",
            ["model"],
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            "corral_inter_token_latency_seconds",
            "Mean time between output tokens of a stream (one observation per request).",
            ["model"],
            buckets=_TOKEN_LATENCY,
            registry=r,
        )
        self.tokens = Counter(
            "corral_tokens",
            "Tokens processed, by model and kind (input, output).",
            ["model", "kind"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "corral_queue_wait_seconds",
            "Time requests waited for a replica slot.",
            ["model"],
            buckets=_LATENCY,
            registry=r,
        )
        self.rejections = Counter(
            "corral_rejections", "Requests refused, by reason.", ["model", "reason"], registry=r
        )
        self.limiter_errors = Counter(
            "corral_limiter_errors", "Rate-limit checks the shared store (Redis) did not answer.", registry=r
        )
        self.decisions = Counter(
            "corral_routing_decisions", "Routing decisions, by policy.", ["model", "policy"], registry=r
        )
        self.prefill_holds = Counter(
            "corral_prefill_holds",
            "Requests held until another request's prefill of their prefix ended (prefill coalescing).",
            ["model"],
            registry=r,
        )
        self.prefill_hold_seconds = Counter(
            "corral_prefill_hold_seconds",
            "Seconds requests were held for another request's prefill of their prefix.",
            ["model"],
            registry=r,
        )
        self.tenant_requests = Counter(
            "corral_tenant_requests",
            "Requests finished, by tenant and HTTP status.",
            ["tenant", "status"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            "corral_tenant_tokens",
            "Tokens of answered requests, by tenant and kind.",
            ["tenant", "kind"],
            registry=r,
        )
        self._state = _StateCollector(router, queue_depths, budgets or (lambda: []))
        self._published: _PublishedState | None = None
        if shared_dir is None:
            r.register(self._state)
        else:
            self._published = _PublishedState(r)
        self._models: dict[str, ModelMetrics] = {}
        self._tenants: dict[str, TenantMetrics] = {}

    def exposition(self) -> bytes:
        """The text Prometheus scrapes: this process's figures, or all workers' summed."""
        if self._shared_dir is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, str(self._shared_dir))  # type: ignore[no-untyped-call]
        return generate_latest(registry)

    def start(self) -> None:
        if self._published is not None:
            self._ticker = asyncio.create_task(self._publish_state(), name="metrics-state")

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker

    async def _publish_state(self) -> None:
        assert self._published is not None
        while True:
            self._published.update(self._state.collect())
            await asyncio.sleep(_STATE_INTERVAL_S)

    def tenant(self, name: str) -> TenantMetrics:
        found = self._tenants.get(name)
        if found is None:
            found = self._tenants[name] = TenantMetrics(self, name)
        return found

    def of(self, model: str) -> ModelMetrics:
        """The labelled children for one model, made once (label lookups are slow on the hot path)."""
        found = self._models.get(model)
        if found is None:
            found = self._models[model] = ModelMetrics(self, model)
        return found


class ModelMetrics:
    """One model's metric children."""

    def __init__(self, metrics: GatewayMetrics, model: str) -> None:
        self._requests = metrics.requests
        self._rejections = metrics.rejections
        self._decisions = metrics.decisions
        self.model = model
        self.e2e = metrics.e2e.labels(model)
        self.ttft = metrics.ttft.labels(model)
        self.itl = metrics.itl.labels(model)
        self.queue_wait = metrics.queue_wait.labels(model)
        self.prefill_holds = metrics.prefill_holds.labels(model)
        self.prefill_hold_seconds = metrics.prefill_hold_seconds.labels(model)
        self.input_tokens = metrics.tokens.labels(model, "input")
        self.output_tokens = metrics.tokens.labels(model, "output")
        self._by_status: dict[int, Counter] = {}
        self._by_policy: dict[str, Counter] = {}

    def finished(self, status: int, seconds: float) -> None:
        counter = self._by_status.get(status)
        if counter is None:
            counter = self._by_status[status] = self._requests.labels(self.model, str(status))
        counter.inc()
        self.e2e.observe(seconds)

    def decided(self, policy: str) -> None:
        counter = self._by_policy.get(policy)
        if counter is None:
            counter = self._by_policy[policy] = self._decisions.labels(self.model, policy)
        counter.inc()

    def rejected(self, reason: str) -> None:
        self._rejections.labels(self.model, reason).inc()


class TenantMetrics:
    """One tenant's metric children: requests by status, tokens by kind."""

    def __init__(self, metrics: GatewayMetrics, tenant: str) -> None:
        self._requests = metrics.tenant_requests
        self.tenant = tenant
        self.input_tokens = metrics.tenant_tokens.labels(tenant, "input")
        self.output_tokens = metrics.tenant_tokens.labels(tenant, "output")
        self._by_status: dict[int, Counter] = {}

    def finished(self, status: int, input_tokens: int, output_tokens: int) -> None:
        counter = self._by_status.get(status)
        if counter is None:
            counter = self._by_status[status] = self._requests.labels(self.tenant, str(status))
        counter.inc()
        if status < 400:
            self.input_tokens.inc(input_tokens)
            self.output_tokens.inc(output_tokens)


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


class _StateCollector(Collector):
    """Replica, engine and queue series, read when Prometheus scrapes. Engine figures are each replica's
    last scraped load in one shape for every engine (vLLM, llama.cpp, the simulator), so dashboards and
    alerts never depend on one engine's metric names."""

    def __init__(
        self, router: Router, queue_depths: Callable[[], dict[str, int]], budgets: BudgetsSpent
    ) -> None:
        self._router = router
        self._queue_depths = queue_depths
        self._budgets = budgets

    def collect(self) -> Iterator[Metric]:
        outstanding = GaugeMetricFamily(
            "corral_replica_outstanding", "Requests in flight per replica.", labels=["model", "replica"]
        )
        ready = GaugeMetricFamily(
            "corral_replica_ready", "1 when the replica takes traffic.", labels=["model", "replica"]
        )
        circuit = GaugeMetricFamily(
            "corral_circuit_state",
            "Circuit breaker: 0 closed, 1 half-open, 2 open.",
            labels=["model", "replica"],
        )
        for replica in self._router.replicas:
            labels = [replica.model, replica.id]
            outstanding.add_metric(labels, replica.outstanding)
            ready.add_metric(labels, 1.0 if replica.ready else 0.0)
            circuit.add_metric(labels, _CIRCUIT[replica.breaker.state])
        depth = GaugeMetricFamily(
            "corral_queue_depth", "Requests waiting for a replica slot.", labels=["model"]
        )
        for model, size in self._queue_depths().items():
            depth.add_metric([model], size)
        yield from (outstanding, ready, circuit, depth)
        yield from self._replica_families()
        yield from self._engine_families()
        budget = GaugeMetricFamily(
            "corral_key_budget_used_ratio",
            "Share of a key's monthly token budget used (keys with a budget this gateway served).",
            labels=["tenant", "key"],
        )
        for tenant, key, ratio in self._budgets():
            budget.add_metric([tenant, key], ratio)
        yield budget

    def _replica_families(self) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "corral_replica_state", "1 for the replica's current state.", labels=["model", "replica", "state"]
        )
        restarts = CounterMetricFamily(
            "corral_replica_restarts",
            "Times the supervisor restarted the replica.",
            labels=["model", "replica"],
        )
        for replica in self._router.replicas:
            for name in ReplicaState:
                state.add_metric(
                    [replica.model, replica.id, str(name)], 1.0 if replica.state is name else 0.0
                )
            restarts.add_metric([replica.model, replica.id], replica.restarts)
        yield from (state, restarts)

    def _engine_families(self) -> Iterator[Metric]:
        labels = ["model", "replica"]
        families: list[tuple[GaugeMetricFamily | CounterMetricFamily, str]] = [
            (GaugeMetricFamily(f"corral_engine_{n}", doc, labels=labels), f) for n, doc, f in _ENGINE_GAUGES
        ]
        families += [
            (CounterMetricFamily(f"corral_engine_{n}", doc, labels=labels), f)
            for n, doc, f in _ENGINE_COUNTERS
        ]
        for replica in self._router.replicas:
            load = replica.load
            if load is None:
                continue
            for family, attribute in families:
                value = getattr(load, attribute)
                if value is not None:
                    family.add_metric([replica.model, replica.id], float(value))
        for family, _ in families:
            yield family


class _PublishedState:
    """The state gauges as multiprocess Gauges, set from a scrape-time collection once a second."""

    _MODES: ClassVar[dict[str, str]] = {
        "corral_replica_outstanding": "livesum",
        "corral_replica_ready": "max",
        "corral_circuit_state": "max",
        "corral_queue_depth": "livesum",
        "corral_key_budget_used_ratio": "max",
    }  # every other family (replica state, engine load: the same snapshot in every worker): max

    def __init__(self, registry: CollectorRegistry) -> None:
        self._gauges: dict[str, Gauge] = {}
        self._registry = registry
        self._set: dict[str, set[tuple[str, ...]]] = {}

    def update(self, families: Iterator[Metric]) -> None:
        for family in families:
            # A counter is published as a gauge (the supervisor's count, not this worker's) under the
            # name a single process exports (`_total`).
            name = family.name + "_total" if family.type == "counter" else family.name
            gauge = self._gauges.get(name)
            if gauge is None:
                if not family.samples:
                    continue
                labels = list(family.samples[0].labels)
                gauge = self._gauges[name] = Gauge(
                    name,
                    family.documentation,
                    labels,
                    registry=self._registry,
                    multiprocess_mode=self._MODES.get(name, "max"),  # type: ignore[arg-type]
                )
            now = set()
            for sample in family.samples:
                key = tuple(sample.labels.values())
                gauge.labels(*key).set(sample.value)
                now.add(key)
            for gone in self._set.get(name, set()) - now:  # a replica or queue that left: 0
                gauge.labels(*gone).set(0)
            self._set[name] = now
