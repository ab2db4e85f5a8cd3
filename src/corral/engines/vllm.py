"""vLLM's OpenAI server: the production engine (GPU; tensor/pipeline parallel), and the metrics shape the
simulator shares with it."""

from __future__ import annotations

from corral.artifacts import Progress, resolve_model
from corral.config import DeploymentSpec, HuggingFaceSource, ModelSpec, Paths
from corral.engines.base import LaunchPlan, read_gauges
from corral.routing import EngineLoad

__all__ = ["VllmEngine", "parse_vllm_load"]


def parse_vllm_load(metrics_text: str) -> EngineLoad:
    """vLLM's /metrics (`vllm:` names, summed over engines) as the common load shape."""
    values = read_gauges(metrics_text)
    return EngineLoad(
        running=int(values.get("vllm:num_requests_running", 0)),
        waiting=int(values.get("vllm:num_requests_waiting", 0)),
        kv_usage=values.get("vllm:kv_cache_usage_perc"),
        prompt_tokens_total=values.get("vllm:prompt_tokens_total", 0.0),
        generated_tokens_total=values.get("vllm:generation_tokens_total", 0.0),
        prefix_cache_queries_total=values.get("vllm:prefix_cache_queries_total", 0.0),
        prefix_cache_hits_total=values.get("vllm:prefix_cache_hits_total", 0.0),
        preemptions_total=values.get("vllm:num_preemptions_total", 0.0),
    )


class VllmEngine:
    """Builds vLLM's OpenAI server command from a deployment: one process per replica, each on its own GPUs.

    vLLM runs from its own environment (it pins torch): `binary` names that environment's Python
    interpreter, and the server starts as `python -m vllm.entrypoints.openai.api_server`.
    """

    name = "vllm"

    def prepare(
        self, model: ModelSpec, deployment: DeploymentSpec, paths: Paths, progress: Progress
    ) -> list[LaunchPlan]:
        python = str(deployment.binary) if deployment.binary else "python3"
        source = model.source
        if isinstance(source, HuggingFaceSource) and source.file is None:
            weights = source.hf  # vLLM fetches and caches the repository itself
        elif source is not None:
            weights = str(resolve_model(source, paths, progress))
        else:
            raise ValueError(f"model {model.name} has no source")
        argv = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            weights,
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
            "--gpu-memory-utilization",
            str(deployment.gpu_memory_utilization),
            "--max-num-seqs",
            str(deployment.max_num_seqs),
            "--max-num-batched-tokens",
            str(deployment.max_num_batched_tokens),
            "--enable-prefix-caching",
        ]
        if deployment.max_model_len:
            argv += ["--max-model-len", str(deployment.max_model_len)]
        if deployment.quantization:
            argv += ["--quantization", deployment.quantization]
        argv += deployment.engine_args
        per_replica = deployment.gpus_per_replica
        return [
            LaunchPlan(
                argv=tuple(argv),
                capacity=deployment.max_num_seqs,
                env={
                    "CUDA_VISIBLE_DEVICES": ",".join(
                        str(d) for d in range(i * per_replica, (i + 1) * per_replica)
                    )
                },
            )
            for i in range(deployment.replicas)
        ]

    def parse_load(self, metrics_text: str) -> EngineLoad:
        return parse_vllm_load(metrics_text)
