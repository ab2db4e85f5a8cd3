"""The autoscaler: per autoscaled deployment, a replica count between its bounds, decided every interval.

Reactive signals, all read from the supervisor's replica set and the gateways' queues (summed over
gateway workers): busy slots (the gateways' requests in flight: exact, where an engine's own gauges are
scraped late and count a finished request twice) against `target_utilization`; the oldest queued
request's wait; mean KV-cache use; prompt tokens routed but not yet prefilled. Replicas still loading count
as capacity on the way, so a slow start is not answered with more starts. `feed_forward` adds the
performance model's view: the measured arrival rate divided by the request rate one replica sustains
within the model's TTFT objective (the planner's scheduler model, for the mean prompt and output lengths
the engines report), so a step in load is met in one move instead of one replica per interval. Both are
read through a Poisson stream's noise (see `_follow_rate`), since the fleet is sized for what they say.
An engine's load read longer ago than a few probe rounds (its scrapes fail) says nothing of now and is
left out (`Supervisor.fresh_load`).

Only interactive demand is sized for. Batch lines run on spare capacity (batch/runner.py): each new
replica's slots would be filled by them again, so the slots they hold, their arrivals and their share of
KV cache and prefill are left out of every signal, as the batch runners report them (`batch_in_flight`,
`batch_arrived` in the pressure). A model with batch lines to run (`batch_pending`) or running keeps one
replica, or wakes one from zero, and no more for them.

Each deployment is decided every `interval_s` of its own; one configured meanwhile (a live apply, a
finished rollout) at once. Scaling up starts replicas at once. Scaling down follows the highest count
wanted over the last `down_cooldown_s` (a stabilisation window, as Kubernetes' HPA does: a moment's lull
does not shrink the fleet) and drains one replica per cooldown, the least-loaded (its requests and streams
finish); replicas over a lowered `max_replicas` are drained at once. With `min_replicas: 0` (every
deployment of the model able to be at zero) the model is held on demand: the gateways queue its requests
while the first replica starts (`FairQueue`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from corral.cluster.capacity import replica_request_rate
from corral.cluster.supervisor import Supervisor
from corral.config import AutoscaleSpec, ModelSpec
from corral.engines import EngineAdapter, EngineLoad, LaunchPlan
from corral.routing import Replica, ReplicaState

__all__ = ["DRAIN_GRACE_S", "Autoscaler", "Pressure"]

logger = logging.getLogger(__name__)

# model → the gateways' queued (slots their waiting requests would take), oldest_wait_s, arrived (requests so
# far); the batch runners' batch_in_flight
# (slots their lines hold, queued or running), batch_arrived (lines sent so far), batch_pending (> 0: lines
# of the model's batches wait to run)
Pressure = Callable[[], dict[str, dict[str, float]]]
_LOADING = (ReplicaState.STARTING, ReplicaState.RESTARTING)
# The arrival rate: a steady mean of each interval's arrivals (5 s half-life), unless a quick mean (1 s)
# stands more than three of its standard deviations (a Poisson stream's noise) above it: then the quick
# one, until the steady one comes within one (a step in load is met at once). A fall beyond the noise is
# forgotten slowly (15 s: a lull between bursts does not drop capacity). Following every upward blip
# quickly, as it once did, read a steady 3 req/s as 6 and 24 as 31 (0.5 s intervals), and sized for that.
_RATE_QUICK_HALF_LIFE_S = 1.0
_RATE_STEADY_HALF_LIFE_S = 5.0
_RATE_FALL_HALF_LIFE_S = 15.0
_RISE_SDS, _RISEN_SDS = 3.0, 1.0
# A replica the supervisor gave up on (failed starts) is replaced at once the first time; while its
# replacements fail too (a missing binary, a dead GPU) each next one waits twice as long, up to 10 minutes
_REPLACE_WAIT_S, _REPLACE_WAIT_MAX_S = 30.0, 600.0
_REPLACE_QUIET_S = 1800.0  # no failure this long: the next one is replaced at once again
# Mean request lengths: the engines' token rates over the arrival rate, each a slower symmetric mean, so
# an interval whose completions are not its arrivals (a backlog draining after a burst) does not read as
# long requests, which sized the fleet for work that was not coming.
_LENGTHS_HALF_LIFE_S = 20.0
# How long a replica the autoscaler drains may take to finish its requests and streams, at least (the
# reconciler gives it the longer of this and `gateway.shutdown_grace`); those still running then are cut
DRAIN_GRACE_S = 120.0


class _Replacing(Protocol):
    """What a deployment remembers of replacing the replicas the supervisor gave up on (`_newly_failed`)."""

    replace_wait: float  # how long the next replacement of a failed replica waits
    held_until: float  # no replacement starts before (the last one's wait)
    replaced: set[str]  # failed replicas being drained to be replaced
    replacements: set[str]  # replicas started since one failed
    failed_at: float  # when a replica last failed (monotonic)


_FAILED = ReplicaState.FAILED


@dataclass
class _Fixed:
    """A fixed-count deployment's replacement of failed replicas (`Autoscaler.replace_failed`)."""

    replace_wait: float = 0.0
    held_until: float = 0.0
    replaced: set[str] = field(default_factory=set)
    replacements: set[str] = field(default_factory=set)
    failed_at: float = 0.0
    # (the failed replica's id, its engine and plan): drained, to start again after the backoff
    owed: list[tuple[str, EngineAdapter, LaunchPlan]] = field(default_factory=list)


