"""`corral plan`: its JSON interface, fit guarantees, and the cluster.yaml it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from corral.config import load_spec
from corral.perf import PerfModel, load_catalog, memory_plan
from corral.perf.calibration import calibrated_efficiency
from corral.plan import PlanRequest, plan
from corral.plan.search import api_for

CORRAL = [sys.executable, "-m", "corral.cli"]
CATALOG = load_catalog()
EFFICIENCY = calibrated_efficiency()


def run_plan(*args: str) -> tuple[int, dict]:
    done = subprocess.run([*CORRAL, "plan", *args, "--json"], capture_output=True, text=True, timeout=120)
    return done.returncode, json.loads(done.stdout)


def test_json_interface_has_the_promised_fields() -> None:
    code, out = run_plan(
        "--model",
        "llama-3.1-8b",
        "--gpu",
        "l40s",
        "--concurrency",
        "16",
        "--input-len",
        "1024",
        "--output-len",
        "256",
        "--ttft-p95-ms",
        "2000",
        "--itl-ms",
        "60",
    )
    assert code == 0 and out["fits"] is True and out["reason"] is None
    layout = out["layouts"][0]
    for key in (
        "gpus",
        "tp",
        "pp",
        "replicas",
        "weights_gib_per_gpu",
        "kv_tokens",
        "max_concurrency",
        "ttft_ms",
        "itl_ms",
        "output_tokens_per_s",
        "cost_per_million_tokens",
    ):
        assert key in layout
    assert layout["ttft_p95_ms"] <= 2000 and layout["itl_ms"] <= 60


def test_gpus_flag_makes_the_first_layout_use_exactly_that_many() -> None:
    code, out = run_plan("--model", "llama-3.1-70b", "--gpu", "l40s", "--gpus", "4")
    assert code == 0
    assert out["layouts"][0]["gpus"] == 4
    assert all(lay["gpus"] == 4 for lay in out["layouts"])


def test_a_model_that_cannot_fit_says_why() -> None:
    code, out = run_plan("--model", "llama-4-scout", "--gpu", "l40s", "--gpus", "4", "--quant", "bf16")
    assert code == 1
    assert out["fits"] is False and out["layouts"] == []
    assert "KV" in out["reason"] and "l40s" in out["reason"]


def test_scout_fits_four_l40s_at_fp8() -> None:
    code, out = run_plan("--model", "llama-4-scout", "--gpu", "l40s", "--gpus", "4", "--quant", "fp8")
    assert code == 0 and 24 <= out["layouts"][0]["weights_gib_per_gpu"] <= 27  # about 25 GiB per GPU


def test_a_70b_awq_model_on_four_24gb_cards_holds_a_dozen_or_so_8k_sequences() -> None:
    """vLLM's own arithmetic for Llama-3.1-70B AWQ at TP 4 on L4s: 12-16 concurrent 8k-token sequences."""
    model = CATALOG.models.get("llama-3.1-70b")
    memory = memory_plan(model, CATALOG.gpus.get("l4"), CATALOG.quantizations.get("awq"), tp=4)
    assert 12 <= memory.max_sequences(model, 8192, 4, 1, 2.0) <= 16


@pytest.mark.slow  # a search over every GPU class (seconds each): make test, not test-fast
@pytest.mark.parametrize(
    "model", ["llama-3.1-70b", "qwen3-235b-a22b", "deepseek-v3", "mixtral-8x7b", "gpt-oss-120b"]
)
def test_no_reported_layout_overcommits_memory(model: str) -> None:
    result = plan(
        PlanRequest(model=model, gpu="all", concurrency=8, limit=50, max_gpus=16), CATALOG, EFFICIENCY
    )
    for lay in result.layouts:
        memory = memory_plan(
            CATALOG.models.get(model), CATALOG.gpus.get(lay.gpu), result.quant, tp=lay.tp, pp=lay.pp
        )
        assert (
            memory.weights + memory.activation + memory.overhead + memory.kv_bytes <= memory.budget * 1.0001
        )
        assert memory.max_sequences(result.model, result.context, lay.tp, lay.pp, 2.0) >= 1


