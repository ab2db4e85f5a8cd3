"""The simulated engine: vLLM's API and metrics, KV capacity and timing shared with the planner."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import aiohttp
import openai
import pytest

from corral.engines import parse_vllm_load, read_gauges
from corral.perf import (
    BLOCK_SIZE,
    EngineSequence,
    PerfModel,
    Scheduler,
    SchedulerConfig,
    StepPipeline,
    closed_loop,
    load_catalog,
    memory_plan,
)
from corral.perf.calibration import calibrated_efficiency
from corral.sim import SimFleet, SimOptions, build_server

CATALOG = load_catalog()
EFFICIENCY = calibrated_efficiency()


async def start(options: SimOptions, replicas: int = 1) -> SimFleet:
    fleet = SimFleet([build_server(options, CATALOG, EFFICIENCY) for _ in range(replicas)])
    await fleet.start([0] * replicas)
    return fleet


@pytest.fixture
async def fast_8b() -> AsyncIterator[str]:
    fleet = await start(SimOptions(model="llama-3.1-8b", gpu="h100-sxm", time_scale=20))
    yield fleet.urls[0]
    await fleet.stop()


async def metrics(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        return read_gauges(await response.text())


async def metrics_text(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        return await response.text()


async def test_openai_client_chat_completion_stream_and_usage(fast_8b: str) -> None:
    client = openai.AsyncOpenAI(base_url=fast_8b + "/v1", api_key="none", max_retries=0)
    reply = await client.chat.completions.create(
        model="llama-3.1-8b",
        max_tokens=12,
        n=2,
        seed=7,
        messages=[{"role": "user", "content": "Hello there"}],
    )
    assert [c.index for c in reply.choices] == [0, 1] and all(
        c.finish_reason == "length" for c in reply.choices
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 24
    again = await client.chat.completions.create(
        model="llama-3.1-8b",
        max_tokens=12,
        n=2,
        seed=7,
        messages=[{"role": "user", "content": "Hello there"}],
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]
    stream = await client.completions.create(
        model="llama-3.1-8b", prompt="Once", max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    models = await client.models.list()
    assert [m.id for m in models.data] == ["llama-3.1-8b"]


async def test_stop_strings_and_context_limit(fast_8b: str) -> None:
    client = openai.AsyncOpenAI(base_url=fast_8b + "/v1", api_key="none", max_retries=0)
    reply = await client.completions.create(
        model="llama-3.1-8b", prompt="x", max_tokens=200, stop=[" the"], seed=1
    )
    assert " the" not in reply.choices[0].text
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        await client.completions.create(model="llama-3.1-8b", prompt="x", max_tokens=10_000_000)


async def test_kv_capacity_is_the_planners() -> None:
    options = SimOptions(model="llama-3.1-70b", gpu="l40s", tp=4, time_scale=50)
    fleet = await start(options)
    try:
        text = await metrics_text(fleet.urls[0])
    finally:
        await fleet.stop()
    model, gpu = CATALOG.models.get("llama-3.1-70b"), CATALOG.gpus.get("l40s")
    planned = memory_plan(model, gpu, CATALOG.quantizations.get("bf16"), tp=4)
    assert f'num_gpu_blocks="{planned.kv_tokens // BLOCK_SIZE}"' in text


async def test_shared_prefix_hits_the_cache_and_lowers_ttft() -> None:
    fleet = await start(SimOptions(model="llama-3.1-8b", gpu="l4", time_scale=1))
    url = fleet.urls[0]
    document = " ".join(f"word{i}" for i in range(3000))

    async def ttft(prompt: str) -> float:
        async with aiohttp.ClientSession() as session:
            started = time.perf_counter()
            body = {"model": "llama-3.1-8b", "prompt": prompt, "max_tokens": 2, "stream": True}
            async with session.post(url + "/v1/completions", json=body) as response:
                await response.content.readline()
                first = time.perf_counter() - started
                await response.read()
        return first

    try:
        cold = await ttft(document + " question one")
        warm = await ttft(document + " question two")
        values = await metrics(url)
    finally:
        await fleet.stop()
    assert values["vllm:prefix_cache_hits_total"] >= 2992
    assert warm < cold / 2


async def test_oversubscribed_kv_preempts() -> None:
    fleet = await start(SimOptions(model="llama-3.1-8b", gpu="h100-sxm", kv_cache_gib=0.125, time_scale=50))
    try:
        url = fleet.urls[0]  # 1024 tokens of KV; six requests of 100 + 200 tokens need 1800
        async with aiohttp.ClientSession() as session:

            async def one(i: int) -> None:
                body = {
                    "model": "llama-3.1-8b",
                    "prompt": " ".join(f"p{i}x{j}" for j in range(100)),
                    "max_tokens": 200,
                }
                async with session.post(url + "/v1/completions", json=body) as response:
                    assert response.status == 200

            await asyncio.gather(*(one(i) for i in range(6)))
        load = parse_vllm_load(await metrics_text(url))
        assert load.preemptions_total > 0
    finally:
        await fleet.stop()


@pytest.mark.slow
async def test_latency_and_throughput_agree_with_the_planner_within_10_percent() -> None:
    options = SimOptions(model="llama-3.1-8b", gpu="l4", time_scale=2, enable_prefix_caching=False)
    fleet = await start(options)
    url = fleet.urls[0]
    model, gpu, quant = (
        CATALOG.models.get("llama-3.1-8b"),
        CATALOG.gpus.get("l4"),
        CATALOG.quantizations.get("bf16"),
    )
    memory = memory_plan(model, gpu, quant)
    server = build_server(options, CATALOG, EFFICIENCY)
    config = SchedulerConfig(num_blocks=memory.kv_tokens // BLOCK_SIZE, enable_prefix_caching=False)
    try:
        for concurrency in (1, 4, 16):
            # the engine's steps, its clients in lockstep as this loop's are (the simulator leaves out the
            # HTTP server's costs, `request_overhead_s` and `stream_overhead_s`: the planner adds them)
            engine_only = replace(
                server.engine.perf.efficiency, request_overhead_s=0.0, stream_overhead_s=0.0
            )
            perf = replace(server.engine.perf, efficiency=engine_only)
            predicted = closed_loop(perf, config, concurrency, input_len=100, output_len=24, drift=False)
            # A second try where the first came out slow: the simulator runs in real time (2x), and a
            # machine busy elsewhere (a real engine's start on the other test worker) only ever delays its
            # clients, so the measure comes out slower, never faster (it agrees within 1.2% with both cores
            # busy). A measure off the other way fails at once.
            for attempt in (1, 2):
                measured = await _closed_loop_over_http(url, concurrency, output_len=24, rounds=2)
                tokens_per_s = measured["tokens"] / measured["seconds"] / options.time_scale  # simulated
                e2e = measured["e2e_p50"] * options.time_scale
                agrees = tokens_per_s == pytest.approx(
                    predicted.output_tokens_per_s, rel=0.10
                ) and e2e == pytest.approx(predicted.e2e_p50, rel=0.10)
                slow = tokens_per_s < predicted.output_tokens_per_s and e2e > predicted.e2e_p50
                if agrees or not slow or attempt == 2:
                    break
            assert tokens_per_s == pytest.approx(predicted.output_tokens_per_s, rel=0.10), concurrency
            assert e2e == pytest.approx(predicted.e2e_p50, rel=0.10), concurrency
    finally:
        await fleet.stop()


async def test_steps_stay_back_to_back_when_the_event_loop_wakes_late() -> None:
    """A busy event loop wakes the step loop late; the engine still keeps its model's step times."""
    options = SimOptions(model="llama-3.1-8b", gpu="l4", time_scale=2, enable_prefix_caching=False)
    engine = build_server(options, CATALOG, EFFICIENCY).engine
    predicted = _virtual_finish(engine.perf, engine.config, sequences=4, prompt_len=100, max_tokens=48)
    hogging = True

    async def hog() -> None:  # another coroutine holding the loop 6 ms at a time, as a busy host does
        while hogging:
            time.sleep(0.006)  # noqa: ASYNC251 - blocking on purpose
            await asyncio.sleep(0)

    runner = asyncio.create_task(engine.run())
    hogger = asyncio.create_task(hog())
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        requests = [engine.submit(list(range(k * 1000, k * 1000 + 100)), 48) for k in range(4)]
        for request in requests:
            while await request.tokens.get() is not None:
                pass
        wall = loop.time() - started
    finally:
        hogging = False
        runner.cancel()
        await asyncio.gather(runner, hogger, return_exceptions=True)
    finish = max(r.seq.finished_at for r in requests if r.seq.finished_at is not None)
    arrival = min(r.seq.arrival for r in requests)
    assert finish - arrival == pytest.approx(predicted, rel=0.01)  # simulated time: the model's, exactly
    assert wall * options.time_scale < predicted * 1.15  # and the wall clock keeps up with it


