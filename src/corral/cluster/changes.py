"""What `corral apply` changes: the running spec and the wanted one compared, change by change
(`plan_changes`: models added or removed, replica counts, live settings, rollouts; what needs a restart is
refused; a new gateway address or `deploy` section is told apart, changing nothing now), and the digests
of what a model's replicas run (`deployed_digest`: the response cache keys on it) and of an adapter's
revision (`adapter_digest`, each of a model's as the gateway names them: `adapter_revisions`). The
reconciler (reconcile.py) makes the changes."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from corral.config import AdapterSpec, ClusterSpec, ModelSpec

__all__ = [
    "ApplyError",
    "Change",
    "adapter_digest",
    "adapter_revisions",
    "deployed_digest",
    "plan_changes",
]

_LIVE_MODEL_FIELDS = (
    "routing",
    "tokenizer",
    "slo",
    "mid_stream_failover",
    "prefix_isolation",  # (the gateway's prefix index: no replica knows of it)
    "rollout",
    "cache",
)
_LIVE_SECTIONS = ("queue", "limits")  # and gateway.routing: cluster settings every gateway takes live
_AT_RESTART = ("host", "port")  # gateway: where corral up listens, kept until it starts again
_RENDERED = ("deploy",)  # read by `corral deploy render` alone: nothing running has anything to change


class ApplyError(ValueError):
    """The new spec differs from the running one in a way apply cannot make live; the message says how."""


@dataclass(frozen=True)
class Change:
    # cluster_settings | add_model | remove_model | scale_up | scale_down | settings | rollout; and what
    # changes nothing now: at_restart (gateway.host, gateway.port), render_only (deploy)
    action: str
    model: str
    group: int = 0  # the deployment's index in the model's `deployments`
    count: int = 0  # replicas added or removed
    detail: str = ""  # what changed, in words ("1 replica added, 2 now"; "routing, cache")

    def said(self) -> str:
        """The change in words: `scale_up (deployment 0: 1 replica added, 3 now)`, `settings (routing)`."""
        detail = f"deployment {self.group}: {self.detail}" if self.count else self.detail
        return f"{self.action} ({detail})" if detail else self.action

    def as_dict(self) -> dict[str, object]:
        return {
            "action": self.action,
            "model": self.model,
            "deployment": self.group,
            "replicas": self.count,
            "detail": self.detail,
        }


def plan_changes(
    running: ClusterSpec,
    wanted: ClusterSpec,
    workers: int = 1,
    revised: Mapping[str, Collection[str]] | None = None,
) -> list[Change]:
    """The changes that turn `running` into `wanted` (served by `workers` gateway processes; `revised`:
    each model's adapters whose files changed where they lie, a new revision each: `adapter_revisions`),
    ending with what changes nothing now (`at_restart`, `render_only`); ApplyError for what needs a
    restart."""
    sections = [
        name
        for name in ClusterSpec.model_fields
        if name not in ("models", "gateway", *_LIVE_SECTIONS, *_RENDERED)
        and getattr(running, name) != getattr(wanted, name)
    ]
    sections += [
        f"gateway.{name}"
        for name in type(running.gateway).model_fields
        if name not in ("routing", *_AT_RESTART)
        and getattr(running.gateway, name) != getattr(wanted.gateway, name)
    ]
    if sections:
        raise ApplyError(
            f"changing {', '.join(sections)} needs a restart of corral up (apply changes models, queue, "
            "limits and gateway.routing)"
        )
    problem = wanted.workers_problem(workers)
    if problem:  # (limits or a cache kept per process, replicas with fewer slots than the workers)
        raise ApplyError(
            f"the new spec cannot be served by the {workers} gateway workers running: workers: {workers} "
            f"{problem} (or restart corral up with fewer workers)"
        )
    live = [name for name in _LIVE_SECTIONS if getattr(running, name) != getattr(wanted, name)]
    live += ["gateway"] if running.gateway.routing != wanted.gateway.routing else []
    before = {m.name: m for m in running.models}
    after = {m.name: m for m in wanted.models}
    changes = [Change("cluster_settings", ",".join(live))] if live else []
    changes += [Change("remove_model", name) for name in before if name not in after]
    for name, model in after.items():
        old = before.get(name)
        if old is None:
            changes.append(Change("add_model", name))
        elif _deployed(old) != _deployed(model):
            changes.append(Change("rollout", name))
        else:
            if changed := _live_changes(old, model, (revised or {}).get(name, ())):
                changes.append(Change("settings", name, detail=", ".join(changed)))
            changes += _count_changes(old, model)
    return changes + _unapplied(running, wanted)


def _unapplied(running: ClusterSpec, wanted: ClusterSpec) -> list[Change]:
    """What differs but changes nothing running: the gateway's address (the next start of corral up takes
    it) and the sections only `corral deploy render` reads."""
    notes = []
    moved = [
        f"gateway.{name}"
        for name in _AT_RESTART
        if getattr(running.gateway, name) != getattr(wanted.gateway, name)
    ]
    if moved:
        notes.append(Change("at_restart", "", detail=", ".join(moved)))
    rendered = [name for name in _RENDERED if getattr(running, name) != getattr(wanted, name)]
    if rendered:
        notes.append(Change("render_only", "", detail=", ".join(rendered)))
    return notes


def _count_changes(old: ModelSpec, new: ModelSpec) -> list[Change]:
    changes = []
    for group, (was, now) in enumerate(zip(old.deployments, new.deployments, strict=True)):
        if now.autoscale is not None:
            continue  # the autoscaler keeps the count within the (new) bounds
        if now.replicas > was.replicas:
            more = now.replicas - was.replicas
            detail = f"{more} {_replicas(more)} added, {now.replicas} now"
            changes.append(Change("scale_up", new.name, group, more, detail))
        elif now.replicas < was.replicas:
            fewer = was.replicas - now.replicas
            detail = f"{fewer} {_replicas(fewer)} drained, {now.replicas} left"
            changes.append(Change("scale_down", new.name, group, fewer, detail))
    return changes


def _deployed(model: ModelSpec) -> dict[str, Any]:
    """What the replicas themselves run: a difference here needs new replicas (a rollout). Adapters are
    the replicas' where llama.cpp loads them at its start; vLLM and the simulator load them at run time,
    so only whether LoRA is on at all is theirs. Who may use an adapter, and its limits, are the gateway's."""
    data = model.model_dump(mode="json", exclude={*_LIVE_MODEL_FIELDS, "adapters"})
    for deployment in data["deployments"]:
        deployment.pop("replicas")
        deployment.pop("autoscale")
    if any(d.engine == "llamacpp" for d in model.deployments):
        data["adapters"] = [a.model_dump(mode="json", include={"name", "source"}) for a in model.adapters]
    else:
        data["adapters"] = bool(model.adapters)
    if model.adapters:
        data["lora"].pop("placement")  # (the gateway's)
    else:
        data.pop("lora")  # (no engine reads it)
    return data


