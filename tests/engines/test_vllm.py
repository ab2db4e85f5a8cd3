"""The vLLM adapter's command line and metrics reading (shared with the simulator)."""

from __future__ import annotations

from pathlib import Path

from corral.config import DeploymentSpec, HuggingFaceSource, ModelSpec, Paths
from corral.engines import engine_named, parse_vllm_load

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
"""


def test_vllm_metrics_become_the_common_load_shape() -> None:
    load = parse_vllm_load(METRICS)
    assert (load.running, load.waiting, load.kv_usage) == (5, 2, 0.42)
    assert (load.prefix_cache_queries_total, load.prefix_cache_hits_total, load.preemptions_total) == (
        1000,
        640,
        3,
    )


def test_vllm_command_follows_the_layout(tmp_path: Path) -> None:
    model = ModelSpec(
        name="llama",
        source=HuggingFaceSource(hf="meta-llama/Llama-3.1-70B-Instruct"),
        deployments=[DeploymentSpec(engine="vllm")],
    )
    deployment = DeploymentSpec(
        engine="vllm",
        replicas=2,
        tensor_parallel=2,
        pipeline_parallel=2,
        quantization="fp8",
        max_model_len=8192,
        binary=Path("/opt/vllm/bin/python"),
    )
    plans = engine_named("vllm").prepare(model, deployment, Paths(tmp_path), lambda _: None)
    argv = list(plans[0].argv)
    assert argv[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = {a: b for a, b in zip(argv, [*argv[1:], ""], strict=True) if a.startswith("--")}
    assert flags["--enable-prefix-caching"].startswith("--")  # a switch, no value
    assert flags["--model"] == "meta-llama/Llama-3.1-70B-Instruct" and flags["--served-model-name"] == "llama"
    assert flags["--tensor-parallel-size"] == "2" and flags["--pipeline-parallel-size"] == "2"
    assert flags["--quantization"] == "fp8" and flags["--max-model-len"] == "8192"
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["0,1,2,3", "4,5,6,7"]
