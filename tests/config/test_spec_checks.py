"""Spec files a reader might get wrong, each refused with the file, line and field: a key written twice
(YAML keeps the last without a word), a file that is not UTF-8 (an "unexpected error" before), `.inf` or
`.nan` for a number (NaN passes every bound), an external server's URL without http(s) or with the /v1 the
gateway adds itself, feed-forward autoscaling of a model the perf catalog does not know (it scaled
reactively, without a word), and a simulated model or GPU it does not know (each replica failed its starts).
A rule across the spec is told without a line or pydantic's words."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from corral.cli import app
from corral.config import SpecError, load_spec, parse_spec

EXTERNAL = "models:\n  - name: m\n    deployments: [{engine: external, urls: ['http://127.0.0.1:9']}]\n"


def test_a_key_written_twice_is_refused_with_both_lines() -> None:
    with pytest.raises(SpecError, match=r"^s\.yaml:5: gateway: repeated \(first on line 1\)"):
        parse_spec("gateway: {port: 8001}\n" + EXTERNAL + "gateway: {port: 8002}\n", source="s.yaml")
    twice = EXTERNAL.replace("urls: ['http://127.0.0.1:9']", "urls: ['http://a:1'], urls: ['http://b:1']")
    with pytest.raises(SpecError, match=r":3: models\.0\.deployments\.0\.urls: repeated"):
        parse_spec(twice, source="s.yaml")
    merged = "models:\n  - name: m\n    deployments:\n      - &d {engine: external, urls: ['http://a:1']}\n"
    assert parse_spec(merged + "  - name: n\n    deployments: [{<<: *d, urls: ['http://b:1']}]\n")


def test_a_file_that_is_not_utf8_is_a_spec_error_naming_it(tmp_path: Path) -> None:
    spec = tmp_path / "latin1.yaml"
    spec.write_bytes(EXTERNAL.replace("name: m", "name: caf\xe9").encode("latin-1"))
    with pytest.raises(SpecError, match=r"latin1\.yaml:2: not UTF-8 text \(byte 0xe9\)"):
        load_spec(spec)
    checked = CliRunner().invoke(app, ["spec", "check", "-f", str(spec)])
    assert checked.exit_code == 2 and "not UTF-8" in checked.output and "unexpected" not in checked.output


@pytest.mark.parametrize("text", ["[" * 5000, "models: " + "[" * 2000 + "]" * 2000, "a: " + "{a: " * 3000])
def test_a_spec_nested_too_deeply_is_a_spec_error(tmp_path: Path, text: str) -> None:
    """PyYAML recurses once a level: a deep spec was a RecursionError (a 500 from POST /admin/spec, a
    traceback from the CLI)."""
    with pytest.raises(SpecError, match=r"^s\.yaml: nested too deeply$"):
        parse_spec(text, source="s.yaml")
    spec = tmp_path / "deep.yaml"
    spec.write_text(text)
    checked = CliRunner().invoke(app, ["spec", "check", "-f", str(spec)])
    assert checked.exit_code == 2 and "deep.yaml: nested too deeply" in checked.output, checked.output


@pytest.mark.parametrize("value", [".inf", ".nan", "-.inf"])
def test_infinite_or_nan_numbers_are_refused(value: str) -> None:
    with pytest.raises(SpecError, match=r"s\.yaml:1: gateway\.read_timeout: Input should be a finite number"):
        parse_spec(f"gateway: {{read_timeout: {value}}}\n" + EXTERNAL, source="s.yaml")
    with pytest.raises(SpecError, match="finite number"):
        parse_spec(EXTERNAL.replace("name: m", f"name: m\n    slo: {{ttft_p95: {value}}}"))


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("127.0.0.1:8000", "not an http:// or https:// URL"),
        ("ftp://127.0.0.1:8000", "not an http:// or https:// URL"),
        ("http://127.0.0.1:8000/v1", "without /v1"),
        ("http://127.0.0.1:8000/v1/", "'http://127.0.0.1:8000', not"),
        ("http://[::1", "not a URL"),
    ],
)
def test_an_external_servers_url_is_a_base_url(url: str, words: str) -> None:
    with pytest.raises(SpecError, match=r"s\.yaml:3: models\.0\.deployments\.0\.urls: ") as refused:
        parse_spec(EXTERNAL.replace("http://127.0.0.1:9", url), source="s.yaml")
    assert words in str(refused.value)
    assert parse_spec(EXTERNAL.replace("http://127.0.0.1:9", "https://vllm.internal/team-a/"))


FEED_FORWARD = """models:
  - name: {name}
{more}    deployments:
      - {{engine: vllm, gpu: l4, autoscale: {{min_replicas: 1, max_replicas: 4, mode: feed_forward}}}}
