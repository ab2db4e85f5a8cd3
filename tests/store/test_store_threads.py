"""The threads a request's own store calls run on (StoreThreads): apart from asyncio's default executor, key
lookups apart from the other calls, and each awaited within its bound."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from corral.store import StoreError, StoreThreads, store_is_down


def _held(release: threading.Event, started: threading.Semaphore) -> str:
    started.release()
    release.wait(10)
    return "held"


async def test_key_lookups_answer_while_the_default_executor_and_the_other_calls_are_held() -> None:
    """Every thread of asyncio's default executor and every other request's call blocked (slow reports, a
    locked usage table): a key lookup still runs at once."""
    release, started = threading.Event(), threading.Semaphore(0)
    threads = StoreThreads(lookups=2, calls=3, wait_s=5)
    loop = asyncio.get_running_loop()
    default = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor's threads
    blocking = [loop.run_in_executor(None, _held, release, started) for _ in range(default + 2)]
    blocking += [asyncio.ensure_future(threads.call(_held, release, started)) for _ in range(5)]
    try:
        await _all_started(started, default + 3)  # every default thread and every call thread is held
        began = time.monotonic()
        assert await threads.lookup(lambda key: f"found {key}", "k1") == "found k1"
        assert time.monotonic() - began < 1.0
    finally:
        release.set()
        await asyncio.gather(*blocking)
        threads.close()


async def _all_started(started: threading.Semaphore, count: int) -> None:
    deadline = time.monotonic() + 10
    while count:
        if started.acquire(blocking=False):
            count -= 1
            continue
        assert time.monotonic() < deadline, f"{count} calls never started"
        await asyncio.sleep(0.01)


async def test_a_call_past_its_wait_is_the_store_not_answering() -> None:
    """A call whose thread hangs (a network gone silent holds a pooled connection's query) is given up after
    `wait_s`, as the store being down; the thread is left to end when TCP does."""
    release = threading.Event()
    threads = StoreThreads(lookups=1, calls=1, wait_s=0.3)
    began = time.monotonic()
    try:
        with pytest.raises(StoreError, match=r"did not answer within 0\.3 s") as raised:
            await threads.lookup(release.wait, 10)
        assert time.monotonic() - began < 2.0
        assert store_is_down(raised.value)
    finally:
        release.set()
        threads.close()


async def test_a_calls_own_timeout_error_is_its_own() -> None:
    """A TimeoutError the call raises itself is not taken for the wait's."""
    threads = StoreThreads(wait_s=5)

    def fails() -> None:
        raise TimeoutError("the call's own")

    try:
        with pytest.raises(TimeoutError, match="the call's own"):
            await threads.call(fails)
    finally:
        threads.close()


async def test_threads_closed_at_a_shutdown_start_again_for_a_gateway_started_again() -> None:
    threads = StoreThreads()
    assert await threads.call(lambda: threading.current_thread().name) == "corral-store-call_0"
    threads.close()
    assert (await threads.lookup(lambda: threading.current_thread().name)).startswith("corral-store-lookup")
    threads.close()


async def test_calls_given_up_on_stay_counted_and_past_a_backlog_the_lane_refuses_at_once() -> None:
    """A connection kept open by a proxy after its store went: every call given up on after its wait kept
    its thread, the calls after it queued for good (50,000 of them, 3 KB each). Those not answered count
    until they end; past four a thread the lane refuses at once, and takes calls again once they end."""
    release, started = threading.Event(), threading.Semaphore(0)
    threads = StoreThreads(lookups=1, calls=1, wait_s=0.2)
    try:
        for _ in range(4):  # (one running, three waiting for its thread: each given up on)
            with pytest.raises(StoreError, match="did not answer within"):
                await threads.lookup(_held, release, started)
        began = time.monotonic()
        with pytest.raises(StoreError, match="has not answered 4 calls"):
            await threads.lookup(lambda: "never")
        assert time.monotonic() - began < 0.1
        assert await threads.call(lambda: "the other lane") == "the other lane"
        release.set()
        deadline = time.monotonic() + 5
        while True:  # (the calls given up on end, one after another)
            try:
                assert await threads.lookup(lambda: "again") == "again"
                break
            except StoreError:
                assert time.monotonic() < deadline, "the lane never took calls again"
                await asyncio.sleep(0.05)
    finally:
        release.set()
        threads.close()


async def test_a_burst_past_the_backlog_waits_its_turn() -> None:
    """Only calls given up on count toward the backlog: 64 streams of a new key at once were refused 503
    when every call waiting its turn counted."""
    threads = StoreThreads(lookups=1, calls=1, wait_s=5)

    def found(key: str) -> str:
        time.sleep(0.005)
        return key

    try:
        keys = [f"k{n}" for n in range(20)]
        assert await asyncio.gather(*(threads.lookup(found, key) for key in keys)) == keys
    finally:
        threads.close()