def adapter_digest(adapter: AdapterSpec, folder: str = "") -> str:
    """A digest of where an adapter comes from and (given its `folder`) what its files are now (the config's
    bytes, each file's size and modification time): its revision's engine name is `name@digest`, so a
    replaced adapter's answers are never taken for the old one's (or served from its cache entries), and
    files changed where they lie make a new revision when the gateway next reads the spec."""
    digest = hashlib.sha256(orjson.dumps(adapter.source.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS))
    place = Path(folder) if folder else None
    if place is not None and place.is_dir():
        for file in sorted(place.iterdir()):
            if file.is_file():
                stat = file.stat()
                digest.update(f"{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        config = place / "adapter_config.json"
        if config.is_file():
            digest.update(config.read_bytes())
    return digest.hexdigest()[:10]


def adapter_revisions(model: ModelSpec, folder: Callable[[AdapterSpec], str]) -> dict[str, str]:
    """Each of the model's adapters' revision digest (by name) as the gateway names it: of its source, and
    of its files where the model's engines load adapters at run time (`folder`: where they lie, fetched
    once). Blocking: a hub may be asked."""
    loads = any(d.engine in ("vllm", "sim") for d in model.deployments)
    return {a.name: adapter_digest(a, folder(a) if loads else "") for a in model.adapters}


def _adapter_changes(old: ModelSpec, new: ModelSpec, revised: Collection[str] = ()) -> list[str]:
    """The adapters added, replaced (their source, or their files where they lie: `revised`) or removed
    (by name), or whose access or limits changed."""
    was = {a.name: a for a in old.adapters}
    now = {a.name: a for a in new.adapters}
    changed = {name for name in was.keys() | now.keys() if was.get(name) != now.get(name)}
    return sorted(changed | (set(revised) & was.keys() & now.keys()))


def deployed_digest(model: ModelSpec) -> str:
    """A digest of what a model's replicas run (weights, engine, arguments): the response cache keys on it,
    so answers of an earlier deployment are never served after a rollout."""
    return hashlib.sha256(orjson.dumps(_deployed(model), option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def _live_changes(old: ModelSpec, new: ModelSpec, revised: Collection[str] = ()) -> list[str]:
    """The live settings that differ (field names; `autoscale` for any deployment's; the adapters changed,
    `revised` included)."""
    was, now = (
        old.model_dump(include=set(_LIVE_MODEL_FIELDS)),
        new.model_dump(include=set(_LIVE_MODEL_FIELDS)),
    )
    changed = [name for name in sorted(_LIVE_MODEL_FIELDS) if was.get(name) != now.get(name)]
    if [d.autoscale for d in old.deployments] != [d.autoscale for d in new.deployments]:
        changed.append("autoscale")
    if adapters := _adapter_changes(old, new, revised):
        changed.append(f"adapters {' '.join(adapters)}")
    return changed


def _replicas(count: int) -> str:
    return "replica" if count == 1 else "replicas"