@dataclass
class _Group:
    """One autoscaled deployment and what the autoscaler remembers of it."""

    model: ModelSpec
    group: int
    engine: EngineAdapter
    plans: list[LaunchPlan]  # one per possible replica (max_replicas): vLLM's differ by GPU
    wanted: deque[tuple[float, int]] = field(default_factory=deque)  # (when, count) over the cooldown
    changed_at: float = field(default_factory=time.monotonic)  # the last scaling action
    due_at: float = 0.0  # the next decision (monotonic); 0: at once
    arrived: float | None = None
    batch_arrived: float = 0.0  # of `arrived`, the batch runners' lines
    seen_at: float = field(default_factory=time.monotonic)
    rate: float = 0.0  # requests/s, as read: the quick mean in a rise, else the steady one
    quick: float = 0.0
    steady: float = 0.0
    rising: bool = False
    counters: dict[str, tuple[float, float]] = field(default_factory=dict)  # replica → prompt, generated
    token_rates: tuple[float, float] = (0.0, 0.0)  # prompt and generated tokens/s, smoothed
    demand: float = 0.0  # requests/s smoothed as the token rates are, to divide them by
    lengths: tuple[float, float] | None = None  # mean prompt and output tokens per request, measured
    reason: str = ""
    replace_wait: float = 0.0  # how long the next replacement of a failed replica waits
    held_until: float = 0.0  # no scale-up before (the last replacement's wait)
    replaced: set[str] = field(default_factory=set)  # failed replicas being drained to be replaced
    replacements: set[str] = field(default_factory=set)  # replicas started since one failed
    failed_at: float = 0.0  # when a replica last failed (monotonic)

    @property
    def spec(self) -> AutoscaleSpec:
        scale = self.model.deployments[self.group].autoscale
        assert scale is not None
        return scale


