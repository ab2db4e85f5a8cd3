"""The admin HTTP API: keys, usage, routing state. Protected by the admin key (Bearer).

Without an admin key configured, the admin API answers only clients on this machine (loopback) of a gateway
that itself runs open (a laptop); otherwise it answers 403.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from corral.cache import ExactCache, StoreUnavailable
from corral.config import parse_spec
from corral.gateway.bodies import read_body
from corral.gateway.clients import ClientAddresses
from corral.gateway.parts import AdminAccess, ReplicaControl
from corral.protocol import (
    InvalidRequest,
    NoCapacity,
    NotFound,
    NotSupported,
    PermissionDenied,
    Unauthorized,
)
from corral.routing import PrefixAffinity, Router
from corral.store import KeyStore, NewKey, UsageStore

__all__ = ["AdminViews", "bearer_is"]


def bearer_is(request: web.Request, secret: bytes) -> bool:
    """The request's `Authorization: Bearer` is `secret` (compared in constant time; a header that is not
    UTF-8 compared as sent)."""
    scheme, _, given = (request.headers.get("Authorization") or "").partition(" ")
    sent = given.strip().encode("utf-8", "surrogateescape")
    return scheme.lower() == "bearer" and hmac.compare_digest(sent, secret)


class AdminViews:
    def __init__(
        self,
        *,
        access: AdminAccess,
        keys: KeyStore,
        usage: UsageStore,
        router: Router,
        queue_depths: Callable[[], dict[str, int]],
        cache: ExactCache | None = None,
        control: ReplicaControl | None = None,
        clients: ClientAddresses | None = None,
        worker: int | None = None,
        body_timeout: float = 30.0,
        max_body_bytes: int = 4 * 1024 * 1024,
    ) -> None:
        self._access = access
        self._body = (body_timeout, max_body_bytes)
        self._keys = keys
        self._usage = usage
        self._router = router
        self._queue_depths = queue_depths
        self._response_cache = cache
        self._replica_control = control
        self._worker = worker  # this process's index among gateway workers (None: the only gateway)
        self._clients = clients or ClientAddresses([])  # no trusted proxies: any proxy header is remote

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/admin/keys", self.list_keys)
        app.router.add_post("/admin/keys", self.create_key)
        app.router.add_get("/admin/keys/{key_id}", self.show_key)
        app.router.add_delete("/admin/keys/{key_id}", self.revoke_key)
        app.router.add_get("/admin/usage", self.usage)
        app.router.add_get("/admin/routing", self.routing)
        app.router.add_post("/admin/replicas/{replica_id}/drain", self.drain)
        app.router.add_post("/admin/spec", self.apply)
        app.router.add_post("/admin/nodes/{node}/drain", self.drain_node)
        app.router.add_get("/admin/rollouts", self.rollouts)
        app.router.add_get("/admin/cache", self.cache_stats)
        app.router.add_delete("/admin/cache", self.cache_purge)
        app.router.add_post("/admin/rollouts/{model}/{action}", self.rollout_action)

    def is_admin(self, request: web.Request) -> bool:
        """The request carries the admin key, or needs none: a client on this machine talking to an open
        gateway without an admin key (a laptop). A key minted by anyone else on an open gateway would
        outlive the gateway being closed."""
        expected = self._access.admin_key
        if expected is None:  # behind a proxy, the client it names must be local (clients.py)
            return self._access.open_access and self._clients.is_local(request)
        return bearer_is(request, expected.encode())

    def check(self, request: web.Request) -> None:
        """Refuse (401/403) a request that is not the admin's."""
        if self.is_admin(request):
            return
        if self._access.admin_key is None:
            raise PermissionDenied(
                "The admin API needs an admin key (CORRAL_ADMIN_KEY or auth.admin_key); without one it "
                "answers only clients on this machine, and only while the gateway is open."
            )
        raise Unauthorized("The admin API needs 'Authorization: Bearer <admin key>'.")

    async def list_keys(self, request: web.Request) -> web.Response:
        self.check(request)
        revoked = request.query.get("include_revoked") in {"1", "true"}
        keys = await asyncio.to_thread(self._keys.list, revoked)
        used = await asyncio.to_thread(self._usage.month_tokens_by_key)  # (budget use, this month)
        return web.json_response({"keys": [{**k.to_dict(), "month_tokens": used.get(k.id, 0)} for k in keys]})

    async def create_key(self, request: web.Request) -> web.Response:
        self.check(request)
        try:
            spec = NewKey.model_validate_json(await read_body(request, *self._body), strict=True)
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            param = ".".join(str(p) for p in err["loc"]) or None
            raise InvalidRequest(f"Invalid value for '{param}': {err['msg']}.", param=param) from exc
        secret, record = await asyncio.to_thread(lambda: self._keys.create(**spec.model_dump()))
        return web.json_response({"key": secret, **record.to_dict()}, status=201)

    async def show_key(self, request: web.Request) -> web.Response:
        self.check(request)
        record = await asyncio.to_thread(self._keys.get, request.match_info["key_id"])
        if record is None:
            raise NotFound(f"No key with id {request.match_info['key_id']}.")
        return web.json_response(record.to_dict())

    async def revoke_key(self, request: web.Request) -> web.Response:
        self.check(request)
        record = await asyncio.to_thread(self._keys.revoke, request.match_info["key_id"])
        if record is None:
            raise NotFound(f"No key with id {request.match_info['key_id']}.")
        return web.json_response(record.to_dict())

    async def usage(self, request: web.Request) -> web.Response:
        self.check(request)
        by = request.query.get("by", "key")
        try:
            rows = await asyncio.to_thread(self._usage.report, by)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="by") from exc
        return web.json_response({"by": by, "rows": rows})

    async def drain(self, request: web.Request) -> web.Response:
        """Take a replica out of routing, wait for its requests, stop it (`corral drain`). `?grace=SECONDS`
        bounds the wait (default 60)."""
        self.check(request)
        control = self._control()
        grace = _grace(request)
        replica_id = request.match_info["replica_id"]
        self._refuse_emptying(request, {replica_id}, f"{replica_id} is the last ready replica")
        try:
            result = await control.drain(replica_id, grace)
        except KeyError:
            raise NotFound(f"No replica with id {replica_id}.", param="replica_id") from None
        return web.json_response(result)

    async def drain_node(self, request: web.Request) -> web.Response:
        """Drain every replica on a Ray node (`corral drain --node`); `?grace=` as for one replica."""
        self.check(request)
        control = self._control()
        grace = _grace(request)
        node = request.match_info["node"]
        on_node = {r.id for r in self._router.replicas if r.node == node}
        self._refuse_emptying(request, on_node, f"node {node} holds the last ready replicas")
        try:
            result = await control.drain_node(node, grace)
        except KeyError:
            raise NotFound(f"No replica runs on node {node}.", param="node") from None
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="node") from None
        return web.json_response(result)

    async def cache_stats(self, request: web.Request) -> web.Response:
        """The response cache's store (entries, bytes; Redis: failures) and which models cache."""
        self.check(request)
        cache = self._cache()
        models = sorted(m for m, p in cache.policies.items() if p.exact or p.semantic)
        semantic = {
            "models": sorted(m for m, p in cache.policies.items() if p.semantic),
            "indexed": len(cache.index),
            "checks": cache.checks,
        }
        return web.json_response({"store": cache.store.stats(), "models": models, "semantic": semantic})

    async def cache_purge(self, request: web.Request) -> web.Response:
        """Remove cached answers: `?tenant=` and/or `?model=` (both absent: everything)."""
        self.check(request)
        tenant, model = request.query.get("tenant"), request.query.get("model")
        for name, value in (("tenant", tenant), ("model", model)):
            if value is not None and not value:
                raise InvalidRequest(
                    f"'{name}' is empty: name one, or leave it out to purge all.", param=name
                )
        try:
            removed = await self._cache().purge(tenant, model)
        except StoreUnavailable as exc:
            raise NoCapacity(str(exc), code="cache_unavailable", retry_after=5) from None
        return web.json_response({"removed": removed})

    async def rollouts(self, request: web.Request) -> web.Response:
        """Each model's latest rollout: phase, traffic share, step, message (`corral rollout status`)."""
        self.check(request)
        return web.json_response({"rollouts": self._router.replicas.rollouts})

    async def rollout_action(self, request: web.Request) -> web.Response:
        """pause | resume | rollback a model's rollout (`corral rollout ...`)."""
        self.check(request)
        control = self._control()
        model, action = request.match_info["model"], request.match_info["action"]
        if action not in ("pause", "resume", "rollback"):
            raise NotFound(f"No rollout action {action!r}: pause, resume or rollback.", param="action")
        try:
            state = await control.rollout_action(model, action, _grace(request))
        except KeyError:
            raise NotFound(f"No rollout of model {model!r} has run.", param="model") from None
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="action") from None
        return web.json_response(state)

    async def apply(self, request: web.Request) -> web.Response:
        """Bring the running cluster to the spec in the body (YAML): models added or removed, replica
        counts changed (`corral apply`). `?grace=SECONDS` bounds each drained replica's wait (default 60)."""
        self.check(request)
        control = self._control()
        grace = _grace(request)
        text = (await read_body(request, *self._body)).decode("utf-8", errors="replace")
        try:
            wanted = parse_spec(text, source="spec")
            changes = await control.apply(wanted, grace)
        except ValueError as exc:  # SpecError, ApplyError: what to change, in one message
            raise InvalidRequest(str(exc), param="spec") from None
        return web.json_response({"changes": changes})

    def _cache(self) -> ExactCache:
        if self._response_cache is None:
            raise NotSupported("This gateway has no response cache.")
        return self._response_cache

    def _refuse_emptying(self, request: web.Request, leaving: set[str], what: str) -> None:
        """Unless `?force=true`: refuse a drain that takes away every ready replica of a model (each of
        its requests would be a 503 until the next apply); a model scaled to zero starts one on demand."""
        if request.query.get("force") in ("1", "true"):
            return
        replicas = self._router.replicas
        emptied = [
            m
            for m in replicas.models()
            if m not in replicas.on_demand
            and (ready := replicas.ready(m))
            and {r.id for r in ready} <= leaving
        ]
        if emptied:
            models = ", ".join(emptied)
            raise InvalidRequest(
                f"{what} of model {models}: draining it leaves {models} with no replica, and every request "
                "to it a 503 until the next `corral apply`. Drain it anyway with `corral drain --force`.",
                param="force",
                code="last_ready_replica",
            )

    def _control(self) -> ReplicaControl:
        control = self._replica_control
        if control is None:
            raise NotSupported("This gateway has no supervisor to ask (it was started without one).")
        return control

    async def routing(self, request: web.Request) -> web.Response:
        """Replicas with load and circuit state, each model's policy, and the latest routing decisions."""
        self.check(request)
        replicas = self._router.replicas
        models = replicas.models()
        policies = {m: self._router.policy_for(m).name for m in models}
        prefix = {}  # what each prefix-affinity model's index believes the replicas hold
        for model in models:
            policy = self._router.policy_for(model)
            if isinstance(policy, PrefixAffinity):
                prefix[model] = policy.describe([r for r in replicas if r.model == model])
        body: dict[str, Any] = {
            "policies": policies,
            "prefix_index": prefix,
            "queues": self._queue_depths(),
            "replicas": [{**r.snapshot(), **self._router.adapters.snapshot(r)} for r in replicas],
            "decisions": list(self._router.decisions)[-50:],
            "rollouts": replicas.rollouts,
            "events": list(replicas.events)[-30:],
            "cache": self._response_cache.store.stats() if self._response_cache is not None else None,
            "worker": self._worker,  # whose view this is: each worker routes with its own
        }
        return web.json_response(body)


def _grace(request: web.Request) -> float:
    """`?grace=SECONDS` of apply and drain: how long a replica taken out may take to finish (default 60)."""
    try:
        grace = float(request.query.get("grace", "60"))
    except ValueError:
        raise InvalidRequest("'grace' must be a number of seconds.", param="grace") from None
    if not 0 < grace <= 3600:
        raise InvalidRequest("'grace' must be between 0 and 3600 seconds.", param="grace")
    return grace
