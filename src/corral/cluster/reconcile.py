"""Declarative apply: bring a running cluster to a new spec without restarting the gateway.

What it changes live: models added (prepared, started, routable once ready), models removed (drained,
then forgotten), and each deployment's replica count (new replicas started; surplus ones drained, newest
first). What it refuses, with the reason: any other change to a running model (weights, engine or its
arguments: that is a rolling update) and any change outside `models` (gateway, auth, store, limits, queue,
supervisor, ray, deploy: those need a restart).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from corral.cluster.supervisor import Supervisor
from corral.config import ClusterSpec, DeploymentSpec, ModelSpec
from corral.engines import EngineAdapter, LaunchPlan

__all__ = ["ApplyError", "Change", "Reconciler", "plan_changes"]

logger = logging.getLogger(__name__)

Prepare = Callable[[ModelSpec, DeploymentSpec], tuple[EngineAdapter, list[LaunchPlan]]]


class ApplyError(ValueError):
    """The new spec differs from the running one in a way apply cannot make live; the message says how."""


@dataclass(frozen=True)
class Change:
    action: str  # add_model | remove_model | scale_up | scale_down
    model: str
    group: int = 0  # the deployment's index in the model's `deployments`
    count: int = 0  # replicas added or removed

    def as_dict(self) -> dict[str, object]:
        return {"action": self.action, "model": self.model, "deployment": self.group, "replicas": self.count}


def plan_changes(running: ClusterSpec, wanted: ClusterSpec) -> list[Change]:
    """The changes that turn `running` into `wanted`; ApplyError for what needs a restart or a rollout."""
    sections = [
        name
        for name in ClusterSpec.model_fields
        if name != "models" and getattr(running, name) != getattr(wanted, name)
    ]
    if sections:
        raise ApplyError(
            f"changing {', '.join(sections)} needs a restart of corral up (apply changes models)"
        )
    before = {m.name: m for m in running.models}
    after = {m.name: m for m in wanted.models}
    changes = [Change("remove_model", name) for name in before if name not in after]
    for name, model in after.items():
        old = before.get(name)
        if old is None:
            changes.append(Change("add_model", name))
            continue
        if _without_counts(old) != _without_counts(model):
            raise ApplyError(
                f"model {name!r} changed beyond its replica counts: that is a rolling update, not built yet "
                "(apply adds and removes models and changes replica counts)"
            )
        for group, (was, now) in enumerate(zip(old.deployments, model.deployments, strict=True)):
            if now.replicas > was.replicas:
                changes.append(Change("scale_up", name, group, now.replicas - was.replicas))
            elif now.replicas < was.replicas:
                changes.append(Change("scale_down", name, group, was.replicas - now.replicas))
    return changes


def _without_counts(model: ModelSpec) -> dict[str, Any]:
    data = model.model_dump()
    for deployment in data["deployments"]:
        deployment.pop("replicas")
    return data


class Reconciler:
    """Applies specs to the supervisor it was given; `prepare` resolves a deployment's launch plans
    (blocking: fetches and builds), `on_model` tells the gateway a model's settings (routing policy,
    tokenizer, failover mode) before it serves."""

    def __init__(
        self,
        supervisor: Supervisor,
        spec: ClusterSpec,
        prepare: Prepare,
        on_model: Callable[[ModelSpec], None],
    ) -> None:
        self._supervisor = supervisor
        self.spec = spec
        self._prepare = prepare
        self._on_model = on_model
        self._lock = asyncio.Lock()

    async def drain(self, replica_id: str, grace_s: float) -> dict[str, object]:
        return await self._supervisor.drain(replica_id, grace_s)

    async def apply(self, wanted: ClusterSpec, grace_s: float) -> list[dict[str, object]]:
        """Make the changes; one apply at a time. Replicas to add are prepared before any is drained. The
        gateway's host and port stay those `corral up` listens on (its flags may override the file's)."""
        async with self._lock:
            listening = {"host": self.spec.gateway.host, "port": self.spec.gateway.port}
            wanted = wanted.model_copy(update={"gateway": wanted.gateway.model_copy(update=listening)})
            changes = plan_changes(self._running(), wanted)
            models = {m.name: m for m in wanted.models}
            additions = [c for c in changes if c.action in ("add_model", "scale_up")]
            prepared = await asyncio.gather(
                *(asyncio.to_thread(self._plans, c, models[c.model]) for c in additions)
            )
            for change, groups in zip(additions, prepared, strict=True):
                if change.action == "add_model":
                    self._on_model(models[change.model])
                for group, engine, plans in groups:
                    self._supervisor.add(change.model, engine, plans, group)
            self._supervisor.start_added()
            removals = [c for c in changes if c.action in ("remove_model", "scale_down")]
            await asyncio.gather(*(self._remove(c, grace_s) for c in removals))
            self.spec = wanted
            for change in changes:
                logger.info(
                    "apply: %s %s (deployment %d, %d replicas)",
                    change.action,
                    change.model,
                    change.group,
                    change.count,
                )
            return [c.as_dict() for c in changes]

    def _running(self) -> ClusterSpec:
        """The spec as it runs now: replica counts as the supervisor has them (`corral drain` removes
        replicas without a new spec)."""
        models = []
        for model in self.spec.models:
            deployments = [
                d.model_copy(update={"replicas": len(self._supervisor.replica_ids(model.name, group))})
                for group, d in enumerate(model.deployments)
            ]
            models.append(model.model_copy(update={"deployments": deployments}))
        return self.spec.model_copy(update={"models": models})

    def _plans(self, change: Change, model: ModelSpec) -> list[tuple[int, EngineAdapter, list[LaunchPlan]]]:
        if change.action == "add_model":
            groups = list(enumerate(model.deployments))
        else:
            deployment = model.deployments[change.group]
            groups = [(change.group, deployment.model_copy(update={"replicas": change.count}))]
        return [(group, *self._prepare(model, deployment)) for group, deployment in groups]

    async def _remove(self, change: Change, grace_s: float) -> None:
        if change.action == "remove_model":
            victims = self._supervisor.replica_ids(change.model)
        else:
            victims = self._supervisor.replica_ids(change.model, change.group)[-change.count :]
        await asyncio.gather(*(self._supervisor.drain(v, grace_s) for v in victims))
        if change.action == "remove_model":
            self._supervisor.replicas.forget(change.model)
