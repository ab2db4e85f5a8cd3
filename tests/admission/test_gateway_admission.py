"""Keys, limits, queueing, usage and metrics through a real gateway on 127.0.0.1."""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import openai
import pytest

from corral.admission import TokenCounter
from corral.admission.tokens import LONG_TEXT_CHARS
from corral.config import AuthSettings, GatewaySettings, LimitsSettings, Paths, QueueSettings
from corral.gateway import GatewayParts, GatewayServer
from corral.routing import Replica, ReplicaSet, ReplicaState, Router

from ..conftest import CORRAL
from ..gateway.conftest import ScriptedUpstream, make_services

ADMIN = "admin-secret"
AS_ADMIN = {"Authorization": f"Bearer {ADMIN}"}
MESSAGES = [{"role": "user", "content": "hi"}]


class Cluster:
    def __init__(self, url: str, services: GatewayParts, replicas: ReplicaSet, database: Path) -> None:
        self.url, self.services, self.replicas, self.database = url, services, replicas, database

    def client(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)

    async def admin(
        self, method: str, path: str, body: dict | None = None, key: str = ADMIN
    ) -> tuple[int, dict]:
        async with (
            aiohttp.ClientSession() as session,
            session.request(
                method, self.url + path, json=body, headers={"Authorization": f"Bearer {key}"}
            ) as response,
        ):
            return response.status, await response.json()


async def start(
    tmp_path: Path,
    upstream: ScriptedUpstream,
    capacity: int | None = None,
    queue: QueueSettings | None = None,
    limits: LimitsSettings | None = None,
) -> tuple[GatewayServer, Cluster]:
    replicas = ReplicaSet(["m"])
    replicas.add(
        Replica(
            id="m-0", model="m", engine="x", url=upstream.url, state=ReplicaState.READY, capacity=capacity
        )
    )
    database = tmp_path / "corral.db"
    services = make_services(
        replicas,
        database,
        auth=AuthSettings(open=False, cache_ttl=0.5),
        queue=queue,
        limits=limits,
        admin_key=ADMIN,
    )
    server = GatewayServer(GatewaySettings(port=0), Router(replicas, default_policy="round_robin"), services)
    await server.start()
    return server, Cluster(f"http://127.0.0.1:{server.port}", services, replicas, database)


@pytest.fixture
async def closed(tmp_path: Path, upstream: ScriptedUpstream) -> AsyncIterator[Cluster]:
    server, cluster = await start(tmp_path, upstream)
    yield cluster
    await server.stop()


async def test_requests_need_a_valid_key(closed: Cluster) -> None:
    with pytest.raises(openai.AuthenticationError):
        await closed.client("sk-corral-made-up").chat.completions.create(model="m", messages=MESSAGES)
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            closed.url + "/v1/chat/completions", json={"model": "m", "messages": MESSAGES}
        ) as response,
    ):
        assert response.status == 401 and "Missing API key" in (await response.json())["error"]["message"]
    status, made = await closed.admin("POST", "/admin/keys", {"tenant": "acme"})
    assert status == 201 and made["key"].startswith("sk-corral-") and made["tenant"] == "acme"
    reply = await closed.client(made["key"]).chat.completions.create(model="m", messages=MESSAGES)
    assert reply.choices[0].message.content


async def test_admin_api_needs_the_admin_key(closed: Cluster) -> None:
    status, body = await closed.admin("GET", "/admin/keys", key="wrong")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body = await closed.admin("POST", "/admin/keys", {"tenant": "x", "priority": "urgent"})
    assert status == 400 and body["error"]["param"] == "priority"


async def test_key_limited_to_some_models_gets_403_elsewhere(closed: Cluster) -> None:
    _, made = await closed.admin("POST", "/admin/keys", {"tenant": "acme", "models": ["other"]})
    with pytest.raises(openai.PermissionDeniedError, match="may not use the model 'm'"):
        await closed.client(made["key"]).chat.completions.create(model="m", messages=MESSAGES)


async def test_revoked_key_stops_working_within_the_cache_ttl(closed: Cluster) -> None:
    _, made = await closed.admin("POST", "/admin/keys", {"tenant": "acme"})
    client = closed.client(made["key"])
    await client.chat.completions.create(model="m", messages=MESSAGES)  # now cached
    status, _ = await closed.admin("DELETE", f"/admin/keys/{made['id']}")
    assert status == 200
    revoked_at = time.monotonic()
    while True:
        sent = time.monotonic()
        try:
            await client.chat.completions.create(model="m", messages=MESSAGES)
        except openai.AuthenticationError:
            break
        # the key was cached before it was revoked: a request sent once that entry expired is refused
        # (whatever the machine's load makes of the answer's time)
        assert sent - revoked_at < 0.5, "a revoked key still worked past auth.cache_ttl"
        await asyncio.sleep(0.05)


