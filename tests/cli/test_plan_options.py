"""`corral plan`'s numbers are bounded: a rate at or below zero hung or divided by zero, no GPUs divided by
zero, a context of 0 was taken as 8192, a limit of 0 printed "does not fit:" without a reason, and a
negative objective was accepted. A --yaml file that cannot be written is one error line too."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from corral.cli import app

from .test_errors import corral, one_error


@pytest.mark.parametrize(
    "option",
    [
        ("--request-rate", "-1"),
        ("--request-rate", "0"),
        ("--request-rate", "nan"),
        ("--gpus", "0"),
        ("--gpus", "-2"),
        ("--context", "0"),
        ("--limit", "0"),
        ("--max-gpus", "0"),
        ("--input-len", "0"),
        ("--output-len", "0"),
        ("--ttft-p95-ms", "-5"),
        ("--itl-ms", "0"),
    ],
    ids=lambda option: " ".join(option),
)
def test_a_number_out_of_its_range_is_refused_naming_the_option(option: tuple[str, str]) -> None:
    done = CliRunner().invoke(app, ["plan", "--model", "llama-3.1-8b", *option], env={"COLUMNS": "200"})
    assert done.exit_code == 2 and isinstance(done.exception, SystemExit | None), done.exception
    said = " ".join(done.output.split())
    assert "Traceback" not in said and option[0] in said, said


def test_a_yaml_file_that_cannot_be_written_is_one_error_line(tmp_path: Path) -> None:
    where = tmp_path / "no" / "such" / "cluster.yaml"
    done = corral("plan", "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--yaml", str(where))
    one_error(done, 1, "--yaml", str(where), "No such file or directory")
