"""The scrape-time series: replicas (readiness, state, restarts, in flight, circuit), each replica's engine
load in one shape for every engine, queue depths and budget use.

They are read from the live replica set when Prometheus scrapes and written straight to the text format
(prometheus_client's generic renderer took ~50 ms for 8 models × 64 replicas, which the gateway's event
loop would pay on every scrape; benchmarks/metrics_render.py). With several gateway workers, each worker's
own part (`WORKERS_OWN`) is published once a second to a file of its own that the worker answering a scrape
merges (`PublishedState`).

Budgets: a tenant-admin may mint thousands of budgeted keys, and a series per key made that many series,
dashboard lines and alerts. A key is exported on its own only from half its budget (the alert fires at
0.9), and only the `BUDGET_KEYS_SHOWN` highest; every tenant's highest share is exported too.
"""

from __future__ import annotations

import heapq
import operator
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path

import orjson

from corral.routing import CircuitState, Router

__all__ = [
    "BUDGET_KEYS_SHOWN",
    "BUDGET_SHOWN_FROM",
    "WORKERS_OWN",
    "BudgetsSpent",
    "Family",
    "Published",
    "PublishedState",
    "StateSeries",
]

BudgetsSpent = Callable[[], list[tuple[str, str, float]]]  # (tenant, key id, share of the monthly budget)
Published = dict[str, list[tuple[list[str], float]]]  # a worker's families: name → [(label values, value)]
BUDGET_SHOWN_FROM = 0.5  # a key's own series from this share of its budget on (observe/rules.py: 0.9)
BUDGET_KEYS_SHOWN = 50  # at most this many keys' own series: the highest shares

_CIRCUIT = {CircuitState.CLOSED: 0, CircuitState.HALF_OPEN: 1, CircuitState.OPEN: 2}
_KEY_BUDGET = "corral_key_budget_used_ratio"
_TENANT_BUDGET = "corral_key_budget_used_max_ratio"
# With several gateway workers, the families each worker knows its own part of (its requests in flight and
# queued, its breakers, the budgets of the keys that asked it), published by each worker and summed or the
# highest. Every other family is the supervisor's snapshot, the same in every worker: the worker that
# answers the scrape writes it itself, so a replica that left leaves the output.
WORKERS_OWN = frozenset(
    {"corral_replica_outstanding", "corral_queue_depth", "corral_circuit_state", _KEY_BUDGET, _TENANT_BUDGET}
)
_SUMMED = frozenset({"corral_replica_outstanding", "corral_queue_depth"})  # the others: the highest
_PER_REPLICA = ("model", "replica")
_ENGINE_GAUGES = (
    ("running", "Sequences the engine is running (its own figure).", "running"),
    ("waiting", "Sequences waiting inside the engine.", "waiting"),
    ("kv_cache_usage_ratio", "Share of the engine's KV cache in use (0-1).", "kv_usage"),
)
_ENGINE_COUNTERS = (
    ("prompt_tokens", "Prompt tokens the engine processed since it started.", "prompt_tokens_total"),
    ("generated_tokens", "Tokens the engine generated since it started.", "generated_tokens_total"),
    (
        "prefix_cache_queries",
        "Prompt tokens looked up in the engine's prefix cache.",
        "prefix_cache_queries_total",
    ),
    ("prefix_cache_hits", "Prompt tokens found in the engine's prefix cache.", "prefix_cache_hits_total"),
    ("preemptions", "Sequences the engine preempted.", "preemptions_total"),
)


@dataclass(slots=True)
class Family:
    """One metric family: its exposed name (counters end in `_total`), type, help and samples."""

    name: str
    kind: str  # "gauge" | "counter"
    doc: str
    labels: tuple[str, ...]
    samples: list[tuple[tuple[str, ...], float]] = field(default_factory=list)

    def text(self, quoted: Callable[[str], str]) -> str:
        head = f"# HELP {self.name} {self.doc}\n# TYPE {self.name} {self.kind}\n"
        names = self.labels
        body = [
            f"{self.name}{{{','.join(f'{n}={quoted(v)}' for n, v in zip(names, values, strict=True))}}} "
            f"{float(value)!r}\n"
            for values, value in self.samples
        ]
        return head + "".join(body)


