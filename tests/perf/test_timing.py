"""The step-time model's one-step function against its parts."""

from __future__ import annotations

import random

import pytest

from corral.perf import PerfModel, load_catalog
from corral.perf.calibration import calibrated_efficiency

CATALOG = load_catalog()


def test_one_step_function_gives_the_same_floats_as_the_parts_it_is_made_of() -> None:
    """`step_time` (the planner's inner loop) takes the model's constants out of `parts` and
    `Efficiency.step_seconds`; the figures are the same to the last bit, dense and MoE, with tensor and
    pipeline parallelism, decodes and prefill chunks."""
    rng = random.Random(5)
    efficiency = calibrated_efficiency()
    checked = 0
    for model in ("llama-3.1-8b", "llama-3.1-70b", "mixtral-8x7b", "qwen3-235b-a22b", "gpt-oss-120b"):
        for gpu in ("l40s", "h100-sxm", "a100-80gb"):
            for tp, pp in ((1, 1), (2, 1), (4, 2), (1, 4), (8, 1)):
                perf = PerfModel(
                    CATALOG.models.get(model),
                    CATALOG.gpus.get(gpu),
                    CATALOG.quantizations.get("bf16"),
                    tp=tp,
                    pp=pp,
                    efficiency=efficiency,
                )
                for _ in range(20):
                    decodes = rng.randint(0, 300)
                    prefill = rng.choice([0, rng.randint(1, 4096)])
                    context = decodes * rng.randint(1, 8000)
                    pairs = prefill * rng.randint(0, 8000) + prefill * (prefill + 1) / 2
                    if decodes + prefill == 0:
                        continue
                    parts = perf.parts(float(decodes), float(context), float(prefill), pairs)
                    expected = float(efficiency.step_seconds(parts))
                    assert perf.step_time(decodes, context, prefill, pairs) == expected
                    checked += 1
    assert checked > 1000


def test_int8_weights_and_activations_multiply_at_the_gpus_int8_rate() -> None:
    """vLLM's W8A8 INT8 GEMMs run on INT8 tensor cores: 624 dense TOPS on an A100 against 312 BF16
    TFLOPS, 1979 against 989 on an H100 (NVIDIA's datasheets); they were timed at the BF16 rate. A GPU
    with no INT8 figure in the catalog (the CPU entry) runs them as BF16."""
    prefill = (0, 0, 2048, 2048 * 1024.5)  # one prefill chunk: its GEMMs are compute-bound

    def gemm(gpu: str, quant: str) -> float:
        perf = PerfModel(
            CATALOG.models.get("llama-3.1-8b"), CATALOG.gpus.get(gpu), CATALOG.quantizations.get(quant)
        )
        return perf.breakdown(*prefill).gemm_s

    assert gemm("a100-80gb", "bf16") / gemm("a100-80gb", "int8") == pytest.approx(624 / 312)
    assert gemm("h100-sxm", "bf16") / gemm("h100-sxm", "int8") == pytest.approx(1979 / 989)
    assert gemm("cpu-dev-1thread", "int8") == gemm("cpu-dev-1thread", "bf16")