async def test_rate_limited_key_gets_429_with_headers(closed: Cluster) -> None:
    _, made = await closed.admin("POST", "/admin/keys", {"tenant": "acme", "rpm": 2})
    async with aiohttp.ClientSession() as session:
        statuses, last, remaining = [], None, []
        for _ in range(3):
            async with session.post(
                closed.url + "/v1/chat/completions",
                json={"model": "m", "messages": MESSAGES},
                headers={"Authorization": f"Bearer {made['key']}"},
            ) as response:
                statuses.append(response.status)
                last = (dict(response.headers), await response.json())
                remaining.append(response.headers.get("x-ratelimit-remaining-requests"))
                if response.status == 200:  # OpenAI sends them on every answer, not only on refusals
                    assert response.headers["x-ratelimit-limit-requests"] == "2"
                    assert 0 < float(response.headers["x-ratelimit-reset-requests"].rstrip("s")) <= 60
    assert statuses == [200, 200, 429] and remaining == ["1", "0", "0"]
    headers, body = last
    assert body["error"]["type"] == "rate_limit_error"
    assert 1 <= int(headers["Retry-After"]) <= 60
    assert headers["x-ratelimit-limit-requests"] == "2" and headers["x-ratelimit-remaining-requests"] == "0"


async def test_usage_is_recorded_and_reported(closed: Cluster) -> None:
    _, made = await closed.admin("POST", "/admin/keys", {"tenant": "globex"})
    client = closed.client(made["key"])
    for _ in range(3):
        await client.chat.completions.create(model="m", messages=MESSAGES)
    stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    async for _ in stream:
        pass
    await asyncio.sleep(0.4)  # store.flush_interval is 0.1 s in tests
    _, report = await closed.admin("GET", "/admin/usage?by=key")
    row = next(r for r in report["rows"] if r["key"] == made["id"])
    assert row["requests"] == 4 and row["output_tokens"] == 16 and row["input_tokens"] == 20
    shown = await asyncio.to_thread(
        subprocess.run,
        [*CORRAL, "usage", "--by", "tenant", "--json", "--store", f"sqlite:///{closed.database}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert any(r["tenant"] == "globex" and r["requests"] == 4 for r in json.loads(shown.stdout))


async def test_metrics_endpoint(closed: Cluster) -> None:
    _, made = await closed.admin("POST", "/admin/keys", {"tenant": "acme"})
    await closed.client(made["key"]).chat.completions.create(model="m", messages=MESSAGES)
    async with (
        aiohttp.ClientSession() as session,
        session.get(closed.url + "/metrics", headers=AS_ADMIN) as response,
    ):
        text = await response.text()
    assert 'corral_requests_total{model="m",status="200"} 1.0' in text
    assert 'corral_tokens_total{kind="output",model="m"} 4.0' in text
    for name in (
        "corral_request_duration_seconds_bucket",
        "corral_queue_depth",
        "corral_replica_outstanding",
        "corral_circuit_state",
        "corral_routing_decisions_total",
        "corral_queue_wait_seconds_count",
    ):
        assert name in text


@pytest.mark.slow
async def test_flooding_tenant_does_not_starve_a_trickle(tmp_path: Path) -> None:
    """Tenant A floods 20 requests at once; tenant B sends one every 0.5 s. Each request holds the single
    slot for 0.25 s. First-come-first-served would make B wait behind all of A (~5 s); fair turns bound B's
    wait to about two service times (the one running, then B's own)."""
    slow = ScriptedUpstream(delay=0.25)
    await slow.start()
    server, cluster = await start(tmp_path, slow, capacity=1, queue=QueueSettings(max_queued=100, timeout=30))
    try:
        _, a = await cluster.admin("POST", "/admin/keys", {"tenant": "a"})
        _, b = await cluster.admin("POST", "/admin/keys", {"tenant": "b"})
        client_a, client_b = cluster.client(a["key"]), cluster.client(b["key"])
        await client_b.chat.completions.create(model="m", messages=MESSAGES)  # warm the key cache
        waits: list[float] = []

        async def call_b() -> None:
            started = time.monotonic()
            await client_b.chat.completions.create(model="m", messages=MESSAGES)
            waits.append(time.monotonic() - started)

        flood = [
            asyncio.create_task(client_a.chat.completions.create(model="m", messages=MESSAGES))
            for _ in range(20)
        ]
        await asyncio.sleep(0.1)
        trickle = []
        for _ in range(6):
            trickle.append(asyncio.create_task(call_b()))
            await asyncio.sleep(0.5)
        await asyncio.gather(*trickle, *flood)
        waits.sort()
        p95 = waits[int(0.95 * (len(waits) - 1))]
        assert p95 <= 2 * 0.25 + 0.15, waits
        assert statistics.median(waits) < 0.6
    finally:
        await server.stop()
        await slow.stop()


async def test_full_queue_and_deadline_give_503_with_retry_after(tmp_path: Path) -> None:
    hang = ScriptedUpstream(mode="hang")
    await hang.start()
    server, cluster = await start(tmp_path, hang, capacity=1, queue=QueueSettings(max_queued=1, timeout=0.3))
    try:
        _, made = await cluster.admin("POST", "/admin/keys", {"tenant": "a"})
        headers = {"Authorization": f"Bearer {made['key']}"}
        body = {"model": "m", "messages": MESSAGES}
        async with aiohttp.ClientSession() as session:
            holder = asyncio.create_task(
                session.post(cluster.url + "/v1/chat/completions", json=body, headers=headers)
            )
            await asyncio.sleep(0.1)
            waiter = asyncio.create_task(
                session.post(cluster.url + "/v1/chat/completions", json=body, headers=headers)
            )
            await asyncio.sleep(0.05)
            async with session.post(cluster.url + "/v1/chat/completions", json=body, headers=headers) as full:
                assert full.status == 503 and (await full.json())["error"]["code"] == "queue_full"
                assert int(full.headers["Retry-After"]) >= 1
            late = await waiter
            assert late.status == 503 and (await late.json())["error"]["code"] == "queue_timeout"
            holder.cancel()
    finally:
        await server.stop()
        await hang.stop()


async def test_input_tokens_are_counted_with_the_models_tokenizer(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    """A 60-word prompt is ~60 tokens by SmolLM2's tokenizer, but its 400-byte body estimates at 100+:
    with the tokenizer the request fits a 100-token-per-minute key; with the estimate it is too large."""
    tokenizer = next((Paths.from_env().models / "hf-from-gguf").glob("SmolLM2*/tokenizer.json"))
    replicas = ReplicaSet(["m"])
    replicas.add(Replica(id="m-0", model="m", engine="x", url=upstream.url, state=ReplicaState.READY))
    body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hello " * 60}]}
    outcomes = []
    for tokenizers in ({"m": tokenizer}, None):
        services = make_services(
            replicas,
            tmp_path / f"{bool(tokenizers)}.db",
            auth=AuthSettings(open=False),
            admin_key=ADMIN,
            tokenizers=tokenizers,
        )
        server = GatewayServer(GatewaySettings(port=0), Router(replicas), services)
        await server.start()
        try:
            key, _ = services.keys.create("t", tpm=100)
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    f"http://127.0.0.1:{server.port}/v1/chat/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {key}"},
                ) as response,
            ):
                outcomes.append(
                    (response.status, (await response.json()).get("error", {}).get("message", ""))
                )
        finally:
            await server.stop()
    assert outcomes[0][0] == 200
    assert outcomes[1][0] == 429 and "too large" in outcomes[1][1]


