"""Memory accounting, checked against vLLM's own numbers and against arithmetic from the configs."""

from __future__ import annotations

import pytest

from corral.perf import GIB, load_catalog, memory_plan, sequence_kv_bytes, weight_bytes
from corral.perf.memory import kv_bytes_per_token_layer

CATALOG = load_catalog()
CPU = CATALOG.gpus.get("a100-40gb")  # any device: the CPU backend fixes the KV size itself


def test_smollm2_kv_capacity_matches_vllm_cpu_startup() -> None:
    """vLLM's CPU backend with VLLM_CPU_KVCACHE_SPACE=1 and float32 reported 23,296 tokens for SmolLM2."""
    model = CATALOG.models.get("smollm2-135m")
    plan = memory_plan(model, CPU, CATALOG.quantizations.get("bf16"), kv_dtype_bytes=4, kv_cache_bytes=GIB)
    assert plan.kv_tokens == 23_296


def test_kv_bytes_per_token_from_the_config() -> None:
    llama = CATALOG.models.get("llama-3.1-8b")
    assert kv_bytes_per_token_layer(llama, tp=1, kv_dtype_bytes=2) * llama.layers == 131_072
    assert kv_bytes_per_token_layer(llama, tp=8, kv_dtype_bytes=2) == 2 * 1 * 128 * 2
    assert kv_bytes_per_token_layer(llama, tp=16, kv_dtype_bytes=2) == 2 * 1 * 128 * 2  # KV heads replicated
    deepseek = CATALOG.models.get("deepseek-v3")
    assert kv_bytes_per_token_layer(deepseek, tp=8, kv_dtype_bytes=2) == (512 + 64) * 2  # MLA latent


def test_sliding_window_layers_cap_their_kv() -> None:
    mistral = CATALOG.models.get("mistral-7b")
    long, short = sequence_kv_bytes(mistral, 32768, 1, 1, 2), sequence_kv_bytes(mistral, 4096, 1, 1, 2)
    assert long < 1.01 * short + kv_bytes_per_token_layer(mistral, 1, 2) * mistral.layers * 32
    scout = CATALOG.models.get("llama-4-scout")  # 12 of 48 layers attend globally
    ratio = sequence_kv_bytes(scout, 131072, 1, 1, 2) / (131072 * kv_bytes_per_token_layer(scout, 1, 2) * 48)
    assert 0.25 < ratio < 0.33


@pytest.mark.parametrize(
    ("model", "quant", "low_gb", "high_gb"),
    [
        ("llama-3.1-70b", "bf16", 140, 142),
        ("llama-3.1-70b", "fp8", 71, 73),
        ("llama-3.1-70b", "awq", 39, 41),
        ("llama-3.1-8b", "bf16", 15.9, 16.2),
        ("gpt-oss-120b", "mxfp4", 62, 66),
    ],
)
def test_weight_bytes(model: str, quant: str, low_gb: float, high_gb: float) -> None:
    size = weight_bytes(CATALOG.models.get(model), CATALOG.quantizations.get(quant)) / 1e9
    assert low_gb <= size <= high_gb


def test_a_fitting_plan_never_overcommits_memory() -> None:
    for model in CATALOG.models:
        for gpu in CATALOG.gpus:
            for tp, pp in ((1, 1), (2, 1), (4, 1), (8, 1), (4, 2)):
                plan = memory_plan(model, gpu, CATALOG.quantizations.get("bf16"), tp=tp, pp=pp)
                if plan.fits:
                    assert (
                        plan.weights + plan.activation + plan.overhead + plan.kv_bytes <= plan.budget * 1.0001
                    )
                    assert plan.kv_tokens >= 16
