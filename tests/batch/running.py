"""What the batch runner tests share: a runner running in a task of its own, and waiting on a condition."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from corral.batch import BatchRunner


async def until(condition: Callable[[], bool], within: float = 10) -> None:
    """Wait until `condition` holds (polled), failing the test past `within` seconds."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running(runner: BatchRunner) -> AsyncIterator[asyncio.Task[None]]:
    """`runner` running in a task, cancelled (and awaited) when the block ends."""
    task = asyncio.create_task(runner.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