async def get(url: str, key: str | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as response:
        return response.status, await response.json()


async def test_closed_gateway_shows_models_and_replicas_only_to_keys(closed: Cluster) -> None:
    assert (await get(closed.url + "/v1/models"))[0] == 401
    assert (await get(closed.url + "/corral/status"))[0] == 401
    # readiness says ready to anyone (a load balancer's probe), the models to those who may see replicas
    assert await get(closed.url + "/ready") == (200, {"ready": True})
    assert await get(closed.url + "/ready", ADMIN) == (200, {"ready": True, "models": {"m": 1}})
    schemas = (await get(closed.url + "/openapi.json"))[1]["components"]["schemas"]  # (anyone reads it)
    assert '"m"' not in json.dumps(schemas["ChatCompletionRequest"])  # no served model named in it
    _, anyone = await closed.admin("POST", "/admin/keys", {"tenant": "acme"})
    _, other = await closed.admin("POST", "/admin/keys", {"tenant": "globex", "models": ["other"]})
    assert [m["id"] for m in (await get(closed.url + "/v1/models", anyone["key"]))[1]["data"]] == ["m"]
    assert (await get(closed.url + "/v1/models", other["key"]))[1]["data"] == []
    status, seen = await get(closed.url + "/corral/status", anyone["key"])
    assert status == 200 and [r["id"] for r in seen["replicas"]] == ["m-0"]
    assert not {"url", "pid", "node"} & set(seen["replicas"][0])  # internals stay hidden from tenants
    # so do the token figures that would tell the sizes of other tenants' requests on a shared replica
    hidden = {"outstanding_tokens", "pending_prefill_tokens", "kv_cached_tokens", "generated_tokens_total"}
    assert not (hidden | {"kv_capacity_tokens", "prefix_cache_hit_rate"}) & set(seen["replicas"][0])
    assert {"outstanding", "capacity", "state"} <= set(seen["replicas"][0])
    assert (await get(closed.url + "/corral/status", other["key"]))[1]["replicas"] == []
    status, full = await get(closed.url + "/corral/status", ADMIN)
    assert status == 200 and full["replicas"][0]["url"].startswith("http://127.0.0.1:")
    shown = {"generated_tokens_total", "kv_capacity_tokens", "prefix_cache_hit_rate"}
    assert shown <= set(full["replicas"][0])


async def test_model_refusal_is_recorded_in_usage_and_metrics(closed: Cluster) -> None:
    _, made = await closed.admin("POST", "/admin/keys", {"tenant": "initech", "models": ["other"]})
    with pytest.raises(openai.PermissionDeniedError):
        await closed.client(made["key"]).chat.completions.create(model="m", messages=MESSAGES)
    async with (
        aiohttp.ClientSession() as session,
        session.get(closed.url + "/metrics", headers=AS_ADMIN) as response,
    ):
        text = await response.text()
    assert 'corral_requests_total{model="m",status="403"} 1.0' in text
    assert 'corral_rejections_total{model="m",reason="model_not_allowed"} 1.0' in text
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        _, report = await closed.admin("GET", "/admin/usage?by=tenant")
        row = next((r for r in report["rows"] if r["tenant"] == "initech"), None)
        if row is not None:
            break
        await asyncio.sleep(0.1)
    assert row is not None and row["requests"] == 1 and row["errors"] == 1


async def test_tokens_per_char_sets_the_input_estimate_reserved_against_tpm(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    """Without a tokenizer the reservation is body bytes × `limits.tokens_per_char` + max_tokens: the same
    2,000-character request fits a 1,000-TPM key at the default 0.25 and is refused as too large at 1.0."""
    body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "x" * 2000}]}
    statuses = []
    for per_char in (0.25, 1.0):
        server, cluster = await start(
            tmp_path / str(per_char), upstream, limits=LimitsSettings(tokens_per_char=per_char)
        )
        try:
            _, made = await cluster.admin("POST", "/admin/keys", {"tenant": "acme", "tpm": 1000})
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    cluster.url + "/v1/chat/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {made['key']}"},
                ) as response,
            ):
                statuses.append(
                    (response.status, (await response.json()).get("error", {}).get("message", ""))
                )
        finally:
            await server.stop()
    assert statuses[0][0] == 200
    assert statuses[1][0] == 429 and "too large" in statuses[1][1]


