"""The simulated engine as a supervised replica: `corral sim` on its own port, read like vLLM."""

from __future__ import annotations

import dataclasses
import sys

from corral.artifacts import Progress
from corral.config import DeploymentSpec, ModelSpec, Paths
from corral.engines.base import LaunchPlan, visible_gpus
from corral.engines.features import EngineFeatures
from corral.engines.load import EngineLoad
from corral.engines.lora import RUNTIME_LORA_ENV, vllm_lora_args
from corral.engines.vllm import parse_vllm_load

__all__ = ["SimEngineAdapter"]

_EMBED_DIM = 384  # an embedding model's vector size unless engine_args say --embed-dim (MiniLM's)


class SimEngineAdapter:
    """Launches `python -m corral.cli sim` for each replica."""

    name = "sim"

    def prepare(
        self, model: ModelSpec, deployment: DeploymentSpec, paths: Paths, progress: Progress
    ) -> list[LaunchPlan]:
        assert deployment.gpu is not None  # the spec requires it for the simulator
        argv = [
            sys.executable,
            "-m",
            "corral.cli",
            "sim",
            "--model",
            model.arch or model.name,
            "--served-name",
            model.name,
            "--gpu",
            deployment.gpu,
            "--tp",
            str(deployment.tensor_parallel),
            "--pp",
            str(deployment.pipeline_parallel),
            "--max-num-seqs",
            str(deployment.max_num_seqs),
            "--max-num-batched-tokens",
            str(deployment.max_num_batched_tokens),
            "--gpu-memory-utilization",
            str(deployment.gpu_memory_utilization),
            "--time-scale",
            str(deployment.time_scale),
            "--host",
            "{host}",
            "--port",
            "{port}",
        ]
        if model.task == "embed" and "--embed-dim" not in deployment.engine_args:
            argv += ["--embed-dim", str(_EMBED_DIM)]
        if deployment.quantization:
            argv += ["--quant", deployment.quantization]
        if deployment.max_model_len:
            argv += ["--max-model-len", str(deployment.max_model_len)]
        argv += vllm_lora_args(model, paths, progress)
        plan = LaunchPlan(
            argv=(*argv, *(a.replace("{", "{{").replace("}", "}}") for a in deployment.engine_args)),
            capacity=deployment.max_num_seqs,
            context_length=deployment.max_model_len,
            # The simulator answers n > 1 itself; it joins a prompt list into one and has no echo or images.
            features=EngineFeatures(
                prompt_lists=False,
                echo=False,
                images=False,
                continuation=False,
                embeddings=model.task == "embed",
                matryoshka=model.matryoshka,
                media_urls=model.media_urls,
                cache_salt=model.task != "embed",
            ),
            kv_events_args=("--kv-events-endpoint", "{events}")
            if deployment.kv_events and model.task != "embed"
            else (),
            adapter_slots=model.lora.slots if model.adapters else 0,
            max_loras=model.lora.max_loras if model.adapters else 0,
        )
        # GPUs as vLLM's replicas take them (the simulator uses none), so scaling picks them the same way
        return [
            dataclasses.replace(
                plan,
                env={
                    "CUDA_VISIBLE_DEVICES": visible_gpus(deployment, index),
                    **(RUNTIME_LORA_ENV if model.adapters else {}),
                },
            )
            for index in range(deployment.replicas)
        ]

    def parse_load(self, metrics_text: str) -> EngineLoad:
        return parse_vllm_load(metrics_text)