class Autoscaler:
    """Moves each autoscaled deployment's replica count; one task for all of them."""

    def __init__(self, supervisor: Supervisor, pressure: Pressure, grace_s: float = DRAIN_GRACE_S) -> None:
        """`grace_s`: how long a replica scaled down (or replaced) may take to finish its requests."""
        self._supervisor = supervisor
        self._replicas = supervisor.replicas
        self._pressure = pressure
        self._grace = grace_s
        self._groups: dict[tuple[str, int], _Group] = {}
        self.frozen: set[str] = set()  # models in a rollout: their counts are the rollout's
        self._drains: set[asyncio.Task[object]] = set()
        self._wake = asyncio.Event()  # a deployment was configured: decide for it now
        self._fixed: dict[tuple[str, int], _Fixed] = {}  # fixed-count deployments replacing failed replicas

    def configure(self, model: ModelSpec, group: int, engine: EngineAdapter, plans: list[LaunchPlan]) -> None:
        """Autoscale deployment `group` of `model` with `plans` (one per possible replica), again with new
        bounds or plans (a live setting, a finished rollout); a deployment without `autoscale` is let go."""
        if model.deployments[group].autoscale is None:
            self.forget(model.name, group)
            return
        old = self._groups.get((model.name, group))
        state = _Group(model, group, engine, plans)
        if old is not None:  # (its stabilisation window and cooldown go on: new bounds are no scaling action)
            state.rate, state.arrived, state.seen_at = old.rate, old.arrived, old.seen_at
            state.quick, state.steady, state.rising = old.quick, old.steady, old.rising
            state.counters, state.token_rates, state.demand = old.counters, old.token_rates, old.demand
            state.lengths, state.batch_arrived = old.lengths, old.batch_arrived
            state.wanted, state.changed_at = old.wanted, old.changed_at
            # (and replacing failed replicas backs off as before: a live setting is no sign they start now)
            state.replace_wait, state.held_until = old.replace_wait, old.held_until
            state.failed_at, state.replaced = old.failed_at, old.replaced
            state.replacements = old.replacements
        self._groups[(model.name, group)] = state
        self._hold_on_demand(model)
        self._replicas.declared[model.name] = (plans[0].features, plans[0].context_length)
        self._replicas.changed(model.name)
        self._wake.set()

    def _hold_on_demand(self, model: ModelSpec) -> None:
        """Hold `model`'s requests while a first replica starts when every deployment of it may be at zero
        (autoscaled from zero, or none declared), for the longest `hold_s` of them."""
        deployments = model.deployments
        at_zero = all(d.autoscale.min_replicas == 0 if d.autoscale else d.replicas == 0 for d in deployments)
        holds = [d.autoscale.hold_s for d in deployments if d.autoscale is not None]
        if at_zero and holds:
            self._replicas.on_demand[model.name] = max(holds)
        else:
            self._replicas.on_demand.pop(model.name, None)

    def forget(self, model: str, group: int | None = None) -> None:
        """Stop autoscaling `model` (one deployment of it when `group` is given)."""
        for key in [k for k in self._groups if k[0] == model and group in (None, k[1])]:
            del self._groups[key]
        left = [g for k, g in self._groups.items() if k[0] == model]
        if left:
            self._hold_on_demand(left[-1].model)
        else:
            self._replicas.on_demand.pop(model, None)
            self._replicas.declared.pop(model, None)

    async def run(self) -> None:
        """Decide for each group every `interval_s` of its own; a group configured meanwhile at once."""
        while True:
            for state in list(self._groups.values()):
                if state.due_at > time.monotonic():
                    continue
                state.due_at = time.monotonic() + state.spec.interval_s
                try:
                    await self._step(state)
                except Exception:  # one deployment's failure must not stop the others' scaling
                    logger.exception("autoscaler: %s deployment %d", state.model.name, state.group)
            self._wake.clear()  # (a group configured during the steps above is due already: seen below)
            due = min((g.due_at for g in self._groups.values()), default=None)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(None if due is None else max(0.0, due - time.monotonic())):
                    await self._wake.wait()

    def _current(self, state: _Group) -> bool:
        """Still this deployment's autoscaling, and no rollout owns the model's replicas now."""
        key = (state.model.name, state.group)
        return self._groups.get(key) is state and state.model.name not in self.frozen

    async def _step(self, state: _Group) -> None:
        if not self._current(state):
            return
        pressure = self._pressure().get(state.model.name, {})
        members = self._live(state)
        self._measure(state, members, pressure)
        want = await self.desired(state, members, pressure)
        if not self._current(state):  # a rollout began, or the model went, while the rate was computed
            return
        members = self._live(state)
        count, now = len(members), time.monotonic()
        cooldown = state.spec.down_cooldown_s
        state.wanted.append((now, want))
        while state.wanted[0][0] < now - cooldown:
            state.wanted.popleft()
        if want > count:
            if now < state.held_until:  # replacing replicas that failed: backing off
                return
            state.changed_at = now
            self._scale_up(state, want - count, members)
            return
        if count > state.spec.max_replicas:  # a lowered bound: what runs over it is drained at once
            state.changed_at = now
            self._scale_down(state, members, state.spec.max_replicas, count - state.spec.max_replicas)
            return
        highest = max(w for _, w in state.wanted)
        if highest < count and now - state.changed_at >= cooldown:
            state.changed_at = now  # one replica per cooldown
            self._scale_down(state, members, highest)

    def _live(self, state: _Group) -> list[Replica]:
        """The deployment's replicas; one the supervisor gave up on (failed starts) is drained, so that it
        is replaced instead of counting as capacity."""
        members = self._supervisor.members(state.model.name, state.group)
        wait = f" in {state.replace_wait:.0f}s" if state.replace_wait else ""
        for replica in _newly_failed(state, members):
            message = f"replace {replica.id}{wait}: {replica.last_error}"
            self._replicas.record("scale", state.model.name, message)
            self._drain(replica)
        return [r for r in members if r.state is not ReplicaState.FAILED]

    def replace_failed(self, deployments: list[tuple[str, int]]) -> None:
        """One round (the reconciler's, every probe interval) of replacing the replicas the supervisor gave
        up on in fixed-count `deployments` (model, index): each is drained, and started again on its plan
        with the backoff an autoscaled deployment's replacements have (see _REPLACE_WAIT_S). A deployment
        left out is forgotten, unless its model is in a rollout (`frozen`): what it owes then waits for the
        rollout's end (a rollback starts it; a completed rollout, `forget_owed`, does not)."""
        for key in set(self._fixed) - set(deployments):
            if key[0] not in self.frozen:
                del self._fixed[key]
        now = time.monotonic()
        for model, group in deployments:
            state = self._fixed.setdefault((model, group), _Fixed())
            members = self._supervisor.members(model, group)
            wait = f" in {state.replace_wait:.0f}s" if state.replace_wait else ""
            for replica in _newly_failed(state, members):
                state.owed.append((replica.id, *self._supervisor.unit(replica.id)[1:]))
                self._replicas.record("scale", model, f"replace {replica.id}{wait}: {replica.last_error}")
                self._drain(replica)
            if not state.owed or now < state.held_until:
                continue
            revision = max((r.revision for r in self._supervisor.members(model)), default=0)
            added, still = [], []
            for failed, engine, plan in state.owed:  # (a plan another replica holds now, its GPU: owed)
                if self._supervisor.unused_plans(model, group, [plan]):
                    added += self._supervisor.add(model, engine, [plan], group, revision)
                else:
                    still.append((failed, engine, plan))
            state.owed = still
            if not added:
                continue
            if state.replace_wait:
                state.replacements.update(r.id for r in added)
            self._supervisor.start_added()
            message = f"started {', '.join(r.id for r in added)} in place of failed replicas"
            logger.info("%s deployment %d: %s", model, group, message)
            self._replicas.record("scale", model, message)

    def owed(self, model: str, group: int) -> list[str]:
        """The failed replicas of fixed-count deployment `group` of `model` drained and not replaced yet
        (backing off): an apply replaces them (`settle_fixed`), as those still failed."""
        state = self._fixed.get((model, group))
        return [failed for failed, _, _ in state.owed] if state is not None else []

    def forget_owed(self, model: str) -> None:
        """A completed rollout replaced `model`'s replicas with its new spec's count: the replacements its
        old replicas were owed (their engines and plans the old spec's) are owed no more, and the backoff
        starts again."""
        for key in [k for k in self._fixed if k[0] == model]:
            del self._fixed[key]

    def settle_fixed(self, model: str, group: int) -> list[str]:
        """An apply sets fixed-count deployment `group` of `model` to its count (which left its failed
        replicas out): those are drained, and replacements not started yet no longer owed; their ids."""
        state = self._fixed.setdefault((model, group), _Fixed())
        state.owed.clear()
        failed = [r for r in self._supervisor.members(model, group) if r.state is ReplicaState.FAILED]
        for replica in failed:
            state.replaced.add(replica.id)
            self._drain(replica)
        return [r.id for r in failed]

    def _measure(self, state: _Group, members: list[Replica], pressure: dict[str, float]) -> None:
        """Update the smoothed arrival rate (of interactive requests: batch lines are sized for by no one)
        and the mean request lengths (of all requests: the engines' token counts are) from the latest
        counters."""
        now = time.monotonic()
        arrived, batch = pressure.get("arrived", 0.0), pressure.get("batch_arrived", 0.0)
        if state.arrived is not None and now > state.seen_at:
            elapsed = now - state.seen_at
            count = max(0.0, arrived - state.arrived)
            interactive = max(0.0, count - max(0.0, batch - state.batch_arrived))
            _follow_rate(state, interactive / elapsed, elapsed)
            added = _token_deltas(state.counters, members)
            state.token_rates = (
                _smoothed(state.token_rates[0], added[0] / elapsed, elapsed, _LENGTHS_HALF_LIFE_S),
                _smoothed(state.token_rates[1], added[1] / elapsed, elapsed, _LENGTHS_HALF_LIFE_S),
            )
            state.demand = _smoothed(state.demand, count / elapsed, elapsed, _LENGTHS_HALF_LIFE_S)
            if state.demand > 0 and min(state.token_rates) > 0:
                state.lengths = (state.token_rates[0] / state.demand, state.token_rates[1] / state.demand)
        else:
            _token_deltas(state.counters, members)  # the counters' starting point
        state.arrived, state.batch_arrived, state.seen_at = arrived, batch, now

    async def desired(self, state: _Group, members: list[Replica], pressure: dict[str, float]) -> int:
        """How many replicas the deployment should have now, within its bounds; `state.reason` says why."""
        scale, count = state.spec, len(members)
        ready = [r for r in members if r.ready]
        slots = state.plans[0].capacity or 1
        queued = self._queue_share(state, members) * pressure.get("queued", 0.0)
        held = sum(_busy(r) for r in ready) + queued
        batch = min(held, self._batch_part(state, ready, pressure))  # (in flight or queued: in `held`)
        demand = held - batch
        want = math.ceil(demand / (slots * scale.target_utilization))
        reason = f"{demand:.0f} requests for {slots} slots each" + (
            f" ({batch:.0f} batch lines beside)" if batch else ""
        )
        loading = any(r.state in _LOADING for r in members)
        loads = [load for r in ready if (load := self._supervisor.fresh_load(r)) is not None]
        share = demand / held if held else 1.0  # interactive requests' part of the KV cache and prefill
        # (else: on its way; the queue's wait pushes one of the model's deployments, not each)
        pushes = "" if loading else _pressures(scale, ready, loads, share, pressure, self._leads(state))
        if pushes and want <= count:
            want, reason = count + 1, pushes
        if scale.mode == "feed_forward" and state.rate > 0:
            per_replica = await self._replica_rate(state)
            if per_replica:
                sized = math.ceil(state.rate / per_replica)
                if sized > want:
                    want = sized
                    reason = f"{state.rate:.2f} req/s arriving, {per_replica:.2f} req/s per replica"
        if count == 0 and queued:
            want, reason = max(want, 1), "requests wait for a first replica"
        if want < 1 and self._runs_batches(state, pressure):  # one to run them on, not more
            want, reason = 1, "batch lines wait for a replica" if count == 0 else "batch lines run"
        state.reason = reason
        return max(scale.min_replicas, min(scale.max_replicas, want))

    def _queue_share(self, state: _Group, members: list[Replica]) -> float:
        """This deployment's part of the model's queue (the gateways queue per model; the router spreads
        requests over all of its replicas): its share of the model's slots, ready or on the way. With none
        anywhere, the model's first deployment that may grow wakes for all of it (`_leads`), no other."""
        slots, mine = 0, False
        for group, deployment in enumerate(state.model.deployments):
            live = [r for r in self._supervisor.members(state.model.name, group) if r.state is not _FAILED]
            if deployment.autoscale is not None and len(live) < deployment.autoscale.max_replicas:
                slots += sum(r.capacity or 1 for r in live)
                mine = mine or group == state.group
        if not mine:  # (at its max: those that can grow take the queue)
            return 0.0
        if slots:  # (those that can grow share it by their slots; a fixed or maxed one's are full already)
            return sum(r.capacity or 1 for r in members) / slots
        return 1.0 if self._leads(state) else 0.0

    def _leads(self, state: _Group) -> bool:
        """This deployment is the one the model's queue as a whole (its oldest wait) pushes: the first of
        the model's autoscaled deployments below its `max_replicas` that is not backing off (replacing
        failed replicas: it cannot grow now); else the first below its max; else the first. None while a
        replica of any of them is on its way."""
        name = state.model.name
        groups = sorted((g for (model, _), g in self._groups.items() if model == name), key=lambda g: g.group)
        if any(r.state in _LOADING for g in groups for r in self._supervisor.members(name, g.group)):
            return False  # (a replica on its way, of any of its deployments, answers the wait: not another)
        below = [
            group
            for group in groups
            if sum(r.state is not _FAILED for r in self._supervisor.members(name, group.group))
            < group.spec.max_replicas
        ]
        now = time.monotonic()
        able = [group for group in below if group.held_until <= now]
        chosen = able or below or groups
        return not chosen or chosen[0] is state

    def _batch_part(self, state: _Group, ready: list[Replica], pressure: dict[str, float]) -> float:
        """The slots the model's batch lines hold on this deployment's replicas: its part of the model's
        ready slots (the runners report per model; lines are routed over all of its replicas)."""
        batch = pressure.get("batch_in_flight", 0.0)
        everyone = sum(r.capacity or 1 for r in self._replicas.ready(state.model.name))
        return batch * sum(r.capacity or 1 for r in ready) / everyone if everyone else batch

    def _runs_batches(self, state: _Group, pressure: dict[str, float]) -> bool:
        """This deployment keeps (or wakes) a replica for the model's batch lines: some run or wait, and no
        other deployment of the model has a replica to run them (the first autoscaled one wakes)."""
        if not (pressure.get("batch_in_flight") or pressure.get("batch_pending")):
            return False
        name = state.model.name
        first = min((group for model, group in self._groups if model == name), default=state.group)
        own = {r.id for r in self._supervisor.members(name, state.group)}
        return state.group == first and all(r.id in own for r in self._supervisor.members(name))

    async def _replica_rate(self, state: _Group) -> float | None:
        deployment = state.model.deployments[state.group]
        lengths = state.lengths or (512.0, 128.0)
        slo = state.model.slo.ttft_p95 if state.model.slo is not None else None
        return await asyncio.to_thread(replica_request_rate, state.model, deployment, lengths, slo)

    def _scale_up(self, state: _Group, more: int, members: list[Replica]) -> None:
        plans = self._supervisor.unused_plans(state.model.name, state.group, state.plans)[:more]
        if not plans:  # every GPU is held (a draining replica still has its own): try again next tick
            logger.info(
                "autoscaler %s: wants %d more replicas, no launch plan is free", state.model.name, more
            )
            return
        revision = max((r.revision for r in members), default=0)
        added = self._supervisor.add(state.model.name, state.engine, plans, state.group, revision)
        if state.replace_wait:
            state.replacements.update(r.id for r in added)
        self._supervisor.start_added()
        message = f"scale up {len(members)} → {len(members) + len(added)}: {state.reason}"
        logger.info("autoscaler %s: %s", state.model.name, message)
        self._replicas.record("scale", state.model.name, message)

    def _scale_down(self, state: _Group, members: list[Replica], want: int, fewer: int = 1) -> None:
        """Drain `fewer` of `members` at once (`want`: the count wanted, for the record)."""
        # those that serve nothing go first: still loading, then unhealthy (its in-flight count says
        # nothing of load: a hung engine's requests wait out their timeouts); then the least busy
        order = sorted(members, key=lambda r: (r.ready, r.state not in _LOADING, _busy(r), -members.index(r)))
        victims = order[:fewer]
        drained = ", ".join(r.id for r in victims)
        message = f"scale down {len(members)} → {len(members) - len(victims)} (wants {want}): drain {drained}"
        logger.info("autoscaler %s: %s", state.model.name, message)
        self._replicas.record("scale", state.model.name, message)
        scaling = state.model.deployments[state.group].autoscale
        grace = scaling.drain_grace_s if scaling is not None else None
        for victim in victims:
            self._drain(victim, grace)

    def _drain(self, replica: Replica, grace_s: float | None = None) -> None:
        """Drain `replica` within `grace_s` (None: the autoscaler's own grace)."""
        task = asyncio.create_task(self._drained_within_grace(replica, grace_s or self._grace))
        self._drains.add(task)
        task.add_done_callback(self._drained)

    async def _drained_within_grace(self, replica: Replica, grace: float) -> dict[str, object]:
        """Drain `replica`; when its grace runs out first, the requests it still had then were cut: how
        many is logged and recorded in the scale event."""
        drain = asyncio.ensure_future(self._supervisor.drain(replica.id, grace))
        done, _ = await asyncio.wait({drain}, timeout=grace)
        cut = replica.outstanding if not done else 0  # (in flight as its grace ran out: the drain stops it)
        result = await drain
        if not result.get("idle", True):
            message = (
                f"drain of {replica.id} timed out after its {grace:g}s grace: "
                f"{cut} {'request' if cut == 1 else 'requests'} in flight cut"
            )
            logger.warning("autoscaler %s: %s", replica.model, message)
            self._replicas.record("scale", replica.model, message)
        return result

    def _drained(self, task: asyncio.Task[object]) -> None:
        self._drains.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("autoscaler: a drain failed: %s", task.exception())


