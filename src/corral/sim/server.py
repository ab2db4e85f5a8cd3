"""A simulated replica's HTTP face: vLLM's OpenAI-compatible API, `/health`, `/v1/models` and `/metrics`.

With `embed_dim` it is an embedding model instead (sim/embed.py). Without `max_tokens` a request stops at
a simulated end-of-sequence after 16–256 tokens (drawn from its seed), or where the context ends
(`max_model_len`, finishing with `length`, as vLLM's); with it, it generates exactly `max_tokens` (like vLLM
with `ignore_eos`), unless it runs with `eos` (`corral sim --eos`: it ends at the drawn end of sequence when
that comes first; a request's own `ignore_eos` decides for it). As vLLM, it refuses a prompt that fills the
context and a `max_tokens` beyond what the context leaves. `stop` strings end the text early, and the
choice's sequence with it (each choice is read as its tokens come). With `tools` or `response_format` a chat
choice says a tool call or JSON instead (sim/tools.py): it ends when that is said, or at `max_tokens` (cut).
Many replicas can share one process and event loop (sim/fleet.py).

With LoRA (sim/lora.py) a request may name an adapter as its `model`: the adapter answers (its words drawn
apart from the base model's, so a client can tell who answered), and `/v1/models` lists the adapters after
the base, each with its `parent`. The runtime endpoints `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter` exist only with `runtime_lora_updating` (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).
Errors are vLLM's (sim/errors.py) where the simulator knows them: an unknown model, the context length,
an empty stop string, the LoRA endpoints; a body it cannot read or validate is a 400 in vLLM's shape, with
its validation type (`Bad Request`) and corral's words. As vLLM, it reads bodies of any size (up to 64 MiB
here), and `/health` answers 503 once its engine (the step loop) is dead.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import generate_latest

from corral.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
)
from corral.sim.embed import SimEmbedder
from corral.sim.engine import DEAD, EngineDeadError, SimEngine, SimRequest
from corral.sim.errors import VllmError, bad_request, model_not_found
from corral.sim.lora import Adapter
from corral.sim.lora_api import LoraEndpoints
from corral.sim.text import TextGenerator, chat_prompt, tokenize
from corral.sim.tools import Script, script_for

__all__ = ["SimServer"]

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_MAX_BODY = 64 * 1024 * 1024  # vLLM sets no limit of its own; aiohttp's default (1 MiB) refused what it takes


class SimServer:
    """One simulated replica."""

    def __init__(
        self,
        engine: SimEngine,
        max_model_len: int,
        vocab: int = 32000,
        embed_dim: int | None = None,
        eos: bool = False,
        root: str | None = None,
        runtime_lora_updating: bool = False,
    ) -> None:
        self.engine = engine
        self.root = root  # the base model's /v1/models `root` (vLLM: the path it loaded)
        self.lora_endpoints = LoraEndpoints(engine) if runtime_lora_updating else None
        self.eos = eos  # end at the drawn end of sequence even with max_tokens (unless ignore_eos says)
        self.max_model_len = max_model_len
        self.vocab = vocab
        self._seeds = random.Random()
        self._embedder = SimEmbedder(engine, embed_dim, max_model_len, vocab) if embed_dim else None
        self._steps: asyncio.Task[None] | None = None  # the engine's step loop, while the app runs

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors], client_max_size=_MAX_BODY)
        if self._embedder is not None:  # an embedding model, like vLLM's pooling runner: nothing else
            app.router.add_post("/v1/embeddings", self._embedder.embeddings)
        else:
            app.router.add_post("/v1/chat/completions", self.chat)
            app.router.add_post("/v1/completions", self.completions)
        if self.lora_endpoints is not None:
            app.router.add_post("/v1/load_lora_adapter", self.lora_endpoints.load)
            app.router.add_post("/v1/unload_lora_adapter", self.lora_endpoints.unload)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)

        async def step_loop(app: web.Application) -> AsyncIterator[None]:
            task = self._steps = asyncio.create_task(self.engine.run(), name=f"sim:{self.engine.model}")
            task.add_done_callback(self._ended)
            yield
            task.cancel()
            await asyncio.wait([task])  # (one that died has been logged)
            if self.engine.kv_events is not None:
                self.engine.kv_events.close()

        app.cleanup_ctx.append(step_loop)
        return app

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("simulated engine %s: its step loop died: %r", self.engine.model, task.exception())

    async def health(self, request: web.Request) -> web.Response:
        """200 while the engine runs; 503 once its step loop has died (vLLM's, when its engine is dead)."""
        dead = self._steps is not None and self._steps.done()
        return web.Response(status=503 if dead else 200)

    async def models(self, request: web.Request) -> web.Response:
        model = {
            "id": self.engine.model,
            "object": "model",
            "created": 0,
            "owned_by": "corral-sim",
            "root": self.root,
            "parent": None,
            "max_model_len": self.max_model_len,
        }
        lora = self.engine.lora
        adapters = lora.model_cards(self.engine.model) if lora is not None else []
        return web.json_response({"object": "list", "data": [model, *adapters]})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.engine.metrics.registry), content_type="text/plain", charset="utf-8"
        )

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = parse_body(ChatCompletionRequest, await request.read())
        prompt = chat_prompt(m.model_dump() for m in body.messages)
        limit = body.max_completion_tokens or body.max_tokens
        return await self._generate(request, body, prompt, limit, chat=True)

    def _scripts(
        self, body: ChatCompletionRequest | CompletionRequest, seed: int, chat: bool
    ) -> list[Script | None]:
        if not chat or not isinstance(body, ChatCompletionRequest):
            return [None] * body.n
        return [script_for(body, random.Random(seed + i)) for i in range(body.n)]

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = parse_body(CompletionRequest, await request.read())
        prompt = body.prompt if isinstance(body.prompt, str) else " ".join(map(str, body.prompt))
        return await self._generate(request, body, prompt, body.max_tokens, chat=False)

    async def _generate(
        self,
        request: web.Request,
        body: ChatCompletionRequest | CompletionRequest,
        prompt: str,
        limit: int | None,
        chat: bool,
    ) -> web.StreamResponse:
        adapter = self._adapter(body.model)
        stops = _stops(body.stop)
        tokens = tokenize(prompt, self.vocab)
        self._check_context(len(tokens), limit)
        seed = body.seed if body.seed is not None else self._seeds.getrandbits(32)
        rng = random.Random(seed)
        scripts = self._scripts(body, seed, chat)
        ignore_eos = (body.model_extra or {}).get("ignore_eos")
        at_eos = not ignore_eos if isinstance(ignore_eos, bool) else self.eos
        drawn = [rng.randint(16, 256) for _ in scripts]
        # Without max_tokens vLLM lets an answer run to the end of the context; with it, to max_tokens.
        cap = limit if limit is not None else self.max_model_len - len(tokens)
        ends = [
            len(script.pieces) if script else end if limit is None or at_eos else None
            for script, end in zip(scripts, drawn, strict=True)
        ]
        lengths = [min(cap, end) if end is not None else cap for end in ends]
        natural = [end is not None and end <= cap for end in ends]  # it ends on its own, not cut
        words = seed ^ zlib.crc32(adapter.name.encode()) if adapter is not None else seed
        choices = [
            _Choice(i, TextGenerator(words + i), stops, "stop" if own else "length", script)
            for i, (script, own) in enumerate(zip(scripts, natural, strict=True))
        ]
        salt = (body.model_extra or {}).get("cache_salt")  # vLLM's: cached blocks shared within a salt only
        salt = salt if isinstance(salt, str) else None
        ends_with = ["stop" if own else "length" for own in natural]
        requests = self._submit(tokens, lengths, ends_with, salt, adapter)
        meta = _Meta(chat, body.model, len(tokens), request.headers.get("X-Request-Id"))
        try:
            if body.stream:
                return await self._stream(request, requests, choices, meta, body.include_usage)
            return await self._whole(requests, choices, meta)
        finally:
            for sim_request in requests:
                self.engine.abort(sim_request)

    def _check_context(self, prompt_tokens: int, max_tokens: int | None) -> None:
        """vLLM's checks of a generation request against the context: the prompt must leave room for a
        token, and prompt and `max_tokens` (where the client sent one) must fit."""
        if prompt_tokens >= self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your request "
                f"has {prompt_tokens} input tokens. Please reduce the length of the input messages.",
                param="input_tokens",
            )
        if max_tokens is not None and prompt_tokens + max_tokens > self.max_model_len:
            raise bad_request(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
                f"context length is {self.max_model_len} tokens and your request has {prompt_tokens} input "
                f"tokens ({max_tokens} > {self.max_model_len} - {prompt_tokens}).",
                param="max_tokens",
            )

    def _submit(
        self,
        tokens: list[int],
        lengths: list[int],
        ends_with: list[str],
        salt: str | None,
        adapter: Adapter | None,
    ) -> list[SimRequest]:
        """Every choice's sequence, or none: one the engine refuses withdraws those before it (a 400)."""
        requests: list[SimRequest] = []
        try:
            for n, reason in zip(lengths, ends_with, strict=True):
                requests.append(self.engine.submit(tokens, n, salt, adapter, reason))
        except ValueError as exc:
            for sim_request in requests:
                self.engine.abort(sim_request)
            raise bad_request(str(exc)) from exc
        return requests

    def _adapter(self, model: str) -> Adapter | None:
        """The adapter a request's `model` names; None for the base model."""
        if model == self.engine.model:
            return None
        adapter = self.engine.lora.adapters.get(model) if self.engine.lora is not None else None
        if adapter is None:
            raise model_not_found(model, self.engine.model)
        return adapter

    async def _whole(self, requests: list[SimRequest], choices: list[_Choice], meta: _Meta) -> web.Response:
        # The choices are read side by side as their tokens come, so each ends when it stops (vLLM's
        # output processor checks every output as it arrives), not when the one before it has ended.
        await asyncio.gather(*(self._read(r, c) for r, c in zip(requests, choices, strict=True)))
        return web.json_response(meta.completion(choices), dumps=lambda d: orjson.dumps(d).decode())

    async def _read(self, sim_request: SimRequest, choice: _Choice) -> None:
        while (token := await sim_request.tokens.get()) is not None:
            if token == DEAD:
                raise EngineDeadError()
            self._advance(sim_request, choice)
            if choice.done:
                return

    def _advance(self, sim_request: SimRequest, choice: _Choice) -> str:
        """The choice's next piece; a choice that has stopped ends its sequence there."""
        piece = choice.add_token()
        if choice.done:
            self.engine.finish(sim_request)
        return piece

    async def _stream(
        self,
        request: web.Request,
        requests: list[SimRequest],
        choices: list[_Choice],
        meta: _Meta,
        include_usage: bool,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        # Like vLLM, a chat choice's first chunk (its role) comes with its first output, after the prefill.
        unannounced = set(choices) if meta.chat else set()
        pending = {
            asyncio.ensure_future(r.tokens.get()): (r, c) for r, c in zip(requests, choices, strict=True)
        }
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    sim_request, choice = pending.pop(future)
                    if future.result() == DEAD:  # vLLM's stream: its error as an event, then [DONE]
                        for other in pending:
                            other.cancel()
                        pending.clear()
                        include_usage = False
                        await response.write(b"data: " + _engine_dead().to_json() + b"\n\n")
                        break
                    if choice in unannounced:
                        unannounced.discard(choice)
                        await response.write(meta.event(choice, choice.announcement()))
                    if future.result() is not None:
                        piece = self._advance(sim_request, choice)
                        await response.write(meta.event(choice, choice.delta(piece) if meta.chat else piece))
                    if future.result() is None or choice.done:
                        await response.write(meta.event(choice, {}, finish=choice.finish_reason))
                        continue
                    pending[asyncio.ensure_future(sim_request.tokens.get())] = (sim_request, choice)
        finally:  # (the client went away) the other choices' reads, which no token will end now
            for future in pending:
                future.cancel()
        if include_usage:
            await response.write(b"data: " + orjson.dumps(meta.usage_chunk(choices)) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


class _Choice:
    """The text of one choice as its tokens arrive; stop strings end it early. A scripted choice (a tool
    call, JSON) says its script's pieces and ends with them."""

    def __init__(
        self,
        index: int,
        words: TextGenerator,
        stops: list[str],
        finish_reason: str,
        script: Script | None = None,
    ) -> None:
        self.index = index
        self._words = words
        self._stops = stops
        # a stop string is looked for where it could have begun: in the new piece, or in the last
        # characters before it (one fewer than the longest stop string's)
        self._reach = max(map(len, stops), default=1) - 1
        self._tail = ""
        self._parts: list[str] = []
        self.tokens = 0
        self.done = False
        self.finish_reason = finish_reason
        self.script = script

    def announcement(self) -> dict[str, Any]:
        """The first chunk's delta (its role; a call's id and name)."""
        if self.script is not None and self.script.call_id is not None:
            call = {
                "index": 0,
                "id": self.script.call_id,
                "type": "function",
                "function": {"name": self.script.name, "arguments": ""},
            }
            return {"role": "assistant", "content": None, "tool_calls": [call]}
        return {"role": "assistant", "content": ""}

    def delta(self, piece: str) -> dict[str, Any]:
        if self.script is not None and self.script.call_id is not None:
            return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
        return {"content": piece}

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def message(self) -> dict[str, Any]:
        if self.script is not None and self.script.call_id is not None:
            call = {
                "id": self.script.call_id,
                "type": "function",
                "function": {"name": self.script.name, "arguments": self.text},
            }
            return {"role": "assistant", "content": None, "tool_calls": [call]}
        return {"role": "assistant", "content": self.text}

    def add_token(self) -> str:
        if self.script is not None:
            piece = self.script.pieces[self.tokens] if self.tokens < len(self.script.pieces) else ""
            self.tokens += 1
            self._parts.append(piece)
            if self.tokens >= len(self.script.pieces):
                self.done = True
                self.finish_reason = "tool_calls" if self.script.call_id else "stop"
            return piece
        piece = self._words.next_word(first=not any(self._parts))
        self.tokens += 1
        if self._stops:
            # (no earlier stop string was whole before this piece: one found now ends in it)
            window = self._tail + piece
            cuts = [cut for stop in self._stops if (cut := window.find(stop)) >= 0]
            if cuts:
                piece = window[: min(cuts)][len(self._tail) :]
                self.done, self.finish_reason = True, "stop"
            seen = self._tail + piece
            self._tail = seen[-self._reach :] if self._reach else ""
        self._parts.append(piece)
        return piece


class _Meta:
    def __init__(self, chat: bool, model: str, prompt_tokens: int, request_id: str | None = None) -> None:
        self.chat = chat
        self.model = model
        self.prompt_tokens = prompt_tokens
        # named by the caller's X-Request-Id where it sends one, as vLLM's answers are
        self.id = ("chatcmpl-" if chat else "cmpl-") + (request_id or uuid.uuid4().hex)
        self.created = int(time.time())

    def _usage(self, choices: list[_Choice]) -> dict[str, int]:
        completion = sum(c.tokens for c in choices)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }

    def completion(self, choices: list[_Choice]) -> dict[str, Any]:
        if self.chat:
            out = [
                {
                    "index": c.index,
                    "message": c.message(),
                    "finish_reason": c.finish_reason,
                    "logprobs": None,
                }
                for c in choices
            ]
            kind = "chat.completion"
        else:
            out = [
                {"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None}
                for c in choices
            ]
            kind = "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": out,
            "usage": self._usage(choices),
        }

    def event(self, choice: _Choice, delta: dict[str, Any] | str, finish: str | None = None) -> bytes:
        if self.chat:
            entry: dict[str, Any] = {"index": choice.index, "delta": delta, "finish_reason": finish}
            kind = "chat.completion.chunk"
        else:
            entry = {
                "index": choice.index,
                "text": delta if isinstance(delta, str) else "",
                "finish_reason": finish,
            }
            kind = "text_completion"
        chunk = {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [entry],
        }
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def usage_chunk(self, choices: list[_Choice]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self._usage(choices),
        }


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if "" in stops:  # vLLM's SamplingParams refuses it (it would end every answer at once)
        raise bad_request("stop cannot contain an empty string.", param="stop")
    return stops


def _engine_dead() -> VllmError:
    """vLLM's answer where its engine has died (EngineDeadError): a 500, its message as vLLM words it."""
    return VllmError(str(EngineDeadError()), "InternalServerError", 500)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as exc:  # (corral's validation of the body) in vLLM's shape, as its validation's
        refusal = VllmError(exc.message, HTTPStatus(exc.status).phrase, exc.status, param=exc.param)
        return web.Response(body=refusal.to_json(), status=exc.status, content_type="application/json")
    except VllmError as exc:
        return web.Response(body=exc.to_json(), status=exc.status, content_type="application/json")
    except EngineDeadError:
        return web.Response(body=_engine_dead().to_json(), status=500, content_type="application/json")
