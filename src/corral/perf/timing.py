"""Time of one engine step, from a roofline over the step's two kinds of kernels.

A step runs a batch of decode tokens and prefill chunks through every layer. Its kernels are of two kinds
that run one after the other: the linear layers (GEMMs: read the weights, multiply them by the batch's
tokens) and attention (read the KV cache, multiply queries by keys). Within a kind, memory reads and
compute overlap; how far is the fitted `overlap`: the kind takes the p-norm of its two times (p → ∞ is
the plain roofline's max, p = 1 their sum; near the ridge point a kernel is neither purely bound).
Per pipeline stage, at datasheet rates scaled by the fitted efficiencies:

    GEMMs     = ‖ (dense weights + MoE experts the batch touches) / (tp·pp) / bandwidth ,
                  2 · active_params · tokens / (tp·pp) / flops ‖_p
    attention = ‖ KV read / bandwidth , 4 · layers · heads · head_dim · attended pairs / (tp·pp) / flops ‖_p
    step      = overhead + pp · (GEMMs + attention of one stage) + TP all-reduces + (pp − 1) · hop

Decode's GEMMs are memory-bound (the weights are read once per step whatever the batch), prefill's
compute-bound; a large decode batch over long contexts pays for its KV reads on top of the weights, not
under them. All-reduces cost the GPU's measured bus bandwidth and latency (`allreduce_gbs`,
`allreduce_latency_us` in the catalog: NVLink, or PCIe where cards have none; a pipeline hop pays the
same latency). The efficiencies, the
overlap and the per-step overhead are fitted per engine family on published measurements
(`validation.py`, stored in `data/fitted.yaml`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Generic, TypeVar

import numpy as np
import numpy.typing as npt

from corral.perf.catalog import GPU, ModelArch, Quantization
from corral.perf.memory import kv_bytes_per_token_layer, weight_bytes

__all__ = ["Efficiency", "PerfModel", "StepBreakdown", "StepParts"]

Floats = npt.NDArray[np.float64]
Seconds = TypeVar("Seconds", float, Floats)


def _overlapped(memory_s: Seconds, compute_s: Seconds, p: float) -> Seconds:
    """A kernel's time from its reads' and its compute's: their p-norm (p = 1 a sum, large p their max)."""
    seconds: Seconds = (memory_s**p + compute_s**p) ** (1 / p)
    return seconds


@dataclass(frozen=True)
class Efficiency:
    """Fitted factors: achieved fraction of datasheet bandwidth and compute, how far reads and compute
    overlap within a kernel (the p of the p-norm), the fixed cost of a step, and the fixed cost of a
    request outside the engine's steps (the HTTP server, tokenizing the prompt, detokenizing and sending
    the first token), which a time to first token and a request's latency pay once: `request_overhead_s`,
    and `stream_overhead_s` more for each other request in flight when it arrives (one API server serves
    every stream, so the others' tokenizing, detokenizing and writing delay this one's way in and its
    first token's way out)."""

    # defaults: about the vLLM family's fit (the planner reads the stored fit, data/fitted.yaml)
    bandwidth: float = 0.78
    compute: float = 0.55
    step_overhead_s: float = 0.0026
    overlap: float = 1.5
    request_overhead_s: float = 0.0
    # KV reads' efficiency against weight reads': 1 on GPUs (paged attention reads the cache as fast as
    # the weights); fitted for the CPU engines, whose attention kernels read it far slower
    kv_reads: float = 1.0
    stream_overhead_s: float = 0.0  # (after kv_reads: the fit and the stored factors name it)

    def kernel(self, memory_s: Seconds, compute_s: Seconds) -> Seconds:
        """One kind of kernel's time from its reads and FLOPs at datasheet rates."""
        return _overlapped(memory_s / self.bandwidth, compute_s / self.compute, self.overlap)

    def step_seconds(self, parts: StepParts[Seconds]) -> Seconds:
        return (
            self.kernel(parts.weights, parts.gemm)
            + self.kernel(parts.kv / self.kv_reads, parts.attention)
            + parts.communication
            + self.step_overhead_s
        )


@dataclass(frozen=True)
class StepParts(Generic[Seconds]):
    """One step's (or, as arrays, many steps') work at datasheet rates, seconds: the GEMMs' weight reads
    and FLOPs, attention's KV reads and FLOPs (all stages), and communication (not scaled)."""

    weights: Seconds
    gemm: Seconds
    kv: Seconds
    attention: Seconds
    communication: Seconds


