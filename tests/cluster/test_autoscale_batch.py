"""The autoscaler sizes for interactive demand only, with a real batch runner beside it over a real store
(SQLite) and the replica set the supervisor publishes: a batch filling its share of the slots (and the KV
cache) asks for no replica, while interactive requests on top still do; a batch for a model scaled to zero
wakes one replica, and only one, and runs on it to the end."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from datetime import timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest

from corral.admission import Principal
from corral.batch import BatchRunner, BatchStore, NewBatch
from corral.cluster import Supervisor
from corral.cluster.autoscale import Autoscaler, Pressure
from corral.config import BatchSettings, ModelSpec, SupervisorSettings, parse_spec
from corral.engines import EngineLoad, LaunchPlan, SimEngineAdapter
from corral.routing import ReplicaSet, ReplicaState
from corral.store import KeyStore, open_database

SPEC = """
models:
  - name: m
    arch: llama-3.1-8b
    deployments:
      - engine: sim
        gpu: l4
        max_num_seqs: 8
        autoscale: {{min_replicas: {low}, max_replicas: 10, interval_s: 0.05, down_cooldown_s: 60}}
"""
PLAN = LaunchPlan(capacity=8)


class NoRuntime:
    """A runtime that starts nothing: the test says when a replica is ready, as its engine would."""

    assigns_gpus = False

    async def start(self, replica_id: str, plan: LaunchPlan) -> object:
        raise AssertionError("the supervisor was not started: no replica is launched")


class Lines:
    """Runs a batch line as the gateway's router counts it: a slot of the model's ready replica in flight
    until `finish` is set."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas
        self.finish = asyncio.Event()
        self.answered = 0

    async def run_line(
        self, principal: Principal, path: str, body: bytes, request_id: str | None = None
    ) -> tuple[int, bytes]:
        replica = self.replicas.ready("m")[0]
        replica.outstanding += 1
        try:
            await self.finish.wait()
        finally:
            replica.outstanding -= 1
        self.answered += 1
        return 200, orjson.dumps({"object": "chat.completion", "choices": []})


def model(low: int) -> ModelSpec:
    return parse_spec(SPEC.format(low=low), source="test").models[0]


def scaler_and_runner(tmp_path: Path) -> tuple[Autoscaler, BatchRunner, Supervisor, BatchStore, Lines]:
    """An autoscaler and a batch runner over one replica set; the autoscaler reads the runner's figures
    beside the gateway's queue (empty here), as its pressure."""
    supervisor = Supervisor(ReplicaSet(), NoRuntime(), SupervisorSettings(probe_interval=0.1))  # type: ignore[arg-type]
    database = open_database(f"sqlite:///{tmp_path / 'batch.db'}")
    store = BatchStore(database)
    lines = Lines(supervisor.replicas)
    nothing_queued: dict[str, int] = {}
    runner = BatchRunner(
        store,
        lines,
        KeyStore(database),
        supervisor.replicas,
        lambda: nothing_queued,
        BatchSettings(poll_s=0.02),
    )
    return Autoscaler(supervisor, beside({}, runner.pressure)), runner, supervisor, store, lines


def beside(queues: dict[str, dict[str, float]], batch: Pressure) -> Pressure:
    """The gateway's queue figures and the batch runner's, per model, in one pressure."""

    def pressure() -> dict[str, dict[str, float]]:
        runner = batch()
        return {m: {**queues.get(m, {}), **runner.get(m, {})} for m in queues.keys() | runner.keys()}

    return pressure


def start_batch(store: BatchStore, lines: int) -> str:
    batch = store.create_batch(NewBatch("acme", None, "/v1/chat/completions", "file-x", timedelta(hours=1)))
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert store.start(batch.id, "m", [(f"c{i}", body) for i in range(lines)])
    return batch.id


