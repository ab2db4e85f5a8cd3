"""Tenant eve against her own monthly budget through a closed gateway: concurrent requests cannot all pass
a check that one of them fits, a stream she cuts before its usage chunk is still charged, a re-read of the
store forgets nothing, and two gateways sharing Redis hold one budget."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import pytest

from corral.admission import BudgetTracker, Principal
from corral.admission.budget import SharedBudgets
from corral.config import AuthSettings, GatewaySettings, LimitsSettings, QueueSettings
from corral.gateway import GatewayServer
from corral.protocol import NoCapacity, RateLimited
from corral.routing import Replica, ReplicaSet, ReplicaState, Router
from corral.store import UsageRecord, UsageStore, open_database

from ..admission.test_gateway_admission import Cluster, start
from ..gateway.conftest import ScriptedUpstream, make_services

BUDGET = 200


async def chat(session: aiohttp.ClientSession, cluster: Cluster, key: str) -> tuple[int, int]:
    """(status, total tokens the answer's usage says)."""
    body = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"Authorization": f"Bearer {key}"}
    async with session.post(cluster.url + "/v1/chat/completions", json=body, headers=headers) as answer:
        data = await answer.json()
        return answer.status, data["usage"]["total_tokens"] if answer.status == 200 else 0


async def used_by(cluster: Cluster, key_id: str, requests: int) -> int:
    """The key's tokens as the usage records say, once all its `requests` are recorded (written every
    0.1 s here)."""
    for _ in range(100):  # 10 s
        _, report = await cluster.admin("GET", "/admin/usage?by=key")
        rows = [r for r in report["rows"] if r["key"] == key_id]
        if sum(r["requests"] for r in rows) >= requests:
            return sum(r["input_tokens"] + r["output_tokens"] for r in rows)
        await asyncio.sleep(0.1)
    raise AssertionError(f"fewer than {requests} usage records for {key_id}")


async def test_concurrent_requests_cannot_run_a_budget_over(tmp_path: Path) -> None:
    """Ten requests at once on a fresh 200-token budget, each reserving its prompt and 50 output tokens:
    all ten passed the check before (450 tokens used); now only those whose reservations fit run."""
    slow = ScriptedUpstream(chunks=40, delay=0.3)  # each answer: 5 prompt + 40 output tokens
    await slow.start()
    server, cluster = await start(tmp_path, slow)
    try:
        _, eve = await cluster.admin("POST", "/admin/keys", {"tenant": "eve", "monthly_token_budget": BUDGET})
        async with aiohttp.ClientSession() as session:
            answers = await asyncio.gather(*(chat(session, cluster, eve["key"]) for _ in range(10)))
        served = [tokens for status, tokens in answers if status == 200]
        assert served and sum(served) <= BUDGET, answers
        assert sorted({status for status, _ in answers}) == [200, 429]
        assert await used_by(cluster, eve["id"], len(answers)) == sum(served) <= BUDGET
    finally:
        await server.stop()
        await slow.stop()