@dataclass(frozen=True)
class StepBreakdown:
    """Where one step's time goes (seconds, at the model's efficiencies): the GEMMs' weight reads and
    compute, attention's KV reads and compute, communication and the fixed overhead. Reads and compute of
    one kind overlap (`overlap`: the p of their p-norm); the kinds, communication and overhead add up."""

    weights_s: float
    gemm_s: float
    kv_s: float
    attention_s: float
    communication_s: float  # tensor-parallel all-reduces and pipeline hops
    overhead_s: float  # fixed per step (scheduling, kernel launches), fitted
    overlap: float

    @property
    def total_s(self) -> float:
        gemms = _overlapped(self.weights_s, self.gemm_s, self.overlap)
        attention = _overlapped(self.kv_s, self.attention_s, self.overlap)
        return gemms + attention + self.communication_s + self.overhead_s

    @property
    def bound(self) -> str:
        """ "memory" where reading weights and KV takes longer than the FLOPs, else "compute"."""
        return "memory" if self.weights_s + self.kv_s >= self.gemm_s + self.attention_s else "compute"


@dataclass(frozen=True)
class PerfModel:
    """One replica's model on its GPUs: the step-time function used by the planner and the simulator."""

    model: ModelArch
    gpu: GPU
    quant: Quantization
    tp: int = 1
    pp: int = 1
    kv_dtype_bytes: float = 2.0
    efficiency: Efficiency = Efficiency()

    @property
    def tflops(self) -> float:
        if self.quant.compute == "fp8" and self.gpu.fp8_tflops:
            return self.gpu.fp8_tflops
        if self.quant.compute == "int8" and self.gpu.int8_tops:
            return self.gpu.int8_tops
        return self.gpu.bf16_tflops

    @cached_property
    def _weights(self) -> tuple[float, float]:
        """`_weight_split()`, worked out once: a planner's search times millions of steps of one model."""
        return self._weight_split()

    @cached_property
    def _kv_layer(self) -> float:
        return kv_bytes_per_token_layer(self.model, self.tp, self.kv_dtype_bytes)

    def _weight_split(self) -> tuple[float, float]:
        """(dense bytes, routed-expert bytes) of the whole model."""
        total = weight_bytes(self.model, self.quant)
        m = self.model
        if not m.experts or not m.active_params_b:
            return total, 0.0
        share = m.active_experts / m.experts
        expert_params = (m.params - m.active_params) / (1 - share)
        expert_bytes = expert_params * self.quant.bytes_per_weight
        return total - expert_bytes, expert_bytes

    def step_time(
        self, decode_tokens: int, decode_context: int, prefill_tokens: int = 0, prefill_pairs: float = 0.0
    ) -> float:
        """Seconds for one step: `decode_context` is the sum of decode sequences' lengths, `prefill_pairs`
        the (query, key) pairs the prefill chunks attend over."""
        if decode_tokens + prefill_tokens == 0:
            return 0.0
        return self.step_function(
            float(decode_tokens), float(decode_context), float(prefill_tokens), float(prefill_pairs)
        )

    @cached_property
    def step_function(self) -> Callable[[float, float, float, float], float]:
        """`efficiency.step_seconds(parts(...))` for one step, as one function of the step's four figures
        with the model's constants taken out: a planner's search times millions of steps. The same
        operations in the same order as `parts` and `Efficiency.step_seconds`, so the same floats
        (tests/perf/test_timing.py)."""
        m, eff, pp, tp = self.model, self.efficiency, self.pp, self.tp
        shards = tp * pp
        dense, experts = self._weights
        share = 1 - m.active_experts / m.experts if experts else 0.0
        bandwidth = self.gpu.bandwidth_gbs * 1e9
        flops = self.tflops * 1e12
        interconnect = self.gpu.interconnect_gbs * 1e9
        latency = self.gpu.allreduce_latency_us * 1e-6
        hidden2 = m.hidden * 2
        gemm_scale = pp * 2 * m.active_params
        kv_layer, layers = self._kv_layer, m.layers
        attention_scale = pp * 4 * m.layers * m.heads * m.head_dim
        ring_scale = 2 * (tp - 1) / tp
        bus = self.gpu.allreduce_bus_gbs * 1e9
        layers2 = 2 * m.layers
        hops = pp - 1
        fixed_weights = pp * dense / shards / bandwidth
        bw_eff, compute_eff, p, kv_reads = eff.bandwidth, eff.compute, eff.overlap, eff.kv_reads
        inverse_p = 1 / p
        overhead = eff.step_overhead_s

        def step_seconds(decode: float, context: float, prefill: float, pairs: float) -> float:
            tokens = decode + prefill
            if experts:
                weights = pp * (dense + experts * (1 - share**tokens)) / shards / bandwidth
            else:
                weights = fixed_weights
            gemm = gemm_scale * tokens / shards / flops
            kv = (context + pairs / (prefill + (prefill == 0))) * kv_layer * layers / bandwidth
            attention = attention_scale * (context + pairs) / shards / flops
            allreduce = 0.0 if tp == 1 else ring_scale * (tokens * hidden2) / bus + latency
            communication = allreduce * layers2 + hops * (tokens * hidden2 / interconnect + latency)
            seconds: float = (
                ((weights / bw_eff) ** p + (gemm / compute_eff) ** p) ** inverse_p
                + ((kv / kv_reads / bw_eff) ** p + (attention / compute_eff) ** p) ** inverse_p
                + communication
                + overhead
            )
            return seconds

        return step_seconds

    def decode_seconds(self, sequences: int, context: int, steps: int) -> Floats:
        """Each step's time in a stretch of decode-only steps of the same `sequences`, the first over
        `context` tokens of KV, each next one over `sequences` more (the scheduler's `DecodeRun`)."""
        contexts = context + sequences * np.arange(steps, dtype=np.float64)
        none = np.zeros(steps)
        seconds: Floats = self.efficiency.step_seconds(self.parts(none + sequences, contexts, none, none))
        return seconds

    def breakdown(
        self, decode_tokens: int, decode_context: int, prefill_tokens: int = 0, prefill_pairs: float = 0.0
    ) -> StepBreakdown:
        """The step's time by part (`corral plan --explain`); the parts make up `step_time` exactly."""
        parts = self.parts(float(decode_tokens), float(decode_context), float(prefill_tokens), prefill_pairs)
        eff = self.efficiency
        return StepBreakdown(
            weights_s=parts.weights / eff.bandwidth,
            gemm_s=parts.gemm / eff.compute,
            kv_s=parts.kv / (eff.bandwidth * eff.kv_reads),
            attention_s=parts.attention / eff.compute,
            communication_s=parts.communication,
            overhead_s=eff.step_overhead_s,
            overlap=eff.overlap,
        )

    def parts(
        self, decode_tokens: Seconds, decode_context: Seconds, prefill_tokens: Seconds, prefill_pairs: Seconds
    ) -> StepParts[Seconds]:
        """The work of steps at datasheet rates: scalars for one step, arrays for a recorded trace."""
        tokens = decode_tokens + prefill_tokens
        m, shards = self.model, self.tp * self.pp
        dense, experts = self._weights
        weights = dense + experts * (1 - (1 - m.active_experts / m.experts) ** tokens) if experts else dense
        kv_layer = self._kv_layer
        prefill_kv = prefill_pairs / (prefill_tokens + (prefill_tokens == 0))  # about the chunks' context
        bandwidth = self.gpu.bandwidth_gbs * 1e9
        flops = self.tflops * 1e12
        hop = tokens * m.hidden * 2 / (self.gpu.interconnect_gbs * 1e9) + self.gpu.allreduce_latency_us * 1e-6
        return StepParts(  # `+ 0 * tokens`: an array per step where the steps come as arrays
            weights=self.pp * weights / shards / bandwidth + 0 * tokens,
            gemm=self.pp * 2 * m.active_params * tokens / shards / flops,
            kv=(decode_context + prefill_kv) * kv_layer * m.layers / bandwidth,
            attention=self.pp
            * 4
            * m.layers
            * m.heads
            * m.head_dim
            * (decode_context + prefill_pairs)
            / shards
            / flops,
            communication=self._allreduce(tokens) * 2 * m.layers + (self.pp - 1) * hop,
        )

    def _allreduce(self, tokens: Seconds) -> Seconds:
        if self.tp == 1:
            return 0 * tokens
        size = tokens * self.model.hidden * 2
        ring = 2 * (self.tp - 1) / self.tp * size / (self.gpu.allreduce_bus_gbs * 1e9)
        return ring + self.gpu.allreduce_latency_us * 1e-6