def _virtual_finish(
    perf: PerfModel, config: SchedulerConfig, sequences: int, prompt_len: int, max_tokens: int
) -> float:
    """When the last of `sequences` requests arriving together finishes, stepping in virtual time."""
    scheduler, pipeline = Scheduler(config), StepPipeline(perf)
    seqs = [
        EngineSequence(id=k, prompt_len=prompt_len, max_tokens=max_tokens, arrival=0.0)
        for k in range(sequences)
    ]
    for seq in seqs:
        scheduler.add(seq)
    now = 0.0
    while not all(seq.finished for seq in seqs):
        while pipeline.has_room and (batch := scheduler.schedule()) is not None:
            pipeline.launch(batch, now)
        now, batch = pipeline.pop()
        scheduler.complete(batch, now)
    return now


async def _closed_loop_over_http(
    url: str, concurrency: int, output_len: int, rounds: int
) -> dict[str, float]:
    """`concurrency` clients sending 100-token prompts back to back; the first round is warm-up."""
    prompt = " ".join(
        f"t{i}" for i in range(100 - 3)
    )  # chat-free completion: 97 words + markers ≈ 100 tokens
    e2e: list[float] = []
    tokens = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def client(k: int) -> None:
            nonlocal tokens
            for r in range(rounds + 1):
                started = time.perf_counter()
                body = {"model": "llama-3.1-8b", "prompt": f"c{k} r{r} {prompt}", "max_tokens": output_len}
                async with session.post(url + "/v1/completions", json=body) as response:
                    data = await response.json()
                if r > 0:
                    e2e.append(time.perf_counter() - started)
                    tokens += data["usage"]["completion_tokens"]

        started = time.perf_counter()
        await asyncio.gather(*(client(k) for k in range(concurrency)))
        total = time.perf_counter() - started
    e2e.sort()
    per_round = total / (rounds + 1)
    return {"tokens": tokens, "seconds": total - per_round, "e2e_p50": e2e[len(e2e) // 2]}
