"""LoRA adapters on a simulated replica: vLLM's registry and caches, and what adapters cost in time.

How vLLM 0.32 serves adapters (`vllm/lora/worker_manager.py`, `model_manager.py`, `peft_helper.py`,
`layers/`; `vllm/v1/core/sched/scheduler.py`), which the simulator follows:

- An adapter is a PEFT folder: `adapter_config.json` (`r`, `lora_alpha`, `target_modules`) and its tensors
  (`adapter_model.safetensors`, `.bin` or `.pt`). It is registered under a name (`--lora-modules`, or
  `POST /v1/load_lora_adapter`); a request whose `model` is that name runs with it.
- Its weights sit in two LRU caches: host memory holds `--max-cpu-loras` adapters
  (`LRUCacheWorkerLoRAManager`), the GPU `--max-loras` slots (`LRUCacheLoRAModelManager.activate_adapter`).
  Before a step's forward pass the worker makes the step's adapters resident: one not in host memory is
  read from disk (the least recently used one leaves, and with it its GPU slot), one without a GPU slot is
  copied into the least recently used slot. The step waits for both. Loading through the endpoint does
  the same between steps (`add_lora`: read, then activate) and answers once it is done.
- The scheduler lets at most `--max-loras` distinct adapters into the running batch (sim/lora_engine.py).
- A GPU slot is sized for `--max-lora-rank`: the adapter's `r` rows are copied in, the rest stay zero, and
  the LoRA kernels (shrink x·Aᵀ, then expand ·Bᵀ) compute over the whole slot on every linear layer vLLM
  wraps (q, k, v, o, gate, up, down), whatever the adapter targets; base-model tokens are skipped.
  Tensor parallelism shards half of it (`fully_sharded_loras` off): B of column-parallel layers, A of
  row-parallel ones.

Cost model, in simulated seconds. The adapter's own `r` and targets set its size; the slot's rank R
(`--max-lora-rank`) and all wrapped layers set the compute:

    size        = layers · Σ_targets r · (d_in + d_out) · 2 bytes             (an MoE's MLP: · experts)
    disk load   = 5 ms + size / 2 GB/s
    slot copy   = size per GPU / 25 GB/s + 10 µs per tensor copied (A and B of each target, each layer)
    LoRA/step   = kernel(reads / bandwidth, flops / compute) + 8 kernels · layers · 2 µs
       flops    = 2 · tokens of adapter requests · R · layers · Σ_wrapped (d_in·s_in + d_out·s_out)
       reads    = adapters in the batch · R · layers · Σ_wrapped (d_in·s_in + d_out·s_out) · 2 bytes

s is 1/tp on the sharded side, else 1; `kernel` is the replica's fitted roofline (perf/timing.py), at the
datasheet bandwidth and FLOPS of the simulated GPU. An MoE's MLP LoRA runs through each token's routed
experts and reads those the batch touches (as perf/timing.py counts expert weights). The slots take GPU
memory from the start (max_loras · R · every wrapped layer), so the KV cache is that much smaller
(`build_server`), and vLLM hashes the adapter's name into its prefix-cache blocks, so an adapter's prompts
share cached blocks only with that adapter's. Constants and where they come from:

- the size formula reproduces PEFT's files: tests/data/lora/corral-marker (SmolLM2-135M, r 8 on q_proj
  and v_proj) computes to 921,600 bytes; its adapter_model.safetensors is 937,024 (the rest is header);
- 5 ms fixed per disk load: measured on vLLM 0.32's CPU build on this machine, a request for that adapter
  once evicted from host memory against one for a resident adapter (page cache warm);
- 2 GB/s from disk: assumed, a data-centre NVMe's sequential read (3–7 GB/s) less safetensors parsing;
- 25 GB/s host to device: assumed, a pinned copy (vLLM pins its host-memory adapters) over PCIe Gen4 x16
  (32 GB/s raw); 10 µs per copy: assumed, the latency of a small cudaMemcpy;
- 2 µs per LoRA kernel: assumed, the gap between small kernels inside a CUDA graph; 8 kernels a layer
  (shrink and expand of qkv, o, gate_up and down).

The simulator counts its loads from disk and its slot copies (`sim:lora_loads_total`,
`sim:lora_activations_total`: the simulator's own metrics; vLLM exports only `vllm:lora_requests_info`).
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from corral.perf import ModelArch, PerfModel
from corral.sim.errors import VllmError

__all__ = [
    "Adapter",
    "LoraCosts",
    "LoraManager",
    "LoraModule",
    "LoraOptions",
    "engine_failure",
    "parse_lora_module",
]

DISK_OVERHEAD_S = 0.005
DISK_BYTES_PER_S = 2e9
HOST_TO_DEVICE_BYTES_PER_S = 25e9
COPY_LATENCY_S = 10e-6
KERNEL_GAP_S = 2e-6
KERNELS_PER_LAYER = 8
LORA_DTYPE_BYTES = 2  # vLLM's lora_dtype "auto": the model's dtype, bf16 or fp16 for LoRA weights
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's LoRAConfig.max_lora_rank choices
_TENSOR_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_ALIASES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "w1": ("gate_proj",),
    "w3": ("up_proj",),
    "w2": ("down_proj",),
}


@dataclass(frozen=True)
class LoraModule:
    """An adapter named at start-up, as vLLM's `--lora-modules` takes it."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(item: str) -> LoraModule:
    """`name=path`, or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`."""
    if "=" in item and "," not in item:
        name, path = item.split("=", 1)
        return LoraModule(name, path)
    try:
        fields = json.loads(item)
        return LoraModule(**fields)
    except json.JSONDecodeError:
        raise ValueError(f"Invalid JSON format for --lora-modules: {item}") from None
    except TypeError as exc:
        raise ValueError(f"Invalid fields for --lora-modules: {item} - {exc}") from None


