"""LoRA adapters at the gateway: a request for an adapter's model id is served by its base's replicas, told
which adapter to apply, after the replica has loaded it.

- vLLM (and the simulator) load adapters at run time (`POST /v1/load_lora_adapter`, with
  VLLM_ALLOW_RUNTIME_LORA_UPDATING set by corral): the request names the adapter's revision
  (`name@digest`) as its `model`. A load answered "already loaded" (another gateway worker's) counts as
  loaded; an answer that the engine does not know the adapter (it restarted, or a worker unloaded it) makes
  the gateway load it again and retry once.
- llama.cpp's server holds every adapter from its start (`--lora`, not applied): the request selects one by
  its index (`"lora": [{"id": i, "scale": 1}]`). A request for the base itself selects none: the `lora`
  member a client sends never reaches the engine, so no key picks an adapter through its base.

A request read before a live apply replaced its adapter (it waited in the admission queue) is served under
the current revision; one whose adapter was removed, or taken from its tenant, meanwhile is a 404, as it
would be if sent now. A refusal to load, and each load, are told to routing, which passes a refusing
replica by as a loader for a while, and says when it refused lately (it is not asked again so soon).

Which replica holds which adapter, and which should load one, is routing's (routing/adapters.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

import orjson

from corral.engines.client import AnswerTooLarge, EngineClient, EngineConnectionError
from corral.gateway.bodies import with_member
from corral.protocol import ModelNotFound
from corral.routing import Replica, Router, RouteRequest
from corral.routing.adapters import Adapter, AdapterCatalogue, Residence

__all__ = ["NO_ADAPTER", "AdapterLoadFailed", "AdapterLoader", "AdapterRefused", "Events", "Renamed"]

logger = logging.getLogger(__name__)

NO_ADAPTER = b',"lora":[]'  # a base request on llama.cpp: no adapter applied, whatever the client sent
_LOAD = "/v1/load_lora_adapter"
_UNLOAD = "/v1/unload_lora_adapter"
_MOST_ANSWER_BYTES = 64 * 1024  # a (un)load answer read at most (vLLM's: a line); larger: the replica failed


class AdapterLoadFailed(Exception):
    """The replica could not be reached to load the adapter (another replica may)."""


class AdapterRefused(AdapterLoadFailed):
    """The replica answered that it cannot load the adapter: the adapter's trouble (its files), not the
    replica's, so its circuit breaker does not hear of it."""


class AdapterLoader:
    """Loads and unloads adapters on replicas as routing places them, and writes each request's body for
    the replica's engine."""

    def __init__(
        self, engines: EngineClient, router: Router, catalogue: AdapterCatalogue, metrics: Any = None
    ) -> None:
        self._engines = engines
        self._router = router
        self._placement = router.adapters
        self._catalogue = catalogue
        self.metrics = metrics  # the gateway's (GatewayMetrics): loads and unloads are counted
        self._loading: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        router.on_unload = self.unload
        catalogue.on_change = self._catalogue_changed
        self._placement.catalogue = catalogue

    async def ready(self, replica: Replica, route: RouteRequest) -> None:
        """Return once `replica` holds the request's adapter (loading it where routing said so); its current
        revision where a live apply replaced it since the request was read (ModelNotFound: removed)."""
        adapter = route.adapter
        if adapter is None:
            return
        current = self._catalogue.get(adapter.name)
        if current is not adapter:
            adapter = self._revise(replica, route, adapter, current)
        if adapter.name in replica.adapters:
            return
        key = (replica.id, adapter.engine_name)
        loading = self._loading.get(key)
        if loading is None and not route.load_adapter:
            return
        if loading is None and self._placement.refused_lately(replica, adapter.engine_name):
            self._placement.failed_load(replica, route.residence)
            raise AdapterRefused(f"replica {replica.id} refused adapter {adapter.name} a moment ago")
        if loading is None:  # a task of its own: a client that leaves does not cancel others' wait
            route.load_adapter = False
            load = self._load(replica, adapter, route.residence)
            loading = self._loading[key] = asyncio.get_running_loop().create_task(load)
            loading.add_done_callback(lambda _: self._loading.pop(key, None))
        await asyncio.shield(loading)

    def _revise(
        self, replica: Replica, route: RouteRequest, old: Adapter, current: Adapter | None
    ) -> Adapter:
        """The request's adapter (`old`) is no longer served as it was read: its current revision
        (`current`), which routing placed it under, else its residence on `replica` swapped for that one's;
        ModelNotFound where the adapter was removed, moved to another base, or taken from the request's
        tenant (where known: a closed gateway's)."""
        tenant = route.tenant
        if current is None or current.base != old.base or (tenant and not current.allows(tenant)):
            current = None
        residence = route.residence
        if current is not None and (residence is None or residence.engine_name == current.engine_name):
            route.adapter = current
            return current
        route.residence, route.load_adapter, unload = self._placement.revise(
            replica, residence, route.load_adapter, current, route.tenant
        )
        for given_up in unload:
            self.unload(replica, given_up)
        if current is None:
            raise ModelNotFound(f"The model '{old.name}' does not exist on this server.", param="model")
        route.adapter = current
        return current

    async def _load(self, replica: Replica, adapter: Adapter, residence: Residence | None) -> None:
        """Load the adapter; AdapterLoadFailed (another replica may serve the request) when the replica
        cannot: unreachable, or refusing (its answer is logged, not told to the client: it names the
        server's paths). Routing forgets the load (`residence`) either way."""
        body = orjson.dumps({"lora_name": adapter.engine_name, "lora_path": adapter.path})
        try:
            try:
                upstream = await self._engines.post(replica.url, _LOAD, body, replica.api_key)
                try:
                    answer = await upstream.read(_MOST_ANSWER_BYTES)
                finally:
                    upstream.release()
            except (EngineConnectionError, TimeoutError, AnswerTooLarge) as exc:
                raise AdapterLoadFailed(f"loading adapter {adapter.name} on {replica.id}: {exc}") from exc
            if upstream.status == 200 or (upstream.status == 400 and b"already been loaded" in answer):
                self._placement.loaded(replica, adapter.engine_name, residence)
                if self.metrics is not None:
                    self.metrics.adapter_loads.labels(adapter.base, adapter.name).inc()
                logger.info("replica %s loaded adapter %s", replica.id, adapter.engine_name)
                return
            logger.error(
                "replica %s refused to load adapter %s (%d): %s",
                replica.id,
                adapter.engine_name,
                upstream.status,
                _message(answer),
            )
            self._placement.refused(replica, adapter.engine_name)
            raise AdapterRefused(f"replica {replica.id} could not load adapter {adapter.name}")
        except BaseException:
            self._placement.failed_load(replica, residence)
            raise

    def unload(self, replica: Replica, residence: Residence) -> None:
        """Have `replica` unload an adapter routing gave up (in the background)."""
        task = asyncio.get_running_loop().create_task(self._unload(replica, residence))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _unload(self, replica: Replica, residence: Residence) -> None:
        loading = self._loading.get((replica.id, residence.engine_name))
        if loading is not None:  # (its load must end first, or the unload would find nothing)
            await asyncio.wait([loading])
        body = orjson.dumps({"lora_name": residence.engine_name})
        try:
            upstream = await self._engines.post(replica.url, _UNLOAD, body, replica.api_key)
            try:
                await upstream.read(_MOST_ANSWER_BYTES)
            finally:
                upstream.release()
        except (EngineConnectionError, TimeoutError, AnswerTooLarge) as exc:
            logger.warning("unloading adapter %s on %s: %s", residence.engine_name, replica.id, exc)
            return
        if upstream.status != 200:  # (404: it was not there, a restart or another gateway worker's unload)
            return
        if self.metrics is not None:
            self.metrics.adapter_unloads.labels(replica.model, residence.adapter).inc()

    def _catalogue_changed(self) -> None:
        """Unload, where idle, the revisions of adapters replaced or removed (a live apply); one still
        answering a request is unloaded by routing once idle and past its slots."""
        replicas = {r.id: r for r in self._router.replicas}
        for rid, residence in self._placement.stale(self._catalogue.engine_names()):
            replica = replicas.get(rid)
            if replica is not None:
                self.unload(replica, residence)

    def forget(self, replica: Replica, route: RouteRequest) -> None:
        """The engine said it does not know the adapter: it is loaded again on the next request."""
        self._placement.failed_load(replica, route.residence)


