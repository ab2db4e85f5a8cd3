"""The vLLM adapter's command line and metrics reading (shared with the simulator)."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.config import DeploymentSpec, HuggingFaceSource, ModelSpec, Paths, SpecError, parse_spec
from corral.engines import VllmEngine, engine_named, parse_vllm_load

METRICS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 5.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 640.0
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.8
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 100.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 100.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 3.0
"""


def test_vllm_metrics_become_the_common_load_shape() -> None:
    load = parse_vllm_load(METRICS)
    assert (load.running, load.waiting, load.kv_usage) == (5, 2, 0.42)
    assert (load.prefix_cache_queries_total, load.prefix_cache_hits_total, load.preemptions_total) == (
        1000,
        640,
        3,
    )


def test_a_pinned_revision_of_a_whole_repository_reaches_vllm(tmp_path: Path) -> None:
    """vLLM fetches a whole repository itself: the spec's pinned revision must go with it (weights and
    tokenizer), or each replica and Ray node takes the branch's head of its own day."""
    pinned = "0123456789abcdef0123456789abcdef01234567"
    model = ModelSpec(
        name="q",
        source=HuggingFaceSource(hf="Qwen/Qwen2.5-7B-Instruct", revision=pinned),
        deployments=[DeploymentSpec(engine="vllm")],
    )
    python = tmp_path / "python"
    python.write_text("")
    deployment = DeploymentSpec(engine="vllm", binary=python)
    (plan,) = engine_named("vllm").prepare(model, deployment, Paths(tmp_path), lambda _: None)
    argv = list(plan.argv)
    assert argv[argv.index("--revision") + 1] == pinned
    assert argv[argv.index("--tokenizer-revision") + 1] == pinned
    for named in (["--tokenizer", "other/tokenizer"], ["--tokenizer=other/tokenizer"]):
        other = DeploymentSpec(engine="vllm", binary=python, engine_args=named)
        (plan,) = engine_named("vllm").prepare(model, other, Paths(tmp_path), lambda _: None)
        assert "--revision" in plan.argv and "--tokenizer-revision" not in plan.argv  # (its own repository's)


def test_vllm_command_follows_the_layout(tmp_path: Path) -> None:
    model = ModelSpec(
        name="llama",
        source=HuggingFaceSource(hf="meta-llama/Llama-3.1-70B-Instruct"),
        deployments=[DeploymentSpec(engine="vllm")],
    )
    python = tmp_path / "python"  # vLLM's own interpreter
    python.write_text("")
    deployment = DeploymentSpec(
        engine="vllm",
        replicas=2,
        tensor_parallel=2,
        pipeline_parallel=2,
        gpus=[4, 5, 6, 7, 0, 1, 2, 3],
        quantization="fp8",
        max_model_len=8192,
        binary=python,
        engine_api_key="sekrit",
    )
    plans = engine_named("vllm").prepare(model, deployment, Paths(tmp_path), lambda _: None)
    argv = list(plans[0].argv)
    assert argv[:3] == [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    flags = {a: b for a, b in zip(argv, [*argv[1:], ""], strict=True) if a.startswith("--")}
    assert flags["--enable-prefix-caching"].startswith("--")  # a switch, no value
    assert flags["--model"] == "meta-llama/Llama-3.1-70B-Instruct" and flags["--served-model-name"] == "llama"
    assert flags["--tensor-parallel-size"] == "2" and flags["--pipeline-parallel-size"] == "2"
    assert flags["--quantization"] == "fp8" and flags["--max-model-len"] == "8192"
    assert "--revision" not in argv  # (none pinned: vLLM takes the repository's default branch)
    # its key reaches vLLM in its environment (VLLM_API_KEY), never in argv, which `ps` and its log show
    assert "sekrit" not in argv and plans[0].env["VLLM_API_KEY"] == "sekrit" and plans[0].api_key == "sekrit"
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["4,5,6,7", "0,1,2,3"]
    assert "--enforce-eager" not in argv and flags["--gpu-memory-utilization"] == "0.9"
    # a Llama 3 model: vLLM parses its tool calls (llama3_json), the gateway passes them through
    assert flags["--tool-call-parser"] == "llama3_json" and "--enable-auto-tool-choice" in argv
    assert plans[0].features.tools


@pytest.mark.parametrize(
    ("source", "parser", "chosen"),
    [
        ("Qwen/Qwen2.5-7B-Instruct", None, "hermes"),
        ("mistralai/Mistral-7B-Instruct-v0.3", None, "mistral"),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", None, None),  # no parser for its family: the gateway's JSON
        ("Qwen/Qwen2.5-7B-Instruct", "none", None),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "pythonic", "pythonic"),
    ],
)
def test_tool_call_parser_follows_the_family_or_the_spec(
    tmp_path: Path, source: str, parser: str | None, chosen: str | None
) -> None:
    python = tmp_path / "python"
    python.write_text("")
    spec = parse_spec(
        f"models: [{{name: m, source: {{hf: {source}}}, deployments: [{{engine: vllm, binary: {python}"
        + (f", tool_call_parser: {parser}" if parser else "")
        + "}]}]"
    )
    model = spec.models[0]
    (plan,) = engine_named("vllm").prepare(model, model.deployments[0], Paths(tmp_path), lambda _: None)
    argv = list(plan.argv)
    found = argv[argv.index("--tool-call-parser") + 1] if "--tool-call-parser" in argv else None
    assert found == chosen and plan.features.tools == (chosen is not None)


