"""How the gateway scales with `gateway.workers`: requests/s at concurrency 128 with 1 and 2 workers.

On a small machine the load generator and the upstream share the cores with the gateway, so both are
chosen to cost next to nothing per request, leaving the cores to the gateway: the load comes from `wrk`
(C, one thread, 128 keep-alive connections) and the upstream is NGINX (one worker process) answering at
once, a chat completion with `return`, or a stream of `--chunks` SSE events (each flushed on its own, as an
engine sends tokens, plus a usage event and `[DONE]`) with the echo module. Both are Debian packages
(`apt-get install wrk nginx-light`). NGINX answered directly is shown for scale.

corral runs with limits in the real Redis (workers > 1 need it; the one-worker run uses it too, so the
two differ only in the worker count), open, and with an API key (a rate-limit reservation and settlement
in Redis per request). Configurations are measured interleaved, `--rounds` times each; medians are
printed as JSON with the 2-worker/1-worker ratio, each gateway's CPU time per request (all its processes),
and what wrk and NGINX spent per request beside it. From those the ratio this machine allows follows: one
worker has a core to itself, two share the machine's cores with wrk and NGINX, so with g the gateway's and
o their CPU per request, 2 workers serve at most min(2, cores × g / (g + o)) times one worker's rate, and
never more than NGINX serves when asked directly (`rps_ratio_bound`).

    .venv/bin/python benchmarks/gateway_workers.py [--seconds 8] [--rounds 3] [--chunks 64]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from _harness import free_port, spawn, stop, upstream_payloads, wait_http

ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = 128


def nginx_config(tmp: Path, port: int, stream_port: int, chunks: int) -> str:
    completion = upstream_payloads(1)[0].decode()  # whole answers: one token
    _, one, last = upstream_payloads(chunks)
    chunk, usage = one.decode(), last.decode()
    events = "\n".join(f"            echo -n 'data: {chunk}\\n\\n'; echo_flush;" for _ in range(chunks))
    return f"""
load_module /usr/lib/nginx/modules/ngx_http_echo_module.so;
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    keepalive_requests 1000000;
    server {{
        listen 127.0.0.1:{port};
        location /health {{ return 200 'ok'; }}
        location /v1/chat/completions {{ default_type application/json; return 200 '{completion}'; }}
    }}
    server {{
        listen 127.0.0.1:{stream_port};
        location /health {{ return 200 'ok'; }}
        location /v1/chat/completions {{
            default_type text/event-stream;
{events}
            echo -n 'data: {usage}\\n\\n'; echo_flush;
            echo -n 'data: [DONE]\\n\\n';
        }}
    }}
}}
"""


def wrk(url: str, model: str, seconds: float, key: str | None) -> dict[str, float]:
    """One wrk run: requests/s, non-2xx responses, socket errors."""
    body = {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 64}
    if model.endswith("stream"):
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    auth = f'wrk.headers["Authorization"] = "Bearer {key}"\n' if key else ""
    script = f'wrk.method = "POST"\nwrk.body = {json.dumps(json.dumps(body))}\n'
    script += f'wrk.headers["Content-Type"] = "application/json"\n{auth}'
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(script)
    before = _children_cpu()
    try:
        done = subprocess.run(
            ["wrk", "-t1", f"-c{CONCURRENCY}", f"-d{seconds:g}s", "-s", f.name, url],
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        os.unlink(f.name)
    out = done.stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return {
        "requests_per_s": rps,
        "non_2xx": int(bad.group(1)) if bad else 0,
        "socket_errors": sum(int(x) for x in errors.groups()) if errors else 0,
        "wrk_cpu_s": _children_cpu() - before,
    }


def _children_cpu() -> float:
    """CPU seconds of this process's finished children (wrk, once it has been waited for)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def tree_cpu(pid: int) -> float:
    """CPU seconds of a process and its children (corral up and its gateway workers)."""
    proc = psutil.Process(pid)
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=8.0, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--output", type=Path, default=ROOT / "results" / "gateway_workers.json")
    args = parser.parse_args()
    for tool in ("wrk", "nginx"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            sys.exit(f"error: {tool} is not installed (apt-get install wrk nginx-light)")
    results = run(args)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


def run(args: argparse.Namespace) -> dict[str, Any]:
    port, stream_port = free_port(), free_port()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "nginx.conf").write_text(nginx_config(tmp, port, stream_port, args.chunks))
        home = {"CORRAL_HOME": str(tmp / "home")}
        key = _make_key(tmp, home)
        procs = [spawn(["nginx", "-c", str(tmp / "nginx.conf"), "-e", str(tmp / "nginx-error.log")])]
        gateways: dict[int, int] = {}
        try:
            wait_http(f"http://127.0.0.1:{port}/health")
            for workers in (1, 2):
                gw_port = free_port()
                spec = tmp / f"workers{workers}.yaml"
                spec.write_text(
                    f"gateway: {{port: {gw_port}, workers: {workers}}}\n"
                    f"store: {{url: 'sqlite:///{tmp / 'corral.db'}'}}\n"
                    f"limits: {{backend: redis, redis_url: '{args.redis}'}}\nauth: {{open: true}}\nmodels:\n"
                    f"  - {{name: bench, deployments: [{{engine: external, urls: ['http://127.0.0.1:{port}']}}]}}\n"
                    "  - {name: bench-stream, deployments: "
                    f"[{{engine: external, urls: ['http://127.0.0.1:{stream_port}']}}]}}\n"
                )
                procs.append(spawn([sys.executable, "-m", "corral.cli", "up", "-f", str(spec)], env=home))
                gateways[workers] = gw_port
            for gw_port in gateways.values():
                wait_http(f"http://127.0.0.1:{gw_port}/ready")
            time.sleep(1.0)
            return measure(args, procs, port, stream_port, gateways, key)
        finally:
            stop(*procs)


