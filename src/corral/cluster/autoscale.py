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

Scaling up starts replicas at once. Scaling down follows the highest count wanted over the last
`down_cooldown_s` (a stabilisation window, as Kubernetes' HPA does: a moment's lull does not shrink the
fleet) and drains one replica per cooldown, the least-loaded (its requests and streams finish). With
`min_replicas: 0` the model is held on demand: the gateways queue its requests while the first replica
starts (`FairQueue`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from corral.cluster.capacity import replica_request_rate
from corral.cluster.supervisor import Supervisor
from corral.config import AutoscaleSpec, ModelSpec
from corral.engines import EngineAdapter, LaunchPlan
from corral.routing import Replica, ReplicaState

__all__ = ["Autoscaler", "Pressure"]

logger = logging.getLogger(__name__)

Pressure = Callable[[], dict[str, dict[str, float]]]  # model → queued, oldest_wait_s, arrived
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


@dataclass
class _Group:
    """One autoscaled deployment and what the autoscaler remembers of it."""

    model: ModelSpec
    group: int
    engine: EngineAdapter
    plans: list[LaunchPlan]  # one per possible replica (max_replicas): vLLM's differ by GPU
    wanted: deque[tuple[float, int]] = field(default_factory=deque)  # (when, count) over the cooldown
    changed_at: float = field(default_factory=time.monotonic)  # the last scaling action
    arrived: float | None = None
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

    def __init__(self, supervisor: Supervisor, pressure: Pressure, grace_s: float = 120.0) -> None:
        self._supervisor = supervisor
        self._replicas = supervisor.replicas
        self._pressure = pressure
        self._grace = grace_s
        self._groups: dict[tuple[str, int], _Group] = {}
        self.frozen: set[str] = set()  # models in a rollout: their counts are the rollout's
        self._drains: set[asyncio.Task[object]] = set()

    def configure(self, model: ModelSpec, group: int, engine: EngineAdapter, plans: list[LaunchPlan]) -> None:
        """Autoscale deployment `group` of `model` with `plans` (one per possible replica), again with new
        bounds or plans (a live setting, a finished rollout); a deployment without `autoscale` is let go."""
        if model.deployments[group].autoscale is None:
            self.forget(model.name, group)
            return
        old = self._groups.get((model.name, group))
        state = _Group(model, group, engine, plans)
        if old is not None:
            state.rate, state.arrived, state.seen_at = old.rate, old.arrived, old.seen_at
            state.quick, state.steady, state.rising = old.quick, old.steady, old.rising
            state.counters, state.token_rates, state.demand = old.counters, old.token_rates, old.demand
            state.lengths = old.lengths
        self._groups[(model.name, group)] = state
        if state.spec.min_replicas == 0:
            self._replicas.on_demand[model.name] = state.spec.hold_s
        else:
            self._replicas.on_demand.pop(model.name, None)
        self._replicas.declared[model.name] = (plans[0].features, plans[0].context_length)
        self._replicas.changed(model.name)

    def forget(self, model: str, group: int | None = None) -> None:
        """Stop autoscaling `model` (one deployment of it when `group` is given)."""
        for key in [k for k in self._groups if k[0] == model and group in (None, k[1])]:
            del self._groups[key]
        if not any(k[0] == model for k in self._groups):
            self._replicas.on_demand.pop(model, None)
            self._replicas.declared.pop(model, None)

    async def run(self) -> None:
        """Decide for every group each `interval_s` (the smallest of them)."""
        while True:
            interval = min((g.spec.interval_s for g in self._groups.values()), default=1.0)
            await asyncio.sleep(interval)
            for state in list(self._groups.values()):
                try:
                    await self._step(state)
                except Exception:  # one deployment's failure must not stop the others' scaling
                    logger.exception("autoscaler: %s deployment %d", state.model.name, state.group)

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
        highest = max(w for _, w in state.wanted)
        if highest < count and now - state.changed_at >= cooldown:
            state.changed_at = now  # one replica per cooldown
            self._scale_down(state, members, highest)

    def _live(self, state: _Group) -> list[Replica]:
        """The deployment's replicas; one the supervisor gave up on (failed starts) is drained, so that it
        is replaced instead of counting as capacity."""
        members = self._supervisor.members(state.model.name, state.group)
        present = {r.id for r in members}
        state.replaced &= present  # (drained ones leave the members)
        state.replacements &= present
        failed = [r for r in members if r.state is ReplicaState.FAILED and r.id not in state.replaced]
        for replica in failed:
            state.replaced.add(replica.id)
            wait = f" in {state.replace_wait:.0f}s" if state.replace_wait else ""
            message = f"replace {replica.id}{wait}: {replica.last_error}"
            self._replicas.record("scale", state.model.name, message)
            self._drain(replica.id)
        now = time.monotonic()
        if failed:  # its replacements back off while they fail too
            state.held_until, state.failed_at = now + state.replace_wait, now
            state.replace_wait = min(max(2 * state.replace_wait, _REPLACE_WAIT_S), _REPLACE_WAIT_MAX_S)
        elif any(r.ready and r.id in state.replacements for r in members) or (
            now - state.failed_at > _REPLACE_QUIET_S
        ):  # (a dead GPU's beside ready ones: only a replacement that serves, or quiet, says it passed)
            state.replace_wait = 0.0
            state.replacements.clear()
        return [r for r in members if r.state is not ReplicaState.FAILED]

    def _measure(self, state: _Group, members: list[Replica], pressure: dict[str, float]) -> None:
        """Update the smoothed arrival rate and the mean request lengths from the latest counters."""
        now = time.monotonic()
        arrived = pressure.get("arrived", 0.0)
        if state.arrived is not None and now > state.seen_at:
            elapsed = now - state.seen_at
            count = max(0.0, arrived - state.arrived)
            _follow_rate(state, count / elapsed, elapsed)
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
        state.arrived, state.seen_at = arrived, now

    async def desired(self, state: _Group, members: list[Replica], pressure: dict[str, float]) -> int:
        """How many replicas the deployment should have now, within its bounds; `state.reason` says why."""
        scale, count = state.spec, len(members)
        ready = [r for r in members if r.ready]
        slots = state.plans[0].capacity or 1
        busy = sum(_busy(r) for r in ready)
        queued = pressure.get("queued", 0.0)
        want = math.ceil((busy + queued) / (slots * scale.target_utilization))
        reason = f"{busy + queued:.0f} requests for {slots} slots each"
        loading = any(r.state in _LOADING for r in members)
        pushes = "" if loading else _pressures(scale, ready, pressure)  # capacity is on its way
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
        state.reason = reason
        return max(scale.min_replicas, min(scale.max_replicas, want))

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

    def _scale_down(self, state: _Group, members: list[Replica], want: int) -> None:
        # one that serves nothing goes first: still loading, then unhealthy (its in-flight count says
        # nothing of load: a hung engine's requests wait out their timeouts); then the least busy
        victim = min(members, key=lambda r: (r.ready, r.state not in _LOADING, _busy(r), -members.index(r)))
        message = f"scale down {len(members)} → {len(members) - 1} (wants {want}): drain {victim.id}"
        logger.info("autoscaler %s: %s", state.model.name, message)
        self._replicas.record("scale", state.model.name, message)
        self._drain(victim.id)

    def _drain(self, replica_id: str) -> None:
        task = asyncio.create_task(self._supervisor.drain(replica_id, self._grace))
        self._drains.add(task)
        task.add_done_callback(self._drained)

    def _drained(self, task: asyncio.Task[object]) -> None:
        self._drains.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("autoscaler: a drain failed: %s", task.exception())


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


def _pressures(scale: AutoscaleSpec, ready: list[Replica], pressure: dict[str, float]) -> str:
    """Why one more replica is wanted regardless of slot counts, or '' when nothing presses."""
    if pressure.get("oldest_wait_s", 0.0) >= scale.queue_wait_s:
        return f"a request waited {pressure['oldest_wait_s']:.1f}s in the queue"
    kv = [r.load.kv_usage for r in ready if r.load is not None and r.load.kv_usage is not None]
    if kv and sum(kv) / len(kv) >= scale.kv_usage_high:
        return f"KV cache {sum(kv) / len(kv):.0%} used"
    if ready and scale.prefill_tokens_high is not None:
        pending = sum(r.pending_prefill for r in ready) / len(ready)
        if pending >= scale.prefill_tokens_high:
            return f"{pending:.0f} prompt tokens per replica await prefill"
    return ""