def quote_label(value: str) -> str:
    """A label value in the text format: quoted, with backslash, quote and newline escaped."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


class StateSeries:
    """Reads the scrape-time families from the router's replica set, the queues and the budgets."""

    def __init__(
        self, router: Router, queue_depths: Callable[[], dict[str, int]], budgets: BudgetsSpent
    ) -> None:
        self._router = router
        self._queue_depths = queue_depths
        self._budgets = budgets
        self._quoted: dict[str, str] = {}  # label values repeat every scrape: quote each once

    def text(self, families: list[Family] | None = None) -> bytes:
        """`families` (by default this gateway's, read now) in Prometheus's text format."""
        if len(self._quoted) > 65536:  # replicas and keys come and go: start over rather than grow
            self._quoted.clear()
        families = self.families() if families is None else families
        return "".join(f.text(self._quote) for f in families).encode()

    def _quote(self, value: str) -> str:
        found = self._quoted.get(value)
        if found is None:
            found = self._quoted[value] = quote_label(value)
        return found

    def families(self) -> list[Family]:
        families = self._replica_families() + self._engine_families()
        depth = Family("corral_queue_depth", "gauge", "Requests waiting for a replica slot.", ("model",))
        depth.samples = [((model,), float(size)) for model, size in self._queue_depths().items()]
        return [*families, depth, *budget_families(self._budgets())]

    def _replica_families(self) -> list[Family]:
        outstanding = Family(
            "corral_replica_outstanding",
            "gauge",
            "Sequences in flight per replica (a request asking n choices: n).",
            _PER_REPLICA,
        )
        ready = Family("corral_replica_ready", "gauge", "1 when the replica takes traffic.", _PER_REPLICA)
        circuit = Family(
            "corral_circuit_state", "gauge", "Circuit breaker: 0 closed, 1 half-open, 2 open.", _PER_REPLICA
        )
        state = Family(
            "corral_replica_state",
            "gauge",
            "1, labelled with the replica's current state (one series per replica, not one per state)",
            (*_PER_REPLICA, "state"),
        )
        restarts = Family(
            "corral_replica_restarts_total",
            "counter",
            "Times the supervisor restarted the replica.",
            _PER_REPLICA,
        )
        for replica in self._router.replicas:
            labels = (replica.model, replica.id)
            outstanding.samples.append((labels, replica.outstanding))
            ready.samples.append((labels, 1.0 if replica.ready else 0.0))
            circuit.samples.append((labels, _CIRCUIT[replica.breaker.state]))
            restarts.samples.append((labels, replica.restarts))
            state.samples.append(((*labels, str(replica.state)), 1.0))
        return [outstanding, ready, circuit, state, restarts]

    def _engine_families(self) -> list[Family]:
        """Each replica's last scraped engine load, the same names whatever the engine."""
        fields = [
            (Family(f"corral_engine_{name}", "gauge", doc, _PER_REPLICA), attribute)
            for name, doc, attribute in _ENGINE_GAUGES
        ]
        fields += [
            (Family(f"corral_engine_{name}_total", "counter", doc, _PER_REPLICA), attribute)
            for name, doc, attribute in _ENGINE_COUNTERS
        ]
        for replica in self._router.replicas:
            load = replica.load
            if load is None:
                continue
            labels = (replica.model, replica.id)
            for family, attribute in fields:
                value = getattr(load, attribute)
                if value is not None:
                    family.samples.append((labels, value))
        return [family for family, _ in fields]


