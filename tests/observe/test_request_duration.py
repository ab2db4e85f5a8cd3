"""corral_request_duration_seconds, which the Cluster dashboard's Request duration panel reads: its
percentiles measure answers, past two minutes too."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from corral.gateway.metrics import GatewayMetrics
from corral.routing import ReplicaSet, Router


def duration_samples(metrics: GatewayMetrics) -> dict[tuple[str, str], float]:
    """(sample name, le) → value of corral_request_duration_seconds, as Prometheus scrapes it."""
    text = metrics.exposition().decode()
    family = next(
        f for f in text_string_to_metric_families(text) if f.name == "corral_request_duration_seconds"
    )
    return {(s.name, s.labels.get("le", "")): s.value for s in family.samples}


def test_refusals_are_not_request_durations() -> None:
    """A 429 storm (milliseconds each) pulled the duration percentiles down."""
    metrics = GatewayMetrics(Router(ReplicaSet()), dict)
    model = metrics.of("m")
    for status in (429, 403, 503, 429):
        model.finished(status, 0.002)
    model.finished(200, 3.0)
    samples = duration_samples(metrics)
    assert samples[("corral_request_duration_seconds_count", "")] == 1
    assert samples[("corral_request_duration_seconds_sum", "")] == 3.0
    requests = metrics.summary()["m"]["requests"]
    assert requests == {"429": 2.0, "403": 1.0, "503": 1.0, "200": 1.0}  # counted all the same


def test_answers_past_two_minutes_land_in_buckets_of_their_own() -> None:
    """With 120 s the top finite bucket, histogram_quantile reported a 7-minute answer as 120 s."""
    metrics = GatewayMetrics(Router(ReplicaSet()), dict)
    for seconds in (200.0, 420.0, 1200.0):
        metrics.of("m").finished(200, seconds)
    buckets = {le: v for (name, le), v in duration_samples(metrics).items() if name.endswith("_bucket")}
    assert [buckets[le] for le in ("120.0", "300.0", "600.0", "1800.0", "+Inf")] == [0, 1, 2, 3, 3]
