"""An engine for the Ray runtime tests that reports where Ray put it, over HTTP (/health, /placement).

Started by a replica actor like any engine (`--host`, `--port`). In a placement group handed over by corral
(`CORRAL_RAY_PLACEMENT_GROUP`, under vLLM's Python through `vllm_ray_entry.py`), it does what vLLM's Ray
executor does with the engine config: reads `parallel_config.placement_group` from a real
`EngineArgs.create_engine_config()` and starts one Ray worker per GPU bundle (`num_gpus=1`, bundle index,
child tasks captured). Each worker reports its interpreter, node and GPU ids. vLLM's executor itself needs a
GPU platform (the CPU build has no Ray device key), so this is how its placement is checked here.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def _worker_report() -> dict[str, Any]:
    import importlib.util

    import ray

    return {
        "executable": sys.executable,
        "vllm": importlib.util.find_spec("vllm") is not None,
        "node": ray.get_runtime_context().get_node_id(),
        "gpus": [str(g) for g in ray.get_gpu_ids()],
    }


def _engine_placement(model: str) -> dict[str, Any]:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=model, enforce_eager=True, max_model_len=512).create_engine_config()
    group = config.parallel_config.placement_group
    ray.init(log_to_driver=False)  # RAY_ADDRESS and the job's runtime env come from the environment
    bundles = [i for i, bundle in enumerate(group.bundle_specs) if bundle.get("GPU")]
    report = ray.remote(_worker_report)
    workers = ray.get(
        [
            report.options(
                num_cpus=0,
                num_gpus=1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group,
                    placement_group_bundle_index=index,
                    placement_group_capture_child_tasks=True,
                ),
            ).remote()
            for index in bundles
        ],
        timeout=120,
    )
    return {"group": group.id.hex(), "bundles": group.bundle_specs, "workers": workers}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="")
    parser.add_argument("--ignore-sigterm", action="store_true", help="an engine that sleeps through it")
    args, _ = parser.parse_known_args()  # the rest of vLLM's server flags
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    report: dict[str, Any] = {
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "api_key": os.environ.get("VLLM_API_KEY"),  # (vLLM guards its /v1 routes with it)
        "pid": os.getpid(),
    }
    if os.environ.get("CORRAL_RAY_PLACEMENT_GROUP"):
        report |= _engine_placement(args.model)
    body = json.dumps(report).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path in ("/health", "/placement") else 404)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