def _newly_failed(state: _Replacing, members: list[Replica]) -> list[Replica]:
    """Those of a deployment's `members` the supervisor gave up on (failed starts) that are not yet being
    replaced, now noted as such; the replacements' backoff follows: it grows while they fail too, and is
    reset once a replacement serves, or after _REPLACE_QUIET_S without a failure."""
    present = {r.id for r in members}
    state.replaced &= present  # (drained ones leave the members)
    state.replacements &= present
    failed = [r for r in members if r.state is ReplicaState.FAILED and r.id not in state.replaced]
    state.replaced.update(r.id for r in failed)
    now = time.monotonic()
    if failed:  # its replacements back off while they fail too
        state.held_until, state.failed_at = now + state.replace_wait, now
        state.replace_wait = min(max(2 * state.replace_wait, _REPLACE_WAIT_S), _REPLACE_WAIT_MAX_S)
    elif any(r.ready and r.id in state.replacements for r in members) or (
        now - state.failed_at > _REPLACE_QUIET_S
    ):  # (a dead GPU's beside ready ones: only a replacement that serves, or quiet, says it passed)
        state.replace_wait = 0.0
        state.replacements.clear()
    return failed


def _smoothed(mean: float, value: float, elapsed: float, half_life: float) -> float:
    return mean + (1.0 - math.pow(0.5, elapsed / half_life)) * (value - mean)