def test_cpu_build_flags_and_environment(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text("")
    model = ModelSpec(
        name="m", source=HuggingFaceSource(hf="org/m"), deployments=[DeploymentSpec(engine="vllm")]
    )
    deployment = DeploymentSpec(engine="vllm", device="cpu", replicas=2, binary=python, kv_cache_gib=1)
    plans = VllmEngine(cores=[4, 5, 6, 7]).prepare(model, deployment, Paths(tmp_path), lambda _: None)
    argv = list(plans[0].argv)
    assert "--enforce-eager" in argv and argv[argv.index("--dtype") + 1] == "float32"
    assert "--gpu-memory-utilization" not in argv
    assert plans[0].env == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "4"}
    assert plans[1].env["VLLM_CPU_OMP_THREADS_BIND"] == "5"


@pytest.mark.parametrize(
    ("layout", "binds"),
    [
        ({"threads": 3}, ["0-2", "3-5"]),  # (each replica its `threads` cores: it got one, the rest idle)
        # one core list per rank, `|` between them: vLLM refuses another count (a single "0" for two
        # tensor-parallel ranks failed its start); `threads` is the replica's, split among its ranks
        ({"threads": 4, "tensor_parallel": 2}, ["0-1|2-3", "4-5|6-7"]),
        ({"threads": 2, "engine_args": ["--data-parallel-size", "2"]}, ["0|1", "2|3"]),
        ({"tensor_parallel": 2, "pipeline_parallel": 2}, ["0|1|2|3", "4|5|6|7"]),  # (a core each at least)
        # threads the ranks do not divide: all of them bound (Ray reserves `threads`), the first rank one more
        ({"threads": 5, "tensor_parallel": 2}, ["0-2|3-4", "5-7|0-1"]),
    ],
)
def test_a_cpu_replica_is_bound_to_its_threads_cores_one_list_per_rank(
    tmp_path: Path, layout: dict[str, object], binds: list[str]
) -> None:
    python = tmp_path / "python"
    python.write_text("")
    model = ModelSpec(
        name="m", source=HuggingFaceSource(hf="org/m"), deployments=[DeploymentSpec(engine="vllm")]
    )
    deployment = DeploymentSpec.model_validate(
        {"engine": "vllm", "device": "cpu", "replicas": 2, "binary": python, **layout}
    )
    plans = VllmEngine(cores=range(8)).prepare(model, deployment, Paths(tmp_path), lambda _: None)
    assert [plan.env["VLLM_CPU_OMP_THREADS_BIND"] for plan in plans] == binds


def test_cpu_replicas_past_the_cores_start_from_the_first_again(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text("")
    model = ModelSpec(
        name="m", source=HuggingFaceSource(hf="org/m"), deployments=[DeploymentSpec(engine="vllm")]
    )
    deployment = DeploymentSpec(engine="vllm", device="cpu", replicas=3, threads=2, binary=python)
    plans = VllmEngine(cores=[6, 7, 9]).prepare(model, deployment, Paths(tmp_path), lambda _: None)
    assert [plan.env["VLLM_CPU_OMP_THREADS_BIND"] for plan in plans] == ["6-7", "6,9", "7,9"]


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ("{engine: vllm, replicas: 2, tensor_parallel: 4, gpus: [0, 1, 2, 3]}", "needs 8 GPUs"),
        ("{engine: vllm, tensor_parallel: 16}", "spans more GPUs than one node"),
        ("{engine: vllm, gpus: [0, 0]}", "lists a device twice"),
    ],
)
def test_gpu_layout_is_checked_against_the_declared_devices(layout: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse_spec(f"models:\n  - name: m\n    source: {{hf: a/b}}\n    deployments:\n      - {layout}\n")


def test_braces_in_any_value_reach_vllm_as_written(tmp_path: Path) -> None:
    """The runtime fills `{host}` and `{port}` into the command line with `str.format`: a value of the
    spec's holding braces (a weights folder `my{v2}`, a dtype) raised KeyError at every replica start, and
    the supervisor retried it for good. Only the engine's own flags were escaped."""
    python = tmp_path / "python"
    python.write_text("")
    weights = tmp_path / "my{v2}"
    weights.mkdir()
    model = ModelSpec.model_validate(
        {"name": "m", "source": {"path": str(weights)}, "deployments": [{"engine": "vllm"}]}
    )
    config = '{"max_cudagraph_capture_size": 8}'
    deployment = DeploymentSpec(
        engine="vllm", binary=python, dtype="x{y}", engine_args=["--compilation-config", config]
    )
    (plan,) = engine_named("vllm").prepare(model, deployment, Paths(tmp_path), lambda _: None)
    argv = [arg.format(host="127.0.0.1", port=8001) for arg in plan.argv]  # (as the runtimes do)
    flags = dict(zip(argv, [*argv[1:], ""], strict=True))
    assert flags["--model"] == str(weights) and flags["--dtype"] == "x{y}"
    assert flags["--compilation-config"] == config
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "8001"
