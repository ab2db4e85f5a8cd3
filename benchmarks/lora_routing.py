"""LoRA routing: adapter-aware placement against round robin and least-load on a simulated fleet serving
many adapters of one base model, in adapter loads per 1,000 requests and TTFT p50/p99.

Set-up, all on this machine: `corral up` serving Llama-3.1-8B on `--replicas` (8) simulated vLLM replicas
(`engine: sim` on `--gpu`, L4 by default) with `lora: {max_loras: 4, max_cpu_loras: 8, max_lora_rank: 16}`:
4 adapters per batch, 8 held per replica (the gateway's slots), so 8 replicas hold 64 of the `--adapters`
(100). Each adapter is a copy of tests/data/lora/corral-marker with `r` set to 16 in its
adapter_config.json: the simulator prices an adapter from its config's rank and target modules (q_proj,
v_proj) on the base's dimensions (sim/lora.py: 13.6 MB, a 12 ms read from disk, a 2 ms copy into a GPU
slot), not from its tensors. Three configurations, each on a fresh cluster:
- `corral`: `lora.placement: affinity` (requests go to replicas holding their adapter, which spreads by
  demand), `routing: least_outstanding_requests` among the holders;
- `round_robin`: `lora.placement: anywhere`, `routing: round_robin`;
- `least_load`: `lora.placement: anywhere`, `routing: least_outstanding_requests`.

Load: streamed chat completions (aiohttp on uvloop), each for an adapter drawn Zipf (`--zipf` 1.0, seeded:
the busiest adapter takes 19% of the requests, the 8 busiest 52%), `--prompt-words` unique words in and
`--output` tokens out, Poisson arrivals at `--load` (0.65) of the saturation rate of the least-load fleet
(the lowest of the three: with 4 adapters per batch, a replica given every adapter runs part-full
batches). That rate comes from a closed-loop probe (`--probe-s`, `replicas × max_num_seqs × 1.5`
clients) on the first least-load cluster, or from `--rate`; all three run at it. `--warmup` requests fill
the adapter slots (the loads per 20 s are flat after the first 20 s), then `--requests` are measured:
- TTFT (the client's clock to the first content chunk, times the time scale: simulated seconds), and its
  p99 by the adapter's demand rank (the busiest, the next 7, ranks 9-64, the rest): where the tail is;
- adapter loads per 1,000 requests, counted twice: by the gateway (`corral_adapter_loads_total`, its
  calls of `/v1/load_lora_adapter`) and by the engines themselves (`sim:lora_loads_total`: reads from
  disk into host memory; `sim:lora_activations_total`: copies into a GPU slot; engines found through
  `/corral/status`). The engines' count is the one that costs time, and it can be the higher: vLLM's
  unload endpoint (as the simulator's) only forgets the name, its host cache of `max_cpu_loras` keeps
  evicting the least recently used by itself, so where the gateway takes an adapter past its slots, or
  gives up another than the engine's least recently used, the engine later reads one again unseen;
- the gateway's loads per 1,000 requests by the loaded adapter's demand rank (the same bands): which
  adapters are loaded again and again;
- loads per replica per simulated minute, the most distinct adapters one replica served in the window
  (from `x-corral-replica`), the most adapters one replica held at once, the mean adapters held in the
  fleet (distinct, and copies) and the mean holders of the 4 busiest (sampled each second from
  `/corral/status`), the busiest replica's share of the requests, and the machine's CPU over the window.

The gateway's placement clocks (`min_resident_s` 10 s, `spread_interval_s` 2 s) run on the wall clock and
the engines on the simulated one: `--time-scale` 1 (the default) keeps them in the proportion a deployment
has. To fit 8 replicas in what this machine can drive at real time, `--max-num-seqs` (16) bounds each
replica's batch: a fleet of 8 × 16 sequences.

The target (the issue's): at least 5× fewer loads than least-load, at an equal or lower TTFT p99. It is
judged on the engines' disk loads and on the gateway's loads. With `--rounds N` the three run N times,
interleaved (least-load, round robin, corral, then again), each figure is the median of its rounds with
every round's value beside it, and corral's comparison counts the rounds in which it met the target: one
round's p99 moves with the machine's neighbours, rounds show by how much.

Prints JSON (also written to results/lora_routing.json; with `--configs` naming fewer than the three, to
results/lora_routing-NAMES.json).

    .venv/bin/python benchmarks/lora_routing.py [--requests 1500] [--warmup 300] [--rounds 1] [--rate R]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psutil
import uvloop
from _harness import free_port, publish, spawn, stop, wait_http

ROOT = Path(__file__).resolve().parent.parent
MARKER = ROOT / "tests" / "data" / "lora" / "corral-marker"
CONFIGS = {  # name → (lora.placement, gateway.routing)
    "least_load": ("anywhere", "least_outstanding_requests"),
    "round_robin": ("anywhere", "round_robin"),
    "corral": ("affinity", "least_outstanding_requests"),
}
SPEC = """\
auth: {{open: true}}
gateway: {{routing: {routing}, read_timeout: 600}}
queue: {{timeout: 600, max_queued: 100000}}
supervisor: {{probe_interval: 0.5}}
models:
  - name: llama
    arch: llama-3.1-8b
    lora: {{max_loras: 4, max_cpu_loras: 8, max_lora_rank: 16, placement: {placement}}}
    adapters:
{adapters}
    deployments:
      - {{engine: sim, replicas: {replicas}, gpu: {gpu}, time_scale: {time_scale}, max_num_seqs: {seqs}}}