"""
LOCAL = "    source: {path: /models/m}\n"


def test_feed_forward_needs_a_model_the_perf_catalog_knows() -> None:
    unknown = FEED_FORWARD.format(name="org/my-model", more="    arch: my-modle\n" + LOCAL)
    with pytest.raises(SpecError, match=r"s\.yaml:2: models\.0: arch: .*'my-modle', 'org/my-model'"):
        parse_spec(unknown, source="s.yaml")
    hf = "    source: {hf: meta-llama/Llama-3.1-8B-Instruct}\n"
    known = [
        FEED_FORWARD.format(name="org/my-model", more="    arch: llama-3.1-8b\n" + LOCAL),
        FEED_FORWARD.format(name="org/my-model", more=hf),
        FEED_FORWARD.format(name="llama-3.1-8b", more=LOCAL),
    ]
    for text in known:
        assert parse_spec(text).models[0].deployments[0].autoscale is not None
    assert parse_spec(unknown.replace("mode: feed_forward", "mode: reactive"))


SIM = """models:
  - name: {name}
{lines}    deployments: [{{engine: {engine}, gpu: {gpu}{more}}}]
"""


@pytest.mark.parametrize(
    ("fields", "line", "words"),
    [
        (
            {"gpu": "h100x"},
            r"s\.yaml:4: models\.0\.deployments\.0: gpu: unknown GPU 'h100x'; did you mean h100-sxm",
            "the perf catalog's GPU types",
        ),
        (
            {"lines": "    arch: llama-3.1-8x\n"},
            r"s\.yaml:2: models\.0: arch: engine 'sim' simulates the perf catalog's model named by arch: "
            r"unknown model 'llama-3\.1-8x'; did you mean llama-3\.1-8b",
            "set arch to a catalog model",
        ),
        (
            {"lines": "", "name": "my-model"},
            r"s\.yaml:2: models\.0: arch: .*of the model's name \(arch is unset\): unknown model 'my-model'",
            "known: llama-3.1-8b, ",  # no close name: every name the catalog has
        ),
        (
            {"more": ", quantization: q4"},
            r"s\.yaml:4: models\.0\.deployments\.0: quantization: unknown quantization 'q4'",
            "known: bf16, fp32",
        ),
        (  # (vLLM's gpu where feed-forward autoscaling sizes replicas with it)
            {
                "engine": "vllm",
                "lines": "    source: {hf: org/m}\n",
                "gpu": "l4x",
                "more": ", autoscale: {min_replicas: 1, max_replicas: 2, mode: feed_forward}",
            },
            r"s\.yaml:4: models\.0\.deployments\.0: gpu: unknown GPU 'l4x'; did you mean l4",
            "(the perf catalog's GPU types)",
        ),
    ],
)
def test_a_simulated_model_and_gpu_must_be_in_the_perf_catalog(
    fields: dict[str, str], line: str, words: str
) -> None:
    """The simulator runs the catalog's model named by arch (else the model's name) on its GPU type: a name
    the catalog lacks passed, and each replica then failed its five starts (`unknown GPU 'h100x'`)."""
    values = {"name": "m", "lines": "    arch: llama-3.1-8b\n", "engine": "sim", "gpu": "h100-sxm"}
    values["more"] = ""
    with pytest.raises(SpecError, match=line) as refused:
        parse_spec(SIM.format(**(values | fields)), source="s.yaml")
    assert words in str(refused.value)
    assert "Value error" not in str(refused.value)
    aliases = {"gpu": "h100", "lines": "    arch: meta-llama/Llama-3.1-8B-Instruct\n"}
    aliases["more"] = ", quantization: fp8"  # (each an alias the catalog knows)
    assert parse_spec(SIM.format(**(values | aliases))).models[0].deployments[0].gpu == "h100"
    assert parse_spec(SIM.format(**(values | {"lines": "", "name": "smollm2-135m"})))
    # vLLM's gpu is only a name where nothing sizes with it (`corral plan --catalog` writes its own GPUs)
    vllm = {"engine": "vllm", "lines": "    source: {hf: org/m}\n", "gpu": "a10g"}
    assert parse_spec(SIM.format(**(values | vllm))).models[0].deployments[0].gpu == "a10g"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (
            EXTERNAL + EXTERNAL.removeprefix("models:\n"),
            "model and adapter names must be unique; repeated: m",
        ),
        ("gateway: {host: 0.0.0.0}\nauth: {open: true}\n" + EXTERNAL, "an open gateway (auth.open: true) on"),
        ("gateway: {workers: 2}\n" + EXTERNAL, "gateway.workers: 2 needs limits.backend: redis"),
    ],
)
def test_a_rule_across_the_spec_is_told_without_a_line_or_pydantics_prefix(
    tmp_path: Path, text: str, said: str
) -> None:
    """They were told as `s.yaml:1: (top level): Value error, …`: line 1 is no place of theirs."""
    with pytest.raises(SpecError) as refused:
        parse_spec(text, source="s.yaml")
    assert str(refused.value).startswith(f"invalid cluster spec\ns.yaml: {said}"), str(refused.value)
    spec = tmp_path / "s.yaml"
    spec.write_text(text)
    checked = CliRunner().invoke(app, ["spec", "check", "-f", str(spec)])
    assert checked.exit_code == 2 and f"\n{spec}: {said}" in checked.output, checked.output
    assert "Value error" not in checked.output and "top level" not in checked.output


@pytest.mark.parametrize(
    ("engine", "args", "named"),
    [
        ("vllm", "[--host, 0.0.0.0]", "--host"),  # (an engine without a key on every interface)
        ("vllm", "[--max_num_seqs, '8']", "--max-num-seqs"),  # (vLLM reads `_` as `-`)
        ("vllm", "[--api-key=k]", "--api-key"),  # (the gateway never learns it: every request a 401)
        ("llamacpp", "[--ctx-size, '512']", "--ctx-size"),
        ("llamacpp", "[-np, '1']", "-np"),
    ],
)
def test_engine_args_may_not_set_what_corral_sets_from_the_deployment(
    engine: str, args: str, named: str
) -> None:
    """Both engines take the later of a flag given twice: engine_args overrode corral's own flags
    silently (the gateway planned 4 slots and 8,192 tokens of context where llama.cpp ran 1 and 512)."""
    source = "{hf: a/b}" if engine == "vllm" else "{path: /m.gguf}"
    deployment = f"{{engine: {engine}, engine_args: {args}}}"
    spec = f"models:\n  - {{name: m, source: {source}, deployments: [{deployment}]}}\n"
    with pytest.raises(SpecError, match=f"engine_args sets {named}, which corral sets from"):
        parse_spec(spec)
    fine = "[--flash-attn, 'on']" if engine == "llamacpp" else "[--enforce-eager, --max-logprobs, '-1']"
    assert parse_spec(spec.replace(args, fine))