def _make_key(tmp: Path, home: dict[str, str]) -> str:
    limits = ["--rpm", "1000000000", "--tpm", "1000000000000"]
    store = ["--store", f"sqlite:///{tmp / 'corral.db'}"]
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "corral.cli",
            "keys",
            "create",
            "--tenant",
            "bench",
            *limits,
            *store,
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **home},
    )
    return str(json.loads(made.stdout)["key"])


def measure(
    args: argparse.Namespace,
    procs: list[subprocess.Popen[bytes]],
    port: int,
    stream_port: int,
    gateways: dict[int, int],
    key: str,
) -> dict[str, Any]:
    pids = {1: procs[1].pid, 2: procs[2].pid}
    configs = []
    for model in ("bench", "bench-stream"):
        direct = f"http://127.0.0.1:{stream_port if model.endswith('stream') else port}/v1/chat/completions"
        samples: dict[str, list[dict[str, float]]] = {}
        wrk(direct, model, 1, None)  # warm-up
        for gw_port in gateways.values():
            wrk(f"http://127.0.0.1:{gw_port}/v1/chat/completions", model, 2, None)
        for _ in range(args.rounds):
            samples.setdefault("nginx_direct", []).append(wrk(direct, model, args.seconds, None))
            for workers, gw_port in gateways.items():
                for keyed in (False, True):
                    name = f"corral_{workers}_worker{'s' if workers > 1 else ''}{'_keys' if keyed else ''}"
                    before, upstream = tree_cpu(pids[workers]), tree_cpu(procs[0].pid)
                    url = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
                    result = wrk(url, model, args.seconds, key if keyed else None)
                    served = max(result["requests_per_s"] * args.seconds, 1)
                    result["cpu_ms_per_request"] = 1000 * (tree_cpu(pids[workers]) - before) / served
                    others = result["wrk_cpu_s"] + tree_cpu(procs[0].pid) - upstream
                    result["wrk_nginx_cpu_ms_per_request"] = 1000 * others / served
                    samples.setdefault(name, []).append(result)
        configs.append(summarise(model, samples))
    return {
        "benchmark": "gateway_workers",
        "concurrency": CONCURRENCY,
        "seconds_per_measurement": args.seconds,
        "rounds": args.rounds,
        "chunks_per_stream": args.chunks,
        "cpus": os.cpu_count(),
        "load": "wrk -t1 -c128 (keep-alive); upstream: nginx, 1 worker process",
        "configs": configs,
    }


def summarise(model: str, samples: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    out: dict[str, Any] = {"stream": model.endswith("stream")}
    for name, runs in samples.items():
        out[name] = {
            "requests_per_s": round(statistics.median(r["requests_per_s"] for r in runs), 1),
            "errors": int(sum(r["non_2xx"] + r["socket_errors"] for r in runs)),
        }
        for figure in ("cpu_ms_per_request", "wrk_nginx_cpu_ms_per_request"):
            if figure in runs[0]:
                out[name][figure] = round(statistics.median(r[figure] for r in runs), 4)
    cores = os.cpu_count() or 1
    for suffix in ("", "_keys"):
        one, two = out[f"corral_1_worker{suffix}"], out[f"corral_2_workers{suffix}"]
        out[f"rps_ratio_2_to_1_workers{suffix}"] = round(two["requests_per_s"] / one["requests_per_s"], 3)
        gateway, others = one["cpu_ms_per_request"], two["wrk_nginx_cpu_ms_per_request"]
        upstream_cap = out["nginx_direct"]["requests_per_s"] / one["requests_per_s"]  # (its one worker)
        bound = min(2.0, cores * gateway / (gateway + others), upstream_cap)
        out[f"rps_ratio_bound{suffix}"] = round(bound, 3)
    return out


if __name__ == "__main__":
    main()
