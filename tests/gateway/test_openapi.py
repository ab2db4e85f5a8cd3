"""The OpenAPI document the gateway serves, and schemathesis fuzzing a live gateway against it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..conftest import DATA, RunningCluster, get_json, start_cluster

SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    running = start_cluster(tmp_path_factory.mktemp("fuzz"), spec=DATA / "sim-fuzz.yaml")
    yield running
    running.stop()


def test_openapi_document_describes_the_api(fuzzed: RunningCluster) -> None:
    status, document = get_json(fuzzed.url + "/openapi.json")
    assert status == 200 and document["openapi"] == "3.1.0"
    assert set(document["paths"]) == {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/v1/models/{model}",
    }
    chat = document["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["properties"]["model"]["enum"] == ["llama-8b"]  # the models this gateway serves
    assert {"model", "messages"} <= set(chat["required"])
    responses = document["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "413", "429", "502", "503", "504"} <= set(responses)


@pytest.mark.slow
def test_schemathesis_finds_no_server_error_hang_or_schema_violation(
    fuzzed: RunningCluster, tmp_path: Path
) -> None:
    """Every check but positive_data_acceptance: the API is stricter than a JSON schema can say (for
    instance `stream_options` only with `stream: true`, `max_tokens` within the context), and says so
    with a 400 naming the field."""
    done = subprocess.run(
        [
            str(SCHEMATHESIS),
            "run",
            fuzzed.url + "/openapi.json",
            "--checks",
            "all",
            "--exclude-checks",
            "positive_data_acceptance",
            "--max-examples",
            "40",
            "--request-timeout",
            "20",  # a hang is a failure
            "--workers",
            "1",
            "--seed",
            "7",
            "--generation-database",
            "none",
            "--no-color",
            "--report-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-6000:]
    assert " passed" in done.stdout and "No issues found" in done.stdout
