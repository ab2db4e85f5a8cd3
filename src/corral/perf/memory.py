"""GPU memory the way vLLM accounts it: weights, activation peak, overhead, and what is left for KV cache.

vLLM gives the KV cache what remains of `memory × gpu_memory_utilization` after the weights, the peak
activation memory of a profiling forward pass over `max_num_batched_tokens`, and non-torch memory (CUDA
context, NCCL buffers, CUDA graphs). The cache is paged in blocks of `block_size` tokens. Formulas:

    stage layers = ⌈layers/pp⌉  (the busiest stage: vLLM splits an uneven count, get_pp_indices)
    weights/GPU  = (body · stage/layers + embeddings/(2 if pp>1 and untied else 1)) / tp  [+ replicated KV
                   projections]
    KV bytes/token/layer = 2 · ceil(kv_heads/tp) · head_dim · kv_bytes  (MLA: (kv_rank + rope_dim) · bytes)
    KV bytes/sequence(L) = (full_layers · L · b + local_layers · min(L, window) · b) · stage/layers
    kv_tokens    = ⌊kv_bytes / (block_size · bytes/token over all layers)⌋ · block_size
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from corral.perf.catalog import GPU, ModelArch, Quantization

__all__ = [
    "GIB",
    "MemoryPlan",
    "kv_bytes_per_token_layer",
    "memory_plan",
    "sequence_kv_bytes",
    "stage_layers",
    "weight_bytes",
]

GIB = 1024**3
BLOCK_SIZE = 16
DEFAULT_BATCHED_TOKENS = 2048
DEFAULT_MAX_SEQS = 256
_OVERHEAD_BYTES = 1.0 * GIB  # CUDA context, allocator slack and CUDA graphs, as vLLM reports them
_TP_OVERHEAD_BYTES = 0.25 * GIB  # NCCL buffers with tensor/pipeline parallelism


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU memory of one replica layout, in bytes, and the KV capacity it leaves."""

    weights: float
    activation: float
    overhead: float
    budget: float
    kv_bytes: float
    kv_tokens: int
    kv_bytes_per_token: float  # over this GPU's layers, all of them counted as full attention

    @property
    def fits(self) -> bool:
        return self.kv_bytes >= BLOCK_SIZE * self.kv_bytes_per_token

    def max_sequences(self, model: ModelArch, context: int, tp: int, pp: int, kv_dtype_bytes: float) -> int:
        """How many sequences of `context` tokens the KV cache holds at once."""
        per_seq = sequence_kv_bytes(model, context, tp, pp, kv_dtype_bytes)
        return int(self.kv_bytes // per_seq) if per_seq > 0 else 0


def weight_bytes(model: ModelArch, quant: Quantization) -> float:
    """All weights of the model in this format (embeddings stay 16-bit unless the format quantizes them)."""
    embed = model.embedding_params
    body = model.params - embed
    embed_bytes = embed * (quant.bytes_per_weight if quant.quantize_embeddings else 2.0)
    return body * quant.bytes_per_weight + embed_bytes


def stage_layers(model: ModelArch, pp: int) -> int:
    """The layers of the busiest pipeline stage: an uneven count (DeepSeek-V3's 61 on 2 stages) gives its
    remainder to stages one each (vLLM's get_pp_indices), so one holds ⌈layers/pp⌉."""
    return -(-model.layers // pp)


def _weights_per_gpu(model: ModelArch, quant: Quantization, tp: int, pp: int) -> float:
    embed = model.embedding_params * (quant.bytes_per_weight if quant.quantize_embeddings else 2.0)
    body = weight_bytes(model, quant) - embed
    stage_embed = embed / 2 if pp > 1 and not model.tied_embeddings else embed
    stage = stage_layers(model, pp)
    per_gpu = (body * stage / model.layers + stage_embed) / tp
    if model.mla_kv_rank is None and tp > model.kv_heads:  # each rank keeps a whole KV head
        kv_proj = 2 * model.hidden * model.head_dim * quant.bytes_per_weight * stage
        per_gpu += kv_proj * (1 - model.kv_heads / tp)
    return per_gpu


def kv_bytes_per_token_layer(model: ModelArch, tp: int, kv_dtype_bytes: float) -> float:
    """KV bytes one token occupies in one layer on one GPU."""
    if model.mla_kv_rank is not None:  # the latent is replicated on every TP rank
        return (model.mla_kv_rank + model.mla_rope_dim) * kv_dtype_bytes
    heads_per_gpu = math.ceil(model.kv_heads / tp)
    return 2 * heads_per_gpu * model.head_dim * kv_dtype_bytes


def _local_layers(model: ModelArch) -> tuple[int, int]:
    """(layers with a local window, that window), for sliding-window or chunked attention."""
    if model.sliding_window and model.sliding_layers:
        return model.sliding_layers, model.sliding_window
    if model.attention_chunk and model.chunked_layers:
        return model.chunked_layers, model.attention_chunk
    return 0, 0


def sequence_kv_bytes(model: ModelArch, context: int, tp: int, pp: int, kv_dtype_bytes: float) -> float:
    """KV bytes one sequence of `context` tokens needs on one GPU (the busiest pipeline stage)."""
    per_layer = kv_bytes_per_token_layer(model, tp, kv_dtype_bytes)
    local, window = _local_layers(model)
    full = model.layers - local
    blocks = math.ceil(context / BLOCK_SIZE) * BLOCK_SIZE
    local_tokens = min(blocks, math.ceil(window / BLOCK_SIZE) * BLOCK_SIZE + BLOCK_SIZE) if local else 0
    return (full * blocks + local * local_tokens) * per_layer * stage_layers(model, pp) / model.layers


def memory_plan(
    model: ModelArch,
    gpu: GPU,
    quant: Quantization,
    *,
    tp: int = 1,
    pp: int = 1,
    gpu_memory_utilization: float = 0.9,
    kv_dtype_bytes: float = 2.0,
    max_num_batched_tokens: int = DEFAULT_BATCHED_TOKENS,
    max_num_seqs: int = DEFAULT_MAX_SEQS,
    kv_cache_bytes: float | None = None,
) -> MemoryPlan:
    """Memory of one GPU of a replica. `kv_cache_bytes` fixes the KV size (vLLM's CPU backend does)."""
    weights = _weights_per_gpu(model, quant, tp, pp)
    experts_active = max(1, model.active_experts) if model.experts else 1
    ffn_active = model.ffn * experts_active
    activation = max_num_batched_tokens * (4 * model.hidden + 2 * ffn_active / tp) * 2.0
    activation += min(max_num_batched_tokens, max_num_seqs) * model.vocab / tp * 4.0 * 2
    overhead = _OVERHEAD_BYTES + (_TP_OVERHEAD_BYTES if tp * pp > 1 else 0.0)
    budget = gpu.memory_bytes * gpu_memory_utilization
    if kv_cache_bytes is None:
        kv_bytes = max(0.0, budget - weights - activation - overhead)
    else:
        kv_bytes = kv_cache_bytes
    per_token = kv_bytes_per_token_layer(model, tp, kv_dtype_bytes) * stage_layers(model, pp)
    kv_tokens = int(kv_bytes // (per_token * BLOCK_SIZE)) * BLOCK_SIZE if per_token > 0 else 0
    return MemoryPlan(weights, activation, overhead, budget, kv_bytes, kv_tokens, per_token)
