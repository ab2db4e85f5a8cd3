"""How an apply counts a deployment's replicas: those the supervisor gave up on (failed starts) serve
nothing, so they count for no replica of the running spec; a fixed-count deployment's failed replicas (and
those drained whose replacements the reconciler's loop still owes, backing off) are replaced by the apply,
which says so; and a lower count drains the replicas serving nothing first.
"""

from __future__ import annotations

import dataclasses

from corral.cluster.autoscale import Autoscaler
from corral.cluster.changes import Change
from corral.cluster.supervisor import Supervisor
from corral.config import ClusterSpec
from corral.routing import Replica, ReplicaState

__all__ = ["failed_fixed", "replacing", "running_spec", "scale_down_victims", "serving"]

_NOTES = ("at_restart", "render_only")  # an apply's changes that change nothing now (said last)


def serving(members: list[Replica]) -> list[Replica]:
    """Those of a deployment's replicas the supervisor has not given up on (failed ones serve nothing)."""
    return [r for r in members if r.state is not ReplicaState.FAILED]


def running_spec(spec: ClusterSpec, supervisor: Supervisor) -> ClusterSpec:
    """`spec` as it runs now: replica counts as the supervisor has them (`corral drain` and the autoscaler
    change them without a new spec), less those it gave up on (failed: they serve nothing)."""
    models = []
    for model in spec.models:
        deployments = [
            d.model_copy(update={"replicas": len(serving(supervisor.members(model.name, group)))})
            for group, d in enumerate(model.deployments)
        ]
        models.append(model.model_copy(update={"deployments": deployments}))
    return spec.model_copy(update={"models": models})


def failed_fixed(
    supervisor: Supervisor, autoscaler: Autoscaler, changes: list[Change], wanted: ClusterSpec
) -> dict[tuple[str, int], list[str]]:
    """The replicas the supervisor gave up on in deployments that keep a fixed count, of the models
    `wanted` keeps without a rollout (which replaces every replica, or owns them while it runs): the
    apply replaces them."""
    elsewhere = {c.model for c in changes if c.action in ("rollout", "remove_model", "add_model")}
    elsewhere |= autoscaler.frozen
    failed = {}
    for model in wanted.models:
        if model.name in elsewhere or not supervisor.replicas.has_model(model.name):
            continue
        for group, deployment in enumerate(model.deployments):
            members = supervisor.members(model.name, group)
            ids = [r.id for r in members if r.state is ReplicaState.FAILED]
            ids += autoscaler.owed(model.name, group)  # (drained, their replacements owed)
            if ids and deployment.autoscale is None:
                failed[(model.name, group)] = ids
    return failed


def replacing(
    changes: list[Change], failed: dict[tuple[str, int], list[str]], wanted: ClusterSpec
) -> list[Change]:
    """`changes`, saying which failed replicas an apply replaces: a scale-up of their deployment starts
    replicas in their place; where none is wanted (as many serve as the spec says), they are drained."""
    said = []
    for change in changes:
        ids = failed.get((change.model, change.group)) if change.action == "scale_up" else None
        said.append(
            change
            if not ids
            else dataclasses.replace(change, detail=f"{change.detail}, in place of failed {', '.join(ids)}")
        )
    scaled = {(c.model, c.group) for c in changes if c.action == "scale_up"}
    counts = {m.name: m.deployments for m in wanted.models}
    for (model, group), ids in failed.items():
        if (model, group) not in scaled:
            left = counts[model][group].replicas
            detail = f"failed {', '.join(ids)} drained, {left} left"
            said.insert(
                len(said) - sum(c.action in _NOTES for c in said),
                Change("drain_failed", model, group, len(ids), detail),
            )
    return said


def scale_down_victims(members: list[Replica], count: int) -> list[str]:
    """The `count` of a deployment's replicas (oldest first) a lower count drains: those serving nothing
    first (given up on, unhealthy, starting: draining the ready ones would leave a model with a replica
    that never serves), then the newest."""
    ranked = sorted(range(len(members)), key=lambda k: (members[k].ready, -k))
    return [members[k].id for k in ranked[:count]]
