"""The vLLM-compatible simulated engine, timed by the performance model."""

from __future__ import annotations

from dataclasses import dataclass

from corral.perf import Catalog, Efficiency
from corral.perf.replica import ReplicaLayout, replica_model
from corral.sim.engine import SimEngine, SimRequest
from corral.sim.kv_events import KvEventPublisher, offset_endpoint
from corral.sim.server import SimFleet, SimServer

__all__ = [
    "SimEngine",
    "SimFleet",
    "SimOptions",
    "SimRequest",
    "SimServer",
    "build_server",
    "offset_endpoint",
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


def build_server(options: SimOptions, catalog: Catalog, efficiency: Efficiency) -> SimServer:
    """A simulated replica whose KV capacity and step times are the planner's for the same layout."""
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
    engine = SimEngine(
        options.served_name or replica.name, replica.perf, replica.config, time_scale=options.time_scale
    )
    if options.kv_events_endpoint and options.enable_prefix_caching and options.embed_dim is None:
        engine.kv_events = KvEventPublisher(options.kv_events_endpoint, engine.scheduler)
    max_len = options.max_model_len or min(replica.max_context, replica.kv_tokens)
    return SimServer(
        engine, max_model_len=max_len, vocab=replica.vocab, embed_dim=options.embed_dim, eos=options.eos
    )
