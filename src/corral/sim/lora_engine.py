"""The scheduler and step pipeline of a simulated replica serving LoRA adapters (sim/lora.py's model).

`LoraScheduler` adds vLLM's `max_loras` rule to the shared scheduler: a waiting request whose adapter would
make one distinct adapter more than `max_loras` among the running requests is skipped this step, and those
behind it still get their turn (vLLM's `skip_request`); skipped ones keep their place at the head of the
queue. The shared scheduler admits in queue order and stops at the first request it cannot admit, so taking
the skipped requests out of the queue for one `schedule()` call is exactly vLLM's walk. Running requests
count for the rule whether or not they are in this step (they hold their adapter's GPU slot).

`LoraStepPipeline` times a batch as vLLM's worker runs it: the batch's adapters are made resident first
(disk reads, slot copies: the step waits for them), then the forward pass pays the LoRA kernels.

`LoraMetrics` exports vLLM's `vllm:lora_requests_info` as vLLM does (one series per combination of labels
`max_lora`, `running_lora_adapters`, `waiting_lora_adapters`, the adapters' names joined by commas; its
value the Unix time it was last current: the newest series is the present) and the simulator's own
counters `sim:lora_loads_total` (adapters read from disk) and `sim:lora_activations_total` (copied into
a GPU slot).
"""

from __future__ import annotations

import heapq
import math
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge

from corral.perf import Batch, EngineSequence, PerfModel, Scheduler, SchedulerConfig, StepPipeline
from corral.sim.lora import Adapter, LoraManager

__all__ = ["LoraMetrics", "LoraScheduler", "LoraStepPipeline"]


class LoraScheduler(Scheduler):
    """The shared scheduler with each sequence's adapter and vLLM's limit on adapters per batch."""

    def __init__(self, config: SchedulerConfig, max_loras: int) -> None:
        super().__init__(config)
        self.max_loras = max_loras
        self._adapters: dict[EngineSequence, Adapter] = {}
        self._done: list[EngineSequence] = []  # finished: their adapter is kept for this step's KV events
        self.deferred = 0  # waiting sequences the last step skipped for max_loras

    def add_with(self, seq: EngineSequence, adapter: Adapter | None) -> None:
        if adapter is not None:
            self._adapters[seq] = adapter
        self.add(seq)

    def adapter_of(self, seq: EngineSequence) -> Adapter | None:
        return self._adapters.get(seq)

    def names(self, seqs: list[EngineSequence] | deque[EngineSequence]) -> list[str]:
        """The distinct adapters of `seqs`, in order (vLLM's `running_lora_adapters` label)."""
        named = (self._adapters.get(seq) for seq in seqs)
        return list(dict.fromkeys(adapter.name for adapter in named if adapter is not None))

    def abort(self, seq: EngineSequence) -> None:
        super().abort(seq)
        self._adapters.pop(seq, None)

    def complete(self, batch: Batch, now: float) -> list[EngineSequence]:
        produced = super().complete(batch, now)
        self._done.extend(seq for seq in produced if seq.finished)
        return produced

    def schedule(self) -> Batch | None:
        for seq in self._done:
            self._adapters.pop(seq, None)
        self._done.clear()
        skipped = self._over_the_limit()
        self.deferred = len(skipped)
        if not skipped:
            return super().schedule()
        queue = self.waiting
        self.waiting = deque(seq for seq in queue if seq not in skipped)
        try:
            return super().schedule()
        finally:
            left, queued = self.waiting, set(queue)
            kept = set(left)
            preempted = [seq for seq in left if seq not in queued]  # put back at the head by this step
            self.waiting = deque([*preempted, *(s for s in queue if s in skipped or s in kept)])

    def _over_the_limit(self) -> set[EngineSequence]:
        """The waiting sequences vLLM's scheduler would skip this step for `max_loras`, admitting the
        others in order."""
        if not self._adapters or not self.waiting:
            return set()
        adapters = {a.id for seq in self.running if (a := self._adapters.get(seq)) is not None}
        skipped = set()
        for seq in self.waiting:
            adapter = self._adapters.get(seq)
            if adapter is None or adapter.id in adapters:
                continue
            if len(adapters) < self.max_loras:
                adapters.add(adapter.id)
            else:
                skipped.add(seq)
        return skipped


class LoraStepPipeline(StepPipeline):
    """The shared step pipeline, each step first waiting for its adapters and then paying their kernels.

    It overrides `launch` as a whole (the shared one has no place for a step's extra time), keeping its
    bookkeeping: a batch enters when the first stage is free, `duration / pp` later the next may.
    """

    def __init__(self, perf: PerfModel, scheduler: LoraScheduler, lora: LoraManager) -> None:
        super().__init__(perf)
        self._scheduler = scheduler
        self._lora = lora

    def decode_rounds(
        self, scheduler: Scheduler, now: float, until: float = math.inf
    ) -> tuple[float, list[tuple[list[EngineSequence], int]]] | None:
        """Never taken here: the rounds launch with the shared `launch`'s arithmetic, not this one's."""
        return None

    def launch(self, batch: Batch, now: float) -> float:
        adapters: dict[int, Adapter] = {}
        lora_tokens = 0
        for seq, count in batch.work:
            adapter = self._scheduler.adapter_of(seq)
            if adapter is not None:
                adapters.setdefault(adapter.id, adapter)
                lora_tokens += count
        ready = self._lora.make_resident(adapters.values())  # before the forward pass, which waits
        duration = self._perf.step_time(
            batch.decode_tokens, batch.decode_context, batch.prefill_tokens, batch.prefill_pairs
        ) + self._lora.costs.step_seconds(lora_tokens, len(adapters))
        start = max(now, self._entry_free_at, self._lora.busy_until) + ready
        self._entry_free_at = start + duration / self._perf.pp
        finish = start + duration
        heapq.heappush(self._in_flight, (finish, self._launched, batch))
        self._launched += 1
        return finish


class LoraMetrics:
    """The LoRA metrics of one simulated engine."""

    def __init__(self, registry: CollectorRegistry, values: tuple[str, str], lora: LoraManager) -> None:
        self._lora = lora
        self._values = values  # model_name, engine
        self._info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=registry,
        )
        labels = ["model_name", "engine"]
        self._loads = Counter(
            "sim:lora_loads",
            "Adapters read from disk into host memory (simulator).",
            labels,
            registry=registry,
        )
        self._activations = Counter(
            "sim:lora_activations", "Adapters copied into a GPU slot (simulator).", labels, registry=registry
        )
        self._reported = (0, 0)

    def publish(self, scheduler: LoraScheduler) -> None:
        lora, values = self._lora, self._values
        running, waiting = (
            ",".join(scheduler.names(scheduler.running)),
            ",".join(scheduler.names(scheduler.waiting)),
        )
        self._info.labels(str(lora.options.max_loras), waiting, running).set_to_current_time()
        loads, activations = lora.loads, lora.activations
        self._loads.labels(*values).inc(loads - self._reported[0])
        self._activations.labels(*values).inc(activations - self._reported[1])
        self._reported = (loads, activations)
