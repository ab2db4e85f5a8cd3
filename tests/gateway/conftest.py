"""A scripted OpenAI-compatible upstream (a real aiohttp server on 127.0.0.1) and a gateway in front."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import pytest
from aiohttp import web

from corral.config import (
    AuthSettings,
    BatchSettings,
    CacheSettings,
    GatewaySettings,
    LimitsSettings,
    ModelCacheSpec,
    QueueSettings,
    StoreSettings,
)
from corral.gateway import GatewayParts, GatewayServer
from corral.routing import Replica, ReplicaSet, ReplicaState, Router


@dataclass
class ScriptedUpstream:
    """Answers like llama-server, or misbehaves as `mode` says: ok, cut, stall (goes silent mid-stream),
    dribble (a byte every 0.1 s mid-stream, never an event), flood (the same, 64 KB at a time), cutwhole,
    fail503 (vLLM starting), fail429 (TGI full), hang, drop, answer."""

    mode: str = "ok"
    chunks: int = 4
    delay: float = 0.0  # seconds a non-streaming answer takes
    gap: float = 0.01  # seconds between a stream's tokens
    bodies: list[dict] = field(default_factory=list)
    cancelled: int = 0
    required_key: str | None = None  # answer 401 unless `Authorization: Bearer <it>` is sent (vLLM --api-key)
    authorizations: list[str | None] = field(default_factory=list)
    request_ids: list[str | None] = field(default_factory=list)  # each request's X-Request-Id
    traces: list[tuple[str | None, str | None]] = field(default_factory=list)  # (traceparent, tracestate)
    answer: tuple[int, str, bytes] | None = None  # mode "answer": (status, content type, body) as is
    # continuing a chat not asked `continue_final_message`, send the continued text back first (as llama.cpp)
    echo_prefill: bool = False
    linger: float = 0.0  # seconds a stream stays open after its `[DONE]` before it ends
    usage: object = None  # reported as the answers' usage, as is, where set (an engine's broken counts)
    retry_after: str | None = None  # the Retry-After of fail503's and fail429's answers
    active: int = 0
    peak_concurrency: int = 0
    hung_probes: int = 0  # health probes left unanswered (mode "hang")
    url: str = ""
    runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)  # (as an engine: no 1 MiB cap)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    async def health(self, request: web.Request) -> web.Response:
        if self.mode == "hang":
            self.hung_probes += 1
            await asyncio.sleep(3600)
        return web.json_response({"status": "ok"})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.active += 1
        self.peak_concurrency = max(self.peak_concurrency, self.active)
        try:
            return await self._answer(request)
        finally:
            self.active -= 1

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.authorizations.append(request.headers.get("Authorization"))
        self.request_ids.append(request.headers.get("X-Request-Id"))
        self.traces.append((request.headers.get("traceparent"), request.headers.get("tracestate")))
        if self.required_key and request.headers.get("Authorization") != f"Bearer {self.required_key}":
            return web.json_response({"error": {"message": "Unauthorized"}}, status=401)
        if self.mode == "answer" and self.answer is not None:
            status, content_type, raw = self.answer
            return web.Response(status=status, body=raw, content_type=content_type)
        if self.mode == "cutwhole" and not body.get("stream"):  # dies halfway through a whole answer
            whole = orjson.dumps(_completion(self.chunks))
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            response.content_length = len(whole)
            await response.prepare(request)
            await response.write(whole[: len(whole) // 2])
            assert request.transport is not None
            request.transport.close()
            return response
        if self.mode in ("fail503", "fail429"):
            status = 503 if self.mode == "fail503" else 429
            headers = {"Retry-After": self.retry_after} if self.retry_after is not None else None
            error = {"message": "loading" if status == 503 else "Model is overloaded", "type": "unavailable"}
            return web.json_response({"error": error}, status=status, headers=headers)
        if self.mode == "drop":
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(1)
        if self.mode == "hang":
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        if not body.get("stream"):
            await asyncio.sleep(self.delay)
            whole = _completion(self.chunks)
            if self.usage is not None:
                whole["usage"] = self.usage
            return web.json_response(whole)
        return await self._stream(request, body)

    async def _stream(self, request: web.Request, body: dict) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        messages = body.get("messages") or [{}]
        continued = messages[-1].get("content", "") if messages[-1].get("role") == "assistant" else ""
        start = continued.count("tok")  # a continuation (mid-stream failover) goes on where the text ends
        if continued and self.echo_prefill and body.get("continue_final_message") is not True:
            await response.write(_event(_chunk(continued)))
        try:
            for i in range(start, self.chunks):
                await response.write(_event(_chunk(f"tok{i} ")))
                if self.mode == "cut" and i == 1 and not continued:
                    assert request.transport is not None
                    request.transport.close()
                    return response
                if self.mode == "stall" and i == 1 and not continued:
                    await asyncio.sleep(3600)
                while self.mode == "dribble" and i == 1 and not continued:  # bytes, never an event's end
                    await response.write(b" ")
                    await asyncio.sleep(0.1)
                while self.mode == "flood" and i == 1 and not continued:  # 64 KB writes, never an event's end
                    await response.write(b"x" * 65536)
                    await asyncio.sleep(0)
                await asyncio.sleep(self.gap)
            await response.write(_event(_chunk("", finish="stop")))
            if (body.get("stream_options") or {}).get("include_usage"):
                await response.write(
                    _event(
                        {
                            "id": "c1",  # (vLLM's usage chunk carries the stream's id too)
                            "choices": [],
                            "object": "chat.completion.chunk",
                            "usage": _usage(self.chunks - start) if self.usage is None else self.usage,
                        }
                    )
                )
            await response.write(b"data: [DONE]\n\n")
            await asyncio.sleep(self.linger)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return response


def _usage(n: int) -> dict:
    return {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}


def _completion(n: int) -> dict:
    return {
        "id": "cmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": " ".join(f"tok{i}" for i in range(n))},
            }
        ],
        "usage": _usage(n),
    }


def _chunk(text: str, finish: str | None = None) -> dict:
    delta = {"content": text} if text else {}
    return {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def _event(data: dict) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


@dataclass
class Gateway:
    url: str
    replicas: ReplicaSet
    server: GatewayServer

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def add_replica(
        self, upstream_url: str, model: str = "m", state: ReplicaState = ReplicaState.READY
    ) -> Replica:
        replica = Replica(
            id=f"{model}-{len(self.replicas.of(model))}",
            model=model,
            engine="scripted",
            url=upstream_url,
            state=state,
        )
        self.replicas.add(replica)
        return replica


@pytest.fixture
async def upstream() -> AsyncIterator[ScriptedUpstream]:
    server = ScriptedUpstream()
    await server.start()
    yield server
    await server.stop()


def make_services(
    replicas: ReplicaSet,
    database: Path,
    auth: AuthSettings | None = None,
    limits: LimitsSettings | None = None,
    queue: QueueSettings | None = None,
    admin_key: str | None = None,
    tokenizers: dict[str, Path] | None = None,
    failover_modes: dict[str, str] | None = None,
    isolation: dict[str, str | None] | None = None,
) -> GatewayParts:
    """Admission services over a fresh SQLite database; open access unless `auth` says otherwise."""
    return GatewayParts.build(
        replicas,
        f"sqlite:///{database}",
        auth or AuthSettings(open=True),
        StoreSettings(flush_interval=0.1),
        limits or LimitsSettings(),
        queue or QueueSettings(),
        admin_key,
        tokenizers,
        failover_modes,
        isolation,
    )


async def start_closed_gateway(
    replicas: ReplicaSet,
    database_url: str,
    admin_key: str,
    settings: GatewaySettings | None = None,
    store: StoreSettings | None = None,
    cache: CacheSettings | None = None,
    cache_policies: dict[str, ModelCacheSpec] | None = None,
    batch: BatchSettings | None = None,
) -> tuple[str, GatewayServer, GatewayParts]:
    """A started gateway in front of `replicas` that admits keys only (made by the admin API under
    `admin_key`), its store at `database_url`: (its url, the server, its parts)."""
    parts = GatewayParts.build(
        replicas,
        database_url,
        AuthSettings(open=False, admin_key=admin_key),
        store or StoreSettings(flush_interval=0.1),
        LimitsSettings(),
        QueueSettings(),
        admin_key=admin_key,
        cache=cache,
        cache_policies=cache_policies,
        batch=batch,
    )
    server = GatewayServer(settings or GatewaySettings(port=0), Router(replicas), parts)
    await server.start()
    return f"http://127.0.0.1:{server.port}", server, parts


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    replicas = ReplicaSet(["m"])
    settings = GatewaySettings(port=0, read_timeout=1.0, connect_timeout=1.0, max_body_bytes=64 * 1024)
    services = make_services(replicas, tmp_path / "corral.db")
    server = GatewayServer(settings, Router(replicas, default_policy="least_outstanding_requests"), services)
    await server.start()
    yield Gateway(f"http://127.0.0.1:{server.port}", replicas, server)
    await server.stop()
