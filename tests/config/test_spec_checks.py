"""Spec files a reader might get wrong, each refused with the file, line and field: a key written twice
(YAML keeps the last without a word), a file that is not UTF-8 (an "unexpected error" before), `.inf` or
`.nan` for a number (NaN passes every bound), an external server's URL without http(s) or with the /v1 the
gateway adds itself, and feed-forward autoscaling of a model the perf catalog does not know (it scaled
reactively, without a word)."""

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
      - {{engine: sim, gpu: l4, autoscale: {{min_replicas: 1, max_replicas: 4, mode: feed_forward}}}}
"""


def test_feed_forward_needs_a_model_the_perf_catalog_knows() -> None:
    unknown = FEED_FORWARD.format(name="org/my-model", more="    arch: my-modle\n")
    with pytest.raises(
        SpecError, match=r"s\.yaml:2: models\.0: Value error, arch: .*'my-modle', 'org/my-model'"
    ):
        parse_spec(unknown, source="s.yaml")
    hf = "    source: {hf: meta-llama/Llama-3.1-8B-Instruct}\n"
    known = [
        FEED_FORWARD.format(name="org/my-model", more="    arch: llama-3.1-8b\n"),
        FEED_FORWARD.format(name="org/my-model", more=hf),
        FEED_FORWARD.format(name="llama-3.1-8b", more=""),
    ]
    for text in known:
        assert parse_spec(text).models[0].deployments[0].autoscale is not None
    assert parse_spec(unknown.replace("mode: feed_forward", "mode: reactive"))
