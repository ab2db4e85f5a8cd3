"""The published-measurements corpus and the planner's validation against it: every point names its
source and workload; a recorded trace, retimed, is exactly the planner's closed loop; leaving a source out
fits on the others only; `corral plan --validate` reports MAPE per GPU class."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from dataclasses import replace
from importlib import resources

import pytest
import yaml
from rich.console import Console

from corral.perf import load_catalog
from corral.perf.calibration import fitted_document, stored_document
from corral.perf.memory import BLOCK_SIZE, memory_plan
from corral.perf.scheduler import SchedulerConfig
from corral.perf.timing import Efficiency, PerfModel
from corral.perf.trace import trace_closed_loop
from corral.perf.validation import CORPUS, PublishedPoint, load_published, trace_point, validate
from corral.perf.workload import closed_loop, open_loop
from corral.plan.render import validation_table


def _raw_points() -> list[dict[str, object]]:
    points: list[dict[str, object]] = []
    for name in CORPUS:
        points += yaml.safe_load((resources.files("corral.perf") / "data" / name).read_text())["points"]
    return points


def test_every_published_point_has_a_source_a_workload_and_catalog_entries() -> None:
    catalog = load_catalog()
    raw = _raw_points()
    for point in raw:
        assert str(point["url"]).startswith("https://") or point.get("command"), point  # or measured here
        assert point["where"] and point["workload"] and point["engine"] and "engine_version" in point, point
        assert point["metrics"], point
        ids = point["catalog"]
        assert isinstance(ids, dict)
        (
            catalog.models.get(ids["model"]),
            catalog.gpus.get(ids["gpu"]),
            catalog.quantizations.get(ids["quant"]),
        )
    usable = [p for p in load_published() if p.unused is None]
    assert all(p.input_len and p.output_len and p.metrics for p in usable)
    assert len(usable) >= 30 and len({p.source for p in usable}) >= 5
    assert len(raw) >= 90  # points the planner cannot state are kept, with why (`unused`), not dropped


@pytest.mark.parametrize(
    ("model", "gpu", "quant", "tp", "clients", "lengths"),
    [
        ("llama-3.1-8b", "h100-sxm", "bf16", 1, 16, (1024, 128)),
        ("llama-3.1-70b", "a100-80gb", "bf16", 4, 24, (1000, 300)),
        ("mixtral-8x7b", "l40s", "fp8", 4, 32, (2048, 64)),
    ],
)
def test_a_trace_retimed_is_the_planners_closed_loop(
    model: str, gpu: str, quant: str, tp: int, clients: int, lengths: tuple[int, int]
) -> None:
    catalog = load_catalog()
    arch, card, q = catalog.models.get(model), catalog.gpus.get(gpu), catalog.quantizations.get(quant)
    memory = memory_plan(arch, card, q, tp=tp)
    config = SchedulerConfig(num_blocks=memory.kv_tokens // BLOCK_SIZE, enable_prefix_caching=False)
    trace = trace_closed_loop(PerfModel(arch, card, q, tp=tp), config, clients, *lengths)
    overheads = Efficiency(0.9, 0.3, 0.0005, 8.0, request_overhead_s=0.02, stream_overhead_s=0.004)
    for efficiency in (Efficiency(0.7, 0.5, 0.003, 1.5), overheads):
        expected = closed_loop(
            PerfModel(arch, card, q, tp=tp, efficiency=efficiency), config, clients, *lengths, drift=False
        )
        timed = trace.timed(efficiency)
        assert math.isclose(timed.output_tokens_per_s, expected.output_tokens_per_s, rel_tol=1e-9)
        assert math.isclose(timed.tpot_mean, expected.itl_mean, rel_tol=1e-9)
        assert math.isclose(timed.ttft_p50, expected.ttft_p50, rel_tol=1e-9)
        assert math.isclose(timed.ttft_mean, expected.ttft_mean, rel_tol=1e-9)
        assert math.isclose(timed.e2e_mean, expected.e2e_mean, rel_tol=1e-9)


def test_leaving_a_source_out_fits_on_the_other_sources_only() -> None:
    points = [p for p in load_published() if p.source in ("mushfiq-rtx4090-mistral", "qwen25-speed-bench")]
    validation = validate(load_catalog(), points)
    assert {p.point.source for p in validation.predictions} == {
        "mushfiq-rtx4090-mistral",
        "qwen25-speed-bench",
    }
    for prediction in validation.predictions:
        assert prediction.point.source not in prediction.fitted_on and prediction.fitted_on
    table = validation.mape()
    assert table["all"]["output tokens/s"][1] == 14 and 0 < table["all"]["output tokens/s"][0] < 1
    document = yaml.safe_load(fitted_document(validation))  # what `corral plan --calibrate` prints
    assert document["factors"] == {f: vars(e) for f, e in validation.factors.items()}
    assert document["fitted_on"]["sources"] == ["mushfiq-rtx4090-mistral", "qwen25-speed-bench"]
    loso = document["report"]["leave_one_source_out"]["all"]["output tokens/s"]
    assert loso == {"mape": round(table["all"]["output tokens/s"][0], 4), "n": 14}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_corral_plan_validate_reports_mape_per_gpu_class() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "corral.cli", "plan", "--validate", "--json"],
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    report = json.loads(done.stdout)
    assert "fitting the planner" in done.stderr  # said before a half-minute's silence (JSON stays clean)
    shown = Console(width=80, record=True, file=io.StringIO())
    shown.print(validation_table(report))
    rows = [line.split()[0:3] for line in shown.export_text().splitlines() if line.strip()]
    assert ["engine", "vllm", "*"] in rows and all(row[0] != "planner's" for row in rows)  # no wrapped label
    loso = report["mape_leave_one_source_out"]
    assert {"h100-sxm", "a100-80gb", "l40s", "h200", "rtx-4090", "all"} <= set(loso)
    assert loso["all"]["output tokens/s"]["n"] >= 30 and loso["all"]["TPOT"]["n"] >= 5
    assert set(report["factors"]) == {"tensorrt-llm", "vllm", "llamacpp", "vllm-cpu"}
    # the planner's stored factors are what a fresh fit on the corpus finds (fitted.yaml is not stale)
    stored = stored_document()
    for family, factors in report["factors"].items():
        assert factors == pytest.approx(stored["factors"][family], rel=0.02, abs=1e-4), family
    for kind, cell in loso["all"].items():
        assert cell["mape"] == pytest.approx(
            stored["report"]["leave_one_source_out"]["all"][kind]["mape"], abs=0.005
        )
    # the step model's error on sources the fit did not see, as the docs state it (issue #17's target)
    assert loso["all"]["output tokens/s"]["mape"] <= 0.15 and loso["all"]["TPOT"]["mape"] <= 0.15
    # time to first token on ≥ 30 GPU points, each source left out: 41% on 2026-12-05, 35% (its tails 38%,
    # from 44%) with the API server's per-stream cost (2026-12-06; issue #43 asks 20%, the docs say where
    # it misses); held here so that it cannot regress unnoticed
    assert loso["all"]["TTFT"]["n"] >= 30 and loso["all"]["TTFT"]["mape"] <= 0.37
    assert loso["all"]["TTFT p90–p99"]["mape"] <= 0.40
    # the CPU engines measured here, one workload left out: every metric within 25% (issue #43's target)
    by_engine = report["mape_leave_one_source_out_by_engine"]
    for family in ("llamacpp", "vllm-cpu"):
        assert {"output tokens/s", "TPOT", "TTFT", "TTFT p90–p99"} <= set(by_engine[family]), family
        for kind, cell in by_engine[family].items():
            assert cell["mape"] <= 0.25, (family, kind, cell)
    assert all(p["source"] not in p["fitted_on"] for p in report["points"])
    measured_here = [p for p in report["points"] if p["source"].startswith("measured-here-")]
    assert len(measured_here) >= 20 and "cpu-dev-1thread" in loso  # the CPU engines, a workload left out
    assert all(" without " in p["fitted_on"][0] for p in measured_here)


def _l40s_8b() -> tuple[PerfModel, SchedulerConfig]:
    catalog = load_catalog()
    arch, card, q = (
        catalog.models.get("llama-3.1-8b"),
        catalog.gpus.get("l40s"),
        catalog.quantizations.get("bf16"),
    )
    memory = memory_plan(arch, card, q)
    config = SchedulerConfig(num_blocks=memory.kv_tokens // BLOCK_SIZE, enable_prefix_caching=False)
    return PerfModel(arch, card, q, efficiency=Efficiency(0.8, 0.6, 0.002, 1.5, 0.03)), config


def test_an_arrival_sees_the_others_queue_and_pays_the_request_overhead_once() -> None:
    """Clients drifted apart: a request arrives at a random moment of the other N − 1 clients' cycles, so
    its TTFT waits behind their prefills, more as N grows; one client waits for nobody. The fixed cost
    of a request (`request_overhead_s`) adds to each TTFT and latency once, not to the time per token."""
    perf, config = _l40s_8b()
    alone = closed_loop(perf, config, 1, 2000, 100)
    assert alone.ttft_p95 == pytest.approx(alone.ttft_p50)  # nothing to wait for
    lockstep = closed_loop(perf, config, 1, 2000, 100, drift=False)
    assert alone == lockstep
    without = closed_loop(
        replace(perf, efficiency=replace(perf.efficiency, request_overhead_s=0)), config, 1, 2000, 100
    )
    assert alone.ttft_p50 - without.ttft_p50 == pytest.approx(0.03)
    assert alone.itl_mean == pytest.approx(without.itl_mean)
    crowd = closed_loop(perf, config, 24, 2000, 100)
    assert crowd.ttft_mean > 1.5 * alone.ttft_mean and crowd.ttft_p95 > crowd.ttft_p50  # a queue, spread
    assert len(crowd.ttfts) >= 100 and list(crowd.ttfts) == sorted(crowd.ttfts)


def test_each_other_stream_in_flight_adds_the_servers_work_for_it() -> None:
    """`stream_overhead_s`: a request's fixed cost grows by it for each other request in flight when it
    arrives (the API server serves every stream): N − 1 of them in a closed loop, as many as the open loop
    holds at its arrival (more at a higher rate); its time per token does not change."""
    perf, config = _l40s_8b()

    def with_streams(each: float) -> PerfModel:
        return replace(perf, efficiency=replace(perf.efficiency, stream_overhead_s=each))

    for clients in (1, 8):
        for drift in (False, True):  # drifted: the arrivals' open loop pays N − 1 too (its rate, N − 1 over
            # a cycle the cost lengthens, a little lower: the queue a little shorter)
            plain = closed_loop(perf, config, clients, 2000, 100, drift=drift)
            served = closed_loop(with_streams(0.01), config, clients, 2000, 100, drift=drift)
            paid = pytest.approx(0.01 * (clients - 1), rel=0.02 if drift else 1e-6)
            assert served.ttft_mean - plain.ttft_mean == paid
            assert served.e2e_mean - plain.e2e_mean == paid
            assert served.streams_s == pytest.approx(0.01 * (clients - 1)) and plain.streams_s == 0
            assert served.itl_mean == pytest.approx(plain.itl_mean)
    added = []
    for rate in (0.5, 4.0):
        plain = open_loop(perf, config, rate, 2000, 100)
        served = open_loop(with_streams(0.01), config, rate, 2000, 100)
        added.append(served.ttft_mean - plain.ttft_mean)
        assert served.streams_s == pytest.approx(added[-1])
    assert 0 < added[0] < added[1]  # (the same arrivals and steps: only the cost differs)
    loaded = trace_closed_loop(perf, config, 8, 2000, 100)
    assert loaded.others == 7 and loaded.overhead(with_streams(0.01).efficiency) == pytest.approx(0.1)


def test_a_run_of_stated_length_counts_its_first_wave_of_clients_starting_at_once() -> None:
    """`num_prompts` requests at concurrency c, as benchmark_serving and `corral bench` run them: the
    first c start at once and queue behind each other's prefills. A run of a few waves is recorded whole,
    its clients in lockstep; in a longer one the rest meet the steady state, so the more requests a run has
    beyond its first wave, the less the wave weighs in its mean TTFT."""

    def point(prompts: int | None) -> PublishedPoint:
        return PublishedPoint(
            index=0, source="s", url="u", engine="vllm", model="llama-3.1-8b", gpu="l40s", quant="bf16",
            tp=1, input_len=2000, output_len=100, concurrency=16, metrics={"ttft_ms_mean": 1.0},
            num_prompts=prompts, unused=None,
        )  # fmt: skip

    efficiency = Efficiency(0.8, 0.6, 0.002, 1.5, 0.01)
    means = {}
    for prompts in (None, 16, 320):
        case = trace_point(point(prompts), load_catalog())
        assert case is not None
        means[prompts] = case.predict(efficiency)["ttft_mean"]
    assert means[16] > means[320] > means[None]  # one wave only; then diluted; the steady state alone
    short = trace_point(point(16), load_catalog())
    assert short is not None and short.whole and short.start is None
    wave = trace_point(point(320), load_catalog())
    assert wave is not None and not wave.whole and wave.start is not None
    first = wave.start.first_wave(efficiency)
    assert len(first) == 16 and first.max() > 8 * first.min()  # the last of them waits for 15 prefills
