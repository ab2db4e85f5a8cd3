"""LoRA adapters on the engines' command lines.

vLLM (and the simulator, which takes its flags) starts with LoRA enabled where the model declares adapters,
with the spec's `lora` limits, and loads each adapter at run time when the gateway asks
(VLLM_ALLOW_RUNTIME_LORA_UPDATING): an adapter added by `corral apply` needs no restart. llama.cpp's server
loads every adapter at its start (`--lora`, none applied until a request selects one), so a change of its
adapters replaces its replicas one at a time. Each adapter is fetched (and for llama.cpp converted to its
GGUF) while the deployment is prepared: a spec whose adapter cannot be had changes nothing.
"""

from __future__ import annotations

from pathlib import Path

from corral.artifacts import ArtifactError, Progress, adapter_gguf, adapter_rank, resolve_adapter
from corral.config import ModelSpec, Paths

__all__ = ["RUNTIME_LORA_ENV", "llamacpp_lora_args", "vllm_lora_args"]

RUNTIME_LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def vllm_lora_args(model: ModelSpec, paths: Paths, progress: Progress) -> list[str]:
    """vLLM's (and the simulator's) LoRA flags for `model` (none without adapters), once every adapter is
    fetched and its rank checked against `lora.max_lora_rank`."""
    if not model.adapters:
        return []
    lora = model.lora
    for adapter in model.adapters:
        folder = resolve_adapter(adapter.source, paths, progress)
        if not (folder / "adapter_config.json").is_file():
            raise ArtifactError(
                f"adapter {adapter.name}: vLLM loads a PEFT folder (adapter_config.json and its weights), "
                f"not {folder.name}"
            )
        rank = adapter_rank(folder)
        if rank is not None and rank > lora.max_lora_rank:
            raise ArtifactError(
                f"adapter {adapter.name} has rank {rank}, above lora.max_lora_rank {lora.max_lora_rank}"
            )
    return [
        "--enable-lora",
        "--max-loras",
        str(lora.max_loras),
        "--max-lora-rank",
        str(lora.max_lora_rank),
        "--max-cpu-loras",
        str(lora.slots),
    ]


def llamacpp_lora_args(model: ModelSpec, weights: Path, paths: Paths, progress: Progress) -> list[str]:
    """llama.cpp's flags: each adapter's GGUF (made from its PEFT folder where it has none), in the spec's
    order (a request selects one by its index), none applied by default."""
    if not model.adapters:
        return []
    args = []
    for adapter in model.adapters:
        found = resolve_adapter(adapter.source, paths, progress)
        args += ["--lora", str(adapter_gguf(found, weights, paths, progress))]
    return [*args, "--lora-init-without-apply"]