def _follow_rate(state: _Group, instant: float, elapsed: float) -> None:
    """Update the arrival rate's means with one interval's rate (see _RATE_QUICK_HALF_LIFE_S)."""
    weight = 1.0 - math.pow(0.5, elapsed / _RATE_QUICK_HALF_LIFE_S)
    state.quick += weight * (instant - state.quick)
    # the quick mean's standard deviation where arrivals come at the steady rate (at least one an interval)
    noise = math.sqrt(weight / (2 - weight) * max(state.steady, 1 / elapsed) / elapsed)
    if state.quick > state.steady + _RISE_SDS * noise:
        state.rising = True
    elif state.quick < state.steady + _RISEN_SDS * noise:
        state.rising = False
    falling = state.quick < state.steady - _RISE_SDS * noise
    half_life = _RATE_FALL_HALF_LIFE_S if falling else _RATE_STEADY_HALF_LIFE_S
    state.steady = _smoothed(state.steady, instant, elapsed, half_life)
    state.rate = state.quick if state.rising else state.steady


def _token_deltas(counters: dict[str, tuple[float, float]], members: list[Replica]) -> tuple[float, float]:
    """Prompt and generated tokens the replicas' engines counted since the last call, replica by replica (a
    replica that left takes its counts with it, one that came counts from zero, a restart from its new
    zero), remembering the counters in `counters`."""
    prompt = generated = 0.0
    seen: dict[str, tuple[float, float]] = {}
    for replica in members:
        if replica.load is None:
            continue
        now = (replica.load.prompt_tokens_total, replica.load.generated_tokens_total)
        before = counters.get(replica.id, (0.0, 0.0))
        if now[0] >= before[0] and now[1] >= before[1]:
            prompt, generated = prompt + now[0] - before[0], generated + now[1] - before[1]
        else:  # the engine restarted: its counters began again
            prompt, generated = prompt + now[0], generated + now[1]
        seen[replica.id] = now
    counters.clear()
    counters.update(seen)
    return prompt, generated


