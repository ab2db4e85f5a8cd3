"""The engine flags corral sets itself from a deployment's fields: `engine_args` may not set them again.

An engine's parser takes the last of a flag given twice, so `--host 0.0.0.0` in `engine_args` put an
engine without a key on every interface, `--max-num-seqs` or `--ctx-size` made the gateway's slots and
context differ from the engine's, and `--api-key` made the engine refuse every request the gateway sent.
Flags are compared as both parsers read them: `--flag=value` as `--flag`, and (vLLM's parser) `_` as `-`.
The LoRA flags stay open: corral sets them only for a model with adapters, and a model without may set
them itself.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["check_engine_args", "flag_name"]

# flag → the deployment field (or what) sets it
_VLLM = {
    "--host": "corral (its loopback address)",
    "--port": "corral",
    "--model": "the model's source",
    "--served-model-name": "the model's name",
    "--tensor-parallel-size": "tensor_parallel",
    "-tp": "tensor_parallel",
    "--pipeline-parallel-size": "pipeline_parallel",
    "-pp": "pipeline_parallel",
    "--max-num-seqs": "max_num_seqs",
    "--max-num-batched-tokens": "max_num_batched_tokens",
    "--max-model-len": "max_model_len",
    "--gpu-memory-utilization": "gpu_memory_utilization",
    "--dtype": "dtype",
    "--quantization": "quantization",
    "-q": "quantization",
    "--revision": "the source's revision",
    "--api-key": "engine_api_key",
    "--kv-events-config": "kv_events",
}
_LLAMACPP = {
    "--host": "corral (its loopback address)",
    "--port": "corral",
    "-m": "the model's source",
    "--model": "the model's source",
    "-a": "the model's name",
    "--alias": "the model's name",
    "-c": "context_length",
    "--ctx-size": "context_length",
    "-np": "parallel",
    "--parallel": "parallel",
    "-t": "threads",
    "--threads": "threads",
    "-tb": "threads",
    "--threads-batch": "threads",
    "--api-key": "nothing: corral's llama.cpp replicas take no key",
}
_MANAGED = {"vllm": _VLLM, "llamacpp": _LLAMACPP}


def flag_name(arg: str, dashes: bool = True) -> str | None:
    """The flag `arg` names (`--flag=value`: `--flag`; with `dashes`, `_` read as `-`, as vLLM's parser
    does), or None for a value."""
    if not arg.startswith("-") or arg == "-" or arg[1:2].isdigit():  # (a negative number is a value)
        return None
    name = arg.split("=", 1)[0]
    return name.replace("_", "-") if dashes and name.startswith("--") else name


def check_engine_args(engine: str, engine_args: Sequence[str]) -> None:
    """ValueError naming a flag of `engine_args` that corral sets from the deployment's fields."""
    managed = _MANAGED.get(engine, {})
    for arg in engine_args:
        name = flag_name(arg, dashes=engine == "vllm")
        if name is not None and name in managed:
            raise ValueError(
                f"engine_args sets {name}, which corral sets from {managed[name]}: set that instead (the "
                "engine would take the later of the two, and the gateway would not know it)"
            )
