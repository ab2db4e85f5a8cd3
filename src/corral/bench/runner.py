"""Sending the load: arrivals (all at once, Poisson or gamma), a concurrency cap, ramp-up, warm-up requests,
and a measurement of the client's own event-loop lag (a lagging client inflates latencies it reports).

Every request is streamed with `stream_options.include_usage`, so TTFT and the gaps between chunks are seen
as they happen and token counts come from the server's usage.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
import orjson

from corral.bench.workloads import BenchRequest

__all__ = ["LoadPlan", "RequestResult", "RunResult", "run_load"]


@dataclass(frozen=True)
class LoadPlan:
    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    api_key: str | None = None
    max_concurrency: int | None = None
    request_rate: float = float("inf")
    burstiness: float = 1.0  # gamma shape: 1 is Poisson, lower is burstier
    ramp_up_s: float = 0.0
    duration_s: float | None = None
    warmup: int = 0
    ignore_eos: bool = False
    timeout_s: float = 600.0
    seed: int = 0


@dataclass
class RequestResult:
    started: float
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float = 0.0
    chunk_gaps: list[float] = field(default_factory=list)
    output_tokens: int = 0
    input_tokens: int = 0
    tokens_from_usage: bool = False
    warmup: bool = False


@dataclass
class RunResult:
    results: list[RequestResult]
    duration_s: float
    loop_lag_p99_ms: float
    loop_lag_max_ms: float


async def run_load(
    plan: LoadPlan,
    requests: Sequence[BenchRequest],
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> RunResult:
    """Send `requests` as `plan` says (cycling through them when a duration is set)."""
    rng = random.Random(plan.seed)
    limit = asyncio.Semaphore(plan.max_concurrency) if plan.max_concurrency else None
    url = plan.base_url.rstrip("/") + plan.endpoint
    headers = {"Content-Type": "application/json"}
    if plan.api_key:
        headers["Authorization"] = f"Bearer {plan.api_key}"
    results: list[RequestResult] = []
    tasks: list[asyncio.Task[None]] = []
    lag = _LagMonitor()
    total = len(requests) if plan.duration_s is None else 0
    timeout = aiohttp.ClientTimeout(total=plan.timeout_s)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        lag.start()
        started = time.perf_counter()

        async def one(index: int, request: BenchRequest) -> None:
            body = orjson.dumps(request.body(plan.model, plan.ignore_eos))
            if limit is not None:
                async with limit:
                    result = await _send(session, url, headers, body)
            else:
                result = await _send(session, url, headers, body)
            result.warmup = index < plan.warmup
            results.append(result)
            progress(len(results), total)

        index = 0
        while True:
            if plan.duration_s is None and index >= len(requests):
                break
            elapsed = time.perf_counter() - started
            if plan.duration_s is not None and elapsed >= plan.duration_s:
                break
            tasks.append(asyncio.create_task(one(index, requests[index % len(requests)])))
            index += 1
            await _next_arrival(plan, rng, elapsed)
            if limit is not None and plan.request_rate == float("inf"):
                await _wait_for_slot(limit)
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
        await lag.stop()
    return RunResult(results, duration, lag.quantile(0.99) * 1000, lag.maximum() * 1000)


async def _next_arrival(plan: LoadPlan, rng: random.Random, elapsed: float) -> None:
    if plan.request_rate == float("inf"):
        await asyncio.sleep(0)
        return
    rate = plan.request_rate
    if plan.ramp_up_s > 0 and elapsed < plan.ramp_up_s:
        rate = max(rate * elapsed / plan.ramp_up_s, rate * 0.02)
    shape = plan.burstiness
    await asyncio.sleep(rng.gammavariate(shape, 1.0 / (rate * shape)))


async def _wait_for_slot(limit: asyncio.Semaphore) -> None:
    """With no rate set, create requests only as fast as slots free up (no pile of idle tasks)."""
    if limit.locked():
        async with limit:
            pass


async def _send(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], body: bytes
) -> RequestResult:
    result = RequestResult(started=time.perf_counter())
    last: float | None = None
    chunks = 0
    try:
        async with session.post(url, data=body, headers=headers) as response:
            if response.status != 200:
                result.error = f"http_{response.status}"
                await response.read()
                return result
            buffer = b""
            async for data in response.content.iter_any():
                now = time.perf_counter()
                buffer += data
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    if not event.startswith(b"data: "):
                        continue
                    payload = event[6:]
                    if payload == b"[DONE]":
                        result.ok = True
                        continue
                    try:
                        chunk = orjson.loads(payload)
                    except orjson.JSONDecodeError:
                        chunk = None
                    if not isinstance(chunk, dict):  # (the server's fault: counted, the run goes on)
                        result.error = "bad_chunk"
                        continue
                    if "error" in chunk:
                        result.error = "stream_error"
                        continue
                    usage = chunk.get("usage")
                    if isinstance(usage, dict) and usage:
                        try:
                            result.output_tokens = int(usage.get("completion_tokens") or 0)
                            result.input_tokens = int(usage.get("prompt_tokens") or 0)
                            result.tokens_from_usage = True
                        except (TypeError, ValueError, OverflowError):
                            result.error = "bad_chunk"
                    if _has_content(chunk):
                        chunks += 1
                        if result.ttft is None:
                            result.ttft = now - result.started
                        elif last is not None:
                            result.chunk_gaps.append(now - last)
                        last = now
    except TimeoutError:
        result.error = "timeout"
    except aiohttp.ClientError as exc:
        result.error = type(exc).__name__
    result.e2e = time.perf_counter() - result.started
    if not result.tokens_from_usage:
        result.output_tokens = chunks  # no usage from the server: one token per content chunk
    if result.error is not None:
        result.ok = False
    elif not result.ok:
        result.error = "incomplete_stream"
    return result


def _has_content(chunk: dict[str, object]) -> bool:
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    first = choices[0]
    if not isinstance(first, dict):
        return False
    delta = first.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else first.get("text")
    return bool(text)


class _LagMonitor:
    """How late the client's event loop wakes a 10 ms timer: the client's own share of measured latency."""

    def __init__(self, interval: float = 0.01) -> None:
        self._interval = interval
        self._lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(self._interval)
            self._lags.append(max(0.0, time.perf_counter() - before - self._interval))

    def quantile(self, q: float) -> float:
        if not self._lags:
            return 0.0
        ordered = sorted(self._lags)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def maximum(self) -> float:
        return max(self._lags, default=0.0)
