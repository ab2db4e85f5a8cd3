"""The simulated engine: the scheduler model stepped in real time, with vLLM's metrics.

Simulated time runs `time_scale` times faster than the wall clock: a step the performance model says takes
40 ms sleeps 4 ms at time_scale 10. Latency metrics are recorded in simulated seconds, so they read like the
GPU's; a client timing requests by the wall clock divides them by `time_scale`. Steps run back to back in
simulated time, so an event loop that wakes late does not slow the engine down as long as it catches up
within a step.

With LoRA (`lora`: sim/lora.py), requests name an adapter, the scheduler and step pipeline are
sim/lora_engine.py's, and the metrics add vLLM's `vllm:lora_requests_info` and the simulator's own
`sim:lora_loads_total` and `sim:lora_activations_total`.

Counters follow vLLM V1: `vllm:prompt_tokens` counts each request's whole prompt once, at its first token
(prefix-cache hits and recomputation after a preemption do not change it), and `vllm:request_success` labels
each finished request with its reason: `length` at `max_tokens`, `stop` where it ended on its own (an end of
sequence, a tool call said, a stop string the server found: `finish`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from corral.perf import (
    Batch,
    EngineSequence,
    PerfModel,
    Scheduler,
    SchedulerConfig,
    StepPipeline,
    block_hashes,
)
from corral.sim.kv_events import KvEventPublisher
from corral.sim.lora import Adapter, LoraManager
from corral.sim.lora_engine import LoraMetrics, LoraScheduler, LoraStepPipeline

__all__ = ["SimEngine", "SimRequest"]

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)

_FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason

DEAD = -1  # on a request's queue: the engine's step loop has ended; no more tokens will come


class EngineDeadError(RuntimeError):
    """The step loop has ended (vLLM's EngineDeadError): a request can be neither taken nor finished."""

    def __init__(self) -> None:
        super().__init__("EngineCore encountered an issue. See stack trace (above) for the root cause.")


@dataclass(eq=False)
class SimRequest:
    """One sequence in the engine and the queue its tokens arrive on (None once it has finished; DEAD
    where the engine's step loop ended first).

    `finished_reason` is vLLM's for its last token: `length` where `max_tokens` cut it, `stop` where the
    answer ends there on its own (its end of sequence)."""

    seq: EngineSequence
    finished_reason: str = "length"
    tokens: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    last_token_at: float | None = None


class _Metrics:
    """vLLM's metric names, so anything that reads vLLM's /metrics reads the simulator's."""

    def __init__(self, model: str, config: SchedulerConfig, lora: LoraManager | None) -> None:
        self.registry = CollectorRegistry()
        self.values = (model, "0")
        labels = ["model_name", "engine"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.waiting_by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
            "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
            "status). Sum of all reasons equals vllm:num_requests_waiting.",
            [*labels, "reason"],
            registry=r,
        )
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=r,
        )
        for reason in _FINISHED_REASONS:  # vLLM exports every reason from the start, at 0
            self.success.labels(*self.values, reason)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token in seconds.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Inter-token latency in seconds.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency in seconds.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the KV cache config.",
            ["block_size", "num_gpu_blocks", "enable_prefix_caching"],
            registry=r,
        )
        info.labels(str(config.block_size), str(config.num_blocks), str(config.enable_prefix_caching)).set(1)
        self.lora = LoraMetrics(r, self.values, lora) if lora is not None else None


def _launch_time(batch: Batch, now: float, last_finish: float) -> float:
    """When a batch starts in simulated time: back to back with the step before it, as on the GPU.

    The event loop wakes a little after a step's finish time (more on a busy host); starting the next step at
    the wake-up time would add that lateness to every step and make the engine slower than its model. A step
    still never starts before the newest of its requests arrived, nor in the future.
    """
    arrived = max((seq.arrival for seq, _ in batch.work), default=last_finish)
    return min(now, max(last_finish, arrived))


