"""The stored efficiency factors are the fit's, and they reproduce every measured point closely."""

from __future__ import annotations

import pytest

from corral.perf import load_catalog
from corral.perf.calibration import calibrated_efficiency, fit, load_points, predict


def test_stored_factors_predict_each_measured_point_within_5_percent() -> None:
    catalog = load_catalog()
    efficiency = calibrated_efficiency("vllm")
    for point in load_points("vllm"):
        assert predict(point, catalog, efficiency) == pytest.approx(point.output_tokens_per_s, rel=0.05)


def test_refitting_finds_the_stored_factors() -> None:
    result = fit(load_catalog(), "vllm")
    stored = calibrated_efficiency("vllm")
    assert result.efficiency.bandwidth == pytest.approx(stored.bandwidth, rel=0.03)
    assert result.efficiency.compute == pytest.approx(stored.compute, rel=0.05)
    assert result.max_error < 0.05
    assert len(result.errors) == len(load_points("vllm"))