def budget_families(spent: list[tuple[str, str, float]]) -> list[Family]:
    """The keys at `BUDGET_SHOWN_FROM` of their budget or more (each tenant's highest, and the
    `BUDGET_KEYS_SHOWN` highest of all: one tenant's many spent keys cannot hide another's from the alert),
    and each tenant's highest share."""
    keys = Family(
        _KEY_BUDGET,
        "gauge",
        f"Share of a key's monthly token budget used: keys with a budget this gateway served in the last "
        f"day, from {BUDGET_SHOWN_FROM:g} of it on: each tenant's highest, and the {BUDGET_KEYS_SHOWN} "
        "highest of all.",
        ("tenant", "key"),
    )
    shown = [entry for entry in spent if entry[2] >= BUDGET_SHOWN_FROM]
    tops: dict[str, tuple[str, str, float]] = {}  # each tenant's highest key: its alert is never crowded out
    for entry in shown:
        if entry[0] not in tops or entry[2] > tops[entry[0]][2]:
            tops[entry[0]] = entry
    chosen = dict.fromkeys([*tops.values(), *heapq.nlargest(BUDGET_KEYS_SHOWN, shown, key=itemgetter(2))])
    keys.samples = [((t, k), r) for t, k, r in chosen]
    tenants = Family(
        _TENANT_BUDGET,
        "gauge",
        "The highest share of its monthly token budget any of the tenant's keys used (keys with a budget "
        "this gateway served in the last day).",
        ("tenant",),
    )
    highest: dict[str, float] = {}
    for tenant, _, ratio in spent:
        highest[tenant] = max(ratio, highest.get(tenant, ratio))
    tenants.samples = [((tenant,), ratio) for tenant, ratio in highest.items()]
    return [keys, tenants]


class PublishedState:
    """With several gateway workers: each worker's `WORKERS_OWN` families, shared through a file of its own
    in the metrics folder (written once a second, replaced whole), merged by the worker answering a scrape.
    A file not written for `FRESH_S` is a worker gone (or stuck): its figures leave the sum. (A
    prometheus_client multiprocess gauge cannot remove a label set: a key, replica or queue that left stayed
    at 0 for the worker's life.)"""

    FRESH_S = 5.0
    _GONE_S = 300.0  # a file this old is a dead worker's: removed

    def __init__(self, folder: Path, clock: Callable[[], float] = time.time) -> None:
        self._folder = folder
        self._clock = clock  # (epoch seconds: compared across the workers' processes)
        self._file = folder / f"state_{os.getpid()}.json"

    def update(self, families: list[Family]) -> None:
        """Publish this worker's part of `families`."""
        own = {f.name: [[list(values), value] for values, value in f.samples] for f in families}
        body = {name: samples for name, samples in own.items() if name in WORKERS_OWN}
        partial = self._file.with_suffix(".part")
        partial.write_bytes(orjson.dumps({"at": self._clock(), "families": body}))
        os.replace(partial, self._file)  # (a reader sees the last whole file, never half of one)

    def merged(self, families: list[Family], others: list[Published]) -> list[Family]:
        """`families`, this worker's as read now, with its `WORKERS_OWN` ones merged with `others` (the
        other live workers', `others()`): summed (in flight, queued) or the highest (circuits, budgets). A
        replica's series are those of the replicas this worker knows (the supervisor's snapshot)."""
        out = []
        for family in families:
            if family.name not in WORKERS_OWN:
                out.append(family)
                continue
            values = dict(family.samples)
            combine = operator.add if family.name in _SUMMED else max
            for published in others:
                for labels, value in published.get(family.name, []):
                    key = tuple(labels)
                    values[key] = combine(values[key], value) if key in values else value
            if family.labels[-1:] == ("replica",):
                values = {key: values[key] for key, _ in family.samples}
            merged = Family(family.name, family.kind, family.doc, family.labels, list(values.items()))
            if family.name == _KEY_BUDGET:  # (the highest of all workers' highest)
                spent = [(t, k, r) for (t, k), r in merged.samples]
                merged.samples = budget_families(spent)[0].samples
            out.append(merged)
        return out

    def others(self) -> list[Published]:
        """The families every other live worker published within `FRESH_S` (blocking: files read). A dead
        worker's file leaves at once (its in-flight and queue figures were counted up to `FRESH_S` more)."""
        found = []
        now = self._clock()
        for path in self._folder.glob("state_*.json"):
            if path == self._file:
                continue
            if not _alive(int(path.stem.removeprefix("state_"))):
                path.unlink(missing_ok=True)
                continue
            try:
                published = orjson.loads(path.read_bytes())
            except (OSError, orjson.JSONDecodeError):  # (removed meanwhile: a worker gone)
                continue
            age = now - float(published["at"])
            if age <= self.FRESH_S:
                found.append(published["families"])
            elif age > self._GONE_S:
                path.unlink(missing_ok=True)
        return found

    def remove(self) -> None:
        """This worker stops: its figures leave the others' sums now."""
        self._file.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's process under a reused pid: alive, not ours to judge)
        return True
    return True
