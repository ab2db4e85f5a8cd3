"""What the feed-forward autoscaler measures, tick by tick on a clock it is given: the arrival rate of a
Poisson stream (steady within its noise, at once after a step) and the mean request lengths (not inflated
while a backlog drains, not lost when a replica leaves or restarts)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.cluster import Supervisor
from corral.cluster.autoscale import Autoscaler, _Group
from corral.config import SupervisorSettings, parse_spec
from corral.engines import EngineLoad, LaunchPlan, SimEngineAdapter
from corral.routing import Replica, ReplicaSet, ReplicaState

SPEC = """
models:
  - name: alpha
    arch: llama-3.1-8b
    slo: {ttft_p95: 0.5}
    deployments:
      - engine: sim
        gpu: l4
        autoscale: {min_replicas: 1, max_replicas: 8, mode: feed_forward}
"""
TICK = 0.5


class Drive:
    """One autoscaled group measured at every tick of a clock the test moves."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 1000.0
        monkeypatch.setattr("corral.cluster.autoscale.time.monotonic", lambda: self.now)
        supervisor = Supervisor(ReplicaSet(), runtime=None, settings=SupervisorSettings())  # type: ignore[arg-type]
        self.scaler = Autoscaler(supervisor, lambda: {})
        self.state = _Group(parse_spec(SPEC, source="test").models[0], 0, SimEngineAdapter(), [LaunchPlan()])
        self.arrived = 0.0
        self.replicas = {"alpha-0": [0.0, 0.0], "alpha-1": [0.0, 0.0]}

    def tick(self, arrivals: int, prompt: float, generated: float) -> None:
        """One interval: `arrivals` new requests; the engines counted these tokens, split between them."""
        self.now += TICK
        self.arrived += arrivals
        for counts in self.replicas.values():
            counts[0] += prompt / len(self.replicas)
            counts[1] += generated / len(self.replicas)
        members = [
            Replica(
                id=name,
                model="alpha",
                engine="sim",
                capacity=4,
                state=ReplicaState.READY,
                load=EngineLoad(running=0, waiting=0, prompt_tokens_total=p, generated_tokens_total=g),
            )
            for name, (p, g) in self.replicas.items()
        ]
        self.scaler._measure(self.state, members, {"arrived": self.arrived})


def poisson(rate: float, ticks: int, seed: int) -> Iterator[int]:
    rng = random.Random(seed)
    for _ in range(ticks):
        count, t = 0, rng.expovariate(rate)
        while t < TICK:
            count, t = count + 1, t + rng.expovariate(rate)
        yield count


@pytest.mark.parametrize("rate", [3.0, 24.0])
def test_a_steady_poisson_stream_reads_as_its_rate(monkeypatch: pytest.MonkeyPatch, rate: float) -> None:
    drive = Drive(monkeypatch)
    readings = []
    for i, count in enumerate(poisson(rate, 600, seed=int(rate))):
        drive.tick(count, 50.0 * count, 64.0 * count)
        if i >= 100:
            readings.append(drive.state.rate)
    mean = sum(readings) / len(readings)
    # following every upward blip at once read 3 req/s as 6.0 and 24 as 31.5 (the same streams)
    assert abs(mean / rate - 1) < 0.2, mean


def test_a_step_in_load_is_followed_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    drive = Drive(monkeypatch)
    for count in poisson(3.0, 60, seed=1):
        drive.tick(count, 0.0, 0.0)
    for count in poisson(24.0, 4, seed=2):  # two seconds after the step
        drive.tick(count, 0.0, 0.0)
    assert drive.state.rate > 0.6 * 24  # the fleet is sized for most of it before a replica could start
    for count in poisson(24.0, 16, seed=3):
        drive.tick(count, 0.0, 0.0)
    assert drive.state.rate > 0.85 * 24


def test_lengths_hold_while_a_backlog_drains_and_as_replicas_change(monkeypatch: pytest.MonkeyPatch) -> None:
    drive = Drive(monkeypatch)
    for _ in range(120):  # a minute at 10 req/s of 50 prompt and 64 output tokens
        drive.tick(5, 250.0, 320.0)
    assert drive.state.lengths == pytest.approx((50.0, 64.0), rel=0.02)
    for _ in range(6):  # the load falls to 2 req/s; three seconds of the backlog's tokens still come in
        drive.tick(1, 50.0, 320.0)
    assert drive.state.lengths is not None and drive.state.lengths[1] < 1.5 * 64  # per tick it read as 320
    del drive.replicas["alpha-1"]  # drained: its counters leave with it
    drive.replicas["alpha-0"] = [0.0, 0.0]  # restarted: its counters begin again
    drive.replicas["alpha-2"] = [0.0, 0.0]
    for _ in range(200):
        drive.tick(5, 250.0, 320.0)
    assert drive.state.lengths == pytest.approx((50.0, 64.0), rel=0.05)