def body_for(replica: Replica, route: RouteRequest, raw: bytes) -> bytes:
    """The request's body as `replica`'s engine takes it: naming the adapter's revision (vLLM, sim), or
    selecting it by index (llama.cpp); for a base request to a replica started with adapters, selecting
    none (whatever the catalogue says now: a rollout's old replicas still hold removed adapters)."""
    adapter = route.adapter
    if adapter is None:
        return with_member(raw, "lora", [], NO_ADAPTER) if replica.adapters else raw
    if adapter.name in replica.adapters:
        selected = [{"id": replica.adapters.index(adapter.name), "scale": 1.0}]
        raw = with_member(raw, "lora", selected, b',"lora":' + orjson.dumps(selected))
        return with_member(raw, "model", adapter.base, _member("model", adapter.base))
    # (the member, where the bytes spell the key with escapes: the engine reads the last of duplicate keys)
    return with_member(raw, "model", adapter.engine_name, _member("model", adapter.engine_name))


def _member(name: str, value: str) -> bytes:
    return b',"' + name.encode() + b'":' + orjson.dumps(value)


def unknown_adapter(route: RouteRequest, status: int, answer: bytes) -> bool:
    """The engine's answer says it does not know the adapter's revision the request named (vLLM's 404)."""
    adapter = route.adapter
    return (
        adapter is not None
        and status == 404
        and b"does not exist" in answer
        and adapter.engine_name.encode() in answer
    )


def _message(answer: bytes) -> str:
    try:
        data = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return answer.decode(errors="replace")[:200]
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])[:300]
    message = data.get("message") if isinstance(data, dict) else None
    return str(message)[:300] if message else answer.decode(errors="replace")[:200]


class Renamed:
    """An adapter's answer names the model as the client asked it: the engine names the base (llama.cpp) or
    the adapter's revision (vLLM: `name@digest`)."""

    def __init__(self, events: Events, adapter: Adapter) -> None:
        self._events = events
        self._adapter = adapter

    @property
    def done(self) -> bool:
        return self._events.done

    def feed(self, data: bytes) -> bytes:
        return self.rename(self._events.feed(data), self._adapter)

    @staticmethod
    def rename(data: bytes, adapter: Adapter) -> bytes:
        asked = b'"model":"' + adapter.name.encode() + b'"'
        for named in (adapter.engine_name, adapter.base):
            data = data.replace(b'"model":"' + named.encode() + b'"', asked)
        return data


class Events(Protocol):
    """Turns upstream bytes into the client's events (SSEFilter, a failover Continuation, or the held
    stream of emulated tool calls)."""

    @property
    def done(self) -> bool: ...

    def feed(self, data: bytes) -> bytes: ...
