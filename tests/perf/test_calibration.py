"""The stored efficiency factors are the fit's, and they reproduce every measured point closely."""

from __future__ import annotations

import pytest

from corral.perf import load_catalog
from corral.perf.calibration import calibrated_efficiency, fit, load_points, predict


@pytest.mark.parametrize("backend", ["vllm", "llamacpp"])
def test_stored_factors_predict_each_measured_point_within_5_percent(backend: str) -> None:
    catalog = load_catalog()
    efficiency = calibrated_efficiency(backend)
    for point in load_points(backend):
        assert predict(point, catalog, efficiency) == pytest.approx(point.output_tokens_per_s, rel=0.05)


@pytest.mark.parametrize("backend", ["vllm", "llamacpp"])
def test_refitting_finds_the_stored_factors(backend: str) -> None:
    result = fit(load_catalog(), backend)
    stored = calibrated_efficiency(backend)
    assert result.efficiency.compute == pytest.approx(stored.compute, rel=0.05)
    assert result.efficiency.step_overhead_s == pytest.approx(stored.step_overhead_s, rel=0.1, abs=1e-4)
    assert result.max_error < 0.05
    assert len(result.errors) == len(load_points(backend))
