"""The admin HTTP API: keys, usage, routing state, changes, the audit trail. Each route needs a permission
its caller's role holds (access.py): the admin key's (break-glass: every one), or a key's or signed-in
person's role. Every action that changes something is written to the audit trail, refused ones too.

Without an admin key configured, the admin key's part is played by clients on this machine (loopback) of a
gateway that itself runs open (a laptop).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from corral.admission import Authenticator, Principal
from corral.cache import ExactCache, StoreUnavailable
from corral.config import parse_spec
from corral.gateway.access import ROUTES, Access, Actor, bearer_is
from corral.gateway.bodies import read_body
from corral.gateway.clients import REQUEST_ID, ClientAddresses
from corral.gateway.key_scope import (
    TENANT_ROLES,
    adopt,
    fields_of,
    limits_of,
    maker,
    managed,
    others_merged,
    within_own,
)
from corral.gateway.parts import AdminAccess, ReplicaControl
from corral.gateway.reports import ReportTurns, month_start, when
from corral.protocol import (
    APIError,
    Conflict,
    InvalidRequest,
    NoCapacity,
    NotFound,
    NotSupported,
    Unauthorized,
)
from corral.routing import PrefixAffinity, Router
from corral.store import (
    AuditEntry,
    AuditLog,
    KeyRecord,
    KeyStore,
    KeyUpdate,
    NewKey,
    SessionStore,
    StoreThreads,
    UsageStore,
    store_is_down,
)
from corral.store.keys import RotationConflict, holds_control_characters

__all__ = ["AdminViews", "bearer_is"]

logger = logging.getLogger(__name__)

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_ACTOR = web.RequestKey("actor", Actor)  # who the request is, once its permission was checked
_DETAIL = web.RequestKey("audit_detail", dict)  # what a handler tells the audit trail of its action
_REFUSALS_KEPT = 30  # refused admin calls recorded per actor a minute (each one a store write)
_CLIENT_GONE = 499  # an audited call whose caller went away before its answer (NGINX's code for it)


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
        auth: Authenticator | None = None,
        audit: AuditLog | None = None,
        sessions: SessionStore | None = None,
        threads: StoreThreads | None = None,
    ) -> None:
        self._admin_access = access
        self._body = (body_timeout, max_body_bytes)
        self._keys = keys
        self._usage = usage
        self._reports = ReportTurns()  # (usage, keys, audit: a few read at once, see reports.py)
        self._router = router
        self._queue_depths = queue_depths
        self._response_cache = cache
        self._replica_control = control
        self._worker = worker  # this process's index among gateway workers (None: the only gateway)
        self._clients = clients or ClientAddresses([])  # no trusted proxies: any proxy header is remote
        self.access = Access(access, auth, self._clients, sessions, threads)
        self._audit = audit
        self._refusals: dict[str, list[float]] = {}  # actor → [its minute's start, refusals in it]
        self._actions: dict[_Handler, str] = {}  # each audited route's handler → its action

    def add_routes(self, app: web.Application) -> None:
        audited = self._audited
        app.router.add_get("/admin/keys", self.list_keys)
        app.router.add_post("/admin/keys", audited("key.create", self.create_key))
        app.router.add_get("/admin/keys/{key_id}", self.show_key)
        app.router.add_patch("/admin/keys/{key_id}", audited("key.update", self.update_key))
        app.router.add_delete("/admin/keys/{key_id}", audited("key.revoke", self.revoke_key))
        app.router.add_post("/admin/keys/{key_id}/rotate", audited("key.rotate", self.rotate_key))
        app.router.add_get("/admin/usage", self.usage)
        app.router.add_get("/admin/routing", self.routing)
        app.router.add_post("/admin/replicas/{replica_id}/drain", audited("replica.drain", self.drain))
        app.router.add_post("/admin/spec", audited("spec.apply", self.apply))
        app.router.add_post("/admin/nodes/{node}/drain", audited("node.drain", self.drain_node))
        app.router.add_get("/admin/rollouts", self.rollouts)
        app.router.add_get("/admin/cache", self.cache_stats)
        app.router.add_delete("/admin/cache", audited("cache.purge", self.cache_purge))
        app.router.add_post(
            "/admin/rollouts/{model}/{action}", audited("rollout.action", self.rollout_action)
        )
        app.router.add_get("/admin/audit", self.audit_trail)

    def is_admin(self, request: web.Request) -> bool:
        """The request carries the admin key (or needs none: a laptop's open gateway, see access.py)."""
        return self.access.is_admin_key(request)

    async def check(self, request: web.Request, permission: str | None = None) -> Actor:
        """The request's actor, allowed `permission` (default: its route's in access.ROUTES); else 401/403."""
        if permission is None:
            method = "GET" if request.method == "HEAD" else request.method
            resource = request.match_info.route.resource
            permission = ROUTES.get(
                (method, resource.canonical if resource is not None else ""), "admin:only"
            )
        actor = await self.access.require(request, permission)
        if permission == "keys:write" and actor.scoped:
            actor = await self._as_stored(actor)
        request[_ACTOR] = actor
        return actor

    async def _as_stored(self, actor: Actor) -> Actor:
        """A tenant-admin's key as the store holds it now, not as this gateway cached it (`auth.cache_ttl`):
        a key revoked or cut back a moment ago makes, rotates and raises no key with what it had (a key it
        made would outlive its revocation). A signed-in tenant-admin's token is its own record."""
        principal = actor.principal
        if principal is None or principal.subject is not None or principal.key_id is None:
            return actor
        record = await asyncio.to_thread(self._keys.get, principal.key_id)
        if record is None or not record.active:
            raise Unauthorized("Incorrect or revoked API key.")
        return replace(actor, principal=Principal.of(record, principal.parents))

    def _audited(self, action: str, handler: _Handler) -> _Handler:
        """`handler`, with one audit record per request that named someone: what it did, to what, and
        how it ended (a refusal too)."""

        async def audited(request: web.Request) -> web.StreamResponse:
            detail: dict[str, Any] = {}
            request[_DETAIL] = detail
            status = 500
            try:
                response = await handler(request)
                status = response.status
                return response
            except APIError as exc:
                status = exc.status
                raise
            except web.HTTPException as exc:
                status = exc.status
                raise
            except Exception as exc:
                status = 503 if store_is_down(exc) else 500  # (as the error boundary will answer it)
                raise
            except asyncio.CancelledError:  # the caller went away (an apply goes on: reconcile.py)
                status = _CLIENT_GONE
                raise
            finally:
                actor = request.get(_ACTOR) or await self.access.actor(request)
                # (a 404 too: another tenant's key is one, by design)
                refused = 400 <= status < 500 and status != _CLIENT_GONE
                if actor is not None and (not refused or self._keeps_refusal(actor.who)):
                    await self._write_audit(request, actor, action, detail, status)

        self._actions[audited] = action
        return audited

    async def refused(self, request: web.Request, status: int) -> None:
        """A request the error boundary refused before its route's handler ran (app.py: a NUL in its path
        or query), on the audit trail as the route's own refusals are: an action's, by someone named."""
        action = self._actions.get(request.match_info.handler)
        if action is None:
            return
        try:
            actor = await self.access.actor(request)
        except Exception:  # (the refusal stands: its record is lost, as a failed write's is, loudly)
            logger.exception("the audit trail could not name who was refused %s", action)
            return
        if actor is not None and self._keeps_refusal(actor.who):
            await self._write_audit(request, actor, action, {}, status)

    def _keeps_refusal(self, who: str) -> bool:
        """Whether a refused call by `who` goes on the trail: the first `_REFUSALS_KEPT` of each minute
        (a key looping on a route its role lacks would write a row a request and push the real actions
        out of the trail's pages); the rest are counted in the log."""
        now = time.monotonic()
        window = self._refusals.get(who)
        if window is None or now - window[0] >= 60:
            if window is not None and window[1] > _REFUSALS_KEPT:
                logger.warning(
                    "audit: %d refused admin calls by %s in a minute (%d recorded)",
                    int(window[1]),
                    who,
                    _REFUSALS_KEPT,
                )
            if len(self._refusals) > 10_000:  # (actors are keys and people: a bound, kept generous)
                self._refusals = {k: w for k, w in self._refusals.items() if now - w[0] < 60}
            window = self._refusals[who] = [now, 0.0]
        window[1] += 1
        return window[1] <= _REFUSALS_KEPT

    async def record(
        self, request: web.Request, who: str, role: str, tenant: str | None, action: str, status: int
    ) -> None:
        """An action outside the admin routes (a console sign-in or sign-out) on the audit trail; a refused
        one (4xx) as the admin routes' refusals are, up to `_REFUSALS_KEPT` a minute an actor."""
        if 400 <= status < 500 and not self._keeps_refusal(who):
            return
        await self._write_audit(request, Actor(who, role, tenant), action, {"target": who}, status)

    async def _write_audit(
        self, request: web.Request, actor: Actor, action: str, detail: dict[str, Any], status: int
    ) -> None:
        if self._audit is None:
            return
        target = detail.pop("target", None) or "/".join(request.match_info.values()) or None
        if target is not None:  # (PostgreSQL's text holds no NUL: the record would be lost)
            target = str(target).replace("\x00", "\\x00")
        entry = AuditEntry(  # (cut to the columns' widths: a long name must not lose the record)
            actor=actor.who[:256],
            role=actor.role[:16],
            tenant=actor.tenant[:128] if actor.tenant else None,
            source=self._clients.of(request)[:64],
            action=action,
            target=str(target)[:256] if target else None,
            detail=detail or None,
            status=status,
            request_id=request.get(REQUEST_ID),
        )
        try:
            await asyncio.to_thread(self._audit.record, entry)
        except Exception as exc:  # the action is done: its record's loss is logged loudly, not an error
            if store_is_down(exc):  # (a line, not a trace: the outage is logged and alerted on elsewhere)
                logger.error("the audit trail could not record %s by %s: %s", action, actor.who, exc)
            else:
                logger.exception("the audit trail could not record %s by %s", action, actor.who)

    # keys ----------------------------------------------------------------------------------------------

    async def list_keys(self, request: web.Request) -> web.Response:
        actor = await self.check(request)
        revoked = request.query.get("include_revoked") in {"1", "true"}
        async with self._reports.turn(_asker(actor)):
            if actor.scoped:  # its tenant's keys (found in SQL: not every tenant's) of the roles it may give
                keys = await asyncio.to_thread(self._keys.list, revoked, actor.tenant)
                keys = [k for k in keys if k.role in TENANT_ROLES]
                ids: list[str] | None = [k.id for k in keys]
            else:
                keys, ids = await asyncio.to_thread(self._keys.list, revoked), None
            used = await asyncio.to_thread(self._usage.month_tokens_by_key, None, ids)  # (this month's)
        return web.json_response({"keys": [{**k.to_dict(), "month_tokens": used.get(k.id, 0)} for k in keys]})

    async def create_key(self, request: web.Request) -> web.Response:
        actor = await self.check(request)
        spec = _validated(NewKey, await read_body(request, *self._body))
        assert isinstance(spec, NewKey)
        request[_DETAIL].update(asked=spec.model_dump(exclude_defaults=True))  # (refused ones too)
        if actor.scoped:
            within_own(actor, spec.tenant, spec.role, spec.model_dump())
        parent = maker(actor)  # (its requests count against its maker's limits too)
        secret, record = await asyncio.to_thread(
            lambda: self._keys.create(**spec.model_dump(), parent=parent)
        )
        request[_DETAIL].update(target=record.id, tenant=record.tenant, role=record.role, **limits_of(record))
        return web.json_response({"key": secret, **record.to_dict()}, status=201)

    async def _own_key(self, request: web.Request, actor: Actor, change: bool = True) -> KeyRecord:
        """The key the route names, as `key_scope.managed` lets `actor` see or `change` it."""
        return await managed(self._keys, request.match_info["key_id"], actor, change)

    async def show_key(self, request: web.Request) -> web.Response:
        actor = await self.check(request)
        return web.json_response((await self._own_key(request, actor, change=False)).to_dict())

    async def revoke_key(self, request: web.Request) -> web.Response:
        actor = await self.check(request)
        await self._own_key(request, actor)
        record = await asyncio.to_thread(self._keys.revoke, request.match_info["key_id"])
        if record is None:
            raise NotFound(f"No key with id {request.match_info['key_id']}.")
        request[_DETAIL].update(tenant=record.tenant)
        return web.json_response(record.to_dict())

    async def rotate_key(self, request: web.Request) -> web.Response:
        """A new secret for the key; the old one is still accepted for `?grace=SECONDS` (default 3600; 0:
        not at all)."""
        actor = await self.check(request)
        current = await self._own_key(request, actor)
        if actor.scoped:  # (a new secret for a key beyond its own limits would be such a key)
            within_own(actor, current.tenant, current.role, fields_of(current))
            await adopt(self._keys, current, actor)
        try:
            grace = float(request.query.get("grace", "3600"))
        except ValueError:
            raise InvalidRequest("'grace' must be a number of seconds.", param="grace") from None
        if not 0 <= grace <= 30 * 86400:
            raise InvalidRequest("'grace' must be between 0 and 30 days, in seconds.", param="grace")
        try:
            rotated = await asyncio.to_thread(self._keys.rotate, request.match_info["key_id"], grace)
        except RotationConflict as exc:
            raise Conflict(str(exc)) from exc
        if rotated is None:
            raise NotFound(f"No active key with id {request.match_info['key_id']}.")
        secret, record = rotated
        request[_DETAIL].update(tenant=record.tenant, grace_s=grace)
        return web.json_response({"key": secret, **record.to_dict()})

    async def update_key(self, request: web.Request) -> web.Response:
        """Change a key's limits or monthly budget (the budget change of the audit trail)."""
        actor = await self.check(request)
        current = await self._own_key(request, actor)
        changes = _validated(KeyUpdate, await read_body(request, *self._body))
        assert isinstance(changes, KeyUpdate)
        wanted = changes.model_dump(exclude_unset=True)
        request[_DETAIL].update(asked=wanted)
        if actor.scoped:
            within_own(actor, current.tenant, current.role, {**fields_of(current), **wanted})
            await adopt(self._keys, current, actor)
        updated = await asyncio.to_thread(self._keys.update, current.id, changes)
        if updated is None:
            raise NotFound(f"No key with id {current.id}.")
        record, before = updated
        request[_DETAIL].update(tenant=record.tenant, before=before, after=wanted)
        return web.json_response(record.to_dict())

    async def usage(self, request: web.Request) -> web.Response:
        """Totals `?by=` key, tenant, model, api or day, of the records from `?since=` up to (not including)
        `?until=` (ISO 8601 or epoch seconds, UTC; neither given: this calendar month, UTC); or one
        request's records (`?request_id=`)."""
        actor = await self.check(request)
        scope = actor.tenant if actor.scoped else None
        request_id = request.query.get("request_id")
        if request_id is not None:  # one request's records, by the x-request-id its client was given
            async with self._reports.turn(_asker(actor)):
                found = await asyncio.to_thread(self._usage.of_request, request_id, scope)
                if scope is not None and found:  # the keys above a tenant-admin go unnamed, as in by=key
                    seen = await asyncio.to_thread(self._keys.list, True, scope)
                    named = {k.id for k in seen if k.role in TENANT_ROLES}
                    found = [row if row["key_id"] in named else {**row, "key_id": None} for row in found]
            return web.json_response({"request_id": request_id, "rows": found})
        by = request.query.get("by", "key")
        since, until = when(request.query.get("since"), "since"), when(request.query.get("until"), "until")
        if since is None and until is None:  # (all time is `since=0`: a report reads what it spans)
            since = month_start()
        async with self._reports.turn(_asker(actor)):
            try:
                rows = await asyncio.to_thread(self._usage.report, by, since, until, scope)
            except ValueError as exc:
                raise InvalidRequest(str(exc), param="by") from exc
            if scope is not None and by == "key":  # the keys above a tenant-admin are not its to see (404)
                seen = await asyncio.to_thread(self._keys.list, True, scope)
                rows = others_merged(rows, {k.id for k in seen if k.role in TENANT_ROLES})
        shown = {name: t.isoformat() if t else None for name, t in (("since", since), ("until", until))}
        return web.json_response({"by": by, **shown, "rows": rows})

    async def audit_trail(self, request: web.Request) -> web.Response:
        """The audit trail, latest first: `?action=` (a trailing `*`: a prefix), `?actor=`, `?tenant=`,
        `?since=` (ISO 8601), `?request_id=`, `?limit=` (at most 1000). Read only: no route changes it."""
        actor = await self.check(request)
        if self._audit is None:
            raise NotSupported("This gateway keeps no audit trail.")
        query = request.query
        since = when(query.get("since"), "since")
        try:
            limit = int(query.get("limit", "100"))
        except ValueError:
            raise InvalidRequest(
                "'limit' must be a whole number of entries (at most 1000 are given).", param="limit"
            ) from None
        audit = self._audit
        async with self._reports.turn(_asker(actor)):
            rows = await asyncio.to_thread(
                lambda: audit.list(
                    action=query.get("action"),
                    actor=query.get("actor"),
                    tenant=query.get("tenant"),
                    since=since,
                    request_id=query.get("request_id"),
                    limit=limit,
                )
            )
        return web.json_response({"entries": rows})

    async def drain(self, request: web.Request) -> web.Response:
        """Take a replica out of routing, wait for its requests, stop it (`corral drain`). `?grace=SECONDS`
        bounds the wait (default 60)."""
        await self.check(request)
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
        await self.check(request)
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
        await self.check(request)
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
        await self.check(request)
        tenant, model = request.query.get("tenant"), request.query.get("model")
        for name, value in (("tenant", tenant), ("model", model)):
            if value is not None and not value:
                raise InvalidRequest(
                    f"'{name}' is empty: name one, or leave it out to purge all.", param=name
                )
        request[_DETAIL].update(tenant=tenant, model=model)
        try:
            removed = await self._cache().purge(tenant, model)
        except StoreUnavailable as exc:
            raise NoCapacity(str(exc), code="cache_unavailable", retry_after=5) from None
        return web.json_response({"removed": removed})

    async def rollouts(self, request: web.Request) -> web.Response:
        """Each model's latest rollout: phase, traffic share, step, message (`corral rollout status`)."""
        await self.check(request)
        return web.json_response({"rollouts": self._router.replicas.rollouts})

    async def rollout_action(self, request: web.Request) -> web.Response:
        """pause | resume | rollback a model's rollout (`corral rollout ...`)."""
        await self.check(request)
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
        await self.check(request)
        control = self._control()
        grace = _grace(request)
        text = (await read_body(request, *self._body)).decode("utf-8", errors="replace")
        try:
            wanted = parse_spec(text, source="spec")
            changes = await control.apply(wanted, grace)
        except ValueError as exc:  # SpecError, ApplyError: what to change, in one message
            raise InvalidRequest(str(exc), param="spec") from None
        request[_DETAIL].update(changes=changes)
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
        await self.check(request)
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


def _validated(model: type[NewKey] | type[KeyUpdate], body: bytes) -> NewKey | KeyUpdate:
    try:
        return model.model_validate_json(body, strict=True)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        if param is None:  # (not JSON, or JSON but not an object: `[]`)
            raise InvalidRequest(
                f"The body must be a JSON object of the key's fields: {err['msg']}."
            ) from exc
        if holds_control_characters(err):
            raise InvalidRequest(
                f"Invalid value for '{param}': it must not hold control characters (such as NUL).",
                param=param,
            ) from exc
        raise InvalidRequest(f"Invalid value for '{param}': {err['msg']}.", param=param) from exc


def _asker(actor: Actor) -> str:
    """Whose turn a report takes (`ReportTurns`): a tenant-admin's tenant, or the operators'."""
    return f"tenant:{actor.tenant}" if actor.scoped else "operators"
