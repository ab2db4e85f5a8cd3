"""The router: each model's policy applied to its routable replicas, with in-flight accounting,
circuit breakers, a retry budget, and a log of recent decisions for the admin view.

It also keeps, per replica, the prompt tokens routed there whose prefill has not finished (the policy's
predicted work), and the prefills running now by the prompt blocks they compute: a request sent to a
replica that is computing its long prefix for another request right now is held until that prefill ends
(its first token), so the engine finds the prefix in its cache instead of computing it twice, when the
spec turns prefill coalescing on (`gateway.prefill_coalescing`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from typing import Any

import orjson

from corral.protocol import NoCapacity
from corral.routing.adapters import AdapterPlacement, Residence
from corral.routing.circuit import RetryBudget
from corral.routing.policy import DEFAULT_POLICY, PrefixAffinity, RoutingPolicy, policy_named
from corral.routing.prefix import PrefillTracker
from corral.routing.replicas import Replica, ReplicaSet
from corral.routing.request import RouteRequest

__all__ = ["Router"]


class Router:
    """Picks a replica for each request and counts what is outstanding on each."""

    def __init__(
        self,
        replicas: ReplicaSet,
        policies: Mapping[str, str] | None = None,
        default_policy: str = DEFAULT_POLICY,
        decisions_kept: int = 200,
        coalesce_prefills: bool = False,
    ) -> None:
        self.replicas = replicas
        self._default = default_policy
        self._coalesce = coalesce_prefills
        self._share: Callable[[bytes], None] | None = None  # see `share_placements`
        self._flush_pending = False
        self._policies: dict[str, RoutingPolicy] = {m: self._policy(p) for m, p in (policies or {}).items()}
        self.retry_budget = RetryBudget()
        self._decisions: deque[tuple[float, str, str, str, str, bool]] = deque(maxlen=decisions_kept)
        self._prefills = PrefillTracker()
        self._generations: dict[str, int] = {}  # each model's replica-set generation last seen
        self.adapters = AdapterPlacement()  # which replica holds which LoRA adapter (routing/adapters.py)
        # told of each adapter a replica should unload (the gateway's adapter loader does it)
        self.on_unload: Callable[[Replica, Residence], None] = lambda replica, residence: None

    def set_default(self, name: str) -> None:
        """A new default policy (a live `corral apply`); models are then set again with `set_policy`."""
        self._default = name

    def set_policy(self, model: str, name: str | None) -> None:
        """Route `model` by policy `name` (None: the default); for a model added to a running cluster."""
        self._policies[model] = self._policy(name or self._default)

    def policy_for(self, model: str) -> RoutingPolicy:
        policy = self._policies.get(model)
        if policy is None:
            policy = self._policies[model] = self._policy(self._default)
        return policy

    def _policy(self, name: str) -> RoutingPolicy:
        policy = policy_named(name)
        if self._coalesce and isinstance(policy, PrefixAffinity):
            policy.coalescing = True  # a duplicate cold prefill is what coalescing avoids: it costs more
        if self._share is not None and isinstance(policy, PrefixAffinity):
            policy.outbox, policy.wake = [], self._flush_soon
        return policy

    def share_placements(self, send: Callable[[bytes], None]) -> None:
        """With several gateway workers: hand this worker's prefix placements (which prompt blocks went to
        which replica, and when those requests ended) to `send`, one JSON line per event-loop turn, for the
        other workers' `learn_placements`. Each worker's prefix index then knows every worker's routing, as
        one gateway's would: with an index of its own requests only, two workers place a tenant's document
        on two replicas, and each counts its own documents against a replica's whole cache."""
        self._share = send
        for policy in self._policies.values():
            if isinstance(policy, PrefixAffinity):
                policy.outbox, policy.wake = [], self._flush_soon

    def learn_placements(self, message: Mapping[str, Any]) -> None:
        """Another worker's placements (a line `share_placements` sent, parsed)."""
        for model, entries in message["placements"].items():
            policy = self.policy_for(model)
            if not isinstance(policy, PrefixAffinity):
                continue
            replicas = {r.id: r for r in self.replicas.of(model)}
            for rid, hashes, ended, use in entries:
                replica = replicas.get(rid)
                if replica is not None:
                    policy.learn(replica, hashes, ended, use)

    def _flush_soon(self) -> None:
        if self._flush_pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (the routing replay): at once
            self._flush()
            return
        self._flush_pending = True
        loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        placements = {}
        for model, policy in self._policies.items():
            if isinstance(policy, PrefixAffinity) and policy.outbox:
                placements[model], policy.outbox = policy.outbox, []
        if placements and self._share is not None:
            self._share(orjson.dumps({"placements": placements}) + b"\n")

    def acquire(self, request: RouteRequest, exclude: Collection[Replica] = ()) -> Replica:
        """A routable replica for the request, now counted as outstanding; else NoCapacity."""
        ready = self.replicas.ready(request.model)
        candidates = [r for r in ready if r.breaker.allows() and r not in exclude]
        adapter = request.adapter
        if adapter is not None and candidates:  # (first: a rollout's old replicas may lack a new adapter)
            candidates = self.adapters.candidates(adapter, candidates, request.tenant)
        split = self.replicas.splits.get(request.model)
        if split is not None:  # a rollout is shifting traffic to a new revision
            candidates = split.choose(candidates, random.random(), ready)
        if not candidates:
            raise NoCapacity(
                f"No ready replica of model '{request.model}' can take the request now.",
                retry_after=self.replicas.retry_after(request.model),
            )
        policy = self.policy_for(request.model)
        generation = self.replicas.generation.get(request.model, 0)
        if self._generations.get(request.model) != generation:  # replicas came or went
            self._generations[request.model] = generation
            present = {r.id for r in self.replicas.of(request.model)}
            if isinstance(policy, PrefixAffinity):  # those gone leave the prefix index
                policy.keep(present)
            self.adapters.keep(request.model, present)
        decision = policy.pick(candidates, request)
        replica = decision.replica
        if adapter is not None:
            request.residence, request.load_adapter, unload = self.adapters.use(
                replica, adapter, request.tenant
            )
            for residence in unload:
                self.on_unload(replica, residence)
        request.trial = replica.breaker.on_dispatch()
        capacity = replica.capacity
        request.held = min(request.sequences, capacity) if capacity else request.sequences
        replica.outstanding += request.held
        replica.outstanding_tokens += request.tokens
        hashes = request.hashes  # empty unless the policy reads the prompt
        cached = min(decision.cached_blocks, len(hashes))
        request.prefill = (
            round(request.prompt_tokens * (1 - cached / len(hashes))) if hashes else request.prompt_tokens
        )
        replica.pending_prefill += request.prefill
        if self._coalesce and len(hashes) > cached:
            request.inflight = self._prefills.start(replica.id, hashes[cached:])
        self._decisions.append(
            (time.time(), request.model, replica.id, policy.name, decision.reason, bool(exclude))
        )
        return replica

    @property
    def decisions(self) -> list[dict[str, object]]:
        """The latest routing decisions, oldest first."""
        keys = ("at", "model", "replica", "policy", "reason", "retry")
        return [dict(zip(keys, d, strict=True)) for d in self._decisions]

    def shared_prefill(self, replica: Replica, request: RouteRequest) -> asyncio.Event | None:
        """What to wait for before sending `request` to `replica`: the end of a prefill running there now
        that computes at least `_MIN_SHARED_BLOCKS` leading blocks of its prompt; None when there is none."""
        if not self._coalesce:
            return None
        prefill, depth = self._prefills.covering(request.hashes, replica.id, request.inflight)
        return prefill.done if prefill is not None and depth >= _MIN_SHARED_BLOCKS else None

    def may_serve(self, replica: Replica, request: RouteRequest) -> bool:
        """Whether `replica`, acquired for `request` a while ago (before a hold), may still serve it: it is
        ready (not draining, unhealthy or stopped), still in the replica set, and its breaker lets the
        request through (or the request is its trial)."""
        return (
            replica.ready
            and (request.trial or replica.breaker.allows())
            and replica in self.replicas.of(request.model)  # (by identity: replicas compare so)
        )

    @staticmethod
    async def hold(done: asyncio.Event) -> float:
        """Wait for a shared prefill to end, `_MAX_HOLD_S` at most; seconds waited."""
        started = time.monotonic()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_MAX_HOLD_S):
                await done.wait()
        return time.monotonic() - started

    def prefilled(self, replica: Replica, request: RouteRequest) -> None:
        """The request's prefill on `replica` ended (its first token arrived, or the request did)."""
        if request.prefill:
            replica.pending_prefill -= request.prefill
            request.prefill = 0
        if request.inflight is not None:
            self._prefills.finish(request.inflight)
            request.inflight = None

    def release(
        self,
        replica: Replica,
        request: RouteRequest,
        ok: bool | None,
        usage: Mapping[str, Any] | None = None,
        answered: bool = False,
    ) -> None:
        """The request is done with `replica`: ok=True success, False failure, None no word on it (not its
        fault, nor a sign of its health: a 4xx refusal, a client gone);
        `usage`: the engine's answer's, when it gave one (the prefix index learns from it); `answered`: the
        failure was the engine's 5xx answer to the request, or a stream it cut while serving others
        (perhaps the input's doing: see circuit.py)."""
        self.prefilled(replica, request)
        if request.adapter is not None:
            for residence in self.adapters.done(replica, request.adapter, request.residence, request.tenant):
                self.on_unload(replica, residence)
            request.residence = None
        policy = self._policies.get(request.model)
        if isinstance(policy, PrefixAffinity):
            policy.ended(replica, request)
            prompt = usage.get("prompt_tokens") if usage is not None else None
            if isinstance(prompt, int):
                policy.observe(request, prompt)
        replica.outstanding -= request.held
        replica.outstanding_tokens -= request.tokens
        replica.served += 1
        if ok is True:
            replica.succeeded += 1
            replica.breaker.on_success()
        elif ok is False:
            replica.failures += 1
            replica.breaker.on_failure(request.tenant if answered and request.tenant else None)
        elif request.trial:  # (only its own: an older request's end says nothing of the trial's)
            replica.breaker.on_release()
        request.trial = False


_MIN_SHARED_BLOCKS = 8  # about 1,000 characters: shorter shared prefixes are cheap to compute twice
_MAX_HOLD_S = 20.0  # a request waits this long at most for another's prefill