@dataclass(frozen=True)
class LoraOptions:
    """vLLM's LoRA settings (`--enable-lora` and its limits) and the adapters loaded at start-up."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    modules: tuple[LoraModule, ...] = ()

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, not {self.max_loras}")
        if self.max_lora_rank not in MAX_LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {', '.join(map(str, MAX_LORA_RANKS))}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}).")

    @property
    def host_slots(self) -> int:
        return self.max_cpu_loras or self.max_loras


@dataclass(frozen=True)
class Adapter:
    """A registered adapter: vLLM's LoRARequest and what its config says."""

    name: str
    path: str  # as given (the /v1/models `root`)
    id: int  # vLLM's lora_int_id
    rank: int
    targets: tuple[str, ...]  # the linear layers it adapts, by their names in a Llama-style layer
    base_model_name: str | None = None


@dataclass(frozen=True)
class _Linear:
    d_in: int
    d_out: int
    column: bool  # column-parallel (its output is sharded); else row-parallel (its input is)
    mlp: bool


def _linears(m: ModelArch) -> dict[str, _Linear]:
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    return {
        "q_proj": _Linear(m.hidden, q, True, False),
        "k_proj": _Linear(m.hidden, kv, True, False),
        "v_proj": _Linear(m.hidden, kv, True, False),
        "o_proj": _Linear(q, m.hidden, False, False),
        "gate_proj": _Linear(m.hidden, m.ffn, True, True),
        "up_proj": _Linear(m.hidden, m.ffn, True, True),
        "down_proj": _Linear(m.ffn, m.hidden, False, True),
    }


def targeted_linears(target_modules: object) -> tuple[str, ...]:
    """The linear layers a PEFT `target_modules` names: a list of module names, "all-linear", or a
    regular expression over the modules' full names (as PEFT matches a string)."""
    if isinstance(target_modules, str):
        if target_modules == "all-linear":
            return (*_ATTENTION, *_MLP)
        return tuple(
            name
            for name in (*_ATTENTION, *_MLP)
            if re.fullmatch(target_modules, f"model.layers.0.{'mlp' if name in _MLP else 'self_attn'}.{name}")
        )
    if not isinstance(target_modules, list):
        return ()
    names: list[str] = []
    for module in target_modules:
        short = str(module).rsplit(".", 1)[-1]
        for name in _ALIASES.get(short, (short,)):
            if name in (*_ATTENTION, *_MLP) and name not in names:
                names.append(name)
    return tuple(names)