"""
HEADERS = {"Content-Type": "application/json"}


def make_adapters(folder: Path, count: int, rank: int) -> list[tuple[str, Path]]:
    """`count` PEFT folders copied from the test adapter, each with `r` = `rank` (what the simulator
    prices): (model id, folder), busiest first."""
    config = json.loads((MARKER / "adapter_config.json").read_text())
    made = []
    for i in range(count):
        path = folder / f"a{i:03d}"
        path.mkdir(parents=True)
        shutil.copy(MARKER / "adapter_model.safetensors", path)
        (path / "adapter_config.json").write_text(json.dumps({**config, "r": rank}))
        made.append((path.name, path))
    return made


def spec_text(config: str, adapters: list[tuple[str, Path]], args: argparse.Namespace) -> str:
    placement, routing = CONFIGS[config]
    listed = "\n".join(f"      - {{name: {name}, source: {{path: {path}}}}}" for name, path in adapters)
    return SPEC.format(
        routing=routing,
        placement=placement,
        adapters=listed,
        replicas=args.replicas,
        gpu=args.gpu,
        time_scale=args.time_scale,
        seqs=args.max_num_seqs,
    )


class Workload:
    """Chat requests whose adapter is drawn Zipf over the adapters (rank k: weight 1/k^s), seeded."""

    def __init__(self, names: list[str], s: float, prompt_words: int, output: int, seed: int) -> None:
        self._rng = random.Random(seed)
        self._names = names
        self._weights = [1.0 / (k + 1) ** s for k in range(len(names))]
        self._prompt_words = prompt_words
        self._output = output
        self._n = 0

    def next(self) -> tuple[str, bytes]:
        name = self._rng.choices(self._names, self._weights)[0]
        self._n += 1
        words = " ".join(f"w{self._rng.randrange(10**6)}" for _ in range(self._prompt_words))
        body = {
            "model": name,
            "max_tokens": self._output,
            "stream": True,
            "messages": [{"role": "user", "content": f"Request {self._n}: {words}"}],
        }
        return name, orjson.dumps(body)


@dataclass
class Served:
    """What the client saw of one request."""

    adapter: str
    ttft: float | None  # wall-clock seconds; None: it failed
    replica: str = ""


@dataclass
class Sampled:
    """What the replicas held, sampled each second from the gateway's view: the most adapters each held
    at once, and per sample the distinct adapters held in the fleet, the copies (replicas × adapters),
    and how many replicas held each adapter."""

    held: dict[str, int] = field(default_factory=dict)
    distinct: list[int] = field(default_factory=list)
    copies: list[int] = field(default_factory=list)
    holders: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))  # the 4 busiest

    def add(self, replicas: list[dict[str, Any]]) -> None:
        count: Counter[str] = Counter()
        for replica in replicas:
            adapters = replica.get("adapters") or []
            self.held[replica["id"]] = max(self.held.get(replica["id"], 0), len(adapters))
            count.update(adapters)
        self.distinct.append(len(count))
        self.copies.append(sum(count.values()))
        for name in ("a000", "a001", "a002", "a003"):
            self.holders[name].append(count[name])

    def summary(self) -> dict[str, Any]:
        mean = statistics.fmean
        return {
            "adapters_held_in_fleet_mean": round(mean(self.distinct), 1),
            "adapter_copies_in_fleet_mean": round(mean(self.copies), 1),
            "holders_of_busiest_4_mean": {name: round(mean(h), 1) for name, h in self.holders.items()},
        }


async def one_request(session: aiohttp.ClientSession, url: str, adapter: str, body: bytes) -> Served:
    started = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=HEADERS) as response:
            if response.status != 200:
                print(f"{adapter}: {response.status} {await response.text()}", file=sys.stderr)
                return Served(adapter, None)
            replica = response.headers.get("x-corral-replica", "")
            ttft = None
            async for line in response.content:
                if ttft is None and line.startswith(b"data: {") and b'"content":"' in line:
                    if b'"content":""' not in line:
                        ttft = time.perf_counter() - started
            return Served(adapter, ttft if ttft is not None else time.perf_counter() - started, replica)
    except (aiohttp.ClientError, TimeoutError) as exc:
        print(f"{adapter}: {exc!r}", file=sys.stderr)
        return Served(adapter, None)


async def open_loop(url: str, work: Workload, rate: float, count: int) -> tuple[list[Served], float]:
    """`count` requests as a Poisson process of `rate` per wall-clock second: what each saw, and the
    seconds from the first arrival to the last answer."""
    rng = random.Random(11)
    tasks = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=900)
    ) as session:
        started = next_at = time.perf_counter()
        for _ in range(count):
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            tasks.append(asyncio.create_task(one_request(session, url, *work.next())))
            next_at += rng.expovariate(rate)
        served = await asyncio.gather(*tasks)
    return list(served), time.perf_counter() - started


async def saturation(url: str, work: Workload, clients: int, seconds: float) -> float:
    """Requests answered per wall-clock second by `clients` clients in a closed loop."""
    done = 0
    stop_at = time.perf_counter() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def client() -> None:
            nonlocal done
            while time.perf_counter() < stop_at:
                if (await one_request(session, url, *work.next())).ttft is not None:
                    done += 1

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        return done / (time.perf_counter() - started)


async def sample_holdings(status_url: str, into: Sampled, until: asyncio.Event) -> None:
    async with aiohttp.ClientSession() as session:
        while not until.is_set():
            async with session.get(status_url) as response:
                into.add((await response.json())["replicas"])
            try:
                await asyncio.wait_for(until.wait(), 1.0)
            except TimeoutError:
                pass


async def measured(base: str, work: Workload, rate: float, count: int) -> tuple[list[Served], float, Sampled]:
    sampled, finished = Sampled(), asyncio.Event()
    sampler = asyncio.create_task(sample_holdings(base + "/corral/status", sampled, finished))
    try:
        served, elapsed = await open_loop(base + "/v1/chat/completions", work, rate, count)
    finally:
        finished.set()
        await sampler
    return served, elapsed, sampled


def metric_sum(url: str, name: str) -> float:
    """A counter's value summed over its series, from a Prometheus text page."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def loads_by_adapter(base: str) -> Counter[str]:
    """The gateway's adapter loads so far, by adapter (`corral_adapter_loads_total`'s `adapter` label)."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as response:
        text = response.read().decode()
    loads: Counter[str] = Counter()
    for line in text.splitlines():
        found = re.match(r'corral_adapter_loads_total\{.*adapter="([^"]+)".*\} (\S+)$', line)
        if found:
            loads[found[1]] += round(float(found[2]))
    return loads


def counters(base: str, engines: list[str]) -> dict[str, float]:
    return {
        "gateway_loads": metric_sum(base, "corral_adapter_loads_total"),
        "gateway_unloads": metric_sum(base, "corral_adapter_unloads_total"),
        "engine_disk_loads": sum(metric_sum(url, "sim:lora_loads_total") for url in engines),
        "engine_slot_copies": sum(metric_sum(url, "sim:lora_activations_total") for url in engines),
    }


def status(base: str) -> dict[str, Any]:
    with urllib.request.urlopen(base + "/corral/status", timeout=10) as response:
        return dict(json.load(response))


def wait_ready(base: str, proc: Any, replicas: int, within: float = 180) -> list[str]:
    """Until every replica is ready: their engines' URLs."""
    wait_http(base + "/ready", timeout=within)
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("corral up exited")
        found = [r for r in status(base)["replicas"] if r["state"] == "ready"]
        if len(found) == replicas:
            return [str(r["url"]) for r in found]
        time.sleep(0.5)
    raise RuntimeError(f"{replicas} replicas were not ready in {within:.0f} s")