def _busy(replica: Replica) -> int:
    """Requests on a replica: the gateways' count in flight (summed over gateway workers)."""
    return replica.outstanding


def _pressures(
    scale: AutoscaleSpec,
    ready: list[Replica],
    loads: list[EngineLoad],
    share: float,
    pressure: dict[str, float],
    waits: bool = True,
) -> str:
    """Why one more replica is wanted regardless of slot counts, or '' when nothing presses. `loads`: the
    ready replicas' engine loads read lately; `share`: interactive requests' part of what the replicas
    hold (KV cache and prefill that batch lines take would be taken again on a new replica); `waits`: the
    model's queued requests' wait pushes this deployment (one of the model's)."""
    if waits and pressure.get("oldest_wait_s", 0.0) >= scale.queue_wait_s:
        return f"a request waited {pressure['oldest_wait_s']:.1f}s in the queue"
    kv = [load.kv_usage for load in loads if load.kv_usage is not None]
    if kv and (used := share * sum(kv) / len(kv)) >= scale.kv_usage_high:
        return f"KV cache {used:.0%} used" + (" by interactive requests" if share < 1 else "")
    if ready and scale.prefill_tokens_high is not None:
        pending = share * sum(r.pending_prefill for r in ready) / len(ready)
        if pending >= scale.prefill_tokens_high:
            return f"{pending:.0f} prompt tokens per replica await prefill"
    return ""
