"""Routing replay: benchmarks/routing_quality.py's workload and fleet in virtual time, for developing
policies.

The engines are the ones `corral sim` runs (the planner's scheduler and step-time model: chunked prefill,
vLLM's prefix cache by block hashes, KV capacity of the GPU), stepped by an event queue instead of the wall
clock; the routing is corral's own `Router` with the chosen policy, told when each request's first token
comes and when it ends, as the gateway is. No HTTP, no processes, no CPU noise: a run is exact and takes
seconds, so a policy change can be compared on several workloads and seeds before the real benchmark
(which stays the figure of record, beside the peer routers) is run.

For each policy: saturation requests/s from `--clients` closed-loop clients over `--duration` simulated
seconds, then, on the same (warm) fleet, TTFT p50/p90/p99 under Poisson arrivals at `--rate` (default: 80%
of round robin's saturation rate on the first workload, when round robin is run first), and the fleet's
prefix-cache hit rate.
`--gateway-ms` adds the gateway's own latency (simulated milliseconds) before a request reaches its
engine. `--workers N` routes each request through one of N gateway workers (each its own router and
in-flight counts; their prefix indexes share placements as `corral up`'s do, or not with `--unshared`);
`--kv-events` has the engines publish their KV-cache events and the routers follow them. Prints JSON.

    .venv/bin/python benchmarks/routing_replay.py [--distribution zipf] [--tenants 1] [--gpu h100-sxm] \\
        [--seeds 3]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import statistics
from dataclasses import dataclass
from typing import Any

import orjson
from routing_quality import Workload

from corral.config import LimitsSettings
from corral.engines import EngineLoad
from corral.engines.kv_events import KvCacheView
from corral.gateway.intake import prompt_text
from corral.perf.calibration import calibrated_efficiency
from corral.perf.catalog import load_catalog
from corral.perf.replica import ReplicaLayout, ReplicaModel, replica_model
from corral.perf.scheduler import EngineSequence, Scheduler, block_hashes
from corral.perf.steps import StepPipeline
from corral.protocol import ChatCompletionRequest, parse_body
from corral.routing import POLICIES, PrefixAffinity, Replica, ReplicaSet, ReplicaState, Router, RouteRequest
from corral.sim.kv_events import take_events
from corral.sim.text import chat_prompt, tokenize

TOKENS_PER_BYTE = LimitsSettings().tokens_per_char  # the gateway's prompt-token estimate per body byte


class _Engine:
    """One simulated replica: the scheduler and its step pipeline, as `corral sim`'s engine runs them, and
    its KV-cache events as the supervisor follows them (with `--kv-events`)."""

    def __init__(self, rid: str, model: ReplicaModel, kv_events: bool) -> None:
        self.id = rid
        self.block_size = model.config.block_size
        self.scheduler = Scheduler(model.config)
        self.pipeline = StepPipeline(model.perf)
        self.kv = KvCacheView() if kv_events else None
        if kv_events:
            self.scheduler.record_kv_events()


@dataclass(slots=True)
class _Request:
    route: RouteRequest
    router: Router
    replica: Replica
    sent: float
    closed_loop: bool
    ttft: float = 0.0


class Replay:
    """A fleet of simulated engines behind corral's router, in virtual time."""

    def __init__(self, args: argparse.Namespace, policy: str, seed: int) -> None:
        model = replica_model(ReplicaLayout(args.model, args.gpu), load_catalog(), calibrated_efficiency())
        self.engines = {f"r{i}": _Engine(f"r{i}", model, args.kv_events) for i in range(args.replicas)}
        kv_tokens = model.config.num_blocks * model.config.block_size  # as its /metrics says
        # each gateway worker: its own router and mirror of the replicas (own in-flight counts and index)
        self.routers: list[Router] = []
        for _ in range(args.workers):
            replicas = ReplicaSet(["llama"])
            for rid in self.engines:
                load = EngineLoad(running=0, waiting=0, kv_capacity_tokens=kv_tokens)
                ready = ReplicaState.READY
                replicas.add(Replica(id=rid, model="llama", engine="sim", state=ready, load=load))
            router = Router(replicas, default_policy=policy)
            chosen = router.policy_for("llama")
            if isinstance(chosen, PrefixAffinity):
                chosen.clock = lambda: self.now  # requests end in virtual time, as the events are stamped
                if args.decode_weight is not None:
                    chosen.decode_weight = args.decode_weight
            self.routers.append(router)
        if args.workers > 1 and not args.unshared:  # as `corral up`'s workers tell each other
            for router in self.routers:
                others = [r for r in self.routers if r is not router]
                router.share_placements(lambda line, others=others: _tell(others, line))
        self._spread = random.Random(seed)  # which worker a request reaches
        self.work = Workload(args.tenants, args.doc_words, args.distribution, seed=seed)
        self.output, self.delay = args.output, args.gateway_ms / 1000
        self.now = 0.0
        self._events: list[tuple[float, int, str, Any]] = []
        self._order = itertools.count()
        self._requests: dict[int, _Request] = {}
        self._ids = itertools.count()
        self.finished: list[_Request] = []
        self._stop_at = 0.0

    def saturation(self, clients: int, duration: float) -> float:
        """Requests/s with `clients` closed-loop clients for `duration` seconds (then drained)."""
        start, self._stop_at, self.finished = self.now, self.now + duration, []
        for _ in range(clients):
            self._send(closed_loop=True)
        self._run()
        return len(self.finished) / (self.now - start)

    def open_loop(self, rate: float, duration: float, seed: int) -> list[float]:
        """Seconds to the first token of each request of Poisson arrivals at `rate` for `duration`."""
        rng, at, self.finished = random.Random(seed), self.now, []
        while at - self.now < duration:
            self._push(at, "send", None)
            at += rng.expovariate(rate)
        self._run()
        return sorted(r.ttft for r in self.finished)

    def hit_rate(self) -> float:
        queries = sum(e.scheduler.prefix_queries for e in self.engines.values())
        return sum(e.scheduler.prefix_hits for e in self.engines.values()) / max(1, queries)

    def _push(self, at: float, kind: str, what: Any) -> None:
        heapq.heappush(self._events, (at, next(self._order), kind, what))

    def _send(self, closed_loop: bool) -> None:
        body = self.work.next_body("llama", self.output)
        raw = orjson.dumps(body)  # what routing_quality.py sends
        estimate = int(len(raw) * TOKENS_PER_BYTE)
        route = RouteRequest(
            "llama", tokens=estimate + self.output, session=body["user"], prompt_tokens=estimate
        )
        route.prompt = prompt_text(parse_body(ChatCompletionRequest, raw))
        router = self._spread.choice(self.routers)
        replica = router.acquire(route)
        engine = self.engines[replica.id]
        prompt = tokenize(chat_prompt(body["messages"]))
        seq = EngineSequence(
            id=next(self._ids),
            prompt_len=len(prompt),
            max_tokens=self.output,
            arrival=self.now + self.delay,
            hashes=block_hashes(prompt, engine.block_size),
            tokens=prompt if engine.kv is not None else (),
        )
        self._requests[seq.id] = _Request(route, router, replica, self.now, closed_loop)
        self._push(self.now + self.delay, "arrive", (engine, seq))

    def _run(self) -> None:
        while self._events:
            self.now, _, kind, what = heapq.heappop(self._events)
            if kind == "send":
                self._send(closed_loop=False)
                continue
            if kind == "arrive":
                engine, seq = what
                engine.scheduler.add(seq)
            else:
                engine = what
                finished_at, batch = engine.pipeline.pop()
                for seq in engine.scheduler.complete(batch, finished_at):
                    self._token(seq)
            while engine.pipeline.has_room and (batch := engine.scheduler.schedule()) is not None:
                self._push(engine.pipeline.launch(batch, self.now), "step", engine)
            if engine.kv is not None:
                self._publish(engine, engine.kv)

    def _publish(self, engine: _Engine, view: KvCacheView) -> None:
        """The engine's cache changes, published and followed at once (the supervisor's view, stamped on
        every worker's replica)."""
        events = take_events(engine.scheduler)
        if events:
            view.apply_events(events, self.now)
            for router in self.routers:
                replica = next(r for r in router.replicas.of("llama") if r.id == engine.id)
                replica.load = view.stamp(replica.load or EngineLoad(running=0, waiting=0))

    def _token(self, seq: EngineSequence) -> None:
        request = self._requests[seq.id]
        if seq.generated == 1:
            request.ttft = self.now - request.sent
            request.router.prefilled(request.replica, request.route)
        if seq.finished:
            usage = {"prompt_tokens": seq.prompt_len, "completion_tokens": seq.generated}
            request.router.release(request.replica, request.route, ok=True, usage=usage)
            del self._requests[seq.id]
            self.finished.append(request)
            if request.closed_loop and self.now < self._stop_at:
                self._send(closed_loop=True)