def percentile(values: list[float], q: float) -> float:
    return values[round(q * (len(values) - 1))]


def figures(
    config: str, served: list[Served], elapsed: float, sampled: Sampled, delta: dict[str, float], args: Any
) -> dict[str, Any]:
    ok = sorted(s.ttft * args.time_scale for s in served if s.ttft is not None)
    n = len(served)
    sim_minutes = elapsed * args.time_scale / 60
    by_replica: dict[str, set[str]] = defaultdict(set)
    for s in served:
        if s.replica:
            by_replica[s.replica].add(s.adapter)
    shares = Counter(s.replica for s in served if s.replica)
    placement, routing = CONFIGS[config]
    return {
        "config": config,
        "placement": placement,
        "routing": routing,
        "requests": n,
        "failed": n - len(ok),
        "ttft_p50_ms": round(1000 * statistics.median(ok), 1),
        "ttft_p90_ms": round(1000 * percentile(ok, 0.9), 1),
        "ttft_p99_ms": round(1000 * percentile(ok, 0.99), 1),
        "engine_disk_loads_per_1000": round(1000 * delta["engine_disk_loads"] / n, 1),
        "gateway_loads_per_1000": round(1000 * delta["gateway_loads"] / n, 1),
        "engine_slot_copies_per_1000": round(1000 * delta["engine_slot_copies"] / n, 1),
        "gateway_unloads_per_1000": round(1000 * delta["gateway_unloads"] / n, 1),
        "engine_disk_loads_per_replica_per_sim_minute": round(
            delta["engine_disk_loads"] / args.replicas / sim_minutes, 2
        ),
        "gateway_loads_per_replica_per_sim_minute": round(
            delta["gateway_loads"] / args.replicas / sim_minutes, 2
        ),
        "max_distinct_adapters_served_by_one_replica": max((len(a) for a in by_replica.values()), default=0),
        "max_adapters_held_by_one_replica": max(sampled.held.values(), default=0),
        **sampled.summary(),
        "busiest_replica_share": round(max(shares.values(), default=0) / n, 3),
        "ttft_p99_ms_by_demand_rank": by_rank(served, args),
        "window_sim_s": round(elapsed * args.time_scale, 1),
    }


