"""The semantic cache's own embedding calls: at most `max_embeddings` at once (a question past them is a miss
at once, without waiting), none for a while after one timed out (a busy embedder costs one timeout, not one
per request), while a failing or refusing embedder is asked again; failures warn once in a while, not once
per request. An embedder in the test's hands (it answers when the test says) and a clock the test moves."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import orjson
import pytest

from corral.cache import ExactCache, MemoryStore, Vector
from corral.config import ModelCacheSpec

POLICY = ModelCacheSpec(semantic=True, embedding_model="e")


class HeldEmbedder:
    """Answers each question once the test releases it, or fails with `error`."""

    def __init__(self) -> None:
        self.calls = 0
        self.arrived: asyncio.Queue[str] = asyncio.Queue()  # each question, as it is asked
        self.release = asyncio.Event()
        self.error: Exception | None = None

    async def embed(self, model: str, text: str) -> Vector:
        self.calls += 1
        self.arrived.put_nowait(text)
        if self.error is not None:
            raise self.error
        await self.release.wait()
        return np.ones(4, dtype=np.float32) / 2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _cache(embedder: HeldEmbedder, clock: Clock, timeout: float = 5.0, cap: int = 8) -> ExactCache:
    cache = ExactCache(
        MemoryStore(1 << 20), {"m": POLICY}, embed_timeout=timeout, max_embeddings=cap, clock=clock
    )
    cache.embedder = embedder
    return cache


async def _ask(cache: ExactCache, question: str) -> tuple[bool, str | None]:
    """(whether the question got a vector, why not)."""
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": question}], "temperature": 0})
    found = await cache.lookup("t", "m", "/v1/chat/completions", body, None)
    assert found is not None
    return found.vector is not None, found.embedding_failure


async def test_a_question_past_the_cap_is_a_miss_at_once_without_asking_the_embedder() -> None:
    embedder = HeldEmbedder()
    cache = _cache(embedder, Clock(), cap=2)
    held = [asyncio.create_task(_ask(cache, f"question {i}")) for i in range(2)]
    for _ in held:
        await embedder.arrived.get()
    async with asyncio.timeout(1):  # (not held up by the two in flight)
        assert await _ask(cache, "one more") == (False, "busy")
    assert embedder.calls == 2
    embedder.release.set()
    assert [await task for task in held] == [(True, None), (True, None)]
    assert await _ask(cache, "after them") == (True, None)  # the cap is free again


async def test_after_a_timeout_the_embedder_is_left_alone_a_while() -> None:
    embedder, clock = HeldEmbedder(), Clock()
    cache = _cache(embedder, clock, timeout=0.05)
    assert await _ask(cache, "slow") == (False, "timeout")
    async with asyncio.timeout(0.04):  # (shorter than the timeout: not asked, not waited for)
        assert await _ask(cache, "next") == (False, "paused")
    clock.now += 4.9
    assert await _ask(cache, "still") == (False, "paused")
    assert embedder.calls == 1
    clock.now += 0.2
    embedder.release.set()
    assert await _ask(cache, "later") == (True, None)
    assert embedder.calls == 2


async def test_a_failing_embedder_is_asked_again_and_warns_once_in_a_while(
    caplog: pytest.LogCaptureFixture,
) -> None:
    embedder, clock = HeldEmbedder(), Clock()
    embedder.error = RuntimeError("e refused the input: too long")
    cache = _cache(embedder, clock)
    with caplog.at_level(logging.DEBUG, logger="corral.cache.embedding"):
        for i in range(5):
            assert await _ask(cache, f"q{i}") == (False, "error")
        clock.now += 11
        assert await _ask(cache, "q5") == (False, "error")
    assert embedder.calls == 6  # (a refusal is no reason to stop asking)
    levels = [r.levelno for r in caplog.records if "embedding the question failed" in r.getMessage()]
    assert levels == [logging.WARNING, *[logging.DEBUG] * 4, logging.WARNING]
