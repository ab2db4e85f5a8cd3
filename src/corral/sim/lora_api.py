"""vLLM's adapter endpoints on a simulated replica: `POST /v1/load_lora_adapter` and `/unload_lora_adapter`.

As vLLM 0.32's `OpenAIServingModels` (entrypoints/openai/models/serving.py) answers them:

- load `{"lora_name", "lora_path", "load_inplace"?}`: 200 `Success: LoRA adapter '{name}' added
  successfully.` (text) once the engine has read it and given it a GPU slot; 400 `InvalidUserInput` for an
  empty name or path, a name that is the base model's, or one already loaded (without `load_inplace`);
  404 `NotFoundError` `Loading lora {name} failed: No adapter found for {path}` when the path holds no
  adapter_config.json; 500 `InternalServerError` `Call to add_lora method failed: ...` for what vLLM's
  worker refuses: a rank over `--max-lora-rank`, a folder without tensors, LoRA not enabled.
- unload `{"lora_name"}`: 200 `Success: LoRA adapter '{name}' removed successfully.`; 400 for an empty
  name; 404 `The lora adapter '{name}' cannot be found.` for one not loaded. As in vLLM, unloading only
  forgets the name: the weights stay in the caches until evicted, and requests already running finish.
- a body that does not parse: 400 with vLLM's validation wording (type `Bad Request`).

Loads run one at a time, as vLLM's engine runs its `add_lora` calls.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from corral.sim.engine import SimEngine
from corral.sim.errors import VllmError
from corral.sim.lora import LoraManager, LoraModule, engine_failure

__all__ = ["LoraEndpoints", "load_static"]

_NOT_ENABLED = "LoRA is not enabled. Use --enable-lora to enable LoRA."

Body = TypeVar("Body", bound=BaseModel)


class _Load(BaseModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class _Unload(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def _parse(model: type[Body], raw: bytes) -> Body:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors()
        locs = [".".join(["body", *map(str, error["loc"])]) for error in errors]
        lines = [
            f"  {{'type': {error['type']!r}, 'loc': {loc!r}, 'msg': {error['msg']!r}}}"
            for error, loc in zip(errors, locs, strict=True)
        ]
        plural = "s" if len(errors) > 1 else ""
        message = f"{len(errors)} validation error{plural}:\n" + "\n".join(lines)
        raise VllmError(message, "Bad Request", 400, param=locs[0]) from None


def _invalid(message: str) -> VllmError:
    return VllmError(message, "InvalidUserInput", 400)


def _check_load(engine: SimEngine, name: str, path: str, inplace: bool) -> LoraManager:
    """vLLM's checks of a load before the engine sees it; the engine's LoRA manager."""
    if not name or not path:
        raise _invalid("Both 'lora_name' and 'lora_path' must be provided.")
    if name == engine.model:
        raise _invalid(f"The lora adapter '{name}' conflicts with a served base model.")
    lora = engine.lora
    if lora is None:  # the name checks pass (nothing is loaded); the worker then refuses
        raise engine_failure(_NOT_ENABLED, engine.perf.tp * engine.perf.pp)
    if not inplace and name in lora.adapters:
        raise _invalid(
            f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
            "set 'load_inplace' to True."
        )
    return lora


def load_static(engine: SimEngine, module: LoraModule) -> None:
    """An adapter of `--lora-modules`, loaded before the server listens (vLLM's `init_static_loras`):
    ValueError with vLLM's message where it would not start."""
    try:
        lora = _check_load(engine, module.name, module.path, inplace=False)
        adapter = lora.read(module.name, module.path, module.base_model_name)
    except VllmError as exc:
        raise ValueError(exc.message) from None
    lora.make_resident([adapter])
    lora.adapters[adapter.name] = adapter


class LoraEndpoints:
    """The handlers of one replica's adapter endpoints."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self._lock = asyncio.Lock()

    async def load(self, request: web.Request) -> web.Response:
        body = _parse(_Load, await request.read())
        name = body.lora_name
        async with self._lock:
            lora = _check_load(self.engine, name, body.lora_path, body.load_inplace)
            adapter = lora.read(name, body.lora_path)
            await self.engine.load_adapter(adapter, reload=body.load_inplace)
            lora.adapters[name] = adapter
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        body = _parse(_Unload, await request.read())
        name = body.lora_name
        if not name:
            raise _invalid("'lora_name' needs to be provided to unload a LoRA adapter.")
        lora = self.engine.lora
        async with self._lock:
            if lora is None or name not in lora.adapters:
                raise VllmError(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
            del lora.adapters[name]
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
