"""Declarative apply: bring a running cluster to a new spec without restarting the gateway.

What it changes live: models added (prepared, started, routable once ready), models removed (drained, then
forgotten), each deployment's replica count (new replicas started; surplus ones drained: those serving nothing
first, then the newest; an autoscaled deployment's count is the autoscaler's, within the new bounds), a
model's live settings (routing policy, failover mode, prefix isolation, tokenizer, SLO, rollout policy,
autoscale bounds), and any other change of a running model (weights, engine, its arguments): a gated
rollout (cluster/rollout.py), and the cluster settings every gateway takes live (`queue`, `limits`,
`gateway.routing`). What it tells apart, changing nothing: `gateway.host` and `gateway.port` (the gateway
keeps listening where `corral up` started it; its next start takes them) and the `deploy` section (read by
`corral deploy render` alone). What it refuses, with the reason: any other change outside `models` (the
rest of `gateway`, `auth`, `store`, `supervisor`, `ray`: those need a restart), and a change to a model
whose rollout is still running.

The reconciler owns the control loops that change the running cluster: apply, rollouts, the autoscaler
(cluster/autoscale.py) and drains; each change is an event in the replica set's log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import aiohttp

from corral.cluster.autoscale import DRAIN_GRACE_S, Autoscaler, Pressure
from corral.cluster.changes import (
    ApplyError,
    Change,
    adapter_revisions,
    plan_changes,
)
from corral.cluster.counts import failed_fixed, replacing, running_spec, scale_down_victims, serving
from corral.cluster.evalgate import gate_adapter
from corral.cluster.preflight import preflight
from corral.cluster.rollout import Rollout, Unit
from corral.cluster.supervisor import Supervisor
from corral.config import AdapterSpec, ClusterSpec, DeploymentSpec, ModelSpec
from corral.engines import EngineAdapter, LaunchPlan
from corral.engines.devices import DeviceError, check_local_gpus, local_gpu_count

__all__ = ["Reconciler"]

logger = logging.getLogger(__name__)

Prepare = Callable[[ModelSpec, DeploymentSpec], tuple[EngineAdapter, list[LaunchPlan]]]
Group = tuple[int, EngineAdapter, list[LaunchPlan]]  # a deployment's index, engine and launch plans
Units = tuple[list[Unit], list[Unit]]  # a rollout's new replicas, and the spare plans they may take instead


class _Prepared(NamedTuple):
    """An apply's changes, with what each needs fetched and built (`Reconciler._prepare_apply`)."""

    wanted: ClusterSpec
    changes: list[Change]
    models: dict[str, ModelSpec]  # the wanted spec's, by name
    before: dict[str, ModelSpec]  # the running spec's, by name
    additions: list[tuple[Change, list[Group]]]
    rollouts: list[tuple[Change, Units]]
    settings: list[tuple[Change, list[tuple[EngineAdapter, list[LaunchPlan]] | None]]]
    revisions: dict[str, dict[str, str]]  # the wanted spec's adapters' revisions, by model and name
    failed: dict[tuple[str, int], list[str]]  # fixed-count deployments' failed replicas, the apply replaces


