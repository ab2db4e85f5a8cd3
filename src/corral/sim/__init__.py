"""The vLLM-compatible simulated engine, timed by the performance model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from corral.perf import GIB, Catalog, Efficiency, PerfModel
from corral.perf.memory import kv_bytes_per_token_layer
from corral.perf.replica import ReplicaLayout, ReplicaModel, replica_model
from corral.sim.engine import SimEngine, SimRequest
from corral.sim.fleet import SimFleet
from corral.sim.kv_events import KvEventPublisher, offset_endpoint
from corral.sim.lora import LoraCosts, LoraManager, LoraModule, LoraOptions, parse_lora_module
from corral.sim.lora_api import load_static
from corral.sim.server import SimServer

__all__ = [
    "LoraModule",
    "LoraOptions",
    "SimEngine",
    "SimFleet",
    "SimOptions",
    "SimRequest",
    "SimServer",
    "build_server",
    "offset_endpoint",
    "parse_lora_module",
]


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
    embed_dim: int | None = None  # an embedding model making vectors of this size
    kv_events_endpoint: str | None = None  # publish KV-cache events there, as vLLM's --kv-events-config
    eos: bool = (
        False  # answers end at a drawn end of sequence even with max_tokens (else: exactly max_tokens)
    )
    lora: LoraOptions | None = None  # vLLM's --enable-lora with its limits and --lora-modules
    runtime_lora_updating: bool = False  # the load/unload endpoints (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)


def build_server(options: SimOptions, catalog: Catalog, efficiency: Efficiency) -> SimServer:
    """A simulated replica whose KV capacity and step times are the planner's for the same layout;
    ValueError where it cannot start, in vLLM's words (a max_model_len the KV cache cannot hold, an adapter
    of --lora-modules it cannot load). Without max_model_len it is the model's context, or the KV cache's
    size where that is smaller."""
    if options.lora is not None and options.embed_dim is not None:
        raise ValueError("the simulator serves LoRA adapters on generation models, not embedding models")
    layout = ReplicaLayout(
        model=options.model,
        gpu=options.gpu,
        quant=options.quant,
        tp=options.tp,
        pp=options.pp,
        max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens,
        gpu_memory_utilization=options.gpu_memory_utilization,
        kv_cache_gib=options.kv_cache_gib,
        enable_prefix_caching=options.enable_prefix_caching,
    )
    replica = replica_model(layout, catalog, efficiency)
    lora = None
    if options.lora is not None:
        costs = LoraCosts(replica.perf, options.lora.max_lora_rank)
        if options.kv_cache_gib is None:
            replica = _with_lora_slots(
                replica, layout, costs.slot_bytes(options.lora.max_loras), catalog, efficiency
            )
        lora = LoraManager(options.lora, costs, world_size=options.tp * options.pp)
    name = options.served_name or replica.name
    engine = SimEngine(name, replica.perf, replica.config, time_scale=options.time_scale, lora=lora)
    if options.kv_events_endpoint and options.enable_prefix_caching and options.embed_dim is None:
        engine.kv_events = KvEventPublisher(options.kv_events_endpoint, engine.scheduler)
    for module in options.lora.modules if options.lora is not None else ():
        load_static(engine, module)
    capacity = replica.config.num_blocks * replica.config.block_size
    max_len = options.max_model_len or min(replica.max_context, capacity)
    if max_len > capacity:  # vLLM does not start: one sequence of max_model_len must fit the KV cache
        per_token = _kv_bytes_per_token(replica.perf)
        raise ValueError(
            f"To serve at least one request with the models's max seq len ({max_len}), "
            f"({max_len * per_token / GIB:.2f} GiB KV cache is needed, which is larger than the available KV "
            f"cache memory ({capacity * per_token / GIB:.2f} GiB). Based on the available memory, the "
            f"estimated maximum model length is {capacity}. Try increasing `gpu_memory_utilization` or "
            "decreasing `max_model_len` when initializing the engine."
        )
    return SimServer(
        engine,
        max_model_len=max_len,
        vocab=replica.vocab,
        embed_dim=options.embed_dim,
        eos=options.eos,
        root=replica.name,
        runtime_lora_updating=options.runtime_lora_updating,
    )


def _with_lora_slots(
    replica: ReplicaModel, layout: ReplicaLayout, slot_bytes: float, catalog: Catalog, efficiency: Efficiency
) -> ReplicaModel:
    """The replica with its KV cache smaller by the GPU memory vLLM reserves for its LoRA slots."""
    kv_bytes = max(0.0, replica.kv_tokens * _kv_bytes_per_token(replica.perf) - slot_bytes)
    return replica_model(dataclasses.replace(layout, kv_cache_gib=kv_bytes / GIB), catalog, efficiency)


def _kv_bytes_per_token(perf: PerfModel) -> float:
    """The KV cache one token takes on each GPU."""
    return kv_bytes_per_token_layer(perf.model, perf.tp, perf.kv_dtype_bytes) * perf.model.layers / perf.pp