async def until(condition: Callable[[], bool], what: str, within: float = 10) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running(*loops: Callable[[], Coroutine[Any, Any, None]]) -> AsyncIterator[None]:
    tasks = [asyncio.create_task(loop()) for loop in loops]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_batch_filling_its_share_asks_for_no_replica_but_interactive_load_still_does(
    tmp_path: Path,
) -> None:
    """Before, the runner's lines counted as busy slots: 6 of 8 (its 0.8 share, less the headroom) is over
    the 0.7 target, so each interval added a replica whose slots the runner filled again, to max_replicas."""
    scaler, runner, supervisor, store, lines = scaler_and_runner(tmp_path)
    spec = model(low=1)
    scaler.configure(spec, 0, SimEngineAdapter(), [PLAN] * 10)
    (replica,) = supervisor.add("m", SimEngineAdapter(), [PLAN])
    replica.state = ReplicaState.READY
    start_batch(store, 40)
    async with running(runner.run):
        await until(lambda: replica.outstanding == 6, "the batch filled its share of the slots")
        replica.load = EngineLoad(running=6, waiting=0, kv_usage=0.95)  # its lines' KV cache, read now
        state = scaler._groups[("m", 0)]
        members = supervisor.members("m", 0)
        assert await scaler.desired(state, members, scaler._pressure()["m"]) == 1
        assert state.reason == "batch lines run"  # (the replica min_replicas keeps anyway)

        replica.outstanding += 6  # interactive requests on top: 6 of them want 6 / 0.7 slots
        assert await scaler.desired(state, members, scaler._pressure()["m"]) == 2
        assert state.reason.startswith("6 requests for 8 slots each")
        lines.finish.set()


async def test_a_batch_for_a_model_at_zero_wakes_one_replica_and_runs_on_it(tmp_path: Path) -> None:
    """Before, the runner had no spare slot with no replica ready, and only a queued interactive request
    woke the model: the batch waited at zero until one came, or until it expired."""
    scaler, runner, supervisor, store, lines = scaler_and_runner(tmp_path)
    lines.finish.set()  # lines answer at once
    scaler.configure(model(low=0), 0, SimEngineAdapter(), [PLAN] * 10)
    batch_id = start_batch(store, 20)
    async with running(scaler.run, runner.run):
        await until(lambda: len(supervisor.members("m")) > 0, "a replica was started for the batch")
        (replica,) = supervisor.members("m")
        state = scaler._groups[("m", 0)]
        await until(lambda: len(state.wanted) >= 5, "decisions while it starts")
        assert len(supervisor.members("m")) == 1
        replica.state = ReplicaState.READY  # its engine answers its health check
        await until(
            lambda: (b := store.batch("acme", batch_id)) is not None and b.status == "completed", "ran"
        )
        assert lines.answered == 20
        assert len(supervisor.members("m")) == 1
    scale_ups = [e["message"] for e in supervisor.replicas.events if e["kind"] == "scale"]
    assert scale_ups == ["scale up 0 → 1: batch lines wait for a replica"], scale_ups


def test_the_arrival_rate_feed_forward_sizes_for_leaves_out_batch_lines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gateway's queue counts a batch line's arrival as any request's; sized for, a batch running at
    its share of the fleet read as arrivals the fleet must grow for."""
    now = [1000.0]
    monkeypatch.setattr("corral.cluster.autoscale.time.monotonic", lambda: now[0])
    supervisor = Supervisor(ReplicaSet(), NoRuntime(), SupervisorSettings())  # type: ignore[arg-type]
    scaler = Autoscaler(supervisor, lambda: {})
    scaler.configure(model(low=1), 0, SimEngineAdapter(), [PLAN] * 10)
    state = scaler._groups[("m", 0)]
    arrived = batch = 0.0
    for tick in range(40):  # 20 s at 0.5 s ticks: 20 batch lines a tick, then as many interactive requests
        now[0] += 0.5
        arrived += 20
        batch += 20 if tick < 20 else 0
        scaler._measure(state, [], {"arrived": arrived, "batch_arrived": batch})
        if tick == 19:
            assert state.rate == 0.0
    assert 30.0 < state.rate <= 40.0  # (the interactive stream's 40 req/s, met at once)