def _tell(routers: list[Router], line: bytes) -> None:
    message = orjson.loads(line)
    for router in routers:
        router.learn_placements(message)


def _percentile(values: list[float], share: float) -> float:
    return values[int(share * (len(values) - 1))]


def measure(policy: str, args: argparse.Namespace, rate: float | None) -> tuple[dict[str, Any], float | None]:
    """The policy's figures, averaged over `--seeds` workloads (each on a fresh fleet), and the offered
    rate; with no rate given, `--load` × this policy's saturation rate on the first workload."""
    runs = []
    for seed in range(7, 7 + args.seeds):
        replay = Replay(args, policy, seed)
        run: dict[str, float] = {"saturation_requests_per_s": replay.saturation(args.clients, args.duration)}
        if rate is None:
            rate = args.load * run["saturation_requests_per_s"]
        if rate:
            ttfts = replay.open_loop(rate, args.duration, seed + 4)
            run |= {f"ttft_p{p}_ms": 1000 * _percentile(ttfts, p / 100) for p in (50, 90, 99)}
        run["prefix_cache_hit_rate"] = replay.hit_rate()
        runs.append(run)
    result: dict[str, Any] = {"policy": policy}
    for key in runs[0]:
        values = [run[key] for run in runs]
        result[key] = round(statistics.mean(values), 4 if key.endswith("rate") else 2)
        if len(values) > 1:
            result[key + "_range"] = [round(min(values), 2), round(max(values), 2)]
    if rate:
        result["offered_requests_per_s"] = round(rate, 3)
    return result, rate


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--gpu", default="l4")
    parser.add_argument("--tenants", type=int, default=48)
    parser.add_argument("--distribution", default="uniform", choices=["uniform", "zipf"])
    parser.add_argument("--doc-words", type=int, default=3000, help="shared document length (tokens)")
    parser.add_argument("--output", type=int, default=32, help="output tokens per request")
    parser.add_argument("--duration", type=float, default=80.0, help="simulated seconds per phase")
    parser.add_argument("--clients", type=int, default=48, help="closed-loop clients for saturation")
    parser.add_argument("--load", type=float, default=0.8, help="share of round robin's saturation rate")
    parser.add_argument("--rate", type=float, help="offered requests/s, instead of --load × round robin's")
    parser.add_argument("--gateway-ms", type=float, default=0.0, help="the gateway's own latency")
    parser.add_argument("--decode-weight", type=float, help="prefix_affinity's decode_weight")
    parser.add_argument("--seeds", type=int, default=1, help="workloads per policy (figures averaged)")
    parser.add_argument("--workers", type=int, default=1, help="gateway workers, each with its own router")
    parser.add_argument(
        "--unshared", action="store_true", help="workers do not share placements (each its own requests)"
    )
    parser.add_argument(
        "--kv-events", action="store_true", help="engines publish KV-cache events that routing follows"
    )
    parser.add_argument("--policies", default="round_robin,prefix_affinity", help=", ".join(POLICIES))
    args = parser.parse_args()

    policies = args.policies.split(",")
    rate = args.rate
    if rate is None and policies[0] != "round_robin":
        rate = 0.0  # no rate to offer: saturation only
    results = []
    for policy in policies:  # round robin, when first and no --rate, sets the rate for everyone
        result, rate = measure(policy, args, rate)
        results.append(result)
    print(json.dumps({"benchmark": "routing_replay", **vars(args), "policies": results}, indent=2))


if __name__ == "__main__":
    main()
