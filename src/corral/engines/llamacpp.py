"""llama.cpp's `llama-server`: the embedded CPU engine.

It batches continuously over `--parallel` slots, answers `/health` (503 while loading), exposes Prometheus
`/metrics` with `--metrics`, and reports usage in streams. One thread per replica: on two busy cores, two
threads each collapsed throughput (about 117 → 4 tokens/s) under contention.
"""

from __future__ import annotations

import signal
from pathlib import Path

from corral.artifacts import (
    ArtifactError,
    Progress,
    gguf_from_bert,
    is_embedding_folder,
    llama_server,
    resolve_model,
)
from corral.artifacts.bert_gguf import max_input_tokens
from corral.artifacts.gguf_meta import gguf_string
from corral.config import DeploymentSpec, ModelSpec, Paths
from corral.engines.base import LaunchPlan, read_gauges
from corral.engines.features import EngineFeatures
from corral.engines.load import EngineLoad
from corral.engines.lora import llamacpp_lora_args

__all__ = ["LlamaCppEngine"]

_PREFIX = "llamacpp:"


class LlamaCppEngine:
    """Adapter for llama.cpp's OpenAI-compatible server."""

    name = "llamacpp"

    def prepare(
        self, model: ModelSpec, deployment: DeploymentSpec, paths: Paths, progress: Progress
    ) -> list[LaunchPlan]:
        assert model.source is not None  # the spec guarantees it for engines that load a file
        # (the model first: a source that cannot be fetched is told in seconds, not after a build of minutes)
        weights = resolve_model(model.source, paths, progress)
        binary = llama_server(paths, deployment.binary, progress)
        context = deployment.context_length
        if is_embedding_folder(weights):
            context = min(context, max_input_tokens(weights) or context)  # its trained input length
            weights = gguf_from_bert(weights, paths, progress)
        elif weights.is_dir():  # (a whole repository's safetensors: vLLM's; llama-server would crash-loop)
            raise ArtifactError(
                f"model {model.name}: llama.cpp loads one GGUF file, and its source is a folder ({weights}): "
                "name the repository's GGUF (`file:`), or serve the folder with `engine: vllm`"
            )
        argv = (
            _braced(str(binary)),
            "--model",
            _braced(str(weights)),
            "--alias",
            _braced(model.name),
            "--host",
            "{host}",
            "--port",
            "{port}",
            "--threads",
            str(deployment.threads),
            "--threads-batch",
            str(deployment.threads),
            "--parallel",
            str(deployment.parallel),
            "--ctx-size",
            str(context * deployment.parallel),
            "--metrics",
            "--no-webui",
            *(_embedding_args(context) if model.task == "embed" else ()),
            *map(_braced, llamacpp_lora_args(model, weights, paths, progress)),
            *map(_braced, deployment.engine_args),
        )  # (the runtime fills in {host} and {port}: every other brace, a JSON argument's, stays as written)
        # Measured on llama-server (b1-0c1e570): n > 1 and prompt lists come back with one choice's usage,
        # echo is ignored, and an image part without a multimodal projector is a 500.
        features = EngineFeatures(
            multiple_choices=False,
            prompt_lists=False,
            echo=False,
            images=any(arg.startswith("--mmproj") for arg in deployment.engine_args),
            prefill_echo=True,
            token_prompts=True,
            embeddings=model.task == "embed",
            matryoshka=model.matryoshka,
            media_urls=model.media_urls,
            tools=model.task != "embed" and _template_takes_tools(weights, deployment.engine_args),
        )
        plan = LaunchPlan(
            argv=argv,
            capacity=deployment.parallel,
            context_length=context,
            features=features,
            adapters=tuple(a.name for a in model.adapters),  # selected per request by index, in this order
            # its SIGTERM handler waits for the server's threads: an orphan once slept through it (and a
            # second SIGTERM) for minutes; it spawns nothing and keeps nothing worth a clean exit
            death_signal=signal.SIGKILL,
        )
        return [plan] * deployment.replicas

    def parse_load(self, metrics_text: str) -> EngineLoad:
        values = read_gauges(metrics_text)
        cached = values.get(_PREFIX + "prompt_tokens_cached_total", 0.0)
        return EngineLoad(
            running=int(values.get(_PREFIX + "requests_processing", 0)),
            waiting=int(values.get(_PREFIX + "requests_deferred", 0)),
            kv_usage=values.get(_PREFIX + "kv_cache_usage_ratio"),
            prompt_tokens_total=values.get(_PREFIX + "prompt_tokens_total", 0.0),
            generated_tokens_total=values.get(_PREFIX + "tokens_predicted_total", 0.0),
            # Prompt tokens are either processed (prompt_tokens_total) or taken from the slot's cache.
            prefix_cache_queries_total=values.get(_PREFIX + "prompt_tokens_total", 0.0) + cached,
            prefix_cache_hits_total=cached,
        )


def _embedding_args(context: int) -> tuple[str, ...]:
    """An embedding model reads each input whole in one batch (no causal mask to split it by); its
    vectors come from /v1/embeddings, pooled as the model says and L2-normalised."""
    return ("--embeddings", "--ubatch-size", str(context), "--batch-size", str(context))


def _template_takes_tools(weights: Path, engine_args: list[str]) -> bool:
    """Whether the model's chat template (the GGUF's, or one the engine flags name) renders tools: without
    them llama-server ignores `tools` (measured: SmolLM2's template answers in prose), and the gateway asks
    for tool calls as JSON instead (gateway/toolcalls.py)."""
    template: str | None = None
    for flag, value in zip(engine_args, [*engine_args[1:], ""], strict=False):
        if flag == "--chat-template-file":
            try:
                template = Path(value).read_text()
            except OSError:
                return False
        elif flag == "--chat-template":
            template = value  # (a built-in name renders no tools)
    if template is None:
        template = gguf_string(weights, "tokenizer.chat_template")
    return template is not None and "tools" in template


def _braced(arg: str) -> str:
    """`arg` as the runtime's `str.format` gives it back (its braces doubled)."""
    return arg.replace("{", "{{").replace("}", "}}")