class LoraCosts:
    """The time adapters take on one replica's GPUs (the module docstring's model)."""

    def __init__(self, perf: PerfModel, max_lora_rank: int) -> None:
        self.perf = perf
        self.max_lora_rank = max_lora_rank
        self._linears = _linears(perf.model)

    def size_bytes(self, adapter: Adapter) -> float:
        """The adapter's weights, whole (on disk and in host memory)."""
        width = self._width(adapter.targets, per_gpu=False)
        return width * adapter.rank * self.perf.model.layers * LORA_DTYPE_BYTES

    def disk_seconds(self, adapter: Adapter) -> float:
        return DISK_OVERHEAD_S + self.size_bytes(adapter) / DISK_BYTES_PER_S

    def copy_seconds(self, adapter: Adapter) -> float:
        """Into a GPU slot: each GPU copies its shard of its stage's layers, all GPUs at once."""
        layers = self.perf.model.layers / self.perf.pp
        shard = self._width(adapter.targets, per_gpu=True) * adapter.rank * layers * LORA_DTYPE_BYTES
        tensors = 2 * layers * self._width(adapter.targets, per_gpu=False, count=True)
        return shard / HOST_TO_DEVICE_BYTES_PER_S + tensors * COPY_LATENCY_S

    def slot_bytes(self, slots: int) -> float:
        """GPU memory of `slots` slots on one GPU: every wrapped layer of its stage, at the slot's rank."""
        layers = self.perf.model.layers / self.perf.pp
        width = self._width(self._linears, per_gpu=True)
        return slots * width * self.max_lora_rank * layers * LORA_DTYPE_BYTES

    def step_seconds(self, lora_tokens: int, adapters: int) -> float:
        """What a step's LoRA kernels add: `lora_tokens` tokens of `adapters` distinct adapters."""
        if lora_tokens == 0:
            return 0.0
        perf, m = self.perf, self.perf.model
        rank_layers = self.max_lora_rank * m.layers
        routed = float(m.active_experts)  # an MoE token goes through its routed experts' MLPs
        touched = m.experts * (1 - (1 - m.active_experts / m.experts) ** lora_tokens) if m.experts else 0.0
        flops = 2 * lora_tokens * rank_layers * self._width(self._linears, per_gpu=True, experts=routed)
        reads = adapters * rank_layers * self._width(self._linears, per_gpu=True, experts=touched)
        memory_s = reads * LORA_DTYPE_BYTES / (perf.gpu.bandwidth_gbs * 1e9)
        compute_s = flops / (perf.tflops * 1e12)
        kernels_s = KERNELS_PER_LAYER * m.layers * KERNEL_GAP_S
        return float(perf.efficiency.kernel(memory_s, compute_s)) + kernels_s

    def _width(
        self, targets: Iterable[str], per_gpu: bool, experts: float | None = None, count: bool = False
    ) -> float:
        """Σ (d_in + d_out) over `targets`, on one GPU (its shards) or whole; an MoE's MLP layers once per
        expert (`experts` of them; default: all). With `count`, how many such layers there are."""
        m = self.perf.model
        tp = self.perf.tp if per_gpu else 1
        total = 0.0
        for target in targets:
            linear = self._linears[target]
            copies = (m.experts if experts is None else experts) if linear.mlp and m.experts else 1.0
            d_in, d_out = (
                (linear.d_in, linear.d_out / tp) if linear.column else (linear.d_in / tp, linear.d_out)
            )
            total += copies * (1.0 if count else d_in + d_out)
        return total


def engine_failure(message: str, world_size: int) -> VllmError:
    """An error raised by vLLM's worker in `add_lora`, as the API server passes it on (500). One GPU runs
    the worker in the engine's process; more run it in worker processes, whose errors come wrapped."""
    if world_size > 1:
        message = (
            f"Worker failed with error '{message}', please check the stack trace above for the root cause"
        )
    return VllmError(f"Call to add_lora method failed: {message}", "InternalServerError", 500)


def _local_folder(path: str) -> Path | None:
    """vLLM's `get_adapter_absolute_path`, offline: an absolute or `~` path as it is, a relative one if it
    exists here (else vLLM would look for a Hugging Face repository: here, none is found)."""
    if os.path.isabs(path) or path.startswith("~"):
        return Path(path).expanduser()
    return Path(path).absolute() if os.path.exists(path) else None


