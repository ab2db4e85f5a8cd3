"""The efficiency factors the planner and the simulator use: the published corpus's fit, stored as data.

`corral plan --calibrate` fits the factors per engine family on every source of the corpus
(`validation.py`) and prints `data/fitted.yaml`: the factors with their fit report (what they were fitted
on, the leave-one-source-out and in-sample error). The planner and the simulator read the vLLM family's;
a test checks that a fresh fit finds the stored factors, so the file cannot go stale unnoticed.
"""

from __future__ import annotations

from datetime import date
from importlib import resources
from typing import Any

import yaml

from corral.perf.timing import Efficiency
from corral.perf.validation import Validation, report

__all__ = ["calibrated_efficiency", "fitted_document", "stored_document"]

_HEADER = """\
# The efficiency factors per engine family, fitted on every source of the published corpus
# (perf/data/published.yaml, measured_cpu.yaml) by perf/validation.py. Written by
# `corral plan --calibrate > src/corral/perf/data/fitted.yaml`; do not edit by hand. The planner and the
# simulator use `vllm`. `report` is the fit's error: each source left out (the error to expect on a
# configuration nobody measured) and in-sample, MAPE per GPU class and metric.
"""


def stored_document() -> dict[str, Any]:
    text = (resources.files("corral.perf") / "data" / "fitted.yaml").read_text()
    document: dict[str, Any] = yaml.safe_load(text)
    return document


def calibrated_efficiency(family: str = "vllm") -> Efficiency:
    """The stored fitted factors of an engine family (vllm, tensorrt-llm, llamacpp, vllm-cpu)."""
    factors = stored_document()["factors"]
    if family not in factors:
        raise KeyError(f"no fitted factors for {family!r}; families: {', '.join(sorted(factors))}")
    return Efficiency(**factors[family])


def fitted_document(validation: Validation, today: date | None = None) -> str:
    """`data/fitted.yaml` for a validation run: factors, what they rest on, and their error."""
    summary = report(validation)
    fitted_on = [p.point for p in validation.in_sample]
    document = {
        "fitted": (today or date.today()).isoformat(),
        "fitted_on": {
            "points": len(fitted_on),
            "sources": sorted({p.source for p in fitted_on}),
            "unused": summary["unused"],
            "refused": summary["refused"],
        },
        "factors": summary["factors"],
        "report": {
            "leave_one_source_out": summary["mape_leave_one_source_out"],
            "leave_one_source_out_by_engine": summary["mape_leave_one_source_out_by_engine"],
            "in_sample": summary["mape_in_sample"],
        },
    }
    return _HEADER + yaml.safe_dump(document, sort_keys=False, width=110)