async def test_a_long_prompt_is_counted_off_the_event_loop(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    """With the model's tokenizer a 1.3 MB prompt takes a second or more to count: on the event loop (or in a
    thread through the tokenizer's `encode`, which keeps the GIL) every other request would wait that
    long. Counted through the GIL-free call in a thread (a count_tokens and a chat request at once),
    /health keeps answering meanwhile, and the count is the tokenizer's own."""
    from tokenizers import Tokenizer

    from corral.admission import TokenCounter

    path = next((Paths.from_env().models / "hf-from-gguf").glob("SmolLM2*/tokenizer.json"))
    text = " ".join(f"word{i % 9973} and more" for i in range(80_000))  # about 1.3 MB
    started = time.perf_counter()
    expected = len(Tokenizer.from_file(str(path)).encode(text, add_special_tokens=False).ids)
    on_the_loop = time.perf_counter() - started  # what the loop would be held for
    assert TokenCounter(path).count(text) == expected  # (the long-text call counts alike)
    replicas = ReplicaSet(["m"])
    replicas.add(Replica(id="m-0", model="m", engine="x", url=upstream.url, state=ReplicaState.READY))
    services = make_services(replicas, tmp_path / "c.db", tokenizers={"m": path})
    server = GatewayServer(GatewaySettings(port=0), Router(replicas), services)
    await server.start()
    url = f"http://127.0.0.1:{server.port}"
    body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": text}]}
    try:
        async with aiohttp.ClientSession() as session:
            counting = asyncio.gather(
                session.post(url + "/v1/messages/count_tokens", json=body),
                session.post(url + "/v1/chat/completions", json=body),
            )
            answered = [time.perf_counter()]  # (the gateway shares this test's event loop)
            while not counting.done():
                async with session.get(url + "/health") as health:
                    assert health.status == 200
                answered.append(time.perf_counter())
                await asyncio.sleep(0.01)
            counted, chat = await counting
            assert counted.status == 200 and chat.status == 200
            assert (await counted.json())["input_tokens"] >= expected
        gaps = [b - a for a, b in itertools.pairwise(answered)]
        assert max(gaps) < on_the_loop / 4, (on_the_loop, max(gaps))
    finally:
        await server.stop()


def _counting_gateway(
    tmp_path: Path, upstream: ScriptedUpstream, counted_model: str = "m", embedder: bool = False
) -> tuple[GatewayServer, GatewayParts, list[int]]:
    """A closed gateway (not started) in front of `upstream` whose model `counted_model` counts prompts
    with SmolLM2's tokenizer, noting each count (`counted`: the texts' lengths); `embedder`: an embedding
    model "e" beside the chat model "m"."""
    from corral.admission import TokenCounter
    from corral.engines import EngineFeatures

    path = next((Paths.from_env().models / "hf-from-gguf").glob("SmolLM2*/tokenizer.json"))
    replicas = ReplicaSet(["m", "e"] if embedder else ["m"])
    replicas.add(Replica(id="m-0", model="m", engine="x", url=upstream.url, state=ReplicaState.READY))
    if embedder:
        features = EngineFeatures(embeddings=True)
        replicas.add(
            Replica(
                id="e-0", model="e", engine="x", url=upstream.url, state=ReplicaState.READY, features=features
            )
        )
    services = make_services(replicas, tmp_path / "c.db", auth=AuthSettings(open=False), admin_key=ADMIN)
    counted: list[int] = []

    class Counted(TokenCounter):
        def count(self, text: str) -> int:
            counted.append(len(text))
            return super().count(text)

    services.sizing.counters[counted_model] = Counted(path)
    return GatewayServer(GatewaySettings(port=0), Router(replicas), services), services, counted


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses"])
async def test_a_key_over_its_limits_is_refused_before_its_long_prompt_is_counted(
    tmp_path: Path, upstream: ScriptedUpstream, route: str
) -> None:
    """Mallory's key allows one request a minute. Her second long prompt is refused (429, recorded by its
    request id) without the model's tokenizer counting it: over her limits she cannot make the gateway
    spend a counting thread's seconds for nothing. Her first, within them, was counted and served; her
    key that may not use the model (403) and her key whose month's budget is spent (429) are refused
    before counting too."""
    from corral.admission import Principal

    server, services, counted = _counting_gateway(tmp_path, upstream)
    await server.start()
    key, record = services.keys.create("mallory", rpm=1)
    text = " ".join(f"word{i % 9973} and more" for i in range(12_000))  # about 200 kB: counted in a thread
    if route == "/v1/chat/completions":
        body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": text}]}
    else:
        body = {"model": "m", "max_output_tokens": 1, "input": text, "store": False}
    headers = {"Authorization": f"Bearer {key}"}
    url = f"http://127.0.0.1:{server.port}"
    try:
        async with aiohttp.ClientSession() as session:
            statuses, ids = [], []
            for _ in range(2):
                async with session.post(url + route, json=body, headers=headers) as answer:
                    statuses.append(answer.status)
                    ids.append(answer.headers["x-request-id"])
                    refusal = await answer.json()
            assert statuses == [200, 429] and len(counted) == 1
            other, _ = services.keys.create("mallory", models=["another-model"])  # (within its limits)
            forbidden = {"Authorization": f"Bearer {other}"}
            async with session.post(url + route, json=body, headers=forbidden) as refused:
                assert refused.status == 403 and len(counted) == 1  # told before counting too
            spent, budgeted = services.keys.create("mallory", monthly_token_budget=1_000)
            assert await services.budget.reserve(Principal.of(budgeted), 1_000)  # (another request's hold)
            broke = {"Authorization": f"Bearer {spent}"}
            async with session.post(url + route, json=body, headers=broke) as refused:
                error = (await refused.json())["error"]
                assert refused.status == 429 and error["code"] == "insufficient_quota"
                # (all of it held by the request in flight: it fits once that ends, in seconds)
                assert len(counted) == 1 and "in flight hold 1,000 of its 1,000 tokens" in error["message"]
                assert int(refused.headers["Retry-After"]) <= 5
            assert refusal["error"]["code"] == "rate_limit_exceeded"
            assert answer.headers["Retry-After"] and answer.headers["x-ratelimit-remaining-requests"] == "0"
            await asyncio.sleep(0.4)  # store.flush_interval is 0.1 s in tests
            async with session.get(f"{url}/admin/usage?request_id={ids[1]}", headers=AS_ADMIN) as found:
                (row,) = (await found.json())["rows"]
    finally:
        await server.stop()
    assert row["status"] == 429 and row["key_id"] == record.id
    assert row["api"] == ("chat" if route == "/v1/chat/completions" else "responses")


class _HeldCounter(TokenCounter):
    """Counts a token per four characters; a long text's count waits for `go` (`began` set when one
    begins), each long text's length noted in `counted`. Stands in for a tokenizer over a few MB."""

    def __init__(self) -> None:  # (no tokenizer file)
        self.go, self.began = threading.Event(), threading.Event()
        self.counted: list[int] = []

    def count(self, text: str) -> int:
        if len(text) >= LONG_TEXT_CHARS:
            self.began.set()
            assert self.go.wait(30)
            self.counted.append(len(text))
        return len(text) // 4


class _Checks:
    """The limiter as it is, its `check` calls counted (one for each long prompt's check of its key)."""

    def __init__(self, real: object) -> None:
        self.real, self.checks = real, 0

    async def check(self, principal: object, tokens: int) -> None:
        self.checks += 1
        await self.real.check(principal, tokens)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)


