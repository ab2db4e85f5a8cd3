"""Rolling and blue-green updates of one model: gated, watched, and rolled back on failure.

A rollout replaces a model's replicas with ones started from its new spec (a new `revision`), without
failing a request:

1. start the first new replicas (rolling: one, surge 1; blue-green: all) with no traffic (a split of 0);
2. gate each: it must become ready without a failed start, answer a warm-up request and the golden eval;
3. shift traffic in the policy's steps (weighted: a share of the model's requests goes to the new
   revision), watching each step: a new replica that stops being ready, an error ratio above
   `max_error_ratio`, or engine TTFT above `max_ttft_ratio` × the old replicas' rolls back. A step in
   which no request reached the new revision, or without TTFTs to compare (llama.cpp reports none), passes
   unjudged: each step's event, and the rollout's state, say how many requests the new revision served
   and failed, or that the step was not judged;
4. replace the rest: rolling starts and gates one new replica per old one it drains; blue-green sends all
   traffic to the new revision and drains every old replica. Draining lets requests and streams finish.

GPUs: a new replica starts only on GPUs that no live replica of the model holds (one being drained holds
its GPUs until it has stopped), as the supervisor counts them (`Supervisor.gpu_holders`: a plan's
CUDA_VISIBLE_DEVICES; nothing under Ray, which picks GPUs itself; nothing for engines without GPUs, whose
rollouts are as above). Spare GPUs are taken first: the new spec's launch plans no running replica holds,
including the GPU slices its `gpus:` lists beyond its replica count. With none spare, the rollout drains
an old replica before starting the new one that needs its GPUs (max-unavailable 1), taking old replicas'
GPUs in the order they are retired. The trade-off: when every listed GPU is busy, even the first (canary)
step first drains an old replica, so the model runs one replica short while each new one starts and is
gated (a model with a single replica has none for that time: its requests wait in the queue). Blue-green
needs GPUs for the whole new revision at once: without them it is refused (rolled back before anything
starts, saying so) rather than started on GPUs the old replicas hold, where vLLM runs out of memory.

A model with no replica running (an autoscaled deployment idle at zero, or whose replicas all failed and
were drained) still has its new revision gated: its units hold one replica for such a deployment, which
starts, is gated and takes the steps like any; once the rollout completes it is the autoscaler's (which
drains it after `down_cooldown_s` without traffic). A rollout with no unit at all rolls back: nothing
would check the revision before its first replica served.

Rolling back stops sending to the new revision at once, starts again any old replica already drained, then
drains the new ones: the old replicas serve throughout. An old replica whose GPUs a new one holds is
started again only after that new one is drained. `pause`, `resume` and `abort` act between checks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Coroutine
from typing import Any

import aiohttp

from corral.cluster.evalgate import gate_timeout, run_gate
from corral.cluster.supervisor import Supervisor
from corral.config import RolloutSpec
from corral.engines import EngineAdapter, LaunchPlan
from corral.routing import Replica, ReplicaState, TrafficSplit

__all__ = ["Rollout", "Unit"]

logger = logging.getLogger(__name__)

Unit = tuple[int, EngineAdapter, LaunchPlan]  # a replica to start: deployment group, engine, plan
_CHECK_S = 0.25
_MIN_JUDGED = 20  # requests a new revision serves before its error ratio can fail a step early


class _Abort(Exception):
    """Why the rollout stops and rolls back."""


class Rollout:
    """One model's update from its running replicas to `units` (the new spec's replicas)."""

    def __init__(
        self,
        supervisor: Supervisor,
        model: str,
        units: list[Unit],
        policy: RolloutSpec,
        revision: int,
        grace_s: float,
        spares: list[Unit] | None = None,
    ) -> None:
        """`units`: the new replicas to start; `spares`: other launch plans of their deployments (GPUs the
        spec lists beyond its replicas) a new replica may take instead, when its own GPUs are held."""
        self._supervisor = supervisor
        self._replicas = supervisor.replicas
        self.model = model
        self._units = units
        self._pool = [*units, *(spares or [])]  # plans not taken yet, the preferred first
        self._wanted = Counter(group for group, _, _ in units)  # new replicas still to start, per group
        self._policy = policy
        self.revision = revision
        self._grace = grace_s
        self._resume = asyncio.Event()
        self._resume.set()
        self._abort: str | None = None
        self._aborted = asyncio.Event()  # set with `_abort`: what waits long (the gate) stops at once
        self._drained_old: list[tuple[Unit, int]] = []  # old replicas drained so far, and their revision
        self._judged: list[tuple[int, int]] = []  # each traffic step's requests to the new revision, failed
        self.outcome: str | None = None  # completed | rolled_back, once done
        self._state: dict[str, Any] = {
            "model": model,
            "revision": revision,
            "strategy": policy.strategy,
            "phase": "starting",
            "share": 0.0,
            "paused": False,
            "started_at": round(time.time(), 3),
            "message": "",
            "served": 0,  # requests the new revision served in the traffic steps
            "failed": 0,
        }

    # control -------------------------------------------------------------------------------------

    def pause(self) -> None:
        self._resume.clear()
        self._publish(paused=True)
        self._replicas.record("rollout", self.model, "paused")

    def resume(self) -> None:
        self._resume.set()
        self._publish(paused=False)
        self._replicas.record("rollout", self.model, "resumed")

    def abort(self, reason: str) -> None:
        self._abort = reason
        self._resume.set()
        self._aborted.set()

    @property
    def state(self) -> dict[str, Any]:
        return dict(self._state)

    # the run ---------------------------------------------------------------------------------------

    async def run(self) -> str:
        """Carry the rollout out; 'completed' or 'rolled_back'. Anything that goes wrong on the way rolls
        back, and the outcome is always set."""
        old = self._supervisor.members(self.model)
        self._event(f"revision {self.revision}: {len(self._units)} new replicas replace {len(old)}")
        outcome = "rolled_back"
        try:
            async with aiohttp.ClientSession() as session:
                try:
                    await self._forward(session, old)
                except _Abort as exc:
                    await self._roll_back(str(exc), suspect=self._abort is None)
                except Exception as exc:
                    logger.exception("rollout of %s: unexpected failure", self.model)
                    await self._roll_back(f"unexpected failure: {type(exc).__name__}: {exc}", suspect=True)
                else:
                    outcome = "completed"
                    message = f"every replica runs the new revision; {self._judged_in_all()}"
                    self._publish(phase="completed", share=1.0, message=message)
                    self._event(f"revision {self.revision} completed; {self._judged_in_all()}")
        finally:
            self._replicas.splits.pop(self.model, None)
            self.outcome = outcome
        return outcome

    async def _forward(self, session: aiohttp.ClientSession, old: list[Replica]) -> None:
        if not self._units:  # nothing would be gated: its first replica would serve untested
            raise _Abort(f"revision {self.revision} has no replica to start and gate before it serves")
        if self._policy.strategy == "blue_green":
            await self._blue_green(session, old)
        else:
            await self._rolling(session, old)

    async def _rolling(self, session: aiohttp.ClientSession, old: list[Replica]) -> None:
        waiting = list(old)  # old replicas still running, in the order they are retired
        new = await self._start(session, [await self._claim(waiting)])  # routable once gated (`admitted`)
        await self._shift(new, waiting, capped=True)
        self._replicas.splits.pop(self.model, None)  # routed by the model's policy over both
        self._publish(phase="replacing", share=None)
        while self._wanted.total():
            if waiting:  # surge 1: an old replica goes for each further new one
                await self._retire(self._pop_retiree(waiting))
            new += await self._start(session, [await self._claim(waiting)])
            await self._watch(new, waiting, 0.0)
        await asyncio.gather(*(self._retire(r) for r in waiting))

    async def _blue_green(self, session: aiohttp.ClientSession, old: list[Replica]) -> None:
        new = await self._start(session, self._claim_all())
        await self._shift(new, old, capped=False)
        self._replicas.splits[self.model] = TrafficSplit(self.revision, 1.0)
        self._publish(phase="replacing", share=1.0)
        await asyncio.gather(*(self._retire(r) for r in old))

    async def _shift(self, new: list[Replica], old: list[Replica], capped: bool) -> None:
        """Move traffic to the new revision in the policy's steps, watching each."""
        for step, share in enumerate(self._policy.steps, 1):
            if capped:  # a new replica among the old ones takes at most its share by count
                share = min(share, len(new) / (len(new) + len(old)))
            self._replicas.splits[self.model] = TrafficSplit(self.revision, share)
            steps = len(self._policy.steps)
            self._publish(phase="shifting", share=share, step=step, message=f"step {step} of {steps}")
            self._event(f"step {step}: {share:.0%} of traffic to revision {self.revision}")
            served, failed = await self._watch(new, old, self._policy.step_s)
            self._judged.append((served, failed))
            judged = self._judged_in_step(served, failed, new, old)
            totals = {"served": sum(s for s, _ in self._judged), "failed": sum(f for _, f in self._judged)}
            self._publish(message=f"step {step} of {steps}: {judged}", **totals)
            self._event(f"step {step}: {judged}")

    # GPUs ------------------------------------------------------------------------------------------

    async def _claim(self, waiting: list[Replica]) -> Unit:
        """The next new replica's launch plan, on GPUs no live replica holds (spare ones first). When none
        is free, the oldest of `waiting` whose GPUs a plan needs is retired first; GPUs held by replicas
        someone else is draining are waited for."""
        deadline = time.monotonic() + self._grace + self._policy.ready_timeout_s
        while (unit := self._free_unit()) is None:
            self._check_abort()
            blocker = self._blocker(waiting)
            if blocker is not None:
                waiting.remove(blocker)
                self._event(f"no free GPUs for the next new replica: {blocker.id} is drained first")
                await self._retire(blocker)
            elif time.monotonic() > deadline:
                raise _Abort(f"no free GPUs for revision {self.revision}'s next replica: {self._held()}")
            else:
                await asyncio.sleep(_CHECK_S)
        return self._take(unit)

    def _claim_all(self) -> list[Unit]:
        """Plans for every new replica at once (blue-green), all on free GPUs; _Abort when there are not
        enough: the old replicas hold the rest, and only a rolling update can free them."""
        units = []
        while (unit := self._free_unit()) is not None:
            units.append(self._take(unit))
        if self._wanted.total():
            raise _Abort(
                f"blue_green needs spare GPUs for the whole new revision: {len(self._units)} new replicas, "
                f"free GPUs for {len(units)} ({self._held()}); list spare GPUs in the deployment's `gpus`, "
                "or use strategy rolling"
            )
        return units

    def _free_unit(self) -> Unit | None:
        """The first plan still wanted whose GPUs no live replica but this revision's holds (the new spec
        may share GPUs between its own deployments)."""
        held: set[str] = set()
        for replica, gpus in self._supervisor.gpu_holders(self.model):
            if replica.revision != self.revision:
                held |= gpus
        gpus_of = self._supervisor.plan_gpus
        return next((u for u in self._pool if self._wanted[u[0]] and not gpus_of(u[2]) & held), None)

    def _take(self, unit: Unit) -> Unit:
        self._pool.remove(unit)
        self._wanted[unit[0]] -= 1
        return unit

    def _blocker(self, waiting: list[Replica]) -> Replica | None:
        """The first of `waiting` holding GPUs that a plan still wanted needs."""
        needed: set[str] = set()
        for group, _, plan in self._pool:
            if self._wanted[group]:
                needed |= self._supervisor.plan_gpus(plan)
        holding = {r.id: gpus for r, gpus in self._supervisor.gpu_holders(self.model)}
        return next((r for r in waiting if holding.get(r.id, frozenset()) & needed), None)

    def _pop_retiree(self, waiting: list[Replica]) -> Replica:
        """The oldest waiting replica, unless no new one could start now and a later one holds GPUs a new
        one needs: that one, so that a retirement always frees room."""
        blocker = None if self._free_unit() is not None else self._blocker(waiting)
        chosen = blocker or waiting[0]
        waiting.remove(chosen)
        return chosen

    def _held(self) -> str:
        held = self._supervisor.gpu_holders(self.model)
        return ", ".join(f"GPU {','.join(sorted(gpus))} held by {r.id}" for r, gpus in held) or "none held"

    def _new_holding(self, plan: LaunchPlan) -> list[Replica]:
        """This revision's replicas that hold any of `plan`'s GPUs."""
        gpus = self._supervisor.plan_gpus(plan)
        holders = self._supervisor.gpu_holders(self.model)
        return [r for r, held in holders if r.revision == self.revision and held & gpus]

    # starting and watching ---------------------------------------------------------------------

    async def _start(self, session: aiohttp.ClientSession, units: list[Unit]) -> list[Replica]:
        """Start replicas of the new revision, wait until they are ready, and gate each."""
        started = [
            replica
            for group, engine, plan in units
            for replica in self._supervisor.add(
                self.model, engine, [plan], group, self.revision, admitted=False
            )
        ]
        self._supervisor.start_added()
        ids = ", ".join(r.id for r in started)
        self._publish(phase="starting", message=f"starting {ids}")
        await self._until_ready(started)
        self._publish(phase="gating", message=f"golden eval on {ids}")
        seconds, limit = gate_timeout(self._policy)
        for replica in started:
            gate = run_gate(
                session, replica, self._policy.golden_eval, self._policy.eval_latency_s, seconds,
                timeout_name=limit,
            )  # fmt: skip
            problem = await self._unless_aborted(gate)
            if problem is not None:
                raise _Abort(f"{replica.id} failed the gate: {problem}")
        for replica in started:
            replica.admitted = True  # routable from here on (within the traffic split)
        self._event(f"{ids} passed the gate ({len(self._policy.golden_eval)} golden prompts)")
        return started

    async def _unless_aborted(self, work: Coroutine[Any, Any, str | None]) -> str | None:
        """`work`'s result, unless the rollout is aborted first (a rollback asked for): then _Abort at once,
        `work` cancelled."""
        task = asyncio.ensure_future(work)
        aborted = asyncio.ensure_future(self._aborted.wait())
        try:
            await asyncio.wait({task, aborted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in (task, aborted):
                waiting.cancel()
            await asyncio.gather(task, aborted, return_exceptions=True)
        self._check_abort()
        return task.result()

    async def _until_ready(self, replicas: list[Replica]) -> None:
        deadline = time.monotonic() + self._policy.ready_timeout_s
        while not all(r.state is ReplicaState.READY for r in replicas):
            self._check_abort()
            for replica in replicas:
                if replica.state in (ReplicaState.RESTARTING, ReplicaState.FAILED):
                    raise _Abort(f"{replica.id} cannot start: {replica.last_error}")
            if time.monotonic() > deadline:
                raise _Abort(f"not ready within {self._policy.ready_timeout_s:g}s")
            await asyncio.sleep(_CHECK_S)

    async def _watch(self, new: list[Replica], old: list[Replica], seconds: float) -> tuple[int, int]:
        """Hold a step for `seconds` (longer while paused), checking the new replicas' health throughout;
        the requests they served in it, and how many of those failed."""
        base = {r.id: (r.served, r.failures) for r in new}
        deadline = time.monotonic() + seconds
        while True:
            self._check_abort()
            judged = self._check_health(new, old, base, final=time.monotonic() >= deadline)
            if time.monotonic() >= deadline and self._resume.is_set():
                return judged
            await asyncio.sleep(_CHECK_S)

    def _check_abort(self) -> None:
        if self._abort is not None:
            raise _Abort(self._abort)

    def _check_health(
        self, new: list[Replica], old: list[Replica], base: dict[str, tuple[int, int]], final: bool
    ) -> tuple[int, int]:
        """_Abort when the new replicas fail a check; else the requests they served since `base`, and how
        many of those failed."""
        for replica in new:
            if replica.state is not ReplicaState.READY:
                why = replica.last_error or "no reason given"
                raise _Abort(f"{replica.id} became {replica.state}: {why}")
        served = sum(r.served - base.get(r.id, (0, 0))[0] for r in new)
        failed = sum(r.failures - base.get(r.id, (0, 0))[1] for r in new)
        if served and (final or served >= _MIN_JUDGED) and failed / served > self._policy.max_error_ratio:
            raise _Abort(
                f"{failed} of {served} requests to revision {self.revision} failed "
                f"(over {self._policy.max_error_ratio:.0%})"
            )
        limit = self._policy.max_ttft_ratio
        new_ttft, old_ttft = _mean_ttft(new), _mean_ttft(old)
        if final and limit and new_ttft and old_ttft and new_ttft > limit * old_ttft:
            raise _Abort(
                f"revision {self.revision}'s engine TTFT {new_ttft * 1000:.0f} ms is over {limit:g}× the old "
                f"replicas' {old_ttft * 1000:.0f} ms"
            )
        return served, failed

    def _judged_in_step(self, served: int, failed: int, new: list[Replica], old: list[Replica]) -> str:
        """What a step's checks judged, in words: a step with no request to the new revision, or with no
        TTFT to compare, passes without a verdict, and says so."""
        if not served:
            return f"not judged: no traffic reached revision {self.revision}"
        judged = f"revision {self.revision} served {served} requests, {failed} failed"
        if self._policy.max_ttft_ratio:
            new_ttft, old_ttft = _mean_ttft(new), _mean_ttft(old)
            if new_ttft and old_ttft:
                judged += f"; engine TTFT {new_ttft * 1000:.0f} ms against {old_ttft * 1000:.0f} ms"
            else:
                judged += "; TTFT not compared (not reported by both revisions' engines)"
        return judged

    def _judged_in_all(self) -> str:
        served, failed = sum(s for s, _ in self._judged), sum(f for _, f in self._judged)
        if not served:
            return "its traffic steps were not judged: no traffic reached it"
        return f"its traffic steps judged {served} requests, {failed} failed"

    async def _retire(self, replica: Replica) -> None:
        try:
            unit = self._supervisor.unit(replica.id)
        except KeyError:
            return  # drained by someone else meanwhile (corral drain)
        self._publish(message=f"draining {replica.id}")
        await self._supervisor.drain(replica.id, self._grace)
        self._drained_old.append((unit, replica.revision))
        self._event(f"{replica.id} drained")

    async def _roll_back(self, reason: str, suspect: bool) -> None:
        """Back to the old revision. New replicas that failed a check (`suspect`) get no request from here
        on; after a rollback someone asked for, they serve until the old replicas are back."""
        logger.warning("rollout of %s (revision %d) rolls back: %s", self.model, self.revision, reason)
        if suspect:
            self._replicas.splits[self.model] = TrafficSplit(self.revision, 0.0)
        self._publish(phase="rolling_back", message=reason)
        self._event(f"rolling back: {reason}")
        back = await self._restart_old()
        candidates = [r for r in self._supervisor.members(self.model) if r.revision == self.revision]
        if not back and candidates:
            self._replicas.splits.pop(self.model, None)  # keep serving with what answers
            message = f"{reason}; the old replicas did not come back, so {len(candidates)} new ones stay"
            self._publish(phase="rolled_back", share=None, message=message)
            self._event(message)
            return
        self._replicas.splits[self.model] = TrafficSplit(self.revision, 0.0)
        await asyncio.gather(*(self._supervisor.drain(r.id, self._grace) for r in candidates))
        self._publish(phase="rolled_back", share=0.0, message=reason)
        self._event(f"rolled back to the previous revision: {reason}")

    async def _restart_old(self) -> bool:
        """Start the drained old replicas again: at once those whose GPUs are free, then one at a time each
        whose GPUs new replicas hold, once those are drained. False when one did not come back in time."""
        free: list[tuple[Unit, int]] = []
        blocked: list[tuple[Unit, int]] = []
        for drained in self._drained_old:
            (blocked if self._new_holding(drained[0][2]) else free).append(drained)
        if not await self._restart(free):
            return False
        for unit, revision in blocked:
            holders = self._new_holding(unit[2])
            if holders:
                self._event(f"draining {', '.join(r.id for r in holders)} to free GPUs for an old replica")
            await asyncio.gather(*(self._supervisor.drain(r.id, self._grace) for r in holders))
            if not await self._restart([(unit, revision)]):
                return False
        return True

    async def _restart(self, drained: list[tuple[Unit, int]]) -> bool:
        """Start these old replicas again; whether all are ready within the policy's ready timeout."""
        restarted = [
            replica
            for (group, engine, plan), revision in drained
            for replica in self._supervisor.add(self.model, engine, [plan], group, revision)
        ]
        self._supervisor.start_added()
        deadline = time.monotonic() + self._policy.ready_timeout_s
        while not all(r.ready for r in restarted) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(_CHECK_S)
        return all(r.ready for r in restarted)

    def _publish(self, **changes: Any) -> None:
        self._state.update(changes, updated_at=round(time.time(), 3))
        self._replicas.rollouts[self.model] = dict(self._state)

    def _event(self, message: str) -> None:
        logger.info("rollout %s: %s", self.model, message)
        self._replicas.record("rollout", self.model, message)


def _mean_ttft(replicas: list[Replica]) -> float | None:
    known = [r.load.ttft_mean_s for r in replicas if r.load is not None and r.load.ttft_mean_s]
    return sum(known) / len(known) if known else None