class LoraManager:
    """vLLM's served adapter names and its two LRU caches of adapter weights (host memory, GPU slots)."""

    def __init__(self, options: LoraOptions, costs: LoraCosts, world_size: int = 1) -> None:
        self.options = options
        self.costs = costs
        self.world_size = world_size  # GPUs of the replica: how worker errors are worded
        self.adapters: dict[str, Adapter] = {}
        self._ids = itertools.count(1)
        self._host: OrderedDict[int, Adapter] = OrderedDict()
        self._slots: OrderedDict[int, None] = OrderedDict()
        self.loads = 0  # adapters read from disk
        self.activations = 0  # adapters copied into a GPU slot
        self.busy_until = 0.0  # simulated time the engine is loading an adapter until (the endpoint's)

    def read(self, name: str, path: str, base_model_name: str | None = None) -> Adapter:
        """The adapter at `path` as vLLM's worker reads and checks it; VllmError as vLLM answers."""
        folder = _local_folder(path)
        if folder is None or not (folder / "adapter_config.json").is_file():
            raise VllmError(f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError", 404)
        try:
            config = json.loads((folder / "adapter_config.json").read_text())
        except (OSError, ValueError) as exc:
            raise engine_failure(str(exc), self.world_size) from exc
        if not isinstance(config, dict):
            raise engine_failure("adapter_config.json does not hold an object", self.world_size)
        missing = {"r", "lora_alpha", "target_modules"} - set(config)
        if missing:
            raise engine_failure(f"Missing required configuration fields: {missing}", self.world_size)
        rank = config["r"]
        if not isinstance(rank, int) or rank <= 0:
            raise engine_failure(f"LoRA rank `r` must be a positive integer, got {rank}.", self.world_size)
        pattern = config.get("rank_pattern") or {}
        largest = max([rank, *(r for r in pattern.values() if isinstance(r, int))])
        if largest > self.options.max_lora_rank:
            message = f"LoRA rank {largest} is greater than max_lora_rank {self.options.max_lora_rank}."
            raise engine_failure(message, self.world_size)
        if not any((folder / tensors).is_file() for tensors in _TENSOR_FILES):
            raise engine_failure(f"{folder} doesn't contain tensors", self.world_size)
        known = self.adapters.get(name)
        adapter_id = known.id if known is not None else next(self._ids)
        targets = targeted_linears(config["target_modules"])
        return Adapter(name, path, adapter_id, rank, targets, base_model_name)

    def make_resident(self, adapters: Iterable[Adapter], reload: bool = False) -> float:
        """Bring `adapters` into host memory and GPU slots as vLLM's worker does before a step (or in
        `add_lora`: `reload` reads an adapter again, vLLM's load_inplace); the seconds it takes."""
        seconds = 0.0
        host, slots = self._host, self._slots
        for adapter in adapters:
            if reload or adapter.id not in host:
                host.pop(adapter.id, None)
                slots.pop(adapter.id, None)
                if len(host) >= self.options.host_slots:
                    evicted, _ = host.popitem(last=False)
                    slots.pop(evicted, None)  # leaving host memory deactivates it
                host[adapter.id] = adapter
                seconds += self.costs.disk_seconds(adapter)
                self.loads += 1
            else:
                host.move_to_end(adapter.id)
            if adapter.id not in slots:
                if len(slots) >= self.options.max_loras:
                    slots.popitem(last=False)
                slots[adapter.id] = None
                seconds += self.costs.copy_seconds(adapter)
                self.activations += 1
            else:
                slots.move_to_end(adapter.id)
        return seconds

    def resident(self, adapter: Adapter) -> bool:
        """Whether the adapter's weights are in host memory (a request for it reads no disk)."""
        return adapter.id in self._host

    def model_cards(self, served_name: str) -> list[dict[str, object]]:
        """The adapters' /v1/models entries, as vLLM lists them after its base model."""
        return [
            {
                "id": adapter.name,
                "object": "model",
                "created": 0,
                "owned_by": "corral-sim",
                "root": adapter.path,
                "parent": adapter.base_model_name if adapter.base_model_name == served_name else served_name,
                "max_model_len": None,
            }
            for adapter in self.adapters.values()
        ]
