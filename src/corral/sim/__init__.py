"""The vLLM-compatible simulated engine, timed by the performance model."""

from __future__ import annotations

from dataclasses import dataclass

from corral.perf import BLOCK_SIZE, Catalog, Efficiency, PerfModel, SchedulerConfig, memory_plan
from corral.sim.engine import SimEngine, SimRequest
from corral.sim.server import SimFleet, SimServer

__all__ = ["SimEngine", "SimFleet", "SimOptions", "SimRequest", "SimServer", "build_server"]


@dataclass(frozen=True)
class SimOptions:
    """What a simulated replica emulates: a model on a GPU layout, with vLLM's limits."""

    model: str
    gpu: str
    served_name: str | None = None
    quant: str | None = None
    tp: int = 1
    pp: int = 1
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    gpu_memory_utilization: float = 0.9
    kv_cache_gib: float | None = None
    enable_prefix_caching: bool = True
    time_scale: float = 1.0


def build_server(options: SimOptions, catalog: Catalog, efficiency: Efficiency) -> SimServer:
    """A simulated replica whose KV capacity and step times are the planner's for the same layout."""
    arch = catalog.models.get(options.model)
    gpu = catalog.gpus.get(options.gpu)
    quant = catalog.quantizations.get(options.quant or arch.native_quant or "bf16")
    memory = memory_plan(
        arch,
        gpu,
        quant,
        tp=options.tp,
        pp=options.pp,
        gpu_memory_utilization=options.gpu_memory_utilization,
        max_num_batched_tokens=options.max_num_batched_tokens,
        max_num_seqs=options.max_num_seqs,
        kv_cache_bytes=options.kv_cache_gib * 1024**3 if options.kv_cache_gib is not None else None,
    )
    if memory.kv_tokens < BLOCK_SIZE:
        raise ValueError(f"{arch.name} does not fit on {gpu.name} with TP={options.tp} PP={options.pp}")
    config = SchedulerConfig(
        max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens,
        num_blocks=memory.kv_tokens // BLOCK_SIZE,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=options.enable_prefix_caching,
    )
    perf = PerfModel(arch, gpu, quant, tp=options.tp, pp=options.pp, efficiency=efficiency)
    engine = SimEngine(options.served_name or arch.name, perf, config, time_scale=options.time_scale)
    max_len = options.max_model_len or min(arch.max_context, memory.kv_tokens)
    return SimServer(engine, max_model_len=max_len, vocab=arch.vocab)