def test_scaling_down_drains_a_replica_that_serves_nothing_before_the_only_ready_one() -> None:
    """An unhealthy replica (a hung engine, its requests counted in flight until they time out) goes
    before an idle ready one: draining the ready one would leave none for a whole engine start."""
    supervisor = Supervisor(ReplicaSet(), runtime=None, settings=SupervisorSettings())  # type: ignore[arg-type]
    scaler = Autoscaler(supervisor, lambda: {})
    drained: list[str] = []
    scaler._drain = lambda replica, grace=None: drained.append(replica.id)  # type: ignore[method-assign]
    state = _Group(parse_spec(SPEC, source="test").models[0], 0, SimEngineAdapter(), [LaunchPlan()])
    ready = Replica(id="alpha-0", model="alpha", engine="sim", capacity=4, state=ReplicaState.READY)
    hung = Replica(id="alpha-1", model="alpha", engine="sim", capacity=4, state=ReplicaState.UNHEALTHY)
    hung.outstanding = 3
    starting = Replica(id="alpha-2", model="alpha", engine="sim", capacity=4, state=ReplicaState.STARTING)
    scaler._scale_down(state, [ready, hung], 1)
    scaler._scale_down(state, [ready, hung, starting], 2)
    assert drained == ["alpha-1", "alpha-2"]  # (a loading one first of all)


async def test_a_deployment_whose_replicas_keep_failing_is_replaced_ever_more_slowly(tmp_path: Path) -> None:
    """A replica the supervisor gave up on is replaced at once; while the replacements fail too (a missing
    binary, a dead GPU) the next waits 30 s, then twice that: not a new replica, log and event every few
    seconds for as long as the cluster runs."""
    from corral.cluster import LocalProcessRuntime

    settings = SupervisorSettings(max_start_failures=1, backoff_initial=0.1)
    supervisor = Supervisor(ReplicaSet(), LocalProcessRuntime(tmp_path / "logs"), settings)
    scaler = Autoscaler(supervisor, lambda: {})
    model = parse_spec(SPEC.replace("mode: feed_forward", "interval_s: 0.1"), source="test").models[0]
    broken = LaunchPlan(argv=("sh", "-c", "exit 3"))
    scaler.configure(model, 0, SimEngineAdapter(), [broken] * 8)
    await supervisor.start()
    running = asyncio.create_task(scaler.run())
    try:
        await asyncio.sleep(4)
        made = supervisor._next_index.get("alpha", 0)
        # the first, and one replacement at once; the next waits 30 s
        assert made == 2, (made, list(supervisor.replicas.events))
        events = [e["message"] for e in supervisor.replicas.events if e["model"] == "alpha"]
        assert any("replace alpha-1 in 30s" in m for m in events), events
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await supervisor.stop()


def test_only_the_latest_drained_replicas_logs_are_kept(tmp_path: Path) -> None:
    """Each scale-up makes a replica id, and a log, of its own: the logs of drained replicas past the last
    32 are deleted, rotated copies too; running replicas' logs are untouched."""
    supervisor = Supervisor(ReplicaSet(), runtime=None, settings=SupervisorSettings())  # type: ignore[arg-type]
    logs = [tmp_path / f"alpha-{i}.log" for i in range(40)]
    for log in logs:
        log.write_text("out")
        log.with_name(log.name + ".1").write_text("older")
    running = tmp_path / "alpha-1000.log"
    running.write_text("live")
    for log in logs:
        supervisor._forget_logs(log)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [running.name] + [n for log in logs[8:] for n in (log.name, log.name + ".1")]
    )


def test_the_replacement_backoff_ends_when_a_replacement_serves() -> None:
    """A dead GPU beside healthy replicas: the ready ones say nothing of it, so the wait before the next
    replacement goes on growing until a replacement itself becomes ready."""
    supervisor = Supervisor(ReplicaSet(), runtime=None, settings=SupervisorSettings())  # type: ignore[arg-type]
    scaler = Autoscaler(supervisor, lambda: {})
    scaler._drain = lambda replica, grace=None: None  # type: ignore[method-assign]
    state = _Group(parse_spec(SPEC, source="test").models[0], 0, SimEngineAdapter(), [LaunchPlan()])

    def replica(name: str, state: ReplicaState) -> Replica:
        return Replica(id=name, model="alpha", engine="sim", capacity=4, state=state)

    healthy = replica("alpha-0", ReplicaState.READY)
    members = [healthy, replica("alpha-1", ReplicaState.FAILED)]
    supervisor.members = lambda model, group=None: members  # type: ignore[method-assign]
    scaler._live(state)
    assert state.replace_wait == 30.0
    members = [healthy]  # the failed one drained; the healthy one serves on
    scaler._live(state)
    assert state.replace_wait == 30.0
    state.replacements.add("alpha-2")  # (as `_scale_up` notes a replacement it starts)
    members = [healthy, replica("alpha-2", ReplicaState.READY)]
    scaler._live(state)
    assert state.replace_wait == 0.0
    members = [healthy, replica("alpha-3", ReplicaState.FAILED)]
    scaler._live(state)
    assert state.replace_wait == 30.0
    members, state.failed_at = [healthy], state.failed_at - 3600  # an hour with no failure, no replacement
    scaler._live(state)
    assert state.replace_wait == 0.0
