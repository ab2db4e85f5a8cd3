"""The llama.cpp adapter: its command line and reading its Prometheus metrics into the load shape."""

from __future__ import annotations

from pathlib import Path

from corral.config import DeploymentSpec, LocalSource, ModelSpec, Paths
from corral.engines import LlamaCppEngine, engine_named

# As llama-server 0.3.36's vendored build prints it (trimmed to the lines the adapter reads and a few more).
METRICS = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 33
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 41
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 3
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 2
# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per llama_decode() call
# TYPE llamacpp:n_busy_slots_per_decode gauge
llamacpp:n_busy_slots_per_decode 1.64
"""


def test_metrics_become_the_common_load_shape() -> None:
    load = LlamaCppEngine().parse_load(METRICS)
    assert (load.running, load.waiting) == (3, 2)
    assert load.prompt_tokens_total == 33 and load.generated_tokens_total == 41
    assert load.kv_usage is None  # this llama.cpp no longer reports it


def _tiny(tmp_path: Path) -> tuple[ModelSpec, Path, Path]:
    """A model of a (fake) GGUF file, and a (fake) llama-server: (model, its weights, the binary)."""
    weights = tmp_path / "m.gguf"
    weights.write_bytes(b"GGUF")
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    model = ModelSpec(name="tiny", source=LocalSource(path=weights), deployments=[DeploymentSpec()])
    return model, weights, binary


def test_command_line_follows_the_deployment(tmp_path: Path) -> None:
    model, weights, binary = _tiny(tmp_path)
    deployment = DeploymentSpec(
        replicas=3,
        threads=2,
        parallel=8,
        context_length=1024,
        binary=binary,
        engine_args=["--flash-attn", "on"],
    )
    plans = engine_named("llamacpp").prepare(model, deployment, Paths(tmp_path), lambda _: None)
    assert len(plans) == 3
    argv = list(plans[0].argv)
    assert argv[0] == str(binary)
    flags = dict(zip(argv[1::2], argv[2::2], strict=False))
    assert flags["--model"] == str(weights.resolve())
    assert flags["--alias"] == "tiny"
    assert flags["--threads"] == "2" and flags["--parallel"] == "8"
    assert flags["--ctx-size"] == str(1024 * 8)  # llama.cpp splits the context across slots
    assert flags["--port"] == "{port}"
    assert "--metrics" in argv and argv[-2:] == ["--flash-attn", "on"]


def test_an_engine_argument_s_braces_reach_llama_server_as_written(tmp_path: Path) -> None:
    """The runtime fills {host} and {port} in with `str.format`: a JSON argument's braces (a chat
    template's keyword arguments) raised KeyError at every start, or lost one of each pair."""
    model, _, binary = _tiny(tmp_path)
    kwargs = ["--chat-template-kwargs", '{"enable_thinking": false}', "--chat-template", "{{ messages }}"]
    deployment = DeploymentSpec(binary=binary, engine_args=kwargs)
    (plan,) = engine_named("llamacpp").prepare(model, deployment, Paths(tmp_path), lambda _: None)
    argv = [arg.format(host="127.0.0.1", port=8080) for arg in plan.argv]
    assert argv[-4:] == kwargs and "8080" in argv
