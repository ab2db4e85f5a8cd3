"""The planner's factors are the published corpus's fit, stored with its report, and `corral plan` with
them lands near published vLLM measurements (in-sample for the vLLM family: the test of how it fares on
sources it has not seen is `corral plan --validate`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from corral.perf.calibration import calibrated_efficiency, stored_document


@pytest.mark.parametrize(
    ("args", "published"),
    [
        # mushfiq-rtx4090-mistral: vLLM, Mistral-7B bf16 on one RTX 4090, 256 in / 128 out, 32 clients
        (("mistral-7b", "rtx-4090", "32", "256", "128"), 975.0),
        # qwen25-speed-bench: vLLM 0.6.3, Qwen2.5-7B bf16 on one A100-80GB, batch 1, 2048 tokens generated
        (("qwen2.5-7b", "a100-80gb", "1", "1", "2048"), 84.28),
    ],
)
def test_corral_plan_predicts_published_vllm_throughput(args: tuple[str, ...], published: float) -> None:
    model, gpu, clients, input_len, output_len = args
    done = subprocess.run(
        [sys.executable, "-m", "corral.cli", "plan", "--model", model, "--gpu", gpu, "--gpus", "1",
         "--quant", "bf16", "--concurrency", clients, "--input-len", input_len, "--output-len", output_len,
         "--json"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    layout = json.loads(done.stdout)["layouts"][0]
    assert (layout["tp"], layout["replicas"]) == (1, 1)
    assert layout["output_tokens_per_s"] == pytest.approx(published, rel=0.15)


def test_the_stored_fit_names_what_it_rests_on_and_its_error() -> None:
    document = stored_document()
    assert set(document["factors"]) == {"vllm", "tensorrt-llm", "llamacpp", "vllm-cpu"}
    assert len(document["fitted_on"]["sources"]) >= 5 and document["fitted_on"]["points"] >= 30
    assert set(document["report"]) == {"leave_one_source_out", "leave_one_source_out_by_engine", "in_sample"}


def test_an_unknown_engine_family_is_named_with_the_known_ones() -> None:
    with pytest.raises(KeyError, match="tensorrt-llm"):
        calibrated_efficiency("sglang")