@pytest.mark.slow  # a search over every GPU class (seconds each): make test, not test-fast
def test_tighter_slo_needs_more_gpus() -> None:
    loose = plan(PlanRequest(model="llama-3.1-8b", gpu="l4", concurrency=64), CATALOG, EFFICIENCY)
    tight = plan(
        PlanRequest(model="llama-3.1-8b", gpu="l4", concurrency=64, itl_ms=40, ttft_p95_ms=1500),
        CATALOG,
        EFFICIENCY,
    )
    assert tight.layouts[0].meets_slo
    assert tight.layouts[0].gpus > loose.layouts[0].gpus


def test_written_cluster_yaml_is_a_valid_spec(tmp_path: Path) -> None:
    out = tmp_path / "cluster.yaml"
    done = subprocess.run(
        [
            *CORRAL,
            "plan",
            "--model",
            "llama-3.1-70b",
            "--gpu",
            "h100-sxm",
            "--quant",
            "fp8",
            "--yaml",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    spec = load_spec(out)
    deployment = spec.models[0].deployments[0]
    assert deployment.engine == "vllm" and deployment.gpu == "h100-sxm" and deployment.quantization == "fp8"
    assert spec.models[0].source is not None


@pytest.mark.parametrize("quant", ["awq", "gptq", "int8", "gguf-q4", "gguf-q8", "mxfp4"])
def test_a_spec_is_not_written_for_weights_vllm_cannot_make_from_the_catalogs_checkpoint(
    quant: str, tmp_path: Path
) -> None:
    """vLLM quantizes a bf16 checkpoint as it loads only to fp8. The spec paired Llama-3.1-8B-Instruct
    with `quantization: awq` (or int8, gguf-q4: not even vLLM methods), which vLLM refuses to start."""
    from corral.plan.render import plan_yaml

    result = plan(PlanRequest(model="llama-3.1-8b", gpu="l40s", gpus=1, quant=quant), CATALOG, EFFICIENCY)
    with pytest.raises(ValueError, match=f"only to fp8 as it loads it; {quant} needs"):
        plan_yaml(result)
    if quant == "awq":
        out = tmp_path / "cluster.yaml"
        code, _ = run_plan("--model", "llama-3.1-8b", "--gpu", "l40s", "--gpus", "1", "--quant", quant,
                           "--yaml", str(out))  # fmt: skip
        assert code == 1 and not out.exists()


def test_a_spec_sets_no_quantization_for_a_checkpoint_already_in_its_format(tmp_path: Path) -> None:
    """gpt-oss ships its experts in MXFP4 (vLLM reads that from the checkpoint); bf16 is the default."""
    from corral.plan.render import plan_yaml

    for model, quant in (("gpt-oss-120b", None), ("llama-3.1-8b", "bf16")):
        result = plan(PlanRequest(model=model, gpu="h100-sxm", gpus=1, quant=quant), CATALOG, EFFICIENCY)
        out = tmp_path / f"{model}.yaml"
        out.write_text(plan_yaml(result))
        assert load_spec(out).models[0].deployments[0].quantization is None


def test_unknown_model_is_a_clear_error() -> None:
    done = subprocess.run([*CORRAL, "plan", "--model", "llama-9"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unknown model 'llama-9'" in done.stderr


@pytest.mark.slow
def test_request_rate_sizes_by_poisson_arrivals() -> None:
    small = plan(
        PlanRequest(model="llama-3.1-8b", gpu="l4", request_rate=0.5, ttft_p95_ms=3000, itl_ms=80),
        CATALOG,
        EFFICIENCY,
    )
    large = plan(
        PlanRequest(model="llama-3.1-8b", gpu="l4", request_rate=8, ttft_p95_ms=3000, itl_ms=80),
        CATALOG,
        EFFICIENCY,
    )
    assert small.layouts[0].meets_slo and large.layouts[0].meets_slo
    assert large.layouts[0].gpus > small.layouts[0].gpus
    assert large.layouts[0].requests_per_s == pytest.approx(8, rel=0.03)  # (it keeps up: it serves 8/s)


def test_open_loop_overload_is_detected() -> None:
    from corral.perf import BLOCK_SIZE, PerfModel, SchedulerConfig, open_loop

    model, gpu, quant = (
        CATALOG.models.get("llama-3.1-8b"),
        CATALOG.gpus.get("l4"),
        CATALOG.quantizations.get("bf16"),
    )
    perf = PerfModel(model, gpu, quant, efficiency=EFFICIENCY)
    config = SchedulerConfig(num_blocks=memory_plan(model, gpu, quant).kv_tokens // BLOCK_SIZE)
    assert not open_loop(perf, config, 0.2, 1024, 256).overloaded
    assert open_loop(perf, config, 50, 1024, 256).overloaded


@pytest.mark.slow  # a search over every GPU class (seconds each): make test, not test-fast
def test_default_search_covers_gpu_classes_not_the_cpu_calibration_entry() -> None:
    searched = plan(PlanRequest(model="llama-3.1-8b", limit=100), CATALOG, EFFICIENCY)
    kinds = {CATALOG.gpus.get(layout.gpu).kind for layout in searched.layouts}
    assert kinds == {"gpu"} and len({layout.gpu for layout in searched.layouts}) > 3
    named = plan(PlanRequest(model="smollm2-135m", gpu="cpu-dev-1thread"), CATALOG, EFFICIENCY)
    assert named.fits and named.layouts[0].gpu == "cpu-dev-1thread"


def test_meets_is_only_said_against_a_stated_slo() -> None:
    _, without = run_plan("--model", "llama-3.1-8b", "--gpu", "l40s")
    assert {layout["meets_slo"] for layout in without["layouts"]} == {None}
    _, stated = run_plan("--model", "llama-3.1-8b", "--gpu", "l40s", "--ttft-p95-ms", "100000")
    assert {layout["meets_slo"] for layout in stated["layouts"]} == {True}
    table = subprocess.run(
        [*CORRAL, "plan", "--model", "llama-3.1-8b", "--gpu", "l40s"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "meets" not in table and "l40s" in table


def test_nothing_fits_names_the_closest_layouts_first() -> None:
    result = plan(PlanRequest(model="llama-3.1-405b", max_gpus=1), CATALOG, EFFICIENCY)
    assert not result.fits and result.reason is not None
    largest = max((g for g in CATALOG.gpus if g.kind == "gpu"), key=lambda g: g.memory_gb)
    closest = result.reason.split("closest: ", 1)[1]
    assert closest.startswith(f"{largest.name} TP=1 PP=1"), closest


@pytest.mark.parametrize(
    ("model", "gpu", "tp", "pp"),
    [("llama-3.1-8b", "l4", 1, 1), ("llama-3.1-70b", "h100-sxm", 4, 2), ("mixtral-8x7b", "a100-80gb", 2, 1)],
)
def test_a_steps_parts_make_up_its_time(model: str, gpu: str, tp: int, pp: int) -> None:
    arch = CATALOG.models.get(model)
    quant = CATALOG.quantizations.get(arch.native_quant or "bf16")
    perf = PerfModel(arch, CATALOG.gpus.get(gpu), quant, tp, pp)
    for args in ((16, 16 * 1500, 0, 0.0), (0, 0, 2048, 2048 * 1024.5), (8, 8000, 512, 512 * 700.0)):
        parts = perf.breakdown(*args)
        assert parts.total_s == pytest.approx(perf.step_time(*args), rel=1e-12)
        assert min(parts.weights_s, parts.gemm_s, parts.overhead_s) > 0
        if args[0] == 0:  # a prefill without decode reads no decode context but attends its own chunk
            assert parts.attention_s > 0


def test_explain_shows_where_the_step_time_goes() -> None:
    code, data = run_plan("--model", "llama-3.1-70b", "--gpu", "h100-sxm", "--concurrency", "32", "--explain")
    assert code == 0
    steps = data["explain"]["steps"]
    decode, prefill = steps["decode"], steps["prefill"]
    assert decode["bound"] == "memory" and decode["weights_ms"] > decode["gemm_ms"]  # decode reads weights
    assert prefill["bound"] == "compute" and prefill["gemm_ms"] > prefill["weights_ms"]
    assert prefill["tokens"] == 1024 and decode["tokens"] == data["layouts"][0]["concurrency_per_replica"]
    for step in (decode, prefill):
        p = step["overlap"]
        gemms = (step["weights_ms"] ** p + step["gemm_ms"] ** p) ** (1 / p)
        attention = (step["kv_ms"] ** p + step["attention_ms"] ** p) ** (1 / p)
        parts = gemms + attention + step["communication_ms"] + step["overhead_ms"]
        assert step["total_ms"] == pytest.approx(parts, abs=0.01)
    table = subprocess.run(
        [*CORRAL, "plan", "--model", "llama-3.1-8b", "--gpu", "l4", "--explain"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "160"},
    )  # fmt: skip
    assert table.returncode == 0 and "one step, by part (ms)" in table.stdout and "decode" in table.stdout


def test_explain_shows_where_a_ttft_comes_from_at_80_columns() -> None:
    """The mean TTFT split into waiting, the prompt's prefill chunks alone, the decodes sharing those
    steps, the fixed per-request cost and the API server's work for the other streams: the parts add up
    to the planner's mean, and a heavier load waits longer, shares its prefill steps with more decodes
    and waits for more streams' work."""
    explained = {}
    for clients in ("4", "48"):
        code, data = run_plan(
            "--model", "llama-3.1-8b", "--gpu", "l40s", "--gpus", "1", "--concurrency", clients,
            "--input-len", "3000", "--output-len", "200", "--explain",
        )  # fmt: skip
        assert code == 0
        ttft = explained[clients] = data["explain"]["ttft"]
        assert ttft["mean_ms"] == data["layouts"][0]["ttft_mean_ms"]
        parts = ("waiting_ms", "prefill_ms", "interference_ms", "overhead_ms", "streams_ms")
        assert sum(ttft[part] for part in parts) == pytest.approx(ttft["mean_ms"], abs=0.1)
        assert ttft["chunks"] == 2  # 3,000 prompt tokens in steps of at most 2,048
        assert ttft["decodes_alongside"] == int(clients) - 1
    light, heavy = explained["4"], explained["48"]
    assert heavy["waiting_ms"] > light["waiting_ms"] and heavy["interference_ms"] > light["interference_ms"]
    assert heavy["prefill_ms"] == light["prefill_ms"] and light["prefill_ms"] > 0
    assert heavy["overhead_ms"] == light["overhead_ms"]
    assert heavy["streams_ms"] == pytest.approx(light["streams_ms"] * 47 / 3, abs=0.2)
    assert light["streams_ms"] > 0
    # at a request rate, the streams in flight at each arrival (the open loop's), as the plan's mean has them
    code, data = run_plan(
        "--model", "llama-3.1-8b", "--gpu", "l40s", "--gpus", "1", "--request-rate", "2",
        "--input-len", "3000", "--output-len", "200", "--explain",
    )  # fmt: skip
    ttft, layout = data["explain"]["ttft"], data["layouts"][0]
    assert ttft["streams_ms"] == layout["ttft_streams_ms"] and 0 < ttft["streams_ms"] < ttft["mean_ms"]
    assert sum(ttft[part] for part in parts) == pytest.approx(ttft["mean_ms"], abs=0.1)
    shown = subprocess.run(
        [*CORRAL, "plan", "--model", "llama-3.1-8b", "--gpu", "l40s", "--gpus", "1", "--explain"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "80"},
    )  # fmt: skip
    assert shown.returncode == 0 and "time to first token: mean" in shown.stdout
    lines = shown.stdout.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    assert any(line.lstrip().startswith("waiting (the step in progress") for line in lines)


def test_when_nothing_fits_the_smallest_change_that_would_is_named() -> None:
    """Llama-3.1-70B in bf16 fits 2×A100-80GB at vLLM's defaults (the cards hold 80 GiB); in FP8 on one
    H100 it needs a higher gpu_memory_utilization; at a 128k context on 2×H100 a shorter max_model_len."""
    code, data = run_plan("--model", "llama-3.1-70b", "--gpu", "a100-80gb", "--gpus", "2")
    assert code == 0 and data["fits"]
    code, data = run_plan("--model", "llama-3.1-70b", "--quant", "fp8", "--gpu", "h100-sxm", "--gpus", "1")
    assert code == 1 and not data["fits"]
    assert "(fits at gpu_memory_utilization 0.92: " in data["reason"]
    assert "concurrent 1280-token sequences" in data["reason"]  # the workload's own length
    code, data = run_plan(
        "--model", "llama-3.1-70b", "--gpu", "h100-sxm", "--gpus", "2", "--context", "131072",
    )  # fmt: skip
    assert code == 1 and "fits at max_model_len ≤ 6144" in data["reason"]


def test_when_no_layout_meets_the_objective_it_says_so_names_the_closest_and_exits_1() -> None:
    """It listed three layouts that all missed, exited 0 and said nothing (`reason` null)."""
    code, out = run_plan(
        "--model", "llama-3.1-70b", "--gpu", "l4", "--concurrency", "64",
        "--ttft-p95-ms", "50", "--max-gpus", "8",
    )  # fmt: skip
    assert code == 1 and out["fits"] is True and out["meets_slo"] is False
    first = out["layouts"][0]
    assert out["reason"].startswith("no layout meets TTFT p95 ≤ 50 ms at this load; the closest is")
    assert f"{first['gpus']}× l4" in out["reason"] and "--max-gpus" in out["reason"]
    code, met = run_plan("--model", "llama-3.1-8b", "--gpu", "l40s", "--ttft-p95-ms", "100000")
    assert code == 0 and met["meets_slo"] is True and met["reason"] is None


def test_a_rate_no_layout_keeps_up_with_misses_the_objective_without_an_slo() -> None:
    """20 requests/s on one L4 (it finishes under one a second): the plan exited 0 and its caption said
    the layout was cheaper than the API, priced at the rate it does serve, not the one asked for."""
    from corral.plan.render import plan_table

    result = plan(
        PlanRequest(model="llama-3.1-8b", gpu="l4", request_rate=20, max_gpus=1), CATALOG, EFFICIENCY
    )
    assert result.fits and result.layouts[0].overloaded and result.reason is not None
    assert result.reason.startswith("no layout within 1 GPU(s) keeps up with 20 requests/s; the closest")
    caption = str(plan_table(result).caption)
    assert "does not keep up" in caption and "cheaper" not in caption and "dearer" not in caption
    code, out = run_plan("--model", "llama-3.1-8b", "--gpu", "l4", "--request-rate", "20", "--max-gpus", "1")
    assert code == 1 and out["reason"] == result.reason


@pytest.mark.slow  # a search over every GPU class (seconds each): make test, not test-fast
def test_the_api_compared_with_is_of_the_models_class_and_all_gpus_sort_by_token_price() -> None:
    """A 70B model was priced against gpt-4o-mini, a small model's API."""
    _, small = run_plan("--model", "llama-3.1-8b", "--gpu", "l40s")
    _, large = run_plan("--model", "llama-3.1-70b", "--gpu", "h100-sxm")
    _, stated = run_plan("--model", "llama-3.1-70b", "--gpu", "h100-sxm", "--api", "gpt-4o")
    assert (small["compared_with"], large["compared_with"], stated["compared_with"]) == (
        "together-llama-3.1-8b",
        "together-llama-3.1-70b",
        "gpt-4o",
    )
    everything = plan(PlanRequest(model="llama-3.1-8b", limit=20), CATALOG, EFFICIENCY)
    prices = [lay.cost.cost_per_million_tokens for lay in everything.layouts]
    assert len({lay.gpu for lay in everything.layouts}) > 1 and prices == sorted(prices)


def test_layouts_split_attention_heads_evenly_over_tensor_parallel_ranks() -> None:
    """vLLM refuses to start a model whose heads do not divide by its TP size (Qwen2.5-7B's 28 on 8)."""
    qwen = plan(
        PlanRequest(model="qwen2.5-7b", gpu="h100-sxm", gpus=8, concurrency=4, limit=100), CATALOG, EFFICIENCY
    )
    assert qwen.layouts and {layout.tp for layout in qwen.layouts} == {1, 2, 4}
    small = plan(PlanRequest(model="smollm2-135m", gpu="h100-sxm", gpus=4, limit=100), CATALOG, EFFICIENCY)
    assert {layout.tp for layout in small.layouts} == {1}  # 9 heads: on one rank each


def test_an_uneven_layer_count_splits_over_pipeline_stages() -> None:
    """DeepSeek-V3's 61 layers go on 2 stages as 31 and 30 (vLLM splits an uneven count): it fits on two
    nodes of 8 H100s, each GPU holding the busier stage's share."""
    result = plan(PlanRequest(model="deepseek-v3", gpu="h100-sxm", limit=100), CATALOG, EFFICIENCY)
    assert (8, 2) in {(layout.tp, layout.pp) for layout in result.layouts}
    model, gpu = CATALOG.models.get("deepseek-v3"), CATALOG.gpus.get("h100-sxm")
    one, two = (memory_plan(model, gpu, result.quant, tp=8, pp=pp) for pp in (1, 2))
    assert two.kv_bytes_per_token == pytest.approx(one.kv_bytes_per_token * 31 / 61)


def test_clients_split_unevenly_over_replicas_count_as_they_are() -> None:
    """16 clients on 5 replicas are 4 + 3 + 3 + 3 + 3, not 5 × 4: the throughput (and so the price of a
    token) lies between 15 clients' and 20's."""
    rates = [
        plan(
            PlanRequest(model="llama-3.1-8b", gpu="h100-sxm", gpus=5, concurrency=clients),
            CATALOG,
            EFFICIENCY,
        )
        .layouts[0]
        .requests_per_s
        for clients in (15, 16, 20)
    ]
    assert rates[0] < rates[1] < rates[2]


def test_a_break_even_beyond_the_planned_load_is_said_so() -> None:
    """8 L4s serving Qwen2.5-7B break even with the API at ~667k requests a day; the planned load is ~470k:
    the table says the break-even is more than this load, and the JSON says so too."""
    from rich.console import Console

    from corral.plan.render import plan_table

    result = plan(PlanRequest(model="qwen2.5-7b", gpu="l4", gpus=8, concurrency=64), CATALOG, EFFICIENCY)
    cost, served = result.layouts[0].cost, result.layouts[0].requests_per_s * 86400
    assert cost.break_even_requests_per_day > served and not cost.reaches_break_even
    console = Console(width=200, record=True)
    console.print(plan_table(result))
    assert "more than this load" in " ".join(console.export_text().split())
    cheap = plan(PlanRequest(model="llama-3.1-8b", gpu="h100-sxm", concurrency=64), CATALOG, EFFICIENCY)
    assert cheap.layouts[0].cost.reaches_break_even


def test_a_mixture_of_experts_is_compared_with_an_api_of_its_total_size() -> None:
    """Hosts price a model by its size: gpt-oss-120b (117B, 5.1B active) was compared with an 8B's API,
    DeepSeek-V3 (671B, 37B active) with a 70B's."""
    chosen = {
        name: api_for(PlanRequest(model=name), CATALOG.models.get(name))
        for name in ("gpt-oss-120b", "deepseek-v3", "mixtral-8x7b", "llama-3.1-8b")
    }
    assert chosen == {
        "gpt-oss-120b": "together-llama-3.1-70b",
        "deepseek-v3": "gpt-4o",
        "mixtral-8x7b": "together-llama-3.1-70b",
        "llama-3.1-8b": "together-llama-3.1-8b",
    }


def test_more_gpus_than_the_largest_cluster_is_an_error_and_concurrency_is_bounded() -> None:
    """`--gpus 16 --max-gpus 4` listed 16-GPU layouts; `--concurrency 100000` simulated for minutes."""
    for flags, message in (
        (["--gpus", "16", "--max-gpus", "4"], "--gpus 16 is more than --max-gpus 4"),
        (["--concurrency", "5000"], "less than or equal to 4096"),
    ):
        done = subprocess.run(
            [*CORRAL, "plan", "--model", "llama-3.1-8b", *flags], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 2 and message in done.stderr
    result = plan(PlanRequest(model="llama-3.1-8b", gpus=16, max_gpus=4), CATALOG, EFFICIENCY)
    assert (
        not result.fits and result.reason is not None and "more than the largest cluster (4)" in result.reason
    )
    code, out = run_plan("--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--gpus", "128", "--limit", "1")
    assert code == 0 and out["layouts"][0]["gpus"] == 128  # (more than the default largest, 64: fine)
