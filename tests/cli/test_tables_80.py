"""The human tables of `corral plan` and `corral bench` read at 80 columns: no number is ever cut short
("1,2…"), however large; a cell too wide for its column folds onto the next line."""

from __future__ import annotations

import re

import pytest
from rich.console import Console

from corral.cli.bench import _show
from corral.perf import load_catalog
from corral.perf.calibration import calibrated_efficiency
from corral.plan import PlanRequest, plan, plan_table


def _render(renderable: object) -> str:
    console = Console(width=80, record=True, force_terminal=False)
    console.print(renderable)
    return console.export_text()


@pytest.mark.slow
def test_plan_tables_are_never_ellipsised_at_80_columns() -> None:
    result = plan(
        PlanRequest(
            model="llama-3.1-405b",
            gpu="all",
            context=16000,
            concurrency=256,
            input_len=8000,
            output_len=1000,
        ),
        load_catalog(),
        calibrated_efficiency(),
    )
    assert result.fits
    text = _render(plan_table(result))
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    for layout in result.layouts:  # every figure is there whole, on its line
        assert f"{layout.kv_tokens:,}" in text and f"{layout.cost.monthly_usd:,.0f}" in text


def _runs(scale: float) -> list[dict[str, object]]:
    figures = {"p50": 123.4 * scale, "p99": 987.6 * scale}
    return [
        {
            "load": "concurrency=1024" if scale > 1 else "c=64",
            "requests_per_s": 12.34 * scale,
            "output_tokens_per_s": 1234.5 * scale,
            "ttft_ms": figures,
            "tpot_ms": figures,
            "itl_ms": figures,
            "e2e_ms": figures,
            "errors": {"timeout": int(12 * scale)},
        }
    ]


class _NoSlo:
    any = False


def test_bench_table_reads_at_80_columns_and_never_cuts_a_number(capsys: pytest.CaptureFixture[str]) -> None:
    _show(_runs(1), _NoSlo())
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    for figure in ("12.34", "1,234.5", "123/988", "123.4/987.6", "c=64"):  # whole, on one line
        assert figure in out, figure
    _show(_runs(10_000), _NoSlo())  # absurd figures fold onto more lines, every digit kept
    out = capsys.readouterr().out
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= 80
    digits = sorted(re.sub(r"\D", "", out))
    for figure in ("123,400.00", "12,345,000.0", "1234000/9876000", "1234000.0/9876000.0", "120000"):
        for digit in set(re.sub(r"\D", "", figure)):
            assert digits.count(digit) >= re.sub(r"\D", "", figure).count(digit)