BROKEN_USAGE = [
    {"prompt_tokens": 5, "completion_tokens": "x", "total_tokens": "x"},
    {"prompt_tokens": -1_000_000, "completion_tokens": 4, "total_tokens": -999_996},
    {"prompt_tokens": 2**70, "completion_tokens": 4, "total_tokens": 2**70 + 4},
    [1, 2],
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("reported", BROKEN_USAGE, ids=["string", "negative", "2**70", "list"])
async def test_an_engines_broken_usage_is_charged_the_reservation_and_frees_the_slot(
    tmp_path: Path, reported: object, stream: bool
) -> None:
    """An engine (an `external` one is anyone's server) reports counts that are no counts. Before: a
    string or a list raised while settling (a 500 for a served answer, the key's one concurrency slot
    never given back: its next request refused); a negative count credited the budget; 2**70 spent it
    and wrote no usage row. Now each answer is served, charged at its reservation, and recorded."""
    upstream = ScriptedUpstream(usage=reported)
    await upstream.start()
    server, cluster = await start(tmp_path, upstream)
    try:
        _, eve = await cluster.admin(
            "POST", "/admin/keys", {"tenant": "eve", "max_concurrency": 1, "monthly_token_budget": 10_000}
        )
        body = {
            "model": "m",
            "max_tokens": 50,
            "stream": stream,
            "messages": [{"role": "user", "content": "hi"}],
        }
        headers = {"Authorization": f"Bearer {eve['key']}"}
        async with aiohttp.ClientSession() as session:
            for _ in range(3):  # one at a time: each needs the slot the one before gave back
                async with session.post(
                    cluster.url + "/v1/chat/completions", json=body, headers=headers
                ) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
        used = await used_by(cluster, eve["id"], 3)
        assert 3 * 50 <= used < 3 * 1000  # three reservations (the prompt's estimate and max_tokens)
        (share,) = [share for _, key, share in cluster.services.budget.spent() if key == eve["id"]]
        assert share * 10_000 == pytest.approx(used)  # the budget as the records: nothing credited or lost
    finally:
        await server.stop()
        await upstream.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
async def test_the_dialects_tell_an_answer_whose_usage_is_broken(
    tmp_path: Path, path: str, stream: bool
) -> None:
    """The same on /v1/responses and /v1/messages: their answers told the engine's counts with int() and
    failed (a whole answer a 500, a stream cut without its closing event); now they are told without the
    counts that are none (Responses) or as zeros (Messages), and the request is charged its reservation."""
    upstream = ScriptedUpstream(usage=BROKEN_USAGE[0])
    await upstream.start()
    server, cluster = await start(tmp_path, upstream)
    try:
        _, eve = await cluster.admin("POST", "/admin/keys", {"tenant": "eve", "max_concurrency": 1})
        turn = [{"role": "user", "content": "hi"}]
        body: dict[str, object] = (
            {"model": "m", "max_output_tokens": 50, "input": "hi", "store": False}
            if path == "/v1/responses"
            else {"model": "m", "max_tokens": 50, "messages": turn}
        )
        body["stream"] = stream
        headers = {"Authorization": f"Bearer {eve['key']}"}
        async with aiohttp.ClientSession() as session:
            for _ in range(2):
                async with session.post(cluster.url + path, json=body, headers=headers) as r:
                    text = await r.text()
                    assert r.status == 200, text
                    if stream:
                        assert "response.completed" in text or "message_stop" in text, text[-300:]
                    else:
                        assert json.loads(text)["status" if path == "/v1/responses" else "type"] in (
                            "completed",
                            "message",
                        )
        assert await used_by(cluster, eve["id"], 2) >= 2 * 50
    finally:
        await server.stop()
        await upstream.stop()


async def test_a_stream_cut_before_its_usage_is_charged_its_reservation(tmp_path: Path) -> None:
    """Eve reads two chunks of a stream and hangs up: the engine's usage never arrives. Before, the budget
    was charged 0 tokens and the record said 0/0; now the reservation is charged and recorded."""
    dripping = ScriptedUpstream(chunks=40, gap=0.05)
    await dripping.start()
    server, cluster = await start(tmp_path, dripping)
    try:
        _, eve = await cluster.admin("POST", "/admin/keys", {"tenant": "eve", "monthly_token_budget": BUDGET})
        body = {
            "model": "m",
            "max_tokens": 60,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        }
        headers = {"Authorization": f"Bearer {eve['key']}"}
        async with aiohttp.ClientSession() as session:
            for _ in range(2):
                async with session.post(
                    cluster.url + "/v1/chat/completions", json=body, headers=headers
                ) as r:
                    assert r.status == 200
                    await r.content.readline()  # one event, then leave
            for _ in range(100):  # the gateway saw both clients leave and cut the upstream streams
                if dripping.cancelled == 2:
                    break
                await asyncio.sleep(0.05)
            charged = await used_by(cluster, eve["id"], 2)
            assert charged >= 2 * 60  # two reservations: max_tokens and the prompt's estimate each
            status, _ = await chat(session, cluster, eve["key"])  # 200 - 2 × ~77 leaves too little for 50
            assert status == 429
    finally:
        await server.stop()
        await dripping.stop()


async def stream(session: aiohttp.ClientSession, cluster: Cluster, key: str, cut: bool) -> tuple[int, int]:
    """(status, total tokens its usage chunk said; 0 when cut after two events or refused)."""
    body = {
        "model": "m",
        "max_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "hi"}],
    }
    headers = {"Authorization": f"Bearer {key}"}
    async with session.post(cluster.url + "/v1/chat/completions", json=body, headers=headers) as answer:
        if answer.status != 200:
            return answer.status, 0
        total, events = 0, 0
        async for line in answer.content:
            if not line.startswith(b"data: {"):
                continue
            events += 1
            if cut and events == 2:
                return 200, 0  # eve hangs up mid-stream
            usage = json.loads(line[6:]).get("usage")
            total = usage["total_tokens"] if usage else total
        return 200, total


async def test_64_concurrent_streams_some_cut_stay_within_a_budget_and_one_request(tmp_path: Path) -> None:
    """64 streams at once on a fresh 1,000-token budget, every fourth cut mid-stream: what is charged and
    recorded never passes the budget plus one request's max_tokens, and every finished stream is recorded
    at the engine's own count."""
    budget, max_tokens = 1000, 50
    dripping = ScriptedUpstream(chunks=40, gap=0.02)  # 5 prompt + 40 output tokens a finished answer
    await dripping.start()
    server, cluster = await start(tmp_path, dripping)
    try:
        _, eve = await cluster.admin("POST", "/admin/keys", {"tenant": "eve", "monthly_token_budget": budget})
        async with aiohttp.ClientSession() as session:
            answers = await asyncio.gather(
                *(stream(session, cluster, eve["key"], cut=i % 4 == 0) for i in range(64))
            )
        statuses = {status for status, _ in answers}
        assert statuses <= {200, 429} and 429 in statuses, answers
        served = sum(status == 200 for status, _ in answers)
        finished = [tokens for status, tokens in answers if status == 200 and tokens]
        assert finished and set(finished) == {45}  # the engine's count, as its usage chunk said
        recorded = await used_by(cluster, eve["id"], len(answers))  # refusals are recorded too
        assert sum(finished) <= recorded <= budget + max_tokens, (recorded, served, len(finished))
    finally:
        await server.stop()
        await dripping.stop()


def principal_of(key_id: str, budget: int) -> Principal:
    return Principal(tenant="eve", key_id=key_id, monthly_token_budget=budget)


async def test_a_store_reread_does_not_forget_usage_not_written_yet(tmp_path: Path) -> None:
    """The budget re-reads the store every 30 s; before, a re-read forgot what this gateway had settled
    but its usage recorder had not written yet (a slow or unreachable store: the budget ran over)."""
    usage = UsageStore(open_database(f"sqlite:///{tmp_path / 'c.db'}"))
    budget = BudgetTracker(usage, refresh_s=0)  # every check re-reads the store
    eve = principal_of("k-eve", 200)
    hold = await budget.reserve(eve, 150)
    budget.settle(eve, 150, hold)  # used; its record not written yet
    with pytest.raises(RateLimited):
        await budget.reserve(eve, 100)
    record = UsageRecord(datetime.now(UTC), "k-eve", "eve", "m", 50, 100, None, 10.0, 200, None)
    usage.write([record])
    budget.written([record])  # the recorder wrote it: counted once, by the store
    with pytest.raises(RateLimited):
        await budget.reserve(eve, 100)
    assert await budget.reserve(eve, 50) is not None  # 150 + 50 fits exactly


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_a_budget_holds_across_two_gateways_with_redis(tmp_path: Path, backend: str) -> None:
    """Two gateways, one store, one key with 200 tokens: ten requests at once, half to each. With the
    limits in Redis the budget is too (never more than 200 used); each gateway counting its own let both
    run it over."""
    slow = ScriptedUpstream(chunks=40, delay=0.3)  # each answer: 5 prompt + 40 output tokens
    await slow.start()
    limits = LimitsSettings(backend=backend)
    servers, urls = [], []
    key = None
    for _ in range(2):
        replicas = ReplicaSet(["m"])
        replicas.add(Replica(id="m-0", model="m", engine="x", url=slow.url, state=ReplicaState.READY))
        parts = make_services(replicas, tmp_path / "c.db", auth=AuthSettings(open=False), limits=limits)
        key = key or parts.keys.create("eve", monthly_token_budget=BUDGET)[0]
        server = GatewayServer(GatewaySettings(port=0), Router(replicas), parts)
        await server.start()
        servers.append(server)
        urls.append(f"http://127.0.0.1:{server.port}")
    try:
        body = {"model": "m", "max_tokens": 40, "messages": [{"role": "user", "content": "hi"}]}
        headers = {"Authorization": f"Bearer {key}"}

        async def one(url: str) -> int:
            async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as answer:
                data = await answer.json()
                return data["usage"]["total_tokens"] if answer.status == 200 else 0

        async with aiohttp.ClientSession() as session:
            used = sum(await asyncio.gather(*(one(urls[i % 2]) for i in range(10))))
        if backend == "redis":
            assert 0 < used <= BUDGET
        else:
            assert used > BUDGET  # what the shared budget prevents
    finally:
        for server in servers:
            await server.stop()
        await slow.stop()


async def test_a_request_without_max_tokens_reserves_all_the_model_may_generate(tmp_path: Path) -> None:
    """Without max_tokens an engine may generate to the end of the context (2,048 here); the budget
    reserved 256 for it before, so a 1,000-token budget let through requests that could run it over."""
    upstream = ScriptedUpstream(chunks=40)
    await upstream.start()
    replicas = ReplicaSet(["m"])
    replicas.add(
        Replica(
            id="m-0", model="m", engine="x", url=upstream.url, state=ReplicaState.READY, context_length=2048
        )
    )
    parts = make_services(replicas, tmp_path / "c.db", auth=AuthSettings(open=False))
    key = parts.keys.create("eve", monthly_token_budget=1000)[0]
    server = GatewayServer(GatewaySettings(port=0), Router(replicas), parts)
    await server.start()
    try:
        headers = {"Authorization": f"Bearer {key}"}
        url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
        async with aiohttp.ClientSession() as session:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            async with session.post(url, json=body, headers=headers) as answer:
                refused = await answer.json()
                assert (answer.status, refused["error"]["code"]) == (429, "insufficient_quota")
                assert "max_tokens is not set" in refused["error"]["message"]
            async with session.post(url, json={**body, "max_tokens": 40}, headers=headers) as answer:
                assert answer.status == 200
            async with session.post(url, json={**body, "max_tokens": 990}, headers=headers) as answer:
                refused = (await answer.json())["error"]["message"]  # 45 used: what fits is said
                fits = re.search(r"\(9\d\d left\).*at most 9\d\d for it to fit", refused)
                assert answer.status == 429 and fits, refused
    finally:
        await server.stop()
        await upstream.stop()


async def test_while_the_store_is_down_a_budget_uses_what_it_knew_or_refuses_with_503(tmp_path: Path) -> None:
    """A store that stops answering was a 500 on every budgeted request."""
    engine = open_database(f"sqlite:///{tmp_path / 'c.db'}")
    budget = BudgetTracker(UsageStore(engine), refresh_s=0)
    known = principal_of("k-known", 200)
    budget.settle(known, 150, await budget.reserve(known, 150))
    with engine.begin() as connection:  # the store stops answering usage queries
        connection.exec_driver_sql("DROP TABLE corral_usage")
    with pytest.raises(RateLimited):  # what it knew: 150 used
        await budget.reserve(known, 100)
    assert await budget.reserve(known, 50) is not None
    with pytest.raises(NoCapacity) as refused:  # a key it knows nothing of cannot be checked
        await budget.reserve(principal_of("k-new", 200), 10)
    assert refused.value.status == 503 and refused.value.code == "budget_unavailable"


async def test_the_shared_budget_takes_the_stores_use_where_redis_heard_less() -> None:
    """Settlements lost while Redis did not answer are in the store: a gateway's next reservation brings
    its figure of the month's use (the store's, where larger) into Redis, so the key cannot overspend by
    what Redis never heard of for the rest of the month."""
    import uuid

    from corral.admission.budget import SharedBudgets

    shared = SharedBudgets("redis://127.0.0.1:6379/0", prefix=f"corral-test:{uuid.uuid4().hex}")
    try:
        ok, used, *_ = await shared.reserve("k", "2026-12", budget=5000, tokens=100, seed=0)
        assert ok and used == 0
        # its settlement never reached Redis; meanwhile the store recorded 4,500 tokens of use
        ok, used, *_ = await shared.reserve("k", "2026-12", budget=5000, tokens=600, seed=4500, stored=4500)
        assert not ok and used >= 4500
        ok, used, *_ = await shared.reserve("k", "2026-12", budget=5000, tokens=100, seed=0)  # a lagging seed
        assert used >= 4500  # (the larger figure holds)
        # what a gateway settled but has not written is on its way to Redis: it does not raise Redis's month
        ok, used, *_ = await shared.reserve("j", "2026-12", budget=5000, tokens=100, seed=0)
        ok, used, *_ = await shared.reserve("j", "2026-12", budget=5000, tokens=100, seed=3000, stored=0)
        assert ok and used == 100  # (only its hold: the unwritten 3,000 would be counted twice)
    finally:
        await shared.close()


async def test_a_live_change_of_the_limits_redis_moves_budgets_with_it(tmp_path: Path) -> None:
    """`corral apply` switching `limits.backend` to Redis moves the monthly budgets there too (they stayed
    each gateway's own: several gateways could spend a budget once each); a hold made before settles where
    it was made."""
    replicas = ReplicaSet(["m"])
    parts = make_services(replicas, tmp_path / "c.db", auth=AuthSettings(open=False))
    other = make_services(replicas, tmp_path / "c.db", auth=AuthSettings(open=False))
    shared = LimitsSettings(backend="redis", redis_url="redis://127.0.0.1:6379/0")
    try:
        _, record = parts.keys.create("eve", monthly_token_budget=BUDGET)
        principal = Principal.of(record)
        before = await parts.budget.reserve(principal, 50)  # (held in this gateway alone)
        parts.reconfigure(QueueSettings(), shared)
        other.reconfigure(QueueSettings(), shared)
        assert await parts.budget.reserve(principal, 120) is not None
        with pytest.raises(RateLimited, match="in flight hold 120 of its 200"):
            await other.budget.reserve(principal, 120)  # the other gateway sees the first's hold in Redis
        parts.budget.settle(principal, 10, before)
    finally:
        await parts.budget.close()
        await other.budget.close()


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_a_refusal_that_requests_in_flight_alone_cause_says_to_retry_soon(
    tmp_path: Path, backend: str
) -> None:
    """Where what the key's requests in flight hold is all that keeps a request out, its refusal says so
    and to retry in seconds (they settle and give back what they did not use), not at next month's start
    (the OpenAI SDK gives up on a wait of weeks); with budgets counted in Redis too."""
    usage = UsageStore(open_database(f"sqlite:///{tmp_path / 'c.db'}"))
    shared = (
        SharedBudgets("redis://127.0.0.1:6379/0", prefix=f"corral-test:{uuid.uuid4().hex}")
        if backend == "redis"
        else None
    )
    budget = BudgetTracker(usage, shared=shared)
    eve = principal_of("k-eve", 200)
    hold = await budget.reserve(eve, 150)
    with pytest.raises(RateLimited) as held:
        await budget.reserve(eve, 100)
    assert held.value.retry_after is not None and held.value.retry_after <= 5
    assert "in flight" in str(held.value)
    budget.settle(eve, 150, hold)  # it used all it held: now only next month has room
    await asyncio.sleep(0.2)  # (a shared hold is settled in Redis by a task)
    with pytest.raises(RateLimited) as spent:
        await budget.reserve(eve, 100)
    assert spent.value.retry_after is not None and spent.value.retry_after > 3600
    await budget.close()