class SimEngine:
    """Runs the scheduler in real time; requests go in with `submit`, tokens come out on their queues."""

    def __init__(
        self,
        model: str,
        perf: PerfModel,
        config: SchedulerConfig,
        time_scale: float = 1.0,
        lora: LoraManager | None = None,
    ) -> None:
        self.model = model
        self.perf = perf
        self.config = config
        self.time_scale = time_scale
        self.lora = lora
        self.metrics = _Metrics(model, config, lora)
        self._lora_scheduler: LoraScheduler | None = None
        self._pipeline: StepPipeline
        if lora is None:
            self.scheduler = Scheduler(config)
            self._pipeline = StepPipeline(perf)
        else:
            self._lora_scheduler = LoraScheduler(config, lora.options.max_loras)
            self.scheduler = self._lora_scheduler
            self._pipeline = LoraStepPipeline(perf, self._lora_scheduler, lora)
        self._requests: dict[int, SimRequest] = {}
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._t0: float | None = None
        self._reported = (0, 0, 0)
        self.kv_events: KvEventPublisher | None = None  # set to publish the cache's changes
        self.dead = False  # the step loop has ended (died or stopped): nothing more is taken or finished

    def now(self) -> float:
        """Simulated seconds since the engine started."""
        loop = asyncio.get_running_loop()
        if self._t0 is None:
            self._t0 = loop.time()
        return (loop.time() - self._t0) * self.time_scale

    def submit(
        self,
        prompt: list[int],
        max_tokens: int,
        cache_salt: str | None = None,
        adapter: Adapter | None = None,
        finished_reason: str = "length",
    ) -> SimRequest:
        """A sequence of `max_tokens` output tokens; ValueError where it needs more KV than the cache has.

        The last token's KV is never computed, so a sequence needs KV for `prompt + max_tokens - 1`
        tokens (all of them with `reserve_whole`, which reserves that much)."""
        if self.dead:
            raise EngineDeadError()
        needed = len(prompt) + max_tokens - (0 if self.config.reserve_whole else 1)
        if needed > self.config.num_blocks * self.config.block_size:
            raise ValueError("the request needs more KV cache than the engine has")
        if adapter is not None:  # vLLM hashes the adapter's name into every block: no sharing across them
            cache_salt = f"lora:{adapter.name}\x00{cache_salt or ''}"
        seq = EngineSequence(
            id=next(self._ids),
            prompt_len=len(prompt),
            max_tokens=max_tokens,
            arrival=self.now(),
            hashes=(
                block_hashes(prompt, self.config.block_size, cache_salt)
                if self.config.enable_prefix_caching
                else []
            ),
            tokens=prompt if self.kv_events is not None else (),
        )
        request = SimRequest(seq, finished_reason)
        self._requests[seq.id] = request
        if self._lora_scheduler is not None:
            self._lora_scheduler.add_with(seq, adapter)
        else:
            self.scheduler.add(seq)
        self._wake.set()
        return request

    def abort(self, request: SimRequest) -> None:
        """Drop a request (its client went away); not counted as finished."""
        if self._requests.pop(request.seq.id, None) is not None and request.seq.finished_at is None:
            self.scheduler.abort(request.seq)

    def finish(self, request: SimRequest, reason: str = "stop") -> None:
        """End a request at the token it has reached, as vLLM's output processor ends one whose text hit a
        stop string: its KV is freed, it counts as finished with `reason`, its queue gets None."""
        seq = request.seq
        if self._requests.pop(seq.id, None) is None or seq.finished_at is not None:
            return
        self.scheduler.abort(seq)
        seq.finished_at = seq.last_token_at if seq.last_token_at is not None else self.now()
        self._count_finished(seq, reason)
        request.tokens.put_nowait(None)

    async def load_adapter(self, adapter: Adapter, reload: bool = False) -> None:
        """vLLM's `add_lora`: between two steps the engine reads the adapter and gives it a GPU slot, no
        step running meanwhile; returns once that is done."""
        if self.lora is None:
            raise RuntimeError("LoRA is not enabled")
        now = self.now()
        pipeline, lora = self._pipeline, self.lora
        start = max(now, lora.busy_until, pipeline.next_finish if pipeline.busy else now)
        lora.busy_until = start + lora.make_resident([adapter], reload=reload)
        await asyncio.sleep((lora.busy_until - now) / self.time_scale)

    async def run(self) -> None:
        """The step loop; runs until cancelled. However it ends, the requests in the engine are told (DEAD
        on their queues: they would wait for tokens for good) and no more are taken."""
        try:
            await self._steps()
        finally:
            self.dead = True
            requests, self._requests = self._requests, {}
            for request in requests.values():
                request.tokens.put_nowait(DEAD)

    async def _steps(self) -> None:
        pipeline = self._pipeline
        last_finish = 0.0
        while True:
            now = self.now()
            while pipeline.has_room and (batch := self.scheduler.schedule()) is not None:
                pipeline.launch(batch, _launch_time(batch, now, last_finish))
            self._publish_gauges()
            if not pipeline.busy:
                self._wake.clear()
                await self._wake.wait()
                continue
            delay = max(0.0, (pipeline.next_finish - self.now()) / self.time_scale)
            if pipeline.has_room:  # a free pipeline slot: an arrival may start a batch before this one ends
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), delay)
                    continue
                except TimeoutError:
                    pass
            else:
                await asyncio.sleep(delay)
            finished_at, batch = pipeline.pop()
            last_finish = finished_at
            for seq in self.scheduler.complete(batch, finished_at):
                self._deliver(seq)
            self._count_batch(batch)
            if self.kv_events is not None:
                self.kv_events.publish()

    def _deliver(self, seq: EngineSequence) -> None:
        m, values = self.metrics, self.metrics.values
        request = self._requests.get(seq.id)
        if seq.generated == 1:  # its prefill is done: vLLM counts the whole prompt here, once
            m.ttft.labels(*values).observe(seq.first_token_at - seq.arrival)  # type: ignore[operator]
            m.prompt_tokens.labels(*values).inc(seq.prompt_len)
        if request is not None:
            if request.last_token_at is not None:
                m.itl.labels(*values).observe(seq.last_token_at - request.last_token_at)  # type: ignore[operator]
            request.last_token_at = seq.last_token_at
            request.tokens.put_nowait(seq.generated)
        if seq.finished:
            self._count_finished(seq, request.finished_reason if request is not None else "length")
            if request is not None:
                request.tokens.put_nowait(None)
                self._requests.pop(seq.id, None)

    def _count_finished(self, seq: EngineSequence, reason: str) -> None:
        m, values = self.metrics, self.metrics.values
        m.e2e.labels(*values).observe(seq.finished_at - seq.arrival)  # type: ignore[operator]
        m.success.labels(*values, reason).inc()

    def _count_batch(self, batch: Batch) -> None:
        m, values = self.metrics, self.metrics.values
        m.generation_tokens.labels(*values).inc(batch.decode_tokens)

    def _publish_gauges(self) -> None:
        m, values, s = self.metrics, self.metrics.values, self.scheduler
        m.running.labels(*values).set(len(s.running))
        m.waiting.labels(*values).set(len(s.waiting))
        m.kv_usage.labels(*values).set(s.kv_usage)
        lora_scheduler = self._lora_scheduler
        deferred = min(lora_scheduler.deferred, len(s.waiting)) if lora_scheduler is not None else 0
        m.waiting_by_reason.labels(*values, "capacity").set(len(s.waiting) - deferred)
        m.waiting_by_reason.labels(*values, "deferred").set(deferred)
        if m.lora is not None and lora_scheduler is not None:
            m.lora.publish(lora_scheduler)
        queries, hits, preemptions = s.prefix_queries, s.prefix_hits, s.preemptions
        last_q, last_h, last_p = self._reported
        m.prefix_queries.labels(*values).inc(queries - last_q)
        m.prefix_hits.labels(*values).inc(hits - last_h)
        m.preemptions.labels(*values).inc(preemptions - last_p)
        self._reported = (queries, hits, preemptions)
