"""The simulator where it met trouble: a long answer with many stop strings, a step loop that died, a
streaming client that went away, a large body and a body that does not validate (answered as vLLM
answers them)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
import pytest

from corral.perf import load_catalog
from corral.perf.calibration import calibrated_efficiency
from corral.sim import SimFleet, SimOptions, SimServer, build_server
from corral.sim.server import _Choice
from corral.sim.text import TextGenerator

CATALOG = load_catalog()
EFFICIENCY = calibrated_efficiency()
MODEL = "llama-3.1-8b"


def sim(**options: Any) -> SimServer:
    return build_server(
        SimOptions(model=MODEL, gpu="h100-sxm", **{"time_scale": 50.0, **options}), CATALOG, EFFICIENCY
    )


@asynccontextmanager
async def serving(server: SimServer) -> AsyncIterator[str]:
    fleet = SimFleet([server])
    await fleet.start([0])
    try:
        yield fleet.urls[0]
    finally:
        await fleet.stop()


async def until(condition: Callable[[], Awaitable[bool]], within: float = 5) -> None:
    deadline = time.monotonic() + within
    while not await condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def test_a_stop_string_across_tokens_ends_the_text_as_a_search_of_the_whole_text_does() -> None:
    """The text ends at the token that completes a stop string (a string spanning several tokens too),
    cut where the earliest stop string found begins, as when each token's check searched the whole text."""
    words = TextGenerator(7)
    pieces = [words.next_word(first=i == 0) for i in range(3000)]
    whole = "".join(pieces)
    stops = ["never said", whole[4000:4009], whole[9000:9004]]  # (the second spans words' ends)
    expected = ""
    for piece in pieces:  # the check as it was: the whole text so far, each token
        cuts = [at for stop in stops if (at := (expected + piece).find(stop)) >= 0]
        if cuts:
            expected += (expected + piece)[: min(cuts)][len(expected) :]
            break
        expected += piece
    choice = _Choice(0, TextGenerator(7), stops, "length")
    while not choice.done:
        assert choice.tokens < 3000
        choice.add_token()
    assert choice.text == expected and choice.finish_reason == "stop"
    assert 3990 < len(expected) <= 4009 and whole[4000:4009] not in expected


def test_many_stop_strings_on_a_long_answer_cost_time_in_proportion_to_it() -> None:
    """Each token's check scanned the whole answer so far: 16 stop strings over 40k tokens took 30 s of CPU
    on one request, during which the replica answered no probe and was restarted."""
    choice = _Choice(0, TextGenerator(1), [f"zzqq{i}" for i in range(16)], "length")
    began = time.process_time()
    for _ in range(20_000):
        choice.add_token()
    assert time.process_time() - began < 1.5  # (0.06 s here; 8 s when it scanned the answer)
    assert not choice.done and choice.tokens == 20_000


@pytest.mark.parametrize("stream", [False, True])
async def test_a_dead_step_loop_fails_its_requests_and_health(stream: bool) -> None:
    """A step that raises (here: publishing KV events on a socket that was closed) ends the engine. Its
    requests waited for tokens for good (a gateway's request hung until its own timeout): each is now
    answered as vLLM answers when its engine is dead (a 500, in a stream an error event and [DONE]), so are
    later ones, and /health says 503 rather than keeping the replica in routing."""
    server = sim(kv_events_endpoint="tcp://127.0.0.1:9")
    assert server.engine.kv_events is not None
    server.engine.kv_events.close()
    async with serving(server) as url, aiohttp.ClientSession() as session:

        async def health() -> int:
            async with session.get(url + "/health") as response:
                return response.status

        assert await health() == 200
        body = {"model": MODEL, "prompt": " ".join(f"w{i}" for i in range(64)), "max_tokens": 4}

        async def ask(stream: bool) -> tuple[int, bytes]:
            async with session.post(url + "/v1/completions", json={**body, "stream": stream}) as response:
                return response.status, await response.read()

        status, answer = await asyncio.wait_for(ask(stream), 5)  # (in the engine as its loop dies)
        if stream:
            assert status == 200
            events = [line[6:] for line in answer.split(b"\n\n") if line.startswith(b"data: ")]
            assert orjson.loads(events[-2])["error"]["code"] == 500 and events[-1] == b"[DONE]"
        else:
            assert status == 500 and orjson.loads(answer)["error"]["type"] == "InternalServerError"
        assert await health() == 503
        later = await asyncio.wait_for(ask(False), 5)
        assert later[0] == 500 and b"EngineCore" in later[1]


async def test_an_embedding_model_whose_step_loop_ended_refuses_as_vllm_does() -> None:
    """An embedding input waited for its prefill for good once the step loop had ended."""
    server = sim(embed_dim=16)
    async with serving(server) as url, aiohttp.ClientSession() as session:
        assert server._steps is not None
        server._steps.cancel()  # (the loop ends: as any failure of a step ends it)
        async with session.post(url + "/v1/embeddings", json={"model": MODEL, "input": "x"}) as response:
            assert response.status == 500 and (await response.json())["error"]["code"] == 500


async def test_a_stream_whose_client_went_away_leaves_no_read_pending() -> None:
    """Each choice's next token was awaited in a task of its own: a client that left mid-answer left those
    tasks pending for good (n of them a request, "Task was destroyed but it is pending!" at exit)."""

    def reads() -> list[asyncio.Task[Any]]:
        return [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "Queue.get"]  # type: ignore[union-attr]

    async with serving(sim(time_scale=1.0)) as url, aiohttp.ClientSession() as session:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}
        response = await session.post(url + "/v1/chat/completions", json={**body, "stream": True, "n": 4})
        for _ in range(6):
            await response.content.readline()
        assert reads()
        response.close()

        async def none_left() -> bool:
            return not reads()

        await until(none_left)


async def test_a_body_larger_than_aiohttps_default_limit_is_read() -> None:
    """The gateway forwards bodies up to 4 MiB and vLLM takes any: aiohttp's 1 MiB default answered 413."""
    prompt = " ".join(["x" * 15] * 100_000)  # 1.6 MB, 100k tokens: within the context
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
    async with serving(sim()) as url, aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200, await response.text()
            assert (await response.json())["usage"]["prompt_tokens"] > 100_000


async def test_a_body_that_does_not_validate_is_refused_in_vllms_shape() -> None:
    """vLLM answers its request validation's failures 400 with type `Bad Request` and the status as `code`
    (its validation handler), as the simulator's other refusals are shaped (sim/errors.py)."""
    async with serving(sim()) as url, aiohttp.ClientSession() as session:
        path = url + "/v1/chat/completions"
        headers = {"Content-Type": "application/json"}
        async with session.post(path, data=b"{not json", headers=headers) as response:
            malformed = response.status, await response.json()
        async with session.post(path, json={"model": MODEL, "messages": "hi"}) as response:
            invalid = response.status, await response.json()
    for status, answer in (malformed, invalid):
        assert status == 400
        assert (answer["error"]["type"], answer["error"]["code"]) == ("Bad Request", 400), answer
    assert "not valid JSON" in malformed[1]["error"]["message"]
    assert invalid[1]["error"]["param"] == "messages", invalid
