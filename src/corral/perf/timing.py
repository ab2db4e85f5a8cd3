"""Time of one engine step, from a roofline over the step's work.

A step runs a batch of decode tokens and prefill chunks through every layer. Per pipeline stage:

    memory  = (dense weights + MoE experts the batch touches) / (tp·pp) + KV read for attention
    compute = (2 · active_params · tokens + 4 · layers · heads · head_dim · attended pairs) / (tp·pp)
    stage   = max(memory / (bandwidth · eff_bw), compute / (tflops · eff_compute)) + TP all-reduces
    step    = overhead + pp · stage + (pp − 1) · hop

Decode is memory-bound (the weights are read once per step whatever the batch), prefill compute-bound, and
a mixed step (chunked prefill) costs the larger of the two: prefill tokens ride along decode steps up to
the compute roof. The efficiencies and the per-step overhead are calibrated (see `calibration.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from corral.perf.catalog import GPU, ModelArch, Quantization
from corral.perf.memory import kv_bytes_per_token_layer, weight_bytes

__all__ = ["Efficiency", "PerfModel", "StepBreakdown"]


@dataclass(frozen=True)
class Efficiency:
    """Calibrated factors: achieved fraction of datasheet bandwidth and compute, fixed costs per step."""

    bandwidth: float = 0.894
    compute: float = 0.9
    step_overhead_s: float = 0.001
    comm_latency_s: float = 15e-6


@dataclass(frozen=True)
class StepBreakdown:
    """Where one step's time goes (seconds). Per pipeline stage the memory reads (weights, KV) and the
    compute overlap: the stage takes the larger, `bound` says which; communication and the fixed overhead
    add to it."""

    weights_s: float  # reading the weights the step touches, all stages
    kv_s: float  # reading the KV cache the step attends over, all stages
    compute_s: float  # the step's FLOPs, all stages
    communication_s: float  # tensor-parallel all-reduces and pipeline hops
    overhead_s: float  # fixed per step (scheduling, kernel launches), calibrated
    bound: str  # "memory" or "compute"

    @property
    def total_s(self) -> float:
        return max(self.weights_s + self.kv_s, self.compute_s) + self.communication_s + self.overhead_s


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
        return self.gpu.bf16_tflops

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
        return self.breakdown(decode_tokens, decode_context, prefill_tokens, prefill_pairs).total_s

    def breakdown(
        self, decode_tokens: int, decode_context: int, prefill_tokens: int = 0, prefill_pairs: float = 0.0
    ) -> StepBreakdown:
        """The step's time by part (`corral plan --explain`); the parts make up `step_time` exactly."""
        tokens = decode_tokens + prefill_tokens
        m, eff, shards = self.model, self.efficiency, self.tp * self.pp
        dense, experts = self._weight_split()
        if experts:
            touched = 1 - (1 - m.active_experts / m.experts) ** tokens
            weights = dense + experts * touched
        else:
            weights = dense
        kv_layer = kv_bytes_per_token_layer(m, self.tp, self.kv_dtype_bytes)
        prefill_kv = prefill_pairs / prefill_tokens if prefill_tokens else 0.0  # about the chunks' context
        kv_read = (decode_context + prefill_kv) * kv_layer * m.layers
        bandwidth = self.gpu.bandwidth_gbs * 1e9 * eff.bandwidth
        attention = 4 * m.layers * m.heads * m.head_dim * (decode_context + prefill_pairs)
        flops = (2 * m.active_params * tokens + attention) / shards
        weights_s = self.pp * weights / shards / bandwidth
        kv_s = kv_read / bandwidth
        compute_s = self.pp * flops / (self.tflops * 1e12 * eff.compute)
        hop = tokens * m.hidden * 2 / (self.gpu.interconnect_gbs * 1e9) + eff.comm_latency_s
        communication_s = self._allreduce(tokens) * 2 * m.layers + (self.pp - 1) * hop
        bound = "memory" if weights_s + kv_s >= compute_s else "compute"
        return StepBreakdown(weights_s, kv_s, compute_s, communication_s, eff.step_overhead_s, bound)

    def _allreduce(self, tokens: int) -> float:
        if self.tp == 1:
            return 0.0
        size = tokens * self.model.hidden * 2
        ring = 2 * (self.tp - 1) / self.tp * size / (self.gpu.interconnect_gbs * 1e9)
        return ring + self.efficiency.comm_latency_s
