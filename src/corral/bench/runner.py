"""Sending the load: arrivals (all at once, Poisson or gamma), a concurrency cap, ramp-up, a warm-up phase
finished before the measured one starts, and a measurement of the client's own event-loop lag (a lagging
client inflates latencies it reports).

Every request is streamed with `stream_options.include_usage`, so TTFT and the gaps between chunks are seen
as they happen and token counts come from the server's usage.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

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
    """Send `requests` as `plan` says: the first `plan.warmup` of them as a phase of their own, every one
    finished before the clock starts, then the rest (cycling through them when a duration is set)."""
    url = plan.base_url.rstrip("/") + plan.endpoint
    headers = {"Content-Type": "application/json"}
    if plan.api_key:
        headers["Authorization"] = f"Bearer {plan.api_key}"
    results: list[RequestResult] = []
    total = len(requests) if plan.duration_s is None else 0
    lag = _LagMonitor()
    timeout = aiohttp.ClientTimeout(total=plan.timeout_s)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        def sent(result: RequestResult) -> None:
            results.append(result)
            progress(len(results), total)

        send = _Sender(plan, session, url, headers, sent)
        await send(requests[: plan.warmup], None, warmup=True)  # (at the rate, without the ramp)
        lag.start()
        started = time.perf_counter()
        await send(requests[plan.warmup :], plan.duration_s, warmup=False)
        duration = time.perf_counter() - started
        await lag.stop()
    return RunResult(results, duration, lag.quantile(0.99) * 1000, lag.maximum() * 1000)


class _Sender:
    """Sends a phase's requests at the plan's arrivals and concurrency cap, and waits for them all."""

    def __init__(
        self,
        plan: LoadPlan,
        session: aiohttp.ClientSession,
        url: str,
        headers: dict[str, str],
        sent: Callable[[RequestResult], None],
    ) -> None:
        self._plan, self._session, self._url, self._headers, self._sent = plan, session, url, headers, sent
        self._rng = random.Random(plan.seed)
        self._limit = asyncio.Semaphore(plan.max_concurrency) if plan.max_concurrency is not None else None

    async def __call__(self, requests: Sequence[BenchRequest], duration: float | None, warmup: bool) -> None:
        """All of `requests` (cycled through for `duration` seconds where given), each as it arrives."""
        if not requests:
            return
        plan = replace(self._plan, ramp_up_s=0.0) if warmup else self._plan
        started = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for index in itertools.count():
                elapsed = time.perf_counter() - started
                if (duration is None and index >= len(requests)) or (
                    duration is not None and elapsed >= duration
                ):
                    break
                group.create_task(self._one(requests[index % len(requests)], warmup))
                await _next_arrival(plan, self._rng, elapsed)
                if self._limit is not None and plan.request_rate == float("inf"):
                    await _wait_for_slot(self._limit)

    async def _one(self, request: BenchRequest, warmup: bool) -> None:
        body = orjson.dumps(request.body(self._plan.model, self._plan.ignore_eos))
        if self._limit is not None:
            async with self._limit:
                result = await _send(self._session, self._url, self._headers, body)
        else:
            result = await _send(self._session, self._url, self._headers, body)
        result.warmup = warmup
        self._sent(result)


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
    chunks = 0
    try:
        async with session.post(url, data=body, headers=headers) as response:
            if response.status != 200:
                result.error = f"http_{response.status}"
                await response.read()
                return result
            chunks = await _read_stream(response, result)
    except TimeoutError:
        result.error = "timeout"
    except aiohttp.ClientError as exc:
        result.error = type(exc).__name__
    result.e2e = time.perf_counter() - result.started
    if not result.tokens_from_usage:
        result.output_tokens = chunks  # no usage from the server: one token per chunk of output
    if result.error is not None:
        result.ok = False
    elif not result.ok:
        result.error = "incomplete_stream"
    return result


async def _read_stream(response: aiohttp.ClientResponse, result: RequestResult) -> int:
    """Read a server-sent event stream into `result` as its events arrive; the chunks carrying output."""
    events = _Events()
    last: float | None = None
    chunks = 0
    async for data in response.content.iter_any():
        now = time.perf_counter()
        for payload in events.feed(data):
            if payload == b"[DONE]":
                result.ok = True
            elif (chunk := _chunk(payload, result)) is not None and _has_output(chunk):
                chunks += 1
                if result.ttft is None:
                    result.ttft = now - result.started
                elif last is not None:
                    result.chunk_gaps.append(now - last)
                last = now
    return chunks


def _chunk(payload: bytes, result: RequestResult) -> dict[str, Any] | None:
    """An event's JSON chunk, its usage noted in `result`; None (and the error noted) where it is not
    one (the server's fault: counted, the run goes on)."""
    try:
        chunk = orjson.loads(payload)
    except orjson.JSONDecodeError:
        chunk = None
    if not isinstance(chunk, dict):
        result.error = "bad_chunk"
        return None
    if "error" in chunk:
        result.error = "stream_error"
        return None
    usage = chunk.get("usage")
    if isinstance(usage, dict) and usage:
        try:
            result.output_tokens = int(usage.get("completion_tokens") or 0)
            result.input_tokens = int(usage.get("prompt_tokens") or 0)
            result.tokens_from_usage = True
        except (TypeError, ValueError, OverflowError):
            result.error = "bad_chunk"
    return chunk


class _Events:
    """Server-sent events from the bytes of a stream: each event's data (its `data:` lines joined), lines
    ending in LF, CRLF or CR and the space after `data:` optional, as the SSE standard has them. A CR ends
    its line at once (an event is seen as soon as it is whole); an LF right after it is then skipped."""

    def __init__(self) -> None:
        self._buffer = b""
        self._after_cr = False

    def feed(self, data: bytes) -> list[bytes]:
        if self._after_cr and data.startswith(b"\n"):
            data = data[1:]
        self._after_cr = data.endswith(b"\r")  # (a read of that LF alone: the next one's LF is a line's)
        text = self._buffer + data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *events, self._buffer = text.split(b"\n\n")
        payloads = []
        for event in events:
            lines = [line[5:] for line in event.split(b"\n") if line.startswith(b"data:")]
            if lines:
                payloads.append(b"\n".join(line.removeprefix(b" ") for line in lines))
        return payloads


def _has_output(chunk: dict[str, Any]) -> bool:
    """Whether a chunk carries generated output: text, or in a chat delta, content, reasoning (vLLM's
    `reasoning_content`, or `reasoning`) or tool calls. A reasoning model's first token is its first
    reasoning token, and a tool call's arguments are tokens too."""
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    first = choices[0]
    if not isinstance(first, dict):
        return False
    delta = first.get("delta")
    if not isinstance(delta, dict):
        return bool(first.get("text"))
    return any(delta.get(key) for key in ("content", "reasoning_content", "reasoning", "tool_calls"))


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