BANDS = ((0, 1), (1, 8), (8, 64), (64, None))  # adapters by demand rank: the busiest, the next 7, ...


def by_rank(served: list[Served], args: Any) -> dict[str, float | None]:
    """TTFT p99 (simulated ms) of the requests for adapters in each band of demand rank (a000 busiest):
    where the tail comes from."""
    out: dict[str, float | None] = {}
    for low, high in BANDS:
        upper = args.adapters if high is None else high
        ttfts = sorted(
            s.ttft * args.time_scale
            for s in served
            if s.ttft is not None and low <= int(s.adapter[1:]) < upper
        )
        out[f"rank_{low + 1}_{upper}"] = round(1000 * percentile(ttfts, 0.99), 1) if ttfts else None
    return out


def loads_by_rank(loaded: Counter[str], requests: int, args: Any) -> dict[str, float]:
    """The gateway's loads per 1,000 requests (of all adapters) of the adapters in each band of demand
    rank: where the loads come from."""
    out = {}
    for low, high in BANDS:
        upper = args.adapters if high is None else high
        count = sum(n for name, n in loaded.items() if low <= int(name[1:]) < upper)
        out[f"rank_{low + 1}_{upper}"] = round(1000 * count / requests, 1)
    return out


def run_config(
    config: str, adapters: list[tuple[str, Path]], args: argparse.Namespace, rate: float | None, round_: int
) -> tuple[dict[str, Any], float]:
    """One configuration on a fresh cluster: its figures, and the rate (simulated requests/s) it ran at."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    names = [name for name, _ in adapters]
    with tempfile.TemporaryDirectory() as home:
        spec = Path(home) / "spec.yaml"
        spec.write_text(spec_text(config, adapters, args))
        up = [sys.executable, "-m", "corral.cli", "up", "-f", str(spec), "--port", str(port)]
        cluster = spawn([*up, "--log-level", "warning"], env={"CORRAL_HOME": home})
        try:
            engines = wait_ready(base, cluster, args.replicas)
            seed = 1000 * round_
            probe: dict[str, Any] = {}
            if rate is None:
                clients = round(args.replicas * args.max_num_seqs * 1.5)
                work = Workload(names, args.zipf, args.prompt_words, args.output, seed + 1)
                wall = asyncio.run(saturation(base + "/v1/chat/completions", work, clients, args.probe_s))
                probe = {
                    "saturation_requests_per_s": round(wall / args.time_scale, 2),
                    "probe_clients": clients,
                }
                rate = args.load * wall / args.time_scale
            warm = Workload(names, args.zipf, args.prompt_words, args.output, seed + 2)
            asyncio.run(measured(base, warm, rate * args.time_scale, args.warmup))
            before, loaded_before = counters(base, engines), loads_by_adapter(base)
            work = Workload(names, args.zipf, args.prompt_words, args.output, seed + 3)
            psutil.cpu_percent()
            served, elapsed, sampled = asyncio.run(
                measured(base, work, rate * args.time_scale, args.requests)
            )
            cpu = psutil.cpu_percent()
            after, loaded = counters(base, engines), loads_by_adapter(base) - loaded_before
        finally:
            stop(cluster)
    delta = {key: after[key] - before[key] for key in after}
    result = figures(config, served, elapsed, sampled, delta, args)
    result["gateway_loads_per_1000_by_demand_rank"] = loads_by_rank(loaded, len(served), args)
    result.update(probe)
    result["offered_requests_per_s"] = round(rate, 2)
    result["achieved_requests_per_s"] = round(len(served) / elapsed / args.time_scale, 2)
    result["machine_cpu_percent"] = cpu
    return result, rate


def median_of(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's figures: each the median of its rounds, with every round's value beside it."""
    if len(rounds) == 1:
        return rounds[0]
    merged: dict[str, Any] = {}
    for key, value in rounds[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            values = [r[key] for r in rounds if key in r]
            merged[key] = round(statistics.median(values), 3)
            merged[key + "_rounds"] = values
        else:
            merged[key] = value
    return merged


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if b else None


def comparison(runs: dict[str, list[dict[str, Any]]], by: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """corral against each baseline: load and p99 ratios (of medians), and the rounds meeting the target."""
    corral = by["corral"]
    out: dict[str, Any] = {}
    for peer in ("least_load", "round_robin"):
        other = by[peer]
        pairs = list(zip(runs["corral"], runs[peer], strict=True))
        out[f"{peer}_vs_corral"] = {
            "engine_disk_loads_ratio": _ratio(
                other["engine_disk_loads_per_1000"], corral["engine_disk_loads_per_1000"]
            ),
            "gateway_loads_ratio": _ratio(other["gateway_loads_per_1000"], corral["gateway_loads_per_1000"]),
            "ttft_p50_ratio": _ratio(other["ttft_p50_ms"], corral["ttft_p50_ms"]),
            "ttft_p99_ratio": _ratio(other["ttft_p99_ms"], corral["ttft_p99_ms"]),
            "rounds_corral_p99_lower_or_equal": sum(c["ttft_p99_ms"] <= p["ttft_p99_ms"] for c, p in pairs),
        }
    least = by["least_load"]
    p99_ok = corral["ttft_p99_ms"] <= least["ttft_p99_ms"]
    fewer = {
        source: corral[f"{source}_per_1000"] * 5 <= least[f"{source}_per_1000"]
        for source in ("engine_disk_loads", "gateway_loads")
    }
    pairs = list(zip(runs["corral"], runs["least_load"], strict=True))
    out["target"] = {
        "wanted": "least_load's loads >= 5x corral's, corral's TTFT p99 <= least_load's",
        "five_times_fewer_engine_disk_loads": fewer["engine_disk_loads"],
        "five_times_fewer_gateway_loads": fewer["gateway_loads"],
        "p99_equal_or_better": p99_ok,
        "met": p99_ok and all(fewer.values()),
        "rounds_met": sum(
            c["ttft_p99_ms"] <= p["ttft_p99_ms"]
            and 5 * c["engine_disk_loads_per_1000"] <= p["engine_disk_loads_per_1000"]
            and 5 * c["gateway_loads_per_1000"] <= p["gateway_loads_per_1000"]
            for c, p in pairs
        ),
        "note": "ratios are baseline / corral: above 1, corral loads less or has the lower TTFT",
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=100)
    parser.add_argument("--rank", type=int, default=16, help="each adapter's r (adapter_config.json)")
    parser.add_argument("--gpu", default="l4")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="sequences per replica's batch")
    parser.add_argument("--time-scale", type=float, default=1.0, help="simulated seconds per second")
    parser.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of adapter demand")
    parser.add_argument("--prompt-words", type=int, default=100)
    parser.add_argument("--output", type=int, default=32, help="output tokens per request")
    parser.add_argument("--requests", type=int, default=1500, help="measured requests per configuration")
    parser.add_argument("--warmup", type=int, default=300, help="requests before the measured ones")
    parser.add_argument("--load", type=float, default=0.65, help="share of the saturation rate offered")
    parser.add_argument("--rate", type=float, help="offered requests per simulated second (no probe)")
    parser.add_argument("--probe-s", type=float, default=20.0, help="wall-clock seconds of the probe")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds of the three (medians)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    args = parser.parse_args()

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    configs = [c for c in CONFIGS if c in args.configs.split(",")]
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    rate = args.rate
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as folder:
        adapters = make_adapters(Path(folder), args.adapters, args.rank)
        for round_ in range(args.rounds):  # interleaved: a slow minute of the machine hits all alike
            for config in configs:
                result, rate = run_config(config, adapters, args, rate, round_)
                runs[config].append(result)
                print(json.dumps({"round": round_ + 1, **result}), file=sys.stderr, flush=True)
    by = {c: median_of(runs[c]) for c in configs}
    report: dict[str, Any] = {
        "benchmark": "lora_routing",
        "setup": {
            "machine": f"{psutil.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB",
            "replicas": args.replicas,
            "arch": "llama-3.1-8b",
            "gpu": args.gpu,
            "max_num_seqs": args.max_num_seqs,
            "lora": {"max_loras": 4, "max_cpu_loras": 8, "max_lora_rank": 16},
            "adapters": args.adapters,
            "adapter_rank": args.rank,
            "zipf_s": args.zipf,
            "prompt_words": args.prompt_words,
            "output_tokens": args.output,
            "time_scale": args.time_scale,
            "load": args.load if args.rate is None else None,
            "offered_requests_per_s": round(rate or 0.0, 2),
            "warmup_requests": args.warmup,
            "measured_requests": args.requests,
            "rounds": args.rounds,
            "wall_s": round(time.monotonic() - started),
        },
        "configs": list(by.values()),
    }
    if {"corral", "least_load", "round_robin"} <= set(by):
        report.update(comparison(runs, by))
    # a run of some of the three keeps its own file: results/lora_routing.json is the comparison's
    publish("lora_routing" if len(configs) == len(CONFIGS) else "lora_routing-" + "-".join(configs), report)


if __name__ == "__main__":
    main()
