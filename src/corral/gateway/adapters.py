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

Which replica holds which adapter, and which should load one, is routing's (routing/adapters.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson

from corral.engines.client import EngineClient, EngineConnectionError
from corral.gateway.bodies import with_member
from corral.protocol import UpstreamError
from corral.routing import Replica, Router, RouteRequest
from corral.routing.adapters import Adapter, AdapterCatalogue, Residence

__all__ = ["NO_ADAPTER", "AdapterLoadFailed", "AdapterLoader"]

logger = logging.getLogger(__name__)

NO_ADAPTER = b',"lora":[]'  # a base request on llama.cpp: no adapter applied, whatever the client sent
_LOAD = "/v1/load_lora_adapter"
_UNLOAD = "/v1/unload_lora_adapter"


class AdapterLoadFailed(Exception):
    """The replica could not be reached to load the adapter (another replica may)."""


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
        self._loading: dict[tuple[str, str], asyncio.Future[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        router.on_unload = self.unload
        catalogue.on_change = self._catalogue_changed

    async def ready(self, replica: Replica, route: RouteRequest) -> None:
        """Return once `replica` holds the request's adapter (loading it where routing said so)."""
        adapter = route.adapter
        if adapter is None or adapter.name in replica.adapters:
            return
        key = (replica.id, adapter.engine_name)
        pending = self._loading.get(key)
        if pending is None and not route.load_adapter:
            return
        if pending is None:
            pending = self._loading[key] = asyncio.get_running_loop().create_future()
            route.load_adapter = False
            try:
                await self._load(replica, adapter)
                pending.set_result(None)
            except BaseException as exc:
                self._placement.failed_load(replica, adapter)
                pending.set_exception(exc)
                pending.exception()  # (retrieved: waiters see it, an unwaited future does not warn)
                raise
            finally:
                self._loading.pop(key, None)
            return
        await asyncio.shield(pending)

    async def _load(self, replica: Replica, adapter: Adapter) -> None:
        body = orjson.dumps({"lora_name": adapter.engine_name, "lora_path": adapter.path})
        try:
            upstream = await self._engines.post(replica.url, _LOAD, body, replica.api_key)
            try:
                answer = await upstream.read()
            finally:
                upstream.release()
        except (EngineConnectionError, TimeoutError) as exc:
            raise AdapterLoadFailed(f"loading adapter {adapter.name} on {replica.id}: {exc}") from exc
        if upstream.status == 200 or (upstream.status == 400 and b"already been loaded" in answer):
            if self.metrics is not None:
                self.metrics.adapter_loads.labels(adapter.base, adapter.name).inc()
            logger.info("replica %s loaded adapter %s", replica.id, adapter.engine_name)
            return
        if upstream.status >= 500:
            raise AdapterLoadFailed(f"replica {replica.id} answered {upstream.status} loading {adapter.name}")
        raise UpstreamError(
            f"The replica could not load the adapter '{adapter.name}': {_message(answer)}",
            code="adapter_load_failed",
        )

    def unload(self, replica: Replica, residence: Residence) -> None:
        """Have `replica` unload an adapter routing gave up (in the background)."""
        task = asyncio.get_running_loop().create_task(self._unload(replica, residence))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _unload(self, replica: Replica, residence: Residence) -> None:
        pending = self._loading.get((replica.id, residence.engine_name))
        if pending is not None:  # (its load must end first, or the unload would find nothing)
            await asyncio.wait([pending])
        body = orjson.dumps({"lora_name": residence.engine_name})
        try:
            upstream = await self._engines.post(replica.url, _UNLOAD, body, replica.api_key)
            try:
                await upstream.read()
            finally:
                upstream.release()
        except (EngineConnectionError, TimeoutError) as exc:
            logger.warning("unloading adapter %s on %s: %s", residence.engine_name, replica.id, exc)
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
        if route.adapter is not None:
            self._placement.failed_load(replica, route.adapter)


def body_for(replica: Replica, route: RouteRequest, raw: bytes, has_adapters: bool) -> bytes:
    """The request's body as `replica`'s engine takes it: naming the adapter's revision (vLLM, sim), or
    selecting it by index (llama.cpp); for the base of a model with adapters on llama.cpp, selecting none."""
    adapter = route.adapter
    if adapter is None:
        if has_adapters and replica.adapters:
            return with_member(raw, "lora", [], NO_ADAPTER)
        return raw
    if adapter.name in replica.adapters:
        selected = [{"id": replica.adapters.index(adapter.name), "scale": 1.0}]
        raw = with_member(raw, "lora", selected, b',"lora":' + orjson.dumps(selected))
        return with_member(raw, "model", adapter.base, b"")
    return with_member(raw, "model", adapter.engine_name, b"")


def unknown_adapter(status: int, answer: bytes) -> bool:
    """The engine's answer says it does not know the model the request named (vLLM's 404)."""
    return status == 404 and b"does not exist" in answer


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