def _held_gateway(
    tmp_path: Path, upstream: ScriptedUpstream, context: int | None = None
) -> tuple[GatewayServer, GatewayParts, _HeldCounter, _Checks]:
    """A closed gateway (not started) whose model "m" (`context` tokens a sequence) counts prompts with a
    `_HeldCounter`, its limiter's checks counted."""
    replicas = ReplicaSet(["m"])
    replicas.add(
        Replica(
            id="m-0",
            model="m",
            engine="x",
            url=upstream.url,
            state=ReplicaState.READY,
            context_length=context,
        )
    )
    services = make_services(replicas, tmp_path / "c.db", auth=AuthSettings(open=False), admin_key=ADMIN)
    counter = services.sizing.counters["m"] = _HeldCounter()
    checks = _Checks(services.limits.limiter)
    services.limits.limiter = checks  # type: ignore[assignment]
    return GatewayServer(GatewaySettings(port=0), Router(replicas), services), services, counter, checks


async def _until(condition: Callable[[], bool], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come within the deadline"
        await asyncio.sleep(0.01)


async def test_long_prompts_waiting_for_their_count_are_checked_again_when_their_turn_comes(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    """Mallory's key allows one request a minute. Seven more long prompts of hers come while her first is
    being counted: each passes the check made as it comes (nothing is reserved before a count) and waits
    for her counting turn. By their turn her first has taken her minute's request: they are refused then,
    uncounted (but for the one whose turn came as her first was being admitted), where all seven were
    counted (seconds of a counting thread each for a few MB) only to be refused after."""
    server, services, counter, checks = _held_gateway(tmp_path, upstream)
    await server.start()
    key, _ = services.keys.create("mallory", rpm=1)
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    text = "word and more " * 15_000  # about 210 kB: counted in a thread, not checked before its parse

    async def ask(i: int) -> tuple[int, dict]:
        body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": f"{text} {i}"}]}
        async with session.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as answer:
            return answer.status, await answer.json()

    try:
        async with aiohttp.ClientSession() as session:
            first = asyncio.create_task(ask(0))
            await _until(counter.began.is_set)
            before = checks.checks
            rest = [asyncio.create_task(ask(i)) for i in range(1, 8)]
            await _until(lambda: checks.checks - before >= 7)  # each checked as it came: all waiting
            counter.go.set()
            answers = await asyncio.gather(first, *rest)
    finally:
        counter.go.set()
        await server.stop()
    assert answers[0][0] == 200
    assert [status for status, _ in answers[1:]] == [429] * 7
    assert {error["error"]["code"] for _, error in answers[1:]} == {"rate_limit_exceeded"}
    assert len(counter.counted) <= 2, counter.counted


async def test_a_tenants_long_prompts_waiting_to_be_counted_are_bounded(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    """Each long prompt waiting for its tenant's counting turn holds its body in memory: ten of a million
    characters at once (a key without limits) park eight (8 Mi characters at most wait), and the other two
    are refused at once, 429 `too_many_long_prompts` with a Retry-After, where all ten waited. The eight
    are counted and served one after another."""
    server, services, counter, _ = _held_gateway(tmp_path, upstream)
    await server.start()
    key, _ = services.keys.create("mallory")
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    text = "x " * 500_000

    async def ask(i: int) -> tuple[int, dict, dict[str, str]]:
        body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": f"{text}{i:02d}"}]}
        async with session.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as answer:
            return answer.status, await answer.json(), dict(answer.headers)

    try:
        async with aiohttp.ClientSession() as session:
            asked = [asyncio.create_task(ask(i)) for i in range(10)]
            await _until(lambda: sum(task.done() for task in asked) >= 2)  # (the first held in its count)
            refused = [task.result() for task in asked if task.done()]
            counter.go.set()
            answers = await asyncio.gather(*asked)
    finally:
        counter.go.set()
        await server.stop()
    assert [status for status, _, _ in refused] == [429, 429]
    for _, error, headers in refused:
        assert (
            error["error"]["code"] == "too_many_long_prompts" and error["error"]["type"] == "rate_limit_error"
        )
        assert int(headers["Retry-After"]) >= 1
    assert sorted(status for status, _, _ in answers) == [200] * 8 + [429] * 2
    assert len(counter.counted) == 8


@pytest.mark.parametrize("refusal", ["too large for its TPM", "past the model's context"])
async def test_a_long_prompt_refused_once_counted_spends_one_of_its_keys_requests(
    tmp_path: Path, upstream: ScriptedUpstream, refusal: str
) -> None:
    """A long prompt refused only once counted (more tokens than the key's whole TPM, or than the model's
    context) is one of its key's requests all the same: a key allowed two a minute has two such prompts
    counted, and the next are refused before their count, where each was counted (a counting thread's
    seconds for a few MB, for nothing) as often as it was sent."""
    context = 8_192 if refusal == "past the model's context" else None
    server, services, counter, _ = _held_gateway(tmp_path, upstream, context=context)
    counter.go.set()
    await server.start()
    key, _ = services.keys.create("mallory", rpm=2, tpm=1_000 if context is None else None)
    body = {
        "model": "m",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "word and more " * 15_000}],
    }
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    answers = []
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as session:
            for _ in range(4):  # one after another: never two at once
                async with session.post(url, json=body) as answer:
                    answers.append((answer.status, (await answer.json())["error"]))
    finally:
        await server.stop()
    spent = 429 if context is None else 400
    assert [status for status, _ in answers] == [spent, spent, 429, 429], answers
    assert all("2 requests per minute" in error["message"] for _, error in answers[2:]), answers
    assert len(counter.counted) == 2


async def test_long_embedding_inputs_over_the_limits_are_refused_before_they_are_counted(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    server, services, counted = _counting_gateway(tmp_path, upstream, counted_model="e", embedder=True)
    await server.start()
    key, _ = services.keys.create("mallory", rpm=1)
    headers = {"Authorization": f"Bearer {key}"}
    url = f"http://127.0.0.1:{server.port}/v1"
    try:
        async with aiohttp.ClientSession() as session:
            chat = {"model": "m", "max_tokens": 1, "messages": MESSAGES}  # her one request this minute
            async with session.post(url + "/chat/completions", json=chat, headers=headers) as answer:
                assert answer.status == 200
            inputs = [" ".join(f"word{i} and more" for i in range(3_000))] * 4  # about 70 kB
            embed = {"model": "e", "input": inputs}
            async with session.post(url + "/embeddings", json=embed, headers=headers) as answer:
                assert answer.status == 429 and counted == []
    finally:
        await server.stop()


async def test_a_long_prompt_to_an_adapter_at_its_limit_is_refused_before_it_is_counted(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    from corral.admission import Principal
    from corral.routing.adapters import Adapter

    server, services, counted = _counting_gateway(tmp_path, upstream)
    services.adapters.replace("m", [Adapter("m-law", "m", "m-law@1", str(tmp_path), rpm=1)])
    # the adapter's one request a minute, over all keys, taken (by another tenant's request)
    assert await services.limits.limiter.reserve(Principal("adapter:m-law", "", rpm=1), 1) is not None
    await server.start()
    key, _ = services.keys.create("mallory")
    text = " ".join(f"word{i % 9973} and more" for i in range(12_000))
    body = {"model": "m-law", "max_tokens": 1, "messages": [{"role": "user", "content": text}]}
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as session:
            async with session.post(url, json=body) as answer:
                refusal = await answer.json()
            assert answer.status == 429 and counted == []
    finally:
        await server.stop()
    assert "'m-law'" in refusal["error"]["message"] and "this key" not in refusal["error"]["message"]


async def test_one_tenants_long_prompts_are_counted_one_at_a_time(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    """Eve sends four long prompts at once, bob one just after: eve's are counted one after another (one
    counting thread at a time is hers), bob's meanwhile on the other thread, not after hers."""
    from corral.admission import TokenCounter

    path = next((Paths.from_env().models / "hf-from-gguf").glob("SmolLM2*/tokenizer.json"))
    replicas = ReplicaSet(["m"])
    replicas.add(Replica(id="m-0", model="m", engine="x", url=upstream.url, state=ReplicaState.READY))
    services = make_services(
        replicas, tmp_path / "c.db", auth=AuthSettings(open=False), admin_key=ADMIN, tokenizers={"m": path}
    )
    counted: list[tuple[str, float, float]] = []  # whose prompt, when its count began and ended

    class Timed(TokenCounter):
        def count(self, text: str) -> int:
            began = time.monotonic()
            tokens = super().count(text)
            counted.append((text[-40:].split()[-1], began, time.monotonic()))
            return tokens

    services.sizing.counters["m"] = Timed(path)
    server = GatewayServer(GatewaySettings(port=0), Router(replicas), services)
    await server.start()
    keys = {tenant: services.keys.create(tenant)[0] for tenant in ("eve", "bob")}
    text = " ".join(f"word{i % 9973} and more" for i in range(12_000))  # about 200 kB
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    try:
        async with aiohttp.ClientSession() as session:

            async def ask(tenant: str) -> None:
                content = f"{text} {tenant}"
                body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": content}]}
                headers = {"Authorization": f"Bearer {keys[tenant]}"}
                async with session.post(url, json=body, headers=headers) as answer:
                    assert answer.status == 200

            eve = [asyncio.create_task(ask("eve")) for _ in range(4)]
            await asyncio.sleep(0.02)
            await asyncio.gather(ask("bob"), *eve)
    finally:
        await server.stop()
    eves = sorted((began, ended) for who, began, ended in counted if who == "eve")
    (bob,) = [(began, ended) for who, began, ended in counted if who == "bob"]
    assert len(eves) == 4
    assert all(later[0] >= earlier[1] for earlier, later in itertools.pairwise(eves)), eves  # one at a time
    assert bob[0] < eves[-1][0], (bob, eves)  # bob's did not wait for eve's


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses", "/v1/messages/count_tokens"])
async def test_a_key_over_its_limits_is_refused_before_its_large_body_is_parsed(
    tmp_path: Path, upstream: ScriptedUpstream, route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parsing megabytes of small JSON values holds the gateway's event loop for most of a second, before
    any limit was looked at: a key over its limits could have the gateway do that as often as it sent
    bodies. A body over 256 KiB is parsed only once its key's limits allow a request."""
    from corral.dialects import anthropic_messages, openai_responses
    from corral.gateway import intake

    parsed: list[int] = []
    for module in (intake, openai_responses, anthropic_messages):

        def spied(kind: type, raw: bytes, real: object = module.parse_body) -> object:
            parsed.append(len(raw))
            return real(kind, raw)  # type: ignore[operator]

        monkeypatch.setattr(module, "parse_body", spied)
    server, services, _ = _counting_gateway(tmp_path, upstream)
    await server.start()
    key, _ = services.keys.create("mallory", rpm=1)
    padding = [[] for _ in range(120_000)]  # ~360 kB of empty lists: cheap to send, dear to parse
    if route != "/v1/responses":
        small = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    else:
        small = {"model": "m", "max_output_tokens": 1, "input": "hi", "store": False}
    large = {**small, "metadata_padding": padding}
    headers = {"Authorization": f"Bearer {key}"}
    url = f"http://127.0.0.1:{server.port}" + route
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json=small, headers=headers) as answer:
                assert answer.status == 200
            parsed.clear()
            async with session.post(url, json=large, headers=headers) as answer:
                assert answer.status == 429, await answer.text()
            assert parsed == []
    finally:
        await server.stop()


async def test_a_list_of_prompts_is_charged_its_prompts_once(
    closed: Cluster, upstream: ScriptedUpstream
) -> None:
    """A completion of ten prompts whose engine reports no usage is charged at its reservation: the ten
    prompts' estimate once (the count is of all of them), not ten times."""
    upstream.usage = "no counts"
    _, made = await closed.admin("POST", "/admin/keys", {"tenant": "acme"})
    body = {"model": "m", "prompt": [f"prompt {i} " + "word " * 80 for i in range(10)], "max_tokens": 4}
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            closed.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {made['key']}"}
        ) as response,
    ):
        assert response.status == 200, await response.text()
    await asyncio.sleep(0.4)  # store.flush_interval is 0.1 s in tests
    _, report = await closed.admin("GET", "/admin/usage?by=key")
    row = next(r for r in report["rows"] if r["key"] == made["id"])
    size = len(json.dumps(body))
    assert 0 < row["input_tokens"] <= size // 2, (row, size)  # (an estimate: well under a token a byte)


async def test_a_client_gone_during_admission_holds_none_of_its_budget(closed: Cluster) -> None:
    """A client that leaves while its rate limits are being reserved (a slow Redis round trip) after its
    budget hold was taken leaves no hold behind: the key's next request may use all of its budget."""
    _, made = await closed.admin(
        "POST", "/admin/keys", {"tenant": "acme", "rpm": 1000, "monthly_token_budget": 2_000}
    )
    limits = closed.services.limits
    real = limits.limiter

    class Slow:
        async def reserve(self, principal: object, tokens: int) -> None:
            await asyncio.sleep(30)

        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

    limits.limiter = Slow()  # type: ignore[assignment]
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 1_500}
    async with aiohttp.ClientSession() as session:
        with pytest.raises(TimeoutError):
            async with session.post(
                closed.url + "/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {made['key']}"},
                timeout=aiohttp.ClientTimeout(total=0.5),
            ):
                pass
    await asyncio.sleep(0.3)  # (the gateway hears of it and cancels the handler)
    limits.limiter = real
    reply = await closed.client(made["key"]).chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=1_500
    )
    assert reply.choices[0].message.content


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/embeddings", "/v1/responses"])
async def test_large_bodies_the_gateway_refuses_count_against_the_keys_rpm(
    closed: Cluster, path: str
) -> None:
    """A large body's parse holds the event loop as long whether it validates or not: one refused (400)
    is one of its key's requests, so a key cannot have the gateway parse megabytes as often as it sends."""
    _, made = await closed.admin("POST", "/admin/keys", {"tenant": "acme", "rpm": 2})
    junk = json.dumps({"model": "m", "x": [[]] * 100_000, "messages": 5, "input": 5})  # (~400 KB)
    statuses = []
    async with aiohttp.ClientSession() as session:
        for _ in range(4):
            async with session.post(
                closed.url + path,
                data=junk,
                headers={"Authorization": f"Bearer {made['key']}", "Content-Type": "application/json"},
            ) as answer:
                statuses.append(answer.status)
    assert statuses[:2] == [400, 400] and statuses[2:] == [429, 429], statuses


