"""The simulator's limits as vLLM's: the context (max_model_len against the prompt, max_tokens and the KV
cache), and the request fields vLLM refuses."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from corral.perf import load_catalog
from corral.perf.calibration import calibrated_efficiency
from corral.sim import SimFleet, SimOptions, SimServer, build_server

from ..conftest import CORRAL

CATALOG = load_catalog()
EFFICIENCY = calibrated_efficiency()
SMALL_KV = 0.125  # GiB: 1024 tokens of Llama-3.1-8B's KV


@asynccontextmanager
async def serving(server: SimServer) -> AsyncIterator[str]:
    fleet = SimFleet([server])
    await fleet.start([0])
    try:
        yield fleet.urls[0]
    finally:
        await fleet.stop()


def sim(**options: Any) -> SimServer:
    """A simulated Llama-3.1-8B on an H100, 50 times faster than real time unless `options` say."""
    options = {"time_scale": 50.0, **options}
    return build_server(SimOptions(model="llama-3.1-8b", gpu="h100-sxm", **options), CATALOG, EFFICIENCY)


async def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body) as response:
        return response.status, await response.json(content_type=None)


def words(count: int) -> str:
    """A prompt of exactly `count` tokens (the simulator's tokens are words)."""
    return " ".join(f"w{i}" for i in range(count))


def test_max_model_len_beyond_the_kv_cache_refuses_to_start() -> None:
    with pytest.raises(ValueError, match=r"max seq len \(2048\).*available KV cache memory") as info:
        sim(kv_cache_gib=SMALL_KV, max_model_len=2048)
    assert "estimated maximum model length is 1024" in str(info.value)
    assert sim(kv_cache_gib=SMALL_KV, max_model_len=1024).max_model_len == 1024  # as much as it holds


def test_the_sim_command_exits_with_the_kv_cache_error() -> None:
    """A spec's max_model_len reaches the simulator as --max-model-len (engines/sim.py): it does not start."""
    argv = [*CORRAL, "sim", "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--port", "0"]
    argv += ["--kv-cache-gib", str(SMALL_KV), "--max-model-len", "2048"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("corral sim started with a max_model_len its KV cache cannot hold")
    assert done.returncode == 2
    assert "max seq len (2048)" in done.stderr and "max_model_len" in done.stderr


async def test_an_embedding_input_as_long_as_the_context_is_embedded() -> None:
    server = sim(kv_cache_gib=SMALL_KV, embed_dim=384)  # the model's context is longer: max_model_len 1024
    assert server.max_model_len == 1024
    async with serving(server) as url:
        status, whole = await post(url, "/v1/embeddings", {"model": "llama-3.1-8b", "input": words(1024)})
        over, refusal = await post(url, "/v1/embeddings", {"model": "llama-3.1-8b", "input": words(1025)})
    assert status == 200, whole
    assert whole["usage"]["prompt_tokens"] == 1024
    assert over == 400 and "maximum context length is 1024" in refusal["error"]["message"]


async def test_a_choice_the_engine_refuses_withdraws_the_choices_before_it() -> None:
    """A server whose max_model_len its engine cannot hold (built without build_server's check): with seed
    1 the first choice (50 tokens) fits the 128 tokens of KV, the second (161) does not."""
    engine = sim(kv_cache_gib=SMALL_KV / 8).engine
    server = SimServer(engine, max_model_len=4096)
    async with serving(server) as url:
        body = {"model": "llama-3.1-8b", "prompt": "hi", "n": 2, "seed": 1}
        status, refusal = await post(url, "/v1/completions", body)
        left = list(engine.scheduler.running) + list(engine.scheduler.waiting)
    assert status == 400 and refusal["error"]["type"] == "BadRequestError", refusal
    assert left == []  # the first choice's sequence did not stay behind


async def test_without_max_tokens_the_answer_runs_at_most_to_the_end_of_the_context() -> None:
    """vLLM caps an answer without max_tokens at what the context leaves, finishing it with `length`."""
    async with serving(sim(max_model_len=300)) as url:
        answers = [
            await post(url, "/v1/completions", {"model": "llama-3.1-8b", "prompt": words(200), "seed": seed})
            for seed in range(12)
        ]
        one_left = await post(url, "/v1/completions", {"model": "llama-3.1-8b", "prompt": words(299)})
        full = await post(url, "/v1/completions", {"model": "llama-3.1-8b", "prompt": words(300)})
    assert [status for status, _ in answers] == [200] * 12
    ends = {(a["usage"]["completion_tokens"] == 100, a["choices"][0]["finish_reason"]) for _, a in answers}
    assert ends == {(True, "length"), (False, "stop")}  # cut by the context at some seeds, ended at others
    assert one_left[0] == 200 and one_left[1]["usage"]["completion_tokens"] == 1
    assert one_left[1]["choices"][0]["finish_reason"] == "length"
    status, refusal = full
    assert status == 400 and refusal["error"]["param"] == "input_tokens"
    assert "maximum context length is 300 tokens" in refusal["error"]["message"]


@pytest.mark.parametrize(
    "extra",
    [
        {"ignore_eos": False},
        {"tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]},
        {"response_format": {"type": "json_object"}},
    ],
    ids=["ignore_eos-false", "tools", "response_format"],
)
async def test_max_tokens_beyond_the_context_is_refused_whatever_would_end_the_answer(
    extra: dict[str, Any],
) -> None:
    messages = [{"role": "user", "content": "What is the weather?"}]
    async with serving(sim(max_model_len=300)) as url:
        body = {"model": "llama-3.1-8b", "messages": messages, "max_tokens": 100_000, **extra}
        status, refusal = await post(url, "/v1/chat/completions", body)
        fits = await post(url, "/v1/chat/completions", {**body, "max_tokens": 280})
    assert status == 400 and refusal["error"]["param"] == "max_tokens", refusal
    assert "'max_tokens' or 'max_completion_tokens' is too large: 100000" in refusal["error"]["message"]
    assert fits[0] == 200


async def test_max_tokens_beyond_the_context_is_refused_with_eos() -> None:
    async with serving(sim(max_model_len=300, eos=True)) as url:
        body = {"model": "llama-3.1-8b", "prompt": "hi", "max_tokens": 100_000}
        status, refusal = await post(url, "/v1/completions", body)
    assert status == 400 and refusal["error"]["param"] == "max_tokens", refusal


@pytest.mark.parametrize("stop", ["", ["the", ""]], ids=["empty", "empty-in-a-list"])
async def test_an_empty_stop_string_is_refused(stop: str | list[str]) -> None:
    async with serving(sim()) as url:
        body = {"model": "llama-3.1-8b", "prompt": "hi", "max_tokens": 5, "stop": stop}
        status, refusal = await post(url, "/v1/completions", body)
    assert status == 400, refusal
    assert refusal["error"] == {
        "message": "stop cannot contain an empty string.",
        "type": "BadRequestError",
        "param": "stop",
        "code": 400,
    }