class Reconciler:
    """Applies specs to the supervisor it was given; `prepare` resolves a deployment's launch plans
    (blocking: fetches and builds), `on_model` tells the gateway(s) a model's settings (routing policy,
    tokenizer, failover mode) before it serves (awaited: what it reads, off the event loop); `pressure`
    reads the gateways' queues (the autoscaler); `overrides` gives an applied spec what `corral up`'s flags
    changed in the one it started with (--ray: the file does not say it), ValueError where it cannot;
    `gpu_count` counts this machine's GPUs (blocking), for the checks `corral up` makes of local vLLM
    deployments."""

    def __init__(
        self,
        supervisor: Supervisor,
        spec: ClusterSpec,
        prepare: Prepare,
        on_model: Callable[[ModelSpec], Awaitable[None]],
        pressure: Pressure | None = None,
        on_cluster: Callable[[ClusterSpec], None] | None = None,
        adapter_path: Callable[[AdapterSpec], str] | None = None,
        workers: int = 1,
        *,
        overrides: Callable[[ClusterSpec], ClusterSpec] | None = None,
        gpu_count: Callable[[], int] = local_gpu_count,
    ) -> None:
        self._supervisor = supervisor
        self._gpu_count = gpu_count
        self._overrides = overrides or (lambda spec: spec)
        self._workers = workers  # the gateway processes sharing the replicas' slots
        self._adapter_path = adapter_path or (lambda adapter: "")
        self._replicas = supervisor.replicas
        self.spec = spec
        self._prepare = prepare
        self._on_model = on_model
        self._on_cluster = on_cluster or (lambda spec: None)
        self._lock = asyncio.Lock()
        # (a replica scaled down may finish its requests for as long as the gateway's at its shutdown)
        grace = max(DRAIN_GRACE_S, spec.gateway.shutdown_grace)
        self.autoscaler = Autoscaler(supervisor, pressure or (lambda: {}), grace)
        self._rollouts: dict[str, Rollout] = {}
        self._previous: dict[str, ModelSpec] = {}  # each model's spec before its latest rollout
        self._revisions: dict[str, int] = {}  # each model's latest rollout's revision (rolled back or not)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._preparing: set[asyncio.Task[Any]] = set()  # the callers of applies still preparing
        self._stopping = False
        # the adapters' revisions the gateways serve, by model and name (`start` reads the spec's)
        self._adapter_revisions: dict[str, dict[str, str]] = {}
        self._reading: asyncio.Task[dict[str, dict[str, str]]] | None = None

    def start(self, prepared: list[tuple[str, EngineAdapter, list[LaunchPlan]]]) -> None:
        """Begin autoscaling the spec's autoscaled deployments; `prepared` holds each deployment's plans in
        spec order (max_replicas of them for an autoscaled one)."""
        models = {m.name: m for m in self.spec.models}
        groups: dict[str, int] = {}
        for name, engine, plans in prepared:
            group = groups[name] = groups.get(name, -1) + 1
            if models[name].deployments[group].autoscale is not None:
                self.autoscaler.configure(models[name], group, engine, plans)
        self._spawn(self.autoscaler.run())
        self._spawn(self._replace_failed())
        # what the gateways named the adapters' revisions when they read the spec just now: an apply that
        # finds other files where an adapter lies makes a new revision of it
        self._reading = self._spawn(asyncio.to_thread(self._revisions_of, self.spec.models))

    async def _replace_failed(self) -> None:
        """Every probe interval, the fixed-count deployments' replicas the supervisor gave up on are replaced
        (with the autoscaler's backoff); not while an apply or a rollout changes the model's replicas."""
        while True:
            await asyncio.sleep(self.spec.supervisor.probe_interval)
            if self._lock.locked():
                continue
            fixed = [
                (m.name, g)
                for m in self.spec.models
                if m.name not in self.autoscaler.frozen
                for g, d in enumerate(m.deployments)
                if d.autoscale is None
            ]
            try:
                self.autoscaler.replace_failed(fixed)
            except Exception:  # (a loop of the cluster's: it goes on)
                logger.exception("replacing failed replicas")

    def _spawn(self, work: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("control loop %s ended: %r", task.get_name(), task.exception())

    async def stop(self) -> None:
        self._stopping = True
        tasks = [*self._preparing, *self._tasks]  # (an apply still preparing changes nothing)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # drains ------------------------------------------------------------------------------------------

    async def drain(self, replica_id: str, grace_s: float) -> dict[str, object]:
        result = await self._supervisor.drain(replica_id, grace_s)
        self._replicas.record("drain", str(result["model"]), f"{replica_id} drained in {result['waited_s']}s")
        return result

    async def drain_node(self, node: str, grace_s: float) -> dict[str, object]:
        """Cordon a Ray node (nothing new is placed there, so the autoscaler and restarts go elsewhere),
        then drain every replica on it; KeyError when none runs there."""
        ids = self._supervisor.on_node(node)
        if not ids:
            raise KeyError(node)
        await asyncio.to_thread(self._supervisor.cordon, node)
        self._replicas.record("drain", "*", f"node {node} cordoned; draining {', '.join(ids)}")
        results = await asyncio.gather(*(self.drain(rid, grace_s) for rid in ids))
        return {"node": node, "replicas": list(results)}

    # apply -------------------------------------------------------------------------------------------

    async def apply(self, wanted: ClusterSpec, grace_s: float) -> list[dict[str, object]]:
        """Make the changes; one apply at a time. Everything new is prepared (fetched, built) before the
        running cluster is touched, so a spec that cannot be prepared changes nothing; replicas to add
        start before any is drained; a rollout is started and runs on (`corral rollout status`). The
        gateway's host and port stay those `corral up` listens on, and --ray's cluster the one it runs on
        (its flags may override the file's). A caller that goes away while it prepares leaves nothing
        changed (as `stop` does); once it changes the cluster it runs to its end (Ctrl-C, a proxy's timeout
        while replicas drain): half made, the replicas would run what the spec the next apply compares with
        does not say."""
        await self._lock.acquire()
        preparing = asyncio.current_task()
        try:
            if self._stopping:  # (an apply that waited for the lock while the gateway began to stop)
                raise ApplyError("the gateway is stopping (nothing changed)")
            if preparing is not None:
                self._preparing.add(preparing)
            prepared = await self._prepare_apply(wanted)
            if self._stopping:
                raise ApplyError("the gateway is stopping (nothing changed)")
        except BaseException:
            self._lock.release()
            raise
        finally:
            self._preparing.discard(preparing)
        task = asyncio.ensure_future(self._make(prepared, grace_s))
        task.add_done_callback(lambda _: self._lock.release())  # (even cancelled before its first step)
        self._tasks.add(task)
        task.add_done_callback(_applied)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    async def _prepare_apply(self, wanted: ClusterSpec) -> _Prepared:
        """The changes `wanted` makes, with everything they need fetched, built and checked; ApplyError
        (nothing changed) where they cannot be made."""
        try:
            wanted = self._overrides(wanted)
        except ValueError as exc:
            raise ApplyError(f"{exc} (nothing changed)") from exc
        revisions, revised = await self._revised(wanted)
        changes = plan_changes(running_spec(self.spec, self._supervisor), wanted, self._workers, revised)
        failed = failed_fixed(self._supervisor, self.autoscaler, changes, wanted)
        changes = replacing(changes, failed, wanted)
        # (another address is told as taken at the next start: the gateway keeps listening where it does)
        listening = {"host": self.spec.gateway.host, "port": self.spec.gateway.port}
        wanted = wanted.model_copy(update={"gateway": wanted.gateway.model_copy(update=listening)})
        # (a rollout with its outcome is still running until `_roll` has put the model back: frozen)
        rolling = {m for m, r in self._rollouts.items() if not r.outcome} | self.autoscaler.frozen
        busy = sorted({c.model for c in changes} & rolling)
        if busy:
            raise ApplyError(
                f"a rollout of {', '.join(busy)} is still running: wait for it, or "
                f"`corral rollout rollback {busy[0]}`"
            )
        # (the files of the models to be prepared or told to the gateways, before any is fetched or built)
        touched = {c.model for c in changes if c.action in ("add_model", "settings", "rollout", "scale_up")}
        problems = await asyncio.to_thread(preflight, wanted, models=touched)
        if problems:
            raise ApplyError(f"{'; '.join(problems)} (nothing changed)")
        if wanted.ray is None:  # `corral up`'s GPU checks (Ray places the GPUs itself): none shared past 1.0
            try:
                await asyncio.to_thread(lambda: check_local_gpus(wanted, self._gpu_count()))
            except DeviceError as exc:
                raise ApplyError(f"{exc} (nothing changed)") from exc
        models = {m.name: m for m in wanted.models}
        before = {m.name: m for m in self.spec.models}
        additions = [c for c in changes if c.action in ("add_model", "scale_up")]
        rollouts = [c for c in changes if c.action == "rollout"]
        settings = [c for c in changes if c.action == "settings"]
        try:
            added, units, scaled = await asyncio.gather(
                asyncio.gather(*(asyncio.to_thread(self._plans, c, models[c.model]) for c in additions)),
                asyncio.gather(*(asyncio.to_thread(self._units, models[c.model]) for c in rollouts)),
                asyncio.gather(*(asyncio.to_thread(self._scaled, models[c.model]) for c in settings)),
            )
        except Exception as exc:  # a model that cannot be fetched or built: nothing changed
            raise ApplyError(f"cannot prepare the new spec (nothing changed): {exc}") from exc
        for change in settings:  # new adapters fetched and checked; replaced ones pass the golden eval
            if "adapters" in change.detail:
                await self._check_adapters(
                    before[change.model], models[change.model], revised.get(change.model, [])
                )
        return _Prepared(
            wanted, changes, models, before, list(zip(additions, added, strict=True)),
            list(zip(rollouts, units, strict=True)), list(zip(settings, scaled, strict=True)), revisions,
            failed,
        )  # fmt: skip

    async def _revised(self, wanted: ClusterSpec) -> tuple[dict[str, dict[str, str]], dict[str, list[str]]]:
        """The wanted spec's adapters' revisions (their files read in a thread), and by model those of its
        running adapters whose revision the gateways do not serve (files changed where they lie)."""
        if self._reading is not None:  # (the spec's, read as the cluster started)
            with contextlib.suppress(Exception):  # (logged as the task ended: then none are known)
                self._adapter_revisions = {**await asyncio.shield(self._reading), **self._adapter_revisions}
            self._reading = None
        revisions = await asyncio.to_thread(self._revisions_of, wanted.models)
        revised = {
            model: [
                name
                for name, digest in now.items()
                if self._adapter_revisions.get(model, {}).get(name, digest) != digest
            ]
            for model, now in revisions.items()
        }
        return revisions, {model: names for model, names in revised.items() if names}

    def _revisions_of(self, models: list[ModelSpec]) -> dict[str, dict[str, str]]:
        """The models' adapters' revisions (blocking); a model whose adapters cannot be read now is left
        out (what the gateways serve of it stands)."""
        found = {}
        for model in models:
            if not model.adapters:
                continue
            try:
                found[model.name] = adapter_revisions(model, self._adapter_path)
            except Exception as exc:  # (a source's resolver raises what its library does)
                logger.warning("apply: the adapters of %s cannot be read now: %s", model.name, exc)
        return found

    async def _make(self, prepared: _Prepared, grace_s: float) -> list[dict[str, object]]:
        """Make the prepared changes (holding the lock `apply` took, released as this task ends)."""
        wanted, changes, models, before = prepared[:4]
        if changes and changes[0].action == "cluster_settings":
            self._on_cluster(wanted)  # queue bounds, rate limits, the default routing policy
        await self._add(prepared.additions, models)
        for change, groups in prepared.settings:
            await self._on_model(models[change.model])
            self._rescale(models[change.model], groups)
        for change, units in prepared.rollouts:
            await self._start_rollout(before[change.model], models[change.model], units, grace_s)
        for model, group in prepared.failed:  # (in place of them: the scale-ups just started)
            self.autoscaler.settle_fixed(model, group)
        removals = [c for c in changes if c.action in ("remove_model", "scale_down")]
        await asyncio.gather(*(self._remove(c, grace_s, before[c.model]) for c in removals))
        changed = {c.model for c in changes}
        current = {m.name: m for m in self.spec.models}  # unchanged models keep their spec as it runs
        kept = [m if m.name in changed else current.get(m.name, m) for m in wanted.models]
        self.spec = wanted.model_copy(update={"models": kept})
        served = self._adapter_revisions
        self._adapter_revisions = {
            m.name: prepared.revisions.get(m.name, served.get(m.name, {})) for m in wanted.models
        }
        for change in changes:
            message = change.said()
            logger.info("apply: %s %s", change.model or "cluster", message)
            if change.model:  # (not what changes nothing now: a new gateway address, a deploy section)
                self._replicas.record("apply", change.model, message)
        return [c.as_dict() for c in changes]

    async def _check_adapters(self, old: ModelSpec, new: ModelSpec, revised: list[str]) -> None:
        """Fetch the model's adapters (as its engines would: a rank over the limit is refused), and have each
        replaced one (its source, or its files where they lie: `revised`) answer the model's golden eval on
        a ready replica, loaded there under a name of its own, before any request reaches it; ApplyError
        (nothing changed) otherwise."""
        try:
            await asyncio.to_thread(self._prepare, new, new.deployments[0])
        except Exception as exc:
            raise ApplyError(
                f"cannot prepare the new adapters of {new.name} (nothing changed): {exc}"
            ) from exc
        was = {a.name: a for a in old.adapters}
        replaced = [
            a for a in new.adapters if a.name in was and (was[a.name].source != a.source or a.name in revised)
        ]
        cases = new.rollout.golden_eval
        if not replaced or not cases:
            return
        ready = [r for r in self._replicas.ready(new.name) if r.adapter_slots > 0]
        if not ready:
            raise ApplyError(
                f"no ready replica of {new.name} can check the replaced adapters (nothing changed)"
            )
        async with aiohttp.ClientSession() as session:
            for adapter in replaced:
                problem = await gate_adapter(
                    session, ready[0], adapter, self._adapter_path(adapter), new.rollout
                )
                if problem is not None:
                    raise ApplyError(f"adapter {adapter.name}: {problem} (nothing changed)")

    async def _add(self, additions: list[tuple[Change, list[Group]]], models: dict[str, ModelSpec]) -> None:
        for change, groups in additions:
            model = models[change.model]
            if change.action == "add_model":
                await self._on_model(model)
            for group, engine, plans in groups:
                scale = model.deployments[group].autoscale
                if change.action == "scale_up":  # the plans no replica holds: free GPUs, unserved URLs
                    free = self._supervisor.unused_plans(change.model, group, plans)
                    if len(free) < change.count:
                        logger.warning(
                            "apply: %s needs %d more replicas but only %d launch plans are free (the others'"
                            " GPUs are held, draining replicas included): starting %d",
                            change.model,
                            change.count,
                            len(free),
                            len(free),
                        )
                    plans = free[: change.count]
                count = model.deployments[group].replicas if scale is not None else len(plans)
                # (the model's revision, as the autoscaler's scale-ups: a rollout's number, once one ran)
                revision = max((r.revision for r in self._supervisor.members(change.model)), default=0)
                self._supervisor.add(change.model, engine, plans[:count], group, revision)
                if scale is not None:
                    self.autoscaler.configure(model, group, engine, plans)
        self._supervisor.start_added()

    def _scaled(self, model: ModelSpec) -> list[tuple[EngineAdapter, list[LaunchPlan]] | None]:
        """`model`'s autoscaled deployments' engines and plans, prepared (blocking: in a thread); None for
        a deployment without `autoscale`."""
        return [
            None if deployment.autoscale is None else self._prepare(model, _all_plans(deployment))
            for deployment in model.deployments
        ]

    def _rescale(self, model: ModelSpec, groups: list[tuple[EngineAdapter, list[LaunchPlan]] | None]) -> None:
        """Autoscale `model`'s deployments as its spec now says (new bounds, a finished rollout's plans;
        `groups` from `_scaled`); one without `autoscale` is let go."""
        for group, prepared in enumerate(groups):
            if prepared is None:
                self.autoscaler.forget(model.name, group)
            else:
                self.autoscaler.configure(model, group, *prepared)

    def _plans(self, change: Change, model: ModelSpec) -> list[Group]:
        if change.action == "add_model":
            groups = [(g, _all_plans(d)) for g, d in enumerate(model.deployments)]
        else:  # a scale-up: every replica's plan, to choose the ones that running replicas do not hold
            groups = [(change.group, model.deployments[change.group])]
        return [(group, *self._prepare(model, deployment)) for group, deployment in groups]

    async def _remove(self, change: Change, grace_s: float, model: ModelSpec) -> None:
        if change.action == "remove_model":
            victims = self._supervisor.replica_ids(change.model)
            self.autoscaler.forget(change.model)
        else:
            members = serving(self._supervisor.members(change.model, change.group))  # (failed: apart)
            victims = scale_down_victims(members, change.count)
        await asyncio.gather(*(self._supervisor.drain(v, grace_s) for v in victims))
        if change.action == "remove_model":
            self._supervisor.replicas.forget(change.model)
            if model.adapters:  # its adapters leave the gateways with it (not listed, their names free)
                await self._on_model(model.model_copy(update={"adapters": [], "tokenizer": None}))

    # rollouts ----------------------------------------------------------------------------------------

    async def _start_rollout(self, old: ModelSpec, new: ModelSpec, units: Units, grace_s: float) -> None:
        """Start `new`'s rollout (the gateways told its settings first: a caller gone meanwhile leaves no
        rollout registered that never runs, its model frozen for the autoscaler and closed to applies)."""
        await self._on_model(new)
        if not units[0]:  # every deployment fixed at `replicas: 0`: nothing runs to gate or to replace
            self._replicas.record("rollout", new.name, "no replica runs or is wanted: the new spec is taken")
            return
        members = self._supervisor.members(new.name)
        # a number never used before: a rolled-back attempt's revision is not the next one's
        revision = max((r.revision for r in members), default=0)
        revision = max(revision, self._revisions.get(new.name, 0)) + 1
        self._revisions[new.name] = revision
        wanted, spares = units
        rollout = Rollout(self._supervisor, new.name, wanted, new.rollout, revision, grace_s, spares)
        self._rollouts[new.name] = rollout
        self._previous[new.name] = old
        self.autoscaler.frozen.add(new.name)
        self._spawn(self._roll(rollout, old, new))

    def _units(self, model: ModelSpec) -> Units:
        """The new spec's replicas: a fixed-count deployment's `replicas` (a count changed with the rollout
        is taken with it); an autoscaled one as many as run now (one at zero, idle or its replicas failed
        and drained, gets one: the rollout gates it, then leaves it to the autoscaler, so that no replica
        of the new spec serves without having passed the gate);
        and the deployments' other plans, spare GPUs a new replica may start on beside the old ones."""
        units: list[Unit] = []
        spares: list[Unit] = []
        for group, deployment in enumerate(model.deployments):
            running = self._supervisor.replica_ids(model.name, group)
            count = (len(running) or 1) if deployment.autoscale else deployment.replicas
            engine, plans = self._prepare(model, _every_slice(deployment))
            if deployment.engine == "external":
                count = len(plans)  # a replica per URL of the new spec, however many run now
            units += [(group, engine, plan) for plan in plans[:count]]
            spares += [(group, engine, plan) for plan in plans[count:]]
        return units, spares

    async def _roll(self, rollout: Rollout, old: ModelSpec, new: ModelSpec) -> None:
        try:
            outcome = await rollout.run()
        finally:
            kept = new if rollout.outcome == "completed" else old
            if kept is old:  # the gateways' settings (the cache's version) back at once, not after the lock:
                try:  # the old replicas' answers are kept as the new spec's meanwhile
                    await self._on_model(old)
                except Exception:  # (an adapter gone from its path): the model is unfrozen, its spec kept
                    logger.exception("rollout of %s: telling the gateways the old settings failed", new.name)
            async with self._lock:
                self.autoscaler.frozen.discard(new.name)
                # (completed: its replicas are the new spec's; rolled back, what was owed starts when due)
                if kept is new:
                    self.autoscaler.forget_owed(new.name)
                if any(m.name == new.name for m in self.spec.models):  # not removed meanwhile
                    self.spec = self.spec.model_copy(
                        update={"models": [kept if m.name == new.name else m for m in self.spec.models]}
                    )
                    self._rescale(kept, await asyncio.to_thread(self._scaled, kept))
        logger.info("rollout of %s: %s", new.name, outcome)

    async def rollout_action(self, model: str, action: str, grace_s: float = 60.0) -> dict[str, object]:
        """pause | resume | rollback a model's rollout. Rolling back a finished rollout starts one back to
        the spec before it. KeyError: no rollout of that model (or the model is gone); ValueError: the
        action does not apply now."""
        if action not in ("pause", "resume", "rollback"):
            raise ValueError(f"unknown rollout action {action!r} (pause, resume, rollback)")
        async with self._lock:  # no apply is starting a rollout of this model meanwhile
            rollout = self._rollouts.get(model)
            current = next((m for m in self.spec.models if m.name == model), None)
            if rollout is None or current is None:
                raise KeyError(model)
            if rollout.outcome is None:
                if action == "pause":
                    rollout.pause()
                elif action == "resume":
                    rollout.resume()
                else:
                    rollout.abort("rollback asked for")
                return rollout.state
            if action != "rollback" or rollout.outcome == "rolled_back":
                raise ValueError(f"the rollout of {model} has ended ({rollout.outcome}): nothing to {action}")
            previous = self._previous[model]
            try:
                units = await asyncio.to_thread(self._units, previous)
            except Exception as exc:
                raise ValueError(f"cannot prepare the spec before the rollout: {exc}") from exc
            await self._start_rollout(current, previous, units, grace_s)
            return self._rollouts[model].state


def _all_plans(deployment: DeploymentSpec) -> DeploymentSpec:
    """An autoscaled deployment is prepared for its most replicas (vLLM's plans differ by GPU)."""
    if deployment.autoscale is None:
        return deployment
    return deployment.model_copy(update={"replicas": deployment.autoscale.max_replicas})


def _every_slice(deployment: DeploymentSpec) -> DeploymentSpec:
    """Prepared for a plan per GPU slice its `gpus` list holds (TP × PP GPUs each), however many replicas
    it runs: the slices beyond them are the spare GPUs a rollout starts new replicas on first."""
    deployment = _all_plans(deployment)
    if not deployment.gpus:
        return deployment
    slices = len(deployment.gpus) // deployment.gpus_per_replica
    return deployment.model_copy(update={"replicas": max(deployment.replicas, slices)})


def _applied(task: asyncio.Task[Any]) -> None:
    """An apply's failure is its caller's answer; logged too, for one whose caller went away."""
    if not task.cancelled() and task.exception() is not None:
        logger.warning("apply ended without its changes: %s", task.exception())