async def test_a_large_body_refused_before_parsing_is_counted_in_the_metrics(closed: Cluster) -> None:
    """A body over 256 KiB whose key is over its limits is refused before it is parsed (nothing names its
    model yet): the refusal still counts, by tenant and API, where the heaviest tenants' 429s went
    uncounted and their dashboards showed none."""
    _, made = await closed.admin("POST", "/admin/keys", {"tenant": "bulk", "rpm": 1})
    headers = {"Authorization": f"Bearer {made['key']}"}
    big = {"model": "m", "messages": [{"role": "user", "content": "word " * 70_000}], "max_tokens": 1}
    async with aiohttp.ClientSession() as session:
        async with session.post(closed.url + "/v1/chat/completions", json=big, headers=headers) as first:
            assert first.status == 200
        async with session.post(closed.url + "/v1/chat/completions", json=big, headers=headers) as refused:
            assert refused.status == 429
        async with session.get(closed.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}) as page:
            text = await page.text()
    lines = text.splitlines()
    assert any(
        line.startswith("corral_tenant_requests_total{")
        and 'tenant="bulk"' in line
        and 'status="429"' in line
        for line in lines
    ), [line for line in lines if "bulk" in line]
    assert any(
        line.startswith("corral_api_requests_total{") and 'api="chat"' in line and 'status="429"' in line
        for line in text.splitlines()
    )


