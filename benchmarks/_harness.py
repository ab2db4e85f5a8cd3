"""What the benchmark scripts share: free ports, waiting for a server, starting and stopping processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import orjson

__all__ = ["free_port", "spawn", "stop", "upstream_payloads", "wait_http"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_http(url: str, timeout: float = 60) -> None:
    """Poll `url` until it answers 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


def spawn(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """A quiet background process in its own session (so `stop` ends all it started)."""
    return subprocess.Popen(
        args,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )


def stop(*procs: subprocess.Popen[bytes]) -> None:
    """Ctrl-C each process group, then SIGKILL what is still running after 20 s."""
    for proc in procs:
        os.killpg(proc.pid, signal.SIGINT)
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def upstream_payloads(tokens: int) -> tuple[bytes, bytes, bytes]:
    """What a fast vLLM-style upstream answers for `tokens` one-token chunks: (the whole chat completion,
    one content chunk's JSON, the usage chunk's JSON)."""
    base = {"id": "c", "created": 1, "model": "bench"}
    usage = {"prompt_tokens": 9, "completion_tokens": tokens, "total_tokens": 9 + tokens}
    message = {"role": "assistant", "content": "tok " * tokens}
    completion = {
        **base,
        "object": "chat.completion",
        "choices": [{"index": 0, "finish_reason": "length", "message": message}],
        "usage": usage,
    }
    chunk = {
        **base,
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": "tok "}, "finish_reason": None}],
    }
    usage_chunk = {**base, "object": "chat.completion.chunk", "choices": [], "usage": usage}
    return orjson.dumps(completion), orjson.dumps(chunk), orjson.dumps(usage_chunk)


def prefix_cache_tokens(urls: list[str]) -> tuple[float, float]:
    """(prefix-cache hit tokens, query tokens) summed over the engines' own vLLM-style metrics."""
    queries = hits = 0.0
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("vllm:prefix_cache_queries_total"):
                    queries += float(line.rsplit(" ", 1)[1])
                elif line.startswith("vllm:prefix_cache_hits_total"):
                    hits += float(line.rsplit(" ", 1)[1])
    return hits, queries


def publish(name: str, figures: object) -> None:
    """Print a benchmark's figures as JSON and keep them in results/NAME.json."""
    text = json.dumps(figures, indent=2)
    print(text)
    out = Path(__file__).resolve().parent.parent / "results" / f"{name}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(text)
