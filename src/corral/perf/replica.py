"""One replica as the performance model sees it: its step times and its scheduler's limits and KV blocks.

The simulator runs this in real time; the planner and the feed-forward autoscaler in virtual time.
"""

from __future__ import annotations

from dataclasses import dataclass

from corral.perf.catalog import Catalog
from corral.perf.memory import BLOCK_SIZE, memory_plan
from corral.perf.scheduler import SchedulerConfig
from corral.perf.timing import Efficiency, PerfModel

__all__ = ["ReplicaLayout", "ReplicaModel", "replica_model"]


@dataclass(frozen=True)
class ReplicaLayout:
    """A model on a GPU layout, with vLLM's limits."""

    model: str
    gpu: str
    quant: str | None = None
    tp: int = 1
    pp: int = 1
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    gpu_memory_utilization: float = 0.9
    kv_cache_gib: float | None = None
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class ReplicaModel:
    name: str  # the model's name in the catalog
    perf: PerfModel
    config: SchedulerConfig
    kv_tokens: int
    vocab: int
    max_context: int


def replica_model(layout: ReplicaLayout, catalog: Catalog, efficiency: Efficiency) -> ReplicaModel:
    """Step times and scheduler limits of one replica; ValueError when the model does not fit."""
    arch = catalog.models.get(layout.model)
    gpu = catalog.gpus.get(layout.gpu)
    quant = catalog.quantizations.get(layout.quant or arch.native_quant or "bf16")
    memory = memory_plan(
        arch,
        gpu,
        quant,
        tp=layout.tp,
        pp=layout.pp,
        gpu_memory_utilization=layout.gpu_memory_utilization,
        max_num_batched_tokens=layout.max_num_batched_tokens,
        max_num_seqs=layout.max_num_seqs,
        kv_cache_bytes=layout.kv_cache_gib * 1024**3 if layout.kv_cache_gib is not None else None,
    )
    if memory.kv_tokens < BLOCK_SIZE:
        raise ValueError(f"{arch.name} does not fit on {gpu.name} with TP={layout.tp} PP={layout.pp}")
    config = SchedulerConfig(
        max_num_seqs=layout.max_num_seqs,
        max_num_batched_tokens=layout.max_num_batched_tokens,
        num_blocks=memory.kv_tokens // BLOCK_SIZE,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=layout.enable_prefix_caching,
    )
    perf = PerfModel(arch, gpu, quant, tp=layout.tp, pp=layout.pp, efficiency=efficiency)
    return ReplicaModel(arch.name, perf, config, memory.kv_tokens, arch.vocab, arch.max_context)
