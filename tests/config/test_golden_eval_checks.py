"""A golden_eval case's check is checked when the spec is loaded: a regex that does not compile, a
json_schema that is not a JSON Schema, and an empty `contains` or `regex` (which every answer passes) are
spec errors naming the field, where before they were accepted and failed only mid-rollout, after the new
replicas had started. `json_schema: {}` stays: it asks for an answer that parses as JSON."""

from __future__ import annotations

import pytest

from corral.cluster.evalgate import check_answer
from corral.config import SpecError, parse_spec

SPEC = """
models:
  - name: m
    arch: llama-3.1-8b
    rollout:
      golden_eval:
        - {{name: capital, prompt: "The capital of France?", {check}}}
    deployments: [{{engine: sim, gpu: l4}}]
"""


@pytest.mark.parametrize(
    ("check", "refused"),
    [
        (
            'regex: "([0-9]"',
            "regex: regex '([0-9]' is not a valid regular expression: missing )",
        ),
        (
            "json_schema: {type: nope}",
            "json_schema: json_schema is not a valid JSON Schema: 'nope'",
        ),
        ('contains: ""', "contains: an empty contains passes every answer"),
        ('regex: ""', "regex: an empty regex passes every answer"),
    ],
)
def test_a_golden_check_that_cannot_judge_an_answer_is_a_spec_error(check: str, refused: str) -> None:
    with pytest.raises(SpecError) as error:
        parse_spec(SPEC.format(check=check), source="cluster.yaml")
    assert f"cluster.yaml:7: models.0.rollout.golden_eval.0.{refused}" in str(error.value), str(error.value)


def test_an_empty_json_schema_still_asks_for_json() -> None:
    case = parse_spec(SPEC.format(check="json_schema: {}"), source="test").models[0].rollout.golden_eval[0]
    assert check_answer(case, '{"city": "Paris"}') is None
    assert check_answer(case, "Paris") == "expected JSON, got 'Paris'"
