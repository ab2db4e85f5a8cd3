"""`corral bench` against a server with known timing and token counts, and against real llama.cpp."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import orjson
import pytest
from aiohttp import web

from corral.bench import (
    LoadPlan,
    PreflightError,
    Slo,
    preflight,
    random_requests,
    run_load,
    shared_prefix_requests,
    summarise,
)
from corral.bench.runner import _Events

from ..conftest import CORRAL, RunningCluster

TTFT, ITL, TOKENS, PROMPT_TOKENS = 0.100, 0.020, 20, 33


class Injected:
    """Streams TOKENS chunks after TTFT, ITL apart, then usage; prompts containing FAIL get a 500, those
    containing GARBLE a stream whose second event is no JSON."""

    def __init__(self, ttft: float = TTFT, itl: float = ITL) -> None:
        self.ttft, self.itl = ttft, itl
        self.url = ""
        self.bodies: list[dict] = []
        self.sent: list[list[float]] = []  # per request: arrival, then each content chunk's send time

    async def handle(self, request: web.Request) -> web.StreamResponse:
        times = [time.perf_counter()]
        body = await request.json()
        self.bodies.append(body)
        if "FAIL" in json.dumps(body):
            return web.json_response({"error": {"message": "boom"}}, status=500)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(self.ttft)
        for i in range(TOKENS):
            if i:
                await asyncio.sleep(self.itl)
            if i == 1 and "GARBLE" in json.dumps(body):
                await response.write(b"data: {bad\n\n")
            choice = {"index": 0, "text": f" t{i}", "finish_reason": None}
            await response.write(b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n")
            times.append(time.perf_counter())
        usage = {
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": TOKENS,
            "total_tokens": PROMPT_TOKENS + TOKENS,
        }
        await response.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        self.sent.append(times)
        return response


@pytest.fixture
async def injected() -> AsyncIterator[Injected]:
    server = Injected()
    app = web.Application()
    app.router.add_post("/v1/completions", server.handle)
    app.router.add_post("/v1/chat/completions", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    server.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield server
    await runner.cleanup()


async def test_measured_latencies_match_the_injected_ones(injected: Injected) -> None:
    plan = LoadPlan(base_url=injected.url, model="m", max_concurrency=4, warmup=2)
    run = await run_load(plan, random_requests(14, 50, TOKENS))
    summary = summarise(run, Slo(ttft_ms=150, tpot_ms=25))
    assert summary["completed"] == 12 and summary["failed"] == 0  # warm-up left out
    assert summary["ttft_ms"]["mean"] == pytest.approx(TTFT * 1000, abs=8)
    assert summary["itl_ms"]["p50"] == pytest.approx(ITL * 1000, abs=2)
    assert summary["tpot_ms"]["mean"] == pytest.approx(ITL * 1000, abs=2)
    assert summary["e2e_ms"]["p50"] == pytest.approx((TTFT + (TOKENS - 1) * ITL) * 1000, abs=40)
    # Against what the server actually did (its sleeps overshoot under load): the client adds little (a
    # few ms: the request's send and the loop's wake-ups, 3.0 ms once in a full CI run on 2 loaded cores).
    served = injected.sent[2:]
    server_ttft = sum(t[1] - t[0] for t in served) / len(served) * 1000
    server_last = sum(t[-1] - t[0] for t in served) / len(served) * 1000
    assert summary["ttft_ms"]["mean"] == pytest.approx(server_ttft, abs=6)
    assert summary["e2e_ms"]["mean"] == pytest.approx(server_last, abs=8)
    assert (
        summary["total_output_tokens"] == 12 * TOKENS and summary["total_input_tokens"] == 12 * PROMPT_TOKENS
    )
    assert summary["token_counts_from"] == "usage"
    assert summary["goodput_requests_per_s"] == summary["requests_per_s"]
    assert injected.bodies[0]["stream_options"] == {"include_usage": True}
    assert injected.bodies[0]["max_tokens"] == TOKENS


async def test_poisson_arrivals_reach_the_requested_rate(injected: Injected) -> None:
    injected.ttft, injected.itl = 0.0, 0.0
    plan = LoadPlan(base_url=injected.url, model="m", request_rate=40.0, seed=3)
    run = await run_load(plan, random_requests(80, 10, TOKENS))
    summary = summarise(run)
    assert summary["requests_per_s"] == pytest.approx(40.0, rel=0.25)


async def test_errors_are_counted_by_kind(injected: Injected) -> None:
    """A failed request counts by its kind, and as one that missed the SLOs; a server's stream that is
    not JSON is one failed request, not the end of the run."""
    requests = random_requests(6, 10, TOKENS)
    requests[1] = type(requests[1])(prompt="FAIL please", output_len=TOKENS)
    requests[4] = type(requests[4])(prompt="GARBLE please", output_len=TOKENS)
    run = await run_load(LoadPlan(base_url=injected.url, model="m"), requests)
    summary = summarise(run, Slo(ttft_ms=10_000))
    assert summary["errors"] == {"http_500": 1, "bad_chunk": 1} and summary["completed"] == 4
    assert summary["slo"]["met_share"] == pytest.approx(4 / 6, abs=1e-3)


def test_a_goodput_search_is_not_capped_by_the_client() -> None:
    search = ["--search-goodput", "--goodput", "ttft:150", "--max-concurrency", "1"]
    done = subprocess.run(
        [*CORRAL, "bench", "--base-url", "http://127.0.0.1:9", "--model", "m", *search],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--max-concurrency would hold them back" in done.stdout + done.stderr


def test_shared_prefix_workload_shares_prefixes_and_grows_chats() -> None:
    requests = shared_prefix_requests(30, tenants=3, prefix_len=100, question_len=5, output_len=8, turns=3)
    systems = {r.messages[0]["content"] for r in requests}
    assert len(systems) == 3 and all(len(s.split()) > 100 for s in systems)
    assert {len(r.messages) for r in requests} == {2, 4, 6}  # 1, 2 and 3 turns of history


@pytest.mark.slow
async def test_cli_writes_json_html_plots_and_compares(injected: Injected, tmp_path: Path) -> None:
    common = [
        *CORRAL,
        "bench",
        "--base-url",
        injected.url,
        "--model",
        "m",
        "--num-prompts",
        "6",
        "--random-input-len",
        "20",
        "--random-output-len",
        str(TOKENS),
    ]
    first = await asyncio.to_thread(
        subprocess.run,
        [
            *common,
            "--sweep-concurrency",
            "1,3",
            "--output",
            str(tmp_path / "a.json"),
            "--html",
            str(tmp_path / "r.html"),
            "--plots",
            str(tmp_path / "plots"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert first.returncode == 0, first.stderr
    result = json.loads((tmp_path / "a.json").read_text())
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        assert set(result[key]) >= {"mean", "p50", "p90", "p99"}
    assert {"output_tokens_per_s", "requests_per_s", "errors"} <= set(result)
    assert [r["load"] for r in result["runs"]] == ["c=1", "c=3"]
    assert (tmp_path / "plots" / "latency_throughput.png").read_bytes()[:4] == b"\x89PNG"
    assert "data:image/png;base64" in (tmp_path / "r.html").read_text()
    second = await asyncio.to_thread(
        subprocess.run,
        [*common, "--output", str(tmp_path / "b.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode == 0, second.stderr
    shown = await asyncio.to_thread(
        subprocess.run,
        [*CORRAL, "bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")],
        capture_output=True,
        text=True,
    )
    assert "ttft_ms.p50" in shown.stdout and "requests_per_s" in shown.stdout


@pytest.mark.slow
def test_against_a_real_llama_cpp_cluster(cluster: RunningCluster, tmp_path: Path) -> None:
    out = tmp_path / "real.json"
    done = subprocess.run(
        [
            *CORRAL,
            "bench",
            "--base-url",
            cluster.url,
            "--model",
            "smollm2",
            "--num-prompts",
            "8",
            "--max-concurrency",
            "4",
            "--random-input-len",
            "32",
            "--random-output-len",
            "16",
            "--ignore-eos",
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["completed"] == 8 and result["errors"] == {}
    assert result["total_output_tokens"] == 8 * 16 and result["token_counts_from"] == "usage"
    assert 0 < result["ttft_ms"]["p50"] < result["e2e_ms"]["p50"]
    assert result["tpot_ms"]["mean"] > 0


def bench_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *CORRAL,
            "bench",
            "--num-prompts",
            "2",
            "--random-input-len",
            "8",
            "--random-output-len",
            "4",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_wrong_model_or_base_url_is_caught_before_the_run(cluster: RunningCluster) -> None:
    wrong = bench_cli("--base-url", cluster.url, "--model", "llama")
    assert wrong.returncode == 1 and "Traceback" not in wrong.stderr
    assert "does not serve the model 'llama'; it serves: smollm2" in wrong.stderr
    doubled = bench_cli("--base-url", cluster.url + "/v1", "--model", "smollm2")
    assert doubled.returncode == 1 and f"use --base-url {cluster.url}" in doubled.stderr
    gone = bench_cli("--base-url", "http://127.0.0.1:9", "--model", "smollm2")
    assert gone.returncode == 1 and "cannot reach http://127.0.0.1:9/v1/completions" in gone.stderr


def test_a_run_where_nothing_succeeds_exits_nonzero_with_error_kinds(cluster: RunningCluster) -> None:
    """Each request asks for more output than the replicas' context: the gateway refuses every one with a
    400, while the one-token check before the run passes."""
    done = bench_cli("--base-url", cluster.url, "--model", "smollm2", "--random-output-len", "100000")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "errors: http_400: 2" in done.stderr
    assert "error: no request succeeded (http_400: 2)" in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_a_sharegpt_file_runs_on_either_endpoint(
    cluster: RunningCluster, tmp_path: Path, endpoint: str
) -> None:
    """The first turns go as chat messages on the chat endpoint and as plain prompts on the completions
    one (as vLLM's benchmark sends them; they once went as messages there, and every request was a 400)."""
    conversations = [
        {
            "conversations": [
                {"from": "human", "value": f"Name a colour, {i}."},
                {"from": "gpt", "value": "Red."},
            ]
        }
        for i in range(3)
    ]
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(conversations))
    out = tmp_path / "sharegpt-result.json"
    done = bench_cli(
        "--base-url", cluster.url, "--model", "smollm2", "--endpoint", endpoint, "--num-prompts", "3",
        "--dataset-name", "sharegpt", "--dataset-path", str(dataset), "--output", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["completed"] == 3 and result["errors"] == {}


@contextlib.asynccontextmanager
async def serving(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> AsyncIterator[str]:
    """`handler` on both endpoints of a server on 127.0.0.1: its base URL."""
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def _usage() -> bytes:
    usage = {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": TOKENS,
        "total_tokens": PROMPT_TOKENS + TOKENS,
    }
    return orjson.dumps({"choices": [], "usage": usage})


@pytest.mark.parametrize(
    "delta",
    [
        {"reasoning_content": " think"},  # vLLM's reasoning parsers
        {"reasoning": " think"},  # vLLM's newer field (and OpenRouter's)
        {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]},  # an answer that is a tool call
    ],
    ids=["reasoning_content", "reasoning", "tool_calls"],
)
async def test_reasoning_and_tool_call_tokens_are_output(delta: dict[str, object]) -> None:
    """A reasoning model streams its thinking before any `content`: TTFT took in the whole reasoning
    phase (and TPOT was spread over the last two tokens' gap); an answer made of a tool call had no
    first token at all. Every delta but the last two here is reasoning or a tool call."""

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(TTFT)
        for i in range(TOKENS):
            if i:
                await asyncio.sleep(ITL)
            piece = delta if i < TOKENS - 2 or "tool_calls" in delta else {"content": f" c{i}"}
            chunk = {"choices": [{"index": 0, "delta": piece, "finish_reason": None}]}
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await response.write(b"data: " + _usage() + b"\n\ndata: [DONE]\n\n")
        return response

    async with serving(handle) as url:
        plan = LoadPlan(base_url=url, model="m", endpoint="/v1/chat/completions")
        summary = summarise(await run_load(plan, random_requests(3, 10, TOKENS, chat=True)))
    assert summary["completed"] == 3
    assert summary["ttft_ms"]["mean"] == pytest.approx(TTFT * 1000, abs=25)
    assert summary["tpot_ms"]["mean"] == pytest.approx(ITL * 1000, abs=5)


async def test_events_ended_by_crlf_with_no_space_after_data_are_read() -> None:
    """The SSE standard ends lines with LF, CRLF or CR and makes the space after `data:` optional: a server
    writing `data:{...}\\r\\n\\r\\n` had every request counted an incomplete stream. Here each CRLF of a
    blank line is split over two writes a token apart: the event counts when its CR arrives."""

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(TTFT)
        lead = b""
        for i in range(TOKENS):
            if i:
                await asyncio.sleep(ITL)
            choice = {"index": 0, "text": f" t{i}", "finish_reason": None}
            await response.write(lead + b"data:" + orjson.dumps({"choices": [choice]}) + b"\r\n\r")
            lead = b"\n"
        await response.write(b"\ndata:" + _usage() + b"\r\n\r\ndata:[DONE]\r\n\r\n")
        return response

    async with serving(handle) as url:
        summary = summarise(await run_load(LoadPlan(base_url=url, model="m"), random_requests(3, 10, TOKENS)))
    assert summary["completed"] == 3 and summary["errors"] == {}
    assert summary["total_output_tokens"] == 3 * TOKENS
    assert summary["ttft_ms"]["mean"] == pytest.approx(TTFT * 1000, abs=12)
    assert summary["itl_ms"]["p50"] == pytest.approx(ITL * 1000, abs=5)


def test_an_lf_read_alone_after_a_cr_ends_its_line_once() -> None:
    """A CRLF split so that its LF came as a read of its own left the reader still after a CR: the next
    read's LF (a blank line's: the event's end) was skipped, and two events were read as one."""
    events = _Events()
    reads = [b'data: {"a":1}\r', b"\n", b'\ndata: {"b":2}\r\n\r\n']
    assert [payload for read in reads for payload in events.feed(read)] == [b'{"a":1}', b'{"b":2}']


async def test_warm_up_requests_finish_before_the_measured_ones_start(injected: Injected) -> None:
    """`--warmup` said "sent first", but the warm-up requests went out beside the measured ones (all at
    once here), so the measured ones met a server still warming up and shared it with them."""
    run = await run_load(LoadPlan(base_url=injected.url, model="m", warmup=3), random_requests(7, 10, TOKENS))
    warm = [r for r in run.results if r.warmup]
    measured = [r for r in run.results if not r.warmup]
    assert len(warm) == 3 and len(measured) == 4 and all(r.ok for r in run.results)
    assert max(r.started + r.e2e for r in warm) <= min(r.started for r in measured)
    assert run.duration_s < (TTFT + TOKENS * ITL) * 1.8  # (the clock started after the warm-up)


def test_numbers_a_run_cannot_use_and_unwritable_outputs_are_refused_before_it(tmp_path: Path) -> None:
    """Each was accepted: a rate of 0 or nan and a burstiness of 0 ended in ZeroDivisionError (and "Task
    exception was never retrieved"), a concurrency cap of 0 meant none, 0 prompts for a duration was a
    modulo by zero, a range ratio of 1 asked for empty prompts, and an --output that could not be written
    failed after the run, its results lost. The server is not there: these fail before any request."""
    (tmp_path / "file").write_text("")
    cases = [
        (["--request-rate", "0"], "--request-rate 0: give requests/s above 0"),
        (["--request-rate", "nan"], "--request-rate nan: give requests/s above 0"),
        (["--burstiness", "0"], "--burstiness 0: give a number above 0"),
        (["--max-concurrency", "0"], "'--max-concurrency': Input should be greater than or equal to 1"),
        (["--num-prompts", "0", "--duration", "1"], "'--num-prompts': Input should be greater than or equal"),
        (["--duration", "-1"], "--duration -1: give a number of seconds above 0"),
        (["--random-range-ratio", "1"], "--random-range-ratio 1: give a share of at least 0 and under 1"),
        (["--goodput", "ttft:-5"], "bad --goodput 'ttft:-5': give milliseconds above 0"),
        (["--output", str(tmp_path)], f"--output {tmp_path}: cannot write there"),
        (["--plots", str(tmp_path / "file")], f"--plots {tmp_path / 'file'}: cannot write there"),
    ]
    base = [*CORRAL, "bench", "--base-url", "http://127.0.0.1:9", "--model", "m"]
    runs = [
        subprocess.Popen([*base, *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for flags, _ in cases
    ]
    for (flags, message), process in zip(cases, runs, strict=True):
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 2 and message in " ".join(stderr.split()), (flags, stderr)
        assert "Traceback" not in stderr


async def test_a_broken_answer_to_the_check_before_a_run_is_a_clear_error() -> None:
    """A server that cut its answer short raised http.client.IncompleteRead through the check (an
    "unexpected error"), as it is neither a URLError nor an OSError."""

    async def cut_short(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"(?i)content-length: *(\d+)", head)
        await reader.readexactly(int(length.group(1)) if length else 0)  # (unread, the close is a reset)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n40\r\ndata: {")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(cut_short, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server:
        with pytest.raises(PreflightError, match="broke off its answer to a one-token test request"):
            await asyncio.to_thread(preflight, url, "m", "/v1/completions", None, 10)


def test_comparing_a_result_without_its_figures_is_a_clear_error(tmp_path: Path) -> None:
    """A JSON file with `runs` but not the figures of one was a KeyError ("an unexpected error")."""
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"runs": [{"requests_per_s": 1.0}]}))
    done = subprocess.run(
        [*CORRAL, "bench", "compare", str(bad), str(bad)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1 and "unexpected error" not in done.stderr
    assert "is not a whole corral bench result: its last run has no number output_tokens_per_s" in " ".join(
        done.stderr.split()
    )