async def test_a_client_that_leaves_once_its_answer_is_whole_is_still_settled_and_recorded(
    closed: Cluster,
) -> None:
    """The answer's last byte leaves before its settlement (a Redis round trip for the rate limits); a
    client that closes then (curl exits) has the handler cancelled: its reservation, budget hold and usage
    row were skipped. Settling is finished whatever the client does."""
    _, made = await closed.admin("POST", "/admin/keys", {"tenant": "acme", "rpm": 100})
    limits = closed.services.limits
    real = limits.limiter
    settled: list[int] = []

    class SlowSettle:
        async def settle(self, reservation: object, tokens: int) -> None:
            await real.settle(reservation, tokens)  # type: ignore[arg-type]
            settled.append(tokens)  # (sent: Redis's limiter queues its call before it waits)
            await asyncio.sleep(0.5)  # (the round trip to a slow Redis)

        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

    limits.limiter = SlowSettle()  # type: ignore[assignment]
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(
                closed.url + "/v1/chat/completions",
                json={"model": "m", "messages": MESSAGES, "stream": True},
                headers={"Authorization": f"Bearer {made['key']}"},
            ) as answer:
                assert answer.status == 200
                assert (await answer.read()).rstrip().endswith(b"[DONE]")
        # (the session closed: its connection with it, while the gateway settles)
        await asyncio.sleep(1.2)
    finally:
        limits.limiter = real
    assert settled
    _, report = await closed.admin("GET", "/admin/usage?by=key")
    assert any(r["key"] == made["id"] and r["requests"] == 1 for r in report["rows"]), report
