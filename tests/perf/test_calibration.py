"""The planner's factors are the published corpus's fit, stored with its report, not code defaults."""

from __future__ import annotations

import pytest

from corral.perf.calibration import calibrated_efficiency, stored_document
from corral.perf.timing import Efficiency


def test_the_planner_uses_the_stored_corpus_fit_for_vllm() -> None:
    document = stored_document()
    assert calibrated_efficiency() == Efficiency(**document["factors"]["vllm"])
    assert calibrated_efficiency() != Efficiency()  # the data decides, not the dataclass defaults
    assert len(document["fitted_on"]["sources"]) >= 5 and document["fitted_on"]["points"] >= 30
    assert set(document["report"]) == {"leave_one_source_out", "in_sample"}


def test_an_unknown_engine_family_is_named_with_the_known_ones() -> None:
    with pytest.raises(KeyError, match="tensorrt-llm"):
        calibrated_efficiency("sglang")
