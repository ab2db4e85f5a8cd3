"""The gateway's Prometheus metrics (`corral_` names), served at /metrics.

Per-request figures are counted as requests end; replica and queue state is read at scrape time. With
several gateway workers (`gateway.workers`), every worker writes its figures to prometheus_client's
multiprocess files and any worker's /metrics sums them; each worker's own replica, queue and budget gauges
are published once a second (state_metrics.PublishedState: in flight and queued summed over workers,
circuit state and budgets the highest). Reading every worker's files takes long with many series (hundreds
of milliseconds with thousands): /metrics and the console read them in a thread, one reading shared by
concurrent callers and reused for a second (`scrape`, `models_summary`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from corral.gateway.state_metrics import BudgetsSpent, Published, PublishedState, StateSeries
from corral.routing import Router

__all__ = [
    "GatewayMetrics",
    "ModelMetrics",
    "SharedReading",
    "TenantMetrics",
    "UsageMetrics",
    "WorkersReading",
    "read_workers",
]

logger = logging.getLogger(__name__)

# Past the top finite bucket histogram_quantile reports that bucket's bound, whatever the true figure: an
# alert threshold at or above it would never fire (observe/rules.py clamps one to it, with a warning, and
# keeps a copy of these tops). Time to first token and queue waits reach the queue timeout and a
# scaled-to-zero model's hold_s (minutes).
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_LATENCY = (*_SECONDS, 180.0, 300.0, 600.0)
# A whole answer may take far longer than its first token (reasoning, long generations, batch lines).
_DURATION = (*_SECONDS, 300.0, 600.0, 1800.0)
_TOKEN_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.0, 5.0)


_STATE_INTERVAL_S = 1.0  # how often a worker publishes its replica and queue gauges
_READING_REUSED_S = 1.0  # how long one reading of the workers' files serves /metrics and the console
# The console's figures: sample name → (what, the label it is counted by)
_SUMMARISED = {
    "corral_requests_total": ("requests", "status"),
    "corral_tokens_total": ("tokens", "kind"),
    "corral_rejections_total": ("rejections", "reason"),
    "corral_time_to_first_token_seconds_bucket": ("ttft", "le"),
    "corral_inter_token_latency_seconds_bucket": ("itl", "le"),
}


class GatewayMetrics:
    def __init__(
        self,
        router: Router,
        queue_depths: Callable[[], dict[str, int]],
        shared_dir: Path | None = None,
        budgets: BudgetsSpent | None = None,
        tenant_labels: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`shared_dir`: the workers' multiprocess folder (several gateway workers); `clock`: when a reading
        of it was made (reused for a second)."""
        self._shared_dir = shared_dir
        self._tenant_labels = tenant_labels
        self._ticker: asyncio.Task[None] | None = None
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "corral_requests", "Requests finished, by model and HTTP status.", ["model", "status"], registry=r
        )
        self.api_requests = Counter(
            "corral_api_requests",
            "Requests finished, by client API (chat, completions, embeddings, responses, messages), status.",
            ["api", "status"],
            registry=r,
        )
        self._by_api: dict[tuple[str, int], Counter] = {}
        self.e2e = Histogram(
            "corral_request_duration_seconds",
            "End-to-end latency of answered requests (status below 400; refusals and errors are counted "
            "in corral_requests_total only).",
            ["model"],
            buckets=_DURATION,
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
        self.store_errors = Counter(
            "corral_store_errors",
            "Calls to corral's store (SQLite/PostgreSQL) that got no answer, by use: key lookups (the key "
            "served as last found, or a 503), usage writes (retried), other requests answered 503 "
            "store_unavailable.",
            ["use"],
            registry=r,
        )
        # (each use's series exists from the start: a rule on it evaluates before the first outage)
        self.store_errors_keys = self.store_errors.labels("key_lookup")
        self.store_unanswered = self.store_errors.labels("request").inc
        self.usage = UsageMetrics(
            pending=Gauge(
                "corral_usage_pending",
                "Usage records waiting to be written to the store (at most store.max_pending).",
                registry=r,
                multiprocess_mode="livesum",
            ),
            dropped=Counter(
                "corral_usage_dropped",
                "Usage records lost: the store stayed unreachable past store.max_pending records or at "
                "shutdown, or refused the record.",
                registry=r,
            ),
            failed_writes=self.store_errors.labels("usage_write"),
        )
        self.connections_closed = Counter(
            "corral_connections_closed",
            "Client connections the gateway closed: address_cap (one address past "
            "gateway.max_client_connections), send_timeout (a client that took nothing of its answer for "
            "gateway.send_timeout).",
            ["reason"],
            registry=r,
        )
        for reason in ("address_cap", "send_timeout"):
            self.connections_closed.labels(reason)
        self.decisions = Counter(
            "corral_routing_decisions", "Routing decisions, by policy.", ["model", "policy"], registry=r
        )
        self.adapter_loads = Counter(
            "corral_adapter_loads",
            "LoRA adapters loaded on a replica at the gateway's asking (vLLM, sim), by base and adapter.",
            ["model", "adapter"],
            registry=r,
        )
        self.adapter_unloads = Counter(
            "corral_adapter_unloads",
            "LoRA adapters the gateway had a replica unload (idle, past its slots, or replaced).",
            ["model", "adapter"],
            registry=r,
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
        self.cache_lookups = Counter(
            "corral_cache_lookups",
            "Response-cache lookups by model, tenant and result (hit, miss, bypass); semantic hits count.",
            ["model", "tenant", "result"],
            registry=r,
        )
        self.cache_tokens_saved = Counter(
            "corral_cache_tokens_saved",
            "Engine tokens (prompt and output) cache hits answered without an engine.",
            ["model"],
            registry=r,
        )
        self.cache_semantic = Counter(
            "corral_cache_semantic",
            "Semantic-cache outcomes by model: hit (a similar question's answer), explore (the engine "
            "answered to check a neighbour, learned thresholds), vetoed (the lexical guard refused the "
            "neighbour), miss (no neighbour close enough).",
            ["model", "result"],
            registry=r,
        )
        self.cache_store_errors = Counter(
            "corral_cache_store_errors",
            "Response-cache store calls that failed (Redis down, slow or refusing), by op: get (served as a "
            "miss), put (the answer not kept), scan (the semantic index rebuilt from what was read), "
            "present (the index sweep skipped), purge (answered 503). After a failure Redis is left alone "
            "for 5 s: a dead cache shows here, not only as a falling hit rate.",
            ["op"],
            registry=r,
        )
        self.cache_embed_errors = Counter(
            "corral_cache_embed_errors",
            "Semantic-cache questions left without a vector (each a miss), by reason: timeout (none within "
            "cache.embedding_timeout; the embedder is then not asked for 5 s), paused (asked in those 5 s), "
            "busy (the gateway's own embedding calls at their cap), error (the embedder failed or refused "
            "the text).",
            ["reason"],
            registry=r,
        )
        # (each label's series exists from the start: a rule on it evaluates before the first failure)
        for op in ("get", "put", "scan", "present", "purge"):
            self.cache_store_errors.labels(op)
        for reason in ("timeout", "paused", "busy", "error"):
            self.cache_embed_errors.labels(reason)
        budgets = budgets if budgets is not None and tenant_labels else (lambda: [])
        self._state = StateSeries(router, queue_depths, budgets)
        self._published = PublishedState(shared_dir) if shared_dir is not None else None
        self._reading = (
            SharedReading(shared_dir, clock, self._published.others)
            if shared_dir is not None and self._published is not None
            else None
        )
        self._models: dict[str, ModelMetrics] = {}
        self._tenants: dict[str, TenantMetrics] = {}

    def exposition(self) -> bytes:
        """The text Prometheus scrapes: this process's figures, or all workers' summed (read now, on the
        caller's thread: the gateway's routes `await scrape()`)."""
        if self._shared_dir is None:
            return generate_latest(self.registry) + self._state.text()
        assert self._published is not None
        reading = read_workers(self._shared_dir, self._published.others)
        return reading.text + self._state_text(reading.others)

    async def scrape(self) -> bytes:
        """/metrics' body: with several workers, their files are read in a thread, once for concurrent
        scrapes and console polls, and that reading serves for a second."""
        if self._reading is None:
            return self.exposition()
        reading = await self._reading.get()
        return reading.text + self._state_text(reading.others)

    def _state_text(self, others: list[Published] | None = None) -> bytes:
        """The scrape-time families, this worker's own (read now) merged with `others`, the other workers'
        as the reading found them (several workers)."""
        if self._published is None:
            return self._state.text()
        return self._state.text(self._published.merged(self._state.families(), others or []))

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per model: requests by status, tokens by kind, refusals by reason and the TTFT/ITL histograms'
        cumulative bucket counts (the console turns two summaries into rates and percentiles)."""
        if self._shared_dir is None:
            return summarise(self.registry.collect())
        return read_workers(self._shared_dir).models

    async def models_summary(self) -> tuple[float, dict[str, dict[str, Any]]]:
        """`summary()` as the console asks for it, with when it was read (epoch seconds): with several
        workers, from the shared reading (up to a second old, and the console's rates divide by the time
        between two)."""
        if self._reading is None:
            return time.time(), self.summary()
        reading = await self._reading.get()
        return reading.at, reading.models

    def start(self) -> None:
        if self._published is not None:
            self._ticker = asyncio.create_task(self._publish_state(), name="metrics-state")

    async def stop(self) -> None:
        if self._reading is not None:
            await self._reading.stop()
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        if self._published is not None:
            self._published.remove()

    async def _publish_state(self) -> None:
        assert self._published is not None
        while True:
            try:
                self._published.update(self._state.families())
            except OSError as exc:  # (a full disk: the other workers' sums go without this one's, for now)
                logger.warning("could not publish this worker's metrics: %s", exc)
            await asyncio.sleep(_STATE_INTERVAL_S)

    def api_finished(self, api: str, status: int) -> None:
        """A request of a client API (chat, completions, embeddings, responses, messages) finished."""
        counter = self._by_api.get((api, status))
        if counter is None:
            counter = self._by_api[(api, status)] = self.api_requests.labels(api, str(status))
        counter.inc()

    def tenant_label(self, name: str) -> str:
        """The label a tenant's series carry: its name, or "-" for all with tenant labels off."""
        return name if self._tenant_labels else "-"

    def tenant(self, name: str) -> TenantMetrics:
        name = self.tenant_label(name)
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


def summarise(families: Iterable[Metric]) -> dict[str, dict[str, Any]]:
    """Per model, the console's figures (`_SUMMARISED`) of `families`."""
    models: dict[str, dict[str, Any]] = {}
    for family in families:
        for sample in family.samples:
            found = _SUMMARISED.get(sample.name)
            model = sample.labels.get("model")
            if found is None or model is None:
                continue
            kind, label = found
            counts = models.setdefault(model, {}).setdefault(kind, {})
            key = sample.labels[label]
            counts[key] = counts.get(key, 0.0) + sample.value
    return models


@dataclass(frozen=True)
class WorkersReading:
    """Every worker's multiprocess files, summed: the text /metrics serves and the console's summary, as
    read at `at` (epoch seconds)."""

    at: float
    text: bytes
    models: dict[str, dict[str, Any]]
    others: list[Published]  # the other workers' published state (state_metrics.PublishedState)


class _Read(Collector):
    """Families already collected, for generate_latest."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def read_workers(folder: Path, others: Callable[[], list[Published]] | None = None) -> WorkersReading:
    """Read and sum the workers' multiprocess files once, and the other workers' published state (`others`)
    (blocking: seconds of CPU with many series)."""
    at = time.time()
    collector = MultiProcessCollector(None, str(folder))  # type: ignore[no-untyped-call]
    families = list(collector.collect())  # type: ignore[no-untyped-call]
    published = others() if others is not None else []
    return WorkersReading(at, generate_latest(_Read(families)), summarise(families), published)


class SharedReading:
    """The workers' files read in a thread: callers while a reading runs share it, and a reading serves
    the callers of the next `reuse_s` seconds (per `clock`) after it ends."""

    def __init__(
        self,
        folder: Path,
        clock: Callable[[], float],
        others: Callable[[], list[Published]] | None = None,
        reuse_s: float = _READING_REUSED_S,
    ) -> None:
        self._folder, self._clock, self._others, self._reuse_s = folder, clock, others, reuse_s
        self._last: tuple[float, WorkersReading] | None = None
        self._running: asyncio.Task[WorkersReading] | None = None

    async def get(self) -> WorkersReading:
        if self._last is not None and self._clock() - self._last[0] < self._reuse_s:
            return self._last[1]
        if self._running is None:
            self._running = asyncio.create_task(self._read(), name="metrics-read")
            self._running.add_done_callback(_retrieved)  # (a failure no caller waited for is not "lost")
        # (a caller that leaves, such as a closed scrape, leaves the reading to the others)
        return await asyncio.shield(self._running)

    async def _read(self) -> WorkersReading:
        try:
            reading = await asyncio.to_thread(read_workers, self._folder, self._others)
        finally:
            self._running = None
        self._last = (self._clock(), reading)
        return reading

    async def stop(self) -> None:
        if self._running is not None:
            self._running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._running


def _retrieved(task: asyncio.Task[WorkersReading]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("reading the gateway workers' metrics failed: %s", task.exception())


@dataclass(frozen=True)
class UsageMetrics:
    """The usage writer's figures (gateway/usage.py): records waiting, records lost, writes that failed."""

    pending: Gauge
    dropped: Counter
    failed_writes: Counter


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
        if status < 400:  # a refusal takes milliseconds: a 429 storm would pull the percentiles down
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
