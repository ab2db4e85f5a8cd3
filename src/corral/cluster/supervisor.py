"""The supervisor: keeps each declared replica running, probed and published in the replica set.

Per replica, one task runs this loop: start through the runtime → wait until `/health` answers → mark
READY → probe health and metrics every interval → on exit or repeated probe failure, stop it, back off
exponentially (reset after a stable run) and start again. A replica leaves the routable set the moment its
process exits or a probe fails, and comes back when it answers again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio

from corral.cluster.runtime import NoRoom, ReplicaRuntime, RunningReplica, log_tail, rotate_log
from corral.config import SupervisorSettings
from corral.engines import EngineAdapter, EngineLoad, LaunchPlan
from corral.engines.client import AnswerTooLarge, EngineClient, EngineConnectionError
from corral.engines.kv_events import KvCacheView, KvEventFeed
from corral.routing import Replica, ReplicaSet, ReplicaState

__all__ = ["Supervisor"]

logger = logging.getLogger(__name__)

_STABLE_RUN_S = 60.0  # a replica that stayed up this long restarts with the initial backoff again
_PROBES_AT_ONCE = 256  # connections the probes use at once (two per replica at most); more wait their turn
_EXPECTED_START_S = 3.0  # used for Retry-After hints while a replica is (re)starting
_ENDED_LOGS_KEPT = 32  # drained replicas whose logs are kept (ids are never reused: each scale-up makes one)
_FRESH_LOAD_ROUNDS = 3  # probe rounds (an interval and a probe's timeout) a scraped load stands for now
# A probe's answer read at most: a larger one is a failed probe (vLLM's metrics page is some 50 KB, with
# many adapters or data-parallel ranks some hundreds)
_PROBE_MOST_BYTES = 4 * 2**20
_PARSED_INLINE_BYTES = 256 * 1024  # a larger metrics page is read in a worker thread, the loop running


@dataclass(slots=True)
class _Slot:
    replica: Replica
    engine: EngineAdapter
    plan: LaunchPlan
    task: asyncio.Task[None] | None = None
    running: RunningReplica | None = None
    became_ready: bool = False  # the current incarnation has answered its health check
    draining: bool = False  # out of routing for good: probes no longer make it ready
    group: int = 0  # the deployment's index in its model's `deployments`
    kv: KvCacheView | None = None  # its engine's prefix cache, by the KV events it publishes
    log_path: Path | None = None  # where its engine's output went (on this machine)
    stopping: asyncio.Future[None] | None = None  # its last incarnation's engine stop (it outlives a cancel)


class Supervisor:
    """Reconciles declared replicas with running ones through a runtime."""

    def __init__(self, replicas: ReplicaSet, runtime: ReplicaRuntime, settings: SupervisorSettings) -> None:
        self.replicas = replicas
        self._runtime = runtime
        self._settings = settings
        self._slots: list[_Slot] = []
        self._probes: EngineClient | None = None  # health probes and metrics scrapes
        self._zmq: zmq.asyncio.Context | None = None  # engines' KV-event subscriptions
        self._stopping = False
        self._next_index: dict[str, int] = {}  # replica ids are never reused (a drained id stays gone)
        self._ended_logs: deque[Path] = deque()  # drained replicas' logs, oldest first
        self._drains: dict[str, asyncio.Future[dict[str, object]]] = {}  # replica id → its drain
        self._engine_stops: set[asyncio.Future[None]] = set()  # engine stops under way (drained ones too)

    def add(
        self,
        model: str,
        engine: EngineAdapter,
        plans: list[LaunchPlan],
        group: int = 0,
        revision: int = 0,
        admitted: bool = True,
    ) -> list[Replica]:
        """Declare replicas of `model`'s deployment `group` (started by rollout `revision`; routable once
        ready only if `admitted`), one per plan; they start with `start` (or, once started, `start_added`)."""
        self.replicas.declare(model)
        added = []
        for plan in plans:
            index = self._next_index.get(model, 0)
            self._next_index[model] = index + 1
            replica = Replica(
                id=f"{model}-{index}",
                model=model,
                engine=engine.name,
                capacity=plan.capacity,
                context_length=plan.context_length,
                features=plan.features,
                api_key=plan.api_key,
                gpus=self._visible_gpus(plan),
                revision=revision,
                admitted=admitted,
                adapters=plan.adapters,
                adapter_slots=plan.adapter_slots,
                max_loras=plan.max_loras,
            )
            self._slots.append(_Slot(replica, engine, plan, group=group))
            self.replicas.add(replica)
            added.append(replica)
        return added

    async def start(self) -> None:
        """Start every declared replica's lifecycle task."""
        timeout = self._settings.probe_timeout
        self._probes = EngineClient(connect_timeout=timeout, read_timeout=timeout, limit=_PROBES_AT_ONCE)
        self._zmq = zmq.asyncio.Context()
        for slot in self._slots:
            slot.task = asyncio.create_task(self._lifecycle(slot), name=f"replica:{slot.replica.id}")

    def start_added(self) -> None:
        """Start the lifecycle of replicas added since `start` (a live apply)."""
        if self._probes is None:
            return  # not started yet: `start` will
        for slot in self._slots:
            if slot.task is None:
                slot.task = asyncio.create_task(self._lifecycle(slot), name=f"replica:{slot.replica.id}")

    def replica_ids(self, model: str, group: int | None = None) -> list[str]:
        """The ids of `model`'s replicas (of one deployment when `group` is given), oldest first."""
        return [r.id for r in self.members(model, group)]

    def members(self, model: str, group: int | None = None) -> list[Replica]:
        """`model`'s replicas not being drained (of one deployment when `group` is given), oldest first."""
        return [
            s.replica
            for s in self._slots
            if s.replica.model == model and (group is None or s.group == group) and not s.draining
        ]

    def fresh_load(self, replica: Replica) -> EngineLoad | None:
        """The replica's engine load, unless its last scrape is older than a few probe rounds: a scrape that
        keeps failing leaves the last reading in place (the drain and the token counters want it), but a
        KV-cache use read minutes ago must not pass for now."""
        load = replica.load
        rounds = _FRESH_LOAD_ROUNDS * (self._settings.probe_interval + self._settings.probe_timeout)
        if load is None or time.monotonic() - load.scraped_monotonic > rounds:
            return None
        return load

    def unused_plans(self, model: str, group: int, plans: list[LaunchPlan]) -> list[LaunchPlan]:
        """Those of `plans` (deployment `group`'s) that none of its replicas holds, so a new replica never
        lands on a busy GPU. A replica holds its plan while its lifecycle runs (draining included: it still
        has its GPUs until it stops; a failed one, whose process is gone, holds nothing). Plans that differ
        (vLLM's and the simulator's by GPU, an external deployment's by URL) are each held once; plans that
        are all alike (llama.cpp's; any under Ray, which picks the GPUs itself) are all free."""
        keys = [self._holds(plan) for plan in plans]
        if all(key == keys[0] for key in keys[1:]):
            return plans
        held = [
            self._holds(s.plan)
            for s in self._slots
            if s.replica.model == model and s.group == group and self._holding(s)
        ]
        free = []
        for plan, key in zip(plans, keys, strict=True):
            if key in held:
                held.remove(key)
            else:
                free.append(plan)
        return free

    def _holds(self, plan: LaunchPlan) -> LaunchPlan:
        """What of a plan a live replica keeps to itself: all of it, less the GPUs when Ray assigns them."""
        if self._visible_gpus(plan) is not None or "CUDA_VISIBLE_DEVICES" not in plan.env:
            return plan
        env = {key: value for key, value in plan.env.items() if key != "CUDA_VISIBLE_DEVICES"}
        return dataclasses.replace(plan, env=env)

    @staticmethod
    def _holding(slot: _Slot) -> bool:
        """A replica holds its plan (its GPUs) while its lifecycle runs and until its engine has stopped:
        draining included, since it keeps its GPUs until it stops; a failed one, whose process is gone,
        holds nothing."""
        stopping = slot.stopping is not None and not slot.stopping.done()
        return slot.task is None or not slot.task.done() or stopping

    def _visible_gpus(self, plan: LaunchPlan) -> str | None:
        """The GPUs a replica of `plan` is given (its CUDA_VISIBLE_DEVICES); None when it has none, or when
        the runtime picks them itself (Ray: the plan's value is dropped)."""
        return None if self._runtime.assigns_gpus else plan.env.get("CUDA_VISIBLE_DEVICES")

    def plan_gpus(self, plan: LaunchPlan) -> frozenset[str]:
        """The GPU ids a replica started from `plan` holds; empty when corral does not place its GPUs."""
        return frozenset(gpu.strip() for gpu in (self._visible_gpus(plan) or "").split(",") if gpu.strip())

    def gpu_holders(self, model: str) -> list[tuple[Replica, frozenset[str]]]:
        """`model`'s replicas that hold GPUs now (draining ones until they stop), each with its GPU ids."""
        live = [s for s in self._slots if s.replica.model == model and self._holding(s)]
        return [(s.replica, gpus) for s in live if (gpus := self.plan_gpus(s.plan))]

    def unit(self, replica_id: str) -> tuple[int, EngineAdapter, LaunchPlan]:
        """How a replica was launched (its deployment group, engine and plan), to start its like again;
        KeyError when it is gone."""
        slot = next((s for s in self._slots if s.replica.id == replica_id), None)
        if slot is None:
            raise KeyError(replica_id)
        return slot.group, slot.engine, slot.plan

    def cordon(self, node: str) -> None:
        """Place no new replica on `node` (runtimes that place replicas on nodes: Ray)."""
        cordon = getattr(self._runtime, "cordon", None)
        if cordon is not None:
            cordon(node)

    def on_node(self, node: str) -> list[str]:
        """The ids of the replicas running on a Ray node (not being drained)."""
        return [s.replica.id for s in self._slots if s.replica.node == node and not s.draining]

    async def wait_ready(self, within: float) -> bool:
        """Wait until every model has at least one ready replica; False on timeout, or as soon as some
        model's replicas have all been given up (`failed_models` names them)."""
        deadline = time.monotonic() + within
        replicas = self.replicas
        while time.monotonic() < deadline:
            if all(replicas.ready(m) or m in replicas.on_demand for m in replicas.models()):
                return True
            if self.failed_models():
                return False
            await asyncio.sleep(0.1)
        return False

    def failed_models(self) -> list[str]:
        """Models none of whose replicas the supervisor still tries to start."""
        return [
            m
            for m in self.replicas.models()
            if self.replicas.of(m) and all(r.state is ReplicaState.FAILED for r in self.replicas.of(m))
        ]

    async def drain(self, replica_id: str, grace_s: float) -> dict[str, object]:
        """Take a replica out of routing, wait until its requests are done (at most `grace_s`), stop it
        and forget it. Done means nothing in flight at this gateway and, for engines with metrics, nothing
        running or waiting in the engine after the gateways learned of the drain (gateway workers mirror
        the replica set within a fraction of a second; the engine is scraped every probe interval)."""
        slot = next((s for s in self._slots if s.replica.id == replica_id), None)
        if slot is None:
            raise KeyError(replica_id)
        running = self._drains.get(replica_id)
        if running is not None:  # drained already by someone else: the same answer when it ends
            return await asyncio.shield(running)
        drain = self._drains[replica_id] = asyncio.ensure_future(self._drain(slot, grace_s))
        drain.add_done_callback(lambda _: self._drains.pop(replica_id, None))
        return await asyncio.shield(drain)

    async def _drain(self, slot: _Slot, grace_s: float) -> dict[str, object]:
        replica, replica_id = slot.replica, slot.replica.id
        # a replica that was not serving (starting, restarting, given up) has no engine load to wait out:
        # its last scrape may be from before it failed, and no newer one ever comes
        serving = replica.state in (ReplicaState.READY, ReplicaState.UNHEALTHY) and (
            slot.task is not None and not slot.task.done()
        )
        slot.draining = True
        replica.state, replica.ready_eta = ReplicaState.DRAINING, None
        began = time.monotonic()
        settle = self._settings.probe_interval + 0.5
        idle = False
        while time.monotonic() - began < grace_s:
            load = replica.load
            engine_idle = (  # (an external server may serve other clients: this gateway's requests count)
                not serving
                or slot.plan.metrics_path is None
                or slot.engine.name == "external"
                or load is None
                or (load.scraped_monotonic > began + 0.5 and load.running + load.waiting == 0)
            )
            if time.monotonic() - began >= settle and replica.outstanding == 0 and engine_idle:
                idle = True
                break
            await asyncio.sleep(0.1)
        if slot.task is not None:
            slot.task.cancel()
            await asyncio.gather(slot.task, return_exceptions=True)
        if slot.stopping is not None:  # (it goes on past the cancel) drained once its engine has stopped
            await asyncio.gather(slot.stopping, return_exceptions=True)
        replica.state = ReplicaState.STOPPED
        self._slots.remove(slot)
        self.replicas.remove(replica)
        if slot.log_path is not None:
            await asyncio.to_thread(self._forget_logs, slot.log_path)
        waited = round(time.monotonic() - began, 2)
        logger.info("replica %s drained in %.1fs%s", replica_id, waited, "" if idle else " (timed out)")
        return {"replica": replica_id, "model": replica.model, "waited_s": waited, "idle": idle}

    def _forget_logs(self, ended: Path) -> None:
        """Keep the logs of the last _ENDED_LOGS_KEPT drained replicas (rotated copies too): an autoscaled
        deployment makes a new replica id, and so a new log, at each scale-up, for as long as it runs."""
        self._ended_logs.append(ended)
        while len(self._ended_logs) > _ENDED_LOGS_KEPT:
            oldest = self._ended_logs.popleft()
            for path in (oldest, *oldest.parent.glob(glob.escape(oldest.name) + ".*")):
                path.unlink(missing_ok=True)

    async def stop(self) -> None:
        """Stop all replicas (SIGTERM, then SIGKILL after the stop timeout) and end their tasks."""
        self._stopping = True
        tasks = [s.task for s in self._slots if s.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # A cancelled task's engine stop goes on (as does a drained replica's, whose slot is gone): finish
        # every one before returning, so that no engine outlives corral's stop
        while self._engine_stops:
            await asyncio.gather(*self._engine_stops, return_exceptions=True)
        for slot in self._slots:
            if slot.running is not None:
                slot.running = None
                slot.replica.state = ReplicaState.STOPPED
        if self._probes is not None:
            self._probes.close()
        if self._zmq is not None:
            self._zmq.destroy(linger=0)

    async def _lifecycle(self, slot: _Slot) -> None:
        replica, settings = slot.replica, self._settings
        backoff = settings.backoff_initial
        start_failures = 0
        while not slot.draining:  # a drained replica is stopped, never restarted
            replica.state = ReplicaState.STARTING
            replica.ready_eta = time.time() + _EXPECTED_START_S
            launched = time.monotonic()
            await self._rotate_log(slot.log_path)  # (a replica that crashes soon after each start, too)
            feed = self._kv_feed(slot)
            waiting = False  # for room in the cluster: no failure of the replica's
            try:
                running = await self._runtime.start(replica.id, feed.plan if feed else slot.plan)
                slot.log_path = running.log_path or slot.log_path
            except NoRoom as exc:
                reason, was_ready, waiting = f"waiting for room: {exc}", False, True
            except Exception as exc:  # any runtime failure: log it, back off, try again
                logger.exception("replica %s: the runtime could not start it", replica.id)
                reason, was_ready = f"launch failed: {exc}", False
            else:
                try:
                    reason, was_ready = await self._run(slot, running, feed)
                except Exception as exc:  # watching it failed (a runtime that lost its cluster): start anew
                    logger.exception("replica %s: watching it failed", replica.id)
                    reason, was_ready = f"watching it failed: {exc}", slot.became_ready
            finally:
                if feed is not None:
                    feed.close()
            if time.monotonic() - launched > _STABLE_RUN_S:
                backoff = settings.backoff_initial
            if not waiting:
                start_failures = 0 if was_ready else start_failures + 1
            replica.last_error = reason
            if start_failures >= settings.max_start_failures:
                replica.state, replica.ready_eta = ReplicaState.FAILED, None
                logger.error(
                    "replica %s: gave up after %d failed starts in a row: %s",
                    replica.id,
                    start_failures,
                    reason,
                )
                return
            replica.ready_eta = time.time() + backoff + _EXPECTED_START_S
            if waiting:  # (never started: no restart, and never given up on for it)
                replica.state = ReplicaState.STARTING
                logger.warning("replica %s: %s; trying again in %.1fs", replica.id, reason, backoff)
            else:
                replica.restarts += 1
                replica.state = ReplicaState.RESTARTING
                logger.warning("replica %s: %s; restarting in %.1fs", replica.id, reason, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, settings.backoff_max)

    def _kv_feed(self, slot: _Slot) -> KvEventFeed | None:
        """A subscription to the engine's KV events for its next incarnation, where it publishes them."""
        plan = slot.plan
        if self._zmq is None or not (plan.kv_events_args or plan.kv_events_urls):
            return None
        try:
            feed = KvEventFeed(self._zmq, plan, remote=self._runtime.assigns_gpus)
        except (OSError, zmq.ZMQError) as exc:
            logger.warning("replica %s: not following its KV events: %s", slot.replica.id, exc)
            return None
        if not feed.active:
            return None
        if slot.kv is None:
            slot.kv = feed.view()
        else:
            slot.kv.restarted()  # a new incarnation starts with an empty cache
        return feed

    async def _run(
        self, slot: _Slot, running: RunningReplica, feed: KvEventFeed | None = None
    ) -> tuple[str, bool]:
        """Serve one incarnation of the replica: why it ended, and whether it was ever ready. Always stops
        the process."""
        replica = slot.replica
        replica.url, replica.pid, replica.started_at = running.url, running.pid, time.time()
        replica.api_key = getattr(running, "api_key", None) or slot.plan.api_key  # (a run's own: Ray's)
        replica.node = getattr(running, "node_id", None)
        slot.running = running
        slot.became_ready = False
        exited = asyncio.ensure_future(running.wait())
        events = None
        if feed is not None and slot.kv is not None:
            view, cleared = slot.kv, slot.kv.cleared

            def changed() -> None:
                """The load shows the events at each scrape (a new load every probe interval reaches the
                workers in one snapshot); an emptied cache at once."""
                nonlocal cleared
                if view.cleared != cleared and replica.load is not None:
                    cleared = view.cleared
                    replica.load = view.stamp(replica.load)

            events = asyncio.create_task(feed.follow(view, changed), name=f"kv-events:{replica.id}")
        try:
            reason = await self._watch(slot, running, exited)
            was_ready = slot.became_ready
            if not was_ready:
                replica.log_tail = tuple(log_tail(running.log_path))
                if replica.log_tail:
                    reason = f"{reason}: {replica.log_tail[-1]}"
            return reason, was_ready
        finally:
            exited.cancel()
            if replica.state is ReplicaState.READY:
                replica.state = ReplicaState.UNHEALTHY
            if self._stopping:
                replica.state = ReplicaState.STOPPING
            stopping = self._stop_engine(slot, running)  # (begun before any await: a cancel cannot skip it)
            if events is not None:
                events.cancel()
                await asyncio.gather(events, return_exceptions=True)
            await asyncio.shield(stopping)
            slot.running = None
            if self._stopping:
                replica.state = ReplicaState.STOPPED

    def _stop_engine(self, slot: _Slot, running: RunningReplica) -> asyncio.Future[None]:
        """Begin stopping an incarnation's engine; the stop goes on when whoever awaits it is cancelled (a
        drain, `stop`: they wait for it)."""
        stopping = slot.stopping = asyncio.ensure_future(running.stop(self._settings.stop_timeout))
        self._engine_stops.add(stopping)
        stopping.add_done_callback(self._engine_stops.discard)
        return stopping

    async def _rotate_log(self, path: Path | None) -> None:
        """Rotate a replica's log past `replica_log_max_mb` (a Ray replica's is on its node: its actor
        rotates it)."""
        if path is not None:
            limit = int(self._settings.replica_log_max_mb * 1024 * 1024)
            await asyncio.to_thread(rotate_log, path, limit, self._settings.replica_log_keep)

    async def _until_ready(
        self, slot: _Slot, running: RunningReplica, exited: asyncio.Future[int]
    ) -> str | None:
        """Wait until the replica answers its health check: None then, else why it never will. It may take
        its engine's own start-up allowance (vLLM's) or `ready_timeout`, whichever is longer."""
        settings = self._settings
        allowed = max(slot.plan.startup_s or 0.0, settings.ready_timeout)
        began = rotated = time.monotonic()
        while not await self._healthy(running.url, slot.plan.health_path):
            if exited.done():
                return f"exited with code {exited.result()} while starting"
            now = time.monotonic()
            if now - began > allowed:
                return f"not ready within {allowed:g}s"
            if now - rotated >= settings.probe_interval:  # (a start that writes much: a compiling engine)
                rotated = now
                await self._rotate_log(running.log_path)
            await asyncio.wait([exited], timeout=0.2)
        if exited.done():  # something answered on its port, but not the engine: it is gone
            return f"exited with code {exited.result()} while starting"
        return None

    async def _watch(self, slot: _Slot, running: RunningReplica, exited: asyncio.Future[int]) -> str:
        replica, settings = slot.replica, self._settings
        not_ready = await self._until_ready(slot, running, exited)
        if not_ready is not None:
            return not_ready
        if not slot.draining:
            replica.state, replica.ready_eta = ReplicaState.READY, None
        slot.became_ready = True
        logger.info("replica %s ready at %s", replica.id, running.url)
        failures = 0
        while True:
            await self._scrape(slot, running)
            await asyncio.wait([exited], timeout=settings.probe_interval)
            if exited.done():
                return f"exited with code {exited.result()}"
            await self._rotate_log(running.log_path)
            if await self._healthy(running.url, slot.plan.health_path):
                failures = 0
                if not slot.draining:
                    replica.state = ReplicaState.READY
                continue
            failures += 1
            if not slot.draining:
                replica.state = ReplicaState.UNHEALTHY  # out of routing at once; restarted if it persists
            if failures >= settings.unhealthy_after:
                return f"failed {failures} health probes in a row"

    async def _healthy(self, base_url: str, path: str) -> bool:
        return (await self._get(base_url, path))[0] == 200

    async def _get(self, base_url: str, path: str) -> tuple[int, bytes]:
        """(status, body) of a GET within `probe_timeout` (corral's lean engine client: a probe costs less
        than half what aiohttp's does); status 0 if none came, or one past `_PROBE_MOST_BYTES`."""
        assert self._probes is not None
        try:
            async with asyncio.timeout(self._settings.probe_timeout):
                response = await self._probes.get(base_url, path)
                try:
                    return response.status, await response.read(_PROBE_MOST_BYTES)
                finally:
                    response.release()
        except AnswerTooLarge:
            logger.warning(
                "%s%s answered more than %d bytes: taken as no answer", base_url, path, _PROBE_MOST_BYTES
            )
            return 0, b""
        except (EngineConnectionError, TimeoutError):
            return 0, b""

    async def _scrape(self, slot: _Slot, running: RunningReplica) -> None:
        """Read the engine's load from its metrics endpoint; a failed scrape keeps the last value (which
        `fresh_load` stops giving once it is a few rounds old). The load is stamped with when it was asked
        for (the engine's figures are of a moment after), not when its page was parsed: a large one is
        parsed in a thread, which can take longer than a drain's wait for an idle engine."""
        if slot.plan.metrics_path is None:
            return
        asked, asked_at = time.monotonic(), time.time()
        status, body = await self._get(running.url, slot.plan.metrics_path)
        if status != 200:
            return
        try:
            if len(body) > _PARSED_INLINE_BYTES:
                load = await asyncio.to_thread(_parse_load, slot.engine, body)
            else:
                load = _parse_load(slot.engine, body)
            load = dataclasses.replace(load, scraped_at=asked_at, scraped_monotonic=asked)
            slot.replica.load = slot.kv.stamp(load) if slot.kv is not None else load
        except ValueError:
            logger.warning("replica %s: unreadable metrics", slot.replica.id)


def _parse_load(engine: EngineAdapter, page: bytes) -> EngineLoad:
    """An engine's load from its metrics page."""
    return engine.parse_load(page.decode("utf-8", "replace"))
