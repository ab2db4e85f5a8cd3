"""LoRA adapters on the simulated engine: vLLM's endpoints, answers, batching limits, caches and load times.

The expected error bodies were recorded from vLLM 0.32.0's OpenAI server (its CPU build on this machine,
SmolLM2-135M with `--enable-lora --max-lora-rank 8`, VLLM_ALLOW_RUNTIME_LORA_UPDATING=true) on
2026-12-05; the simulator's run on the simulated GPUs, whose worker wording differs only by the number of
GPUs (one GPU: no "Worker failed" wrapper).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import pytest

from corral.engines import read_gauges
from corral.perf import load_catalog
from corral.perf.calibration import calibrated_efficiency
from corral.perf.replica import ReplicaLayout, replica_model
from corral.sim import LoraModule, LoraOptions, SimFleet, SimOptions, build_server
from corral.sim.lora import LoraCosts, LoraManager

from ..conftest import CORRAL, DATA

CATALOG = load_catalog()
EFFICIENCY = calibrated_efficiency()
MARKER = str(DATA / "lora" / "corral-marker")  # PEFT, rank 8 on q_proj and v_proj
BASE = "llama-3.1-8b"


def options(lora: LoraOptions | None, runtime: bool = True, tp: int = 1) -> SimOptions:
    return SimOptions(
        model=BASE, gpu="h100-sxm", tp=tp, time_scale=20, lora=lora, runtime_lora_updating=runtime
    )


async def start(sim_options: SimOptions) -> SimFleet:
    fleet = SimFleet([build_server(sim_options, CATALOG, EFFICIENCY)])
    await fleet.start([0])
    return fleet


@pytest.fixture
async def lora_sim() -> AsyncIterator[str]:
    fleet = await start(options(LoraOptions(max_loras=2, max_lora_rank=16)))
    yield fleet.urls[0]
    await fleet.stop()


async def post(url: str, path: str, body: Mapping[str, object]) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body) as response:
        return response.status, await response.text()


async def get_json(url: str, path: str) -> dict[str, object]:
    async with aiohttp.ClientSession() as session, session.get(url + path) as response:
        data: dict[str, object] = await response.json()
        return data


async def metrics_text(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        return await response.text()


async def complete(
    url: str, model: str, prompt: str = "Hello there", max_tokens: int = 8
) -> dict[str, object]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "seed": 3}
    status, text = await post(url, "/v1/completions", body)
    assert status == 200, text
    reply: dict[str, object] = json.loads(text)
    return reply


def error(status: int, message: str, type_: str, param: str | None = None) -> tuple[int, dict[str, object]]:
    return status, {"error": {"message": message, "type": type_, "param": param, "code": status}}


def parsed(reply: tuple[int, str]) -> tuple[int, object]:
    return reply[0], json.loads(reply[1])


def shown(path: str) -> str:
    """A path as vLLM's messages show it: hidden under the system's folders (the recording's were in /tmp)."""
    hidden = ("/home/", "/usr/", "/opt/", "/var/", "/tmp/", "/root/", "/lib/", "/mnt/", "/srv/")
    return "<path>" if path.startswith(hidden) else path


def adapter_folder(root: Path, rank: int, tensors: bool = True) -> str:
    """A PEFT folder of the given rank (the tensors file's content is never read by the simulator)."""
    folder = root / f"rank{rank}"
    folder.mkdir()
    config = json.loads((Path(MARKER) / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(config | {"r": rank}))
    if tensors:
        (folder / "adapter_model.safetensors").write_bytes(b"")
    return str(folder)


async def test_load_unload_and_their_errors_answer_as_vllm(lora_sim: str) -> None:
    load = {"lora_name": "marker", "lora_path": MARKER}
    assert await post(lora_sim, "/v1/load_lora_adapter", load) == (
        200,
        "Success: LoRA adapter 'marker' added successfully.",
    )
    assert parsed(await post(lora_sim, "/v1/load_lora_adapter", load)) == error(
        400,
        "The lora adapter 'marker' has already been loaded. If you want to load the adapter in place, set "
        "'load_inplace' to True.",
        "InvalidUserInput",
    )
    assert parsed(
        await post(lora_sim, "/v1/load_lora_adapter", {"lora_name": BASE, "lora_path": MARKER})
    ) == (error(400, f"The lora adapter '{BASE}' conflicts with a served base model.", "InvalidUserInput"))
    missing = {"lora_name": "missing", "lora_path": "/work/nowhere/adapter"}
    assert parsed(await post(lora_sim, "/v1/load_lora_adapter", missing)) == error(
        404, "Loading lora missing failed: No adapter found for /work/nowhere/adapter", "NotFoundError"
    )
    assert parsed(await post(lora_sim, "/v1/unload_lora_adapter", {"lora_name": "nope"})) == error(
        404, "The lora adapter 'nope' cannot be found.", "NotFoundError"
    )
    assert parsed(await post(lora_sim, "/v1/unload_lora_adapter", {"lora_name": ""})) == error(
        400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput"
    )
    assert (await complete(lora_sim, "marker"))["model"] == "marker"
    assert await post(lora_sim, "/v1/unload_lora_adapter", {"lora_name": "marker"}) == (
        200,
        "Success: LoRA adapter 'marker' removed successfully.",
    )
    body = {"model": "marker", "prompt": "hi", "max_tokens": 3}
    assert parsed(await post(lora_sim, "/v1/completions", body)) == error(
        404, f"The model `marker` does not exist. Valid aliases: {BASE}.", "NotFoundError", "model"
    )


async def test_models_list_adapters_with_their_parent(lora_sim: str) -> None:
    await post(lora_sim, "/v1/load_lora_adapter", {"lora_name": "marker", "lora_path": MARKER})
    models = (await get_json(lora_sim, "/v1/models"))["data"]
    assert isinstance(models, list)
    assert [(m["id"], m["parent"]) for m in models] == [(BASE, None), ("marker", BASE)]
    assert models[1]["root"] == MARKER and models[1]["max_model_len"] is None


async def test_an_adapter_answers_differently_from_the_base(lora_sim: str) -> None:
    await post(lora_sim, "/v1/load_lora_adapter", {"lora_name": "marker", "lora_path": MARKER})
    base, adapter, again = [await complete(lora_sim, model) for model in (BASE, "marker", "marker")]
    text = [r["choices"][0]["text"] for r in (base, adapter, again)]  # type: ignore[index]
    assert text[1] != text[0] and text[1] == text[2]


async def test_adapter_checks_the_worker_makes_fail_as_in_vllm(tmp_path: Path) -> None:
    """500 for a rank over --max-lora-rank and for a folder without tensors, 404 without a config; two GPUs
    word the worker's failure as vLLM's worker processes do (the recorded answers)."""
    fleet = await start(options(LoraOptions(max_lora_rank=8), tp=2))
    try:
        url = fleet.urls[0]
        big = {"lora_name": "big", "lora_path": adapter_folder(tmp_path, 16)}
        assert parsed(await post(url, "/v1/load_lora_adapter", big)) == error(
            500,
            "Call to add_lora method failed: Worker failed with error 'LoRA rank 16 is greater than "
            "max_lora_rank 8.', please check the stack trace above for the root cause",
            "InternalServerError",
        )
        bare = {"lora_name": "notensors", "lora_path": adapter_folder(tmp_path, 8, tensors=False)}
        assert parsed(await post(url, "/v1/load_lora_adapter", bare)) == error(
            500,
            f"Call to add_lora method failed: Worker failed with error '{shown(bare['lora_path'])} doesn't "
            "contain tensors', "
            "please check the stack trace above for the root cause",
            "InternalServerError",
        )
        empty = tmp_path / "empty"
        empty.mkdir()
        nothing = {"lora_name": "missing2", "lora_path": str(empty)}
        assert parsed(await post(url, "/v1/load_lora_adapter", nothing)) == error(
            404, f"Loading lora missing2 failed: No adapter found for {shown(str(empty))}", "NotFoundError"
        )
        models = (await get_json(url, "/v1/models"))["data"]
        assert isinstance(models, list) and [m["id"] for m in models] == [BASE]
    finally:
        await fleet.stop()
    one_gpu = options(LoraOptions(max_lora_rank=8, modules=(LoraModule("big", big["lora_path"]),)))
    with pytest.raises(
        ValueError, match=r"^Call to add_lora method failed: LoRA rank 16 is greater than max"
    ):
        build_server(one_gpu, CATALOG, EFFICIENCY)


async def test_without_enable_lora_loading_is_refused() -> None:
    fleet = await start(options(None))
    try:
        url = fleet.urls[0]
        assert parsed(
            await post(url, "/v1/load_lora_adapter", {"lora_name": "m", "lora_path": MARKER})
        ) == error(
            500,
            "Call to add_lora method failed: LoRA is not enabled. Use --enable-lora to enable LoRA.",
            "InternalServerError",
        )
        assert (await post(url, "/v1/unload_lora_adapter", {"lora_name": "m"}))[0] == 404
    finally:
        await fleet.stop()


async def test_runtime_endpoints_are_absent_without_the_variable() -> None:
    fleet = await start(options(LoraOptions(modules=(LoraModule("marker", MARKER),)), runtime=False))
    try:
        url = fleet.urls[0]
        assert (await post(url, "/v1/load_lora_adapter", {"lora_name": "m", "lora_path": MARKER}))[0] == 404
        assert (await post(url, "/v1/unload_lora_adapter", {"lora_name": "marker"}))[0] == 404
        assert (await complete(url, "marker"))["model"] == "marker"  # --lora-modules still serve
    finally:
        await fleet.stop()


def lora_series(text: str) -> list[tuple[list[str], list[str]]]:
    """Every `vllm:lora_requests_info` series: (running adapters, waiting adapters)."""
    found = re.findall(
        r'^vllm:lora_requests_info\{max_lora="\d+",running_lora_adapters="([^"]*)",'
        r'waiting_lora_adapters="([^"]*)"\}',
        text,
        re.MULTILINE,
    )
    return [
        (running.split(",") if running else [], waiting.split(",") if waiting else [])
        for running, waiting in found
    ]


async def adapters_seen_together(max_loras: int) -> list[tuple[list[str], list[str]]]:
    """Three requests for adapter a, then three for b, at once; the lora_requests_info series after."""
    modules = (LoraModule("a", MARKER), LoraModule("b", MARKER))
    lora = LoraOptions(max_loras=max_loras, max_cpu_loras=2, modules=modules)
    fleet = await start(SimOptions(model=BASE, gpu="h100-sxm", time_scale=5, lora=lora))
    try:
        url = fleet.urls[0]
        await asyncio.gather(
            *(complete(url, name, f"{name}{i} says", 100) for name in "ab" for i in range(3))
        )
        return lora_series(await metrics_text(url))
    finally:
        await fleet.stop()


async def test_max_loras_limits_the_distinct_adapters_in_a_batch() -> None:
    one = await adapters_seen_together(max_loras=1)
    assert all(len(running) <= 1 for running, _ in one), one
    assert any(running == ["a"] and "b" in waiting for running, waiting in one), one  # b held back meanwhile
    two = await adapters_seen_together(max_loras=2)
    assert any(sorted(running) == ["a", "b"] for running, _ in two), two


async def test_host_memory_eviction_reloads_the_adapter_and_is_counted() -> None:
    modules = (LoraModule("a", MARKER), LoraModule("b", MARKER))
    fleet = await start(options(LoraOptions(max_loras=1, max_cpu_loras=1, modules=modules)))
    try:
        url = fleet.urls[0]

        async def loads() -> float:
            return read_gauges(await metrics_text(url))["sim:lora_loads_total"]

        assert await loads() == 2  # both at start-up; b's load evicted a
        await complete(url, "a")
        assert await loads() == 3  # a again, evicting b
        await complete(url, "a")
        assert await loads() == 3
        await complete(url, "b")
        assert await loads() == 4
    finally:
        await fleet.stop()


async def test_a_request_for_an_evicted_adapter_waits_for_its_load() -> None:
    """The first token of a request whose adapter must be read from disk and copied to the GPU comes that
    much later (simulated seconds, from the engine's own TTFT histogram) than one whose adapter is held."""
    modules = (LoraModule("a", MARKER), LoraModule("b", MARKER))
    sim_options = options(LoraOptions(max_loras=1, max_cpu_loras=1, modules=modules))
    fleet = await start(sim_options)
    try:
        url = fleet.urls[0]

        async def ttft_sum() -> float:
            return read_gauges(await metrics_text(url)).get("vllm:time_to_first_token_seconds_sum", 0.0)

        async def ttft(model: str) -> float:
            before = await ttft_sum()
            await complete(url, model, "the same prompt for both", max_tokens=1)
            return await ttft_sum() - before

        held, evicted = await ttft("b"), await ttft("a")
    finally:
        await fleet.stop()
    replica = replica_model(ReplicaLayout(model=BASE, gpu="h100-sxm"), CATALOG, EFFICIENCY)
    costs = LoraCosts(replica.perf, 16)
    adapter = LoraManager(LoraOptions(), costs).read("a", MARKER)
    load = costs.disk_seconds(adapter) + costs.copy_seconds(adapter)
    assert evicted > held
    assert evicted - held == pytest.approx(load, rel=0.01)


def test_adapter_size_matches_its_peft_file() -> None:
    """The size the load times are computed from, against the adapter's real tensors (SmolLM2-135M)."""
    replica = replica_model(ReplicaLayout(model="smollm2-135m", gpu="h100-sxm"), CATALOG, EFFICIENCY)
    costs = LoraCosts(replica.perf, 16)
    adapter = LoraManager(LoraOptions(), costs).read("marker", MARKER)
    on_disk = (Path(MARKER) / "adapter_model.safetensors").stat().st_size
    assert costs.size_bytes(adapter) == pytest.approx(on_disk, rel=0.02)


def _read_url(process: subprocess.Popen[str], timeout: float) -> str:
    stdout = process.stdout
    assert stdout is not None
    with ThreadPoolExecutor(1) as pool:
        try:
            url = pool.submit(stdout.readline).result(timeout).strip()
        except TimeoutError:
            process.kill()
            raise AssertionError(f"corral sim did not start within {timeout} s") from None
    assert url, f"corral sim exited: {process.stderr.read() if process.stderr else ''}"
    return url


def _http(url: str, body: Mapping[str, object] | None = None) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.parametrize("variable", ["true", None])
def test_cli_flags_and_the_runtime_variable(variable: str | None) -> None:
    """vLLM's flags (two adapters after one --lora-modules, one in its JSON form); the load/unload
    endpoints only with VLLM_ALLOW_RUNTIME_LORA_UPDATING."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ALLOW_RUNTIME_LORA_UPDATING"}
    if variable is not None:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = variable
    second = json.dumps({"name": "second", "path": MARKER, "base_model_name": BASE})
    argv = [*CORRAL, "sim", "--model", BASE, "--gpu", "h100-sxm", "--port", "0", "--time-scale", "20"]
    argv += ["--enable-lora", "--max-loras", "2", "--lora-modules", f"marker={MARKER}", second]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = _read_url(process, timeout=30)
        models = json.loads(_http(url + "/v1/models")[1])["data"]
        assert [(m["id"], m["parent"]) for m in models] == [(BASE, None), ("marker", BASE), ("second", BASE)]
        status, _ = _http(url + "/v1/unload_lora_adapter", {"lora_name": "marker"})
        assert status == (200 if variable else 404)
    finally:
        process.terminate()
        process.wait(10)
