"""Defects found in review, each pinned by a test that failed before its fix (issue #10)."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import make_mocked_request
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from corral.config import AuthSettings, GatewaySettings, LimitsSettings, SpecError, parse_spec
from corral.engines import EngineFeatures
from corral.gateway import GatewayParts, GatewayServer
from corral.gateway.admin import AdminViews
from corral.gateway.app import _StatusViews
from corral.gateway.usage import UsageRecorder
from corral.routing import Replica, ReplicaSet, ReplicaState, Router
from corral.store import UsageRecord
from corral.store.schema import UsageRow

from ..conftest import CORRAL
from .conftest import Gateway, ScriptedUpstream, make_services

MESSAGES = [{"role": "user", "content": "hi"}]
EXTERNAL = "models:\n  - name: m\n    deployments: [{engine: external, urls: ['http://127.0.0.1:9']}]\n"


async def post(url: str, body: dict, key: str | None = None) -> tuple[int, dict, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as session, session.post(url, json=body, headers=headers) as response:
        return response.status, await response.json(), dict(response.headers)


async def start_gateway(
    tmp_path: Path,
    upstream_url: str,
    settings: GatewaySettings | None = None,
    limits: LimitsSettings | None = None,
    api_key: str | None = None,
    features: EngineFeatures | None = None,
) -> tuple[GatewayServer, Gateway, GatewayParts]:
    replicas = ReplicaSet(["m"])
    replicas.add(
        Replica(
            id="m-0",
            model="m",
            engine="x",
            url=upstream_url,
            state=ReplicaState.READY,
            api_key=api_key,
            features=features or EngineFeatures(),
        )
    )
    services = make_services(replicas, tmp_path / "corral.db", auth=AuthSettings(open=True), limits=limits)
    server = GatewayServer(settings or GatewaySettings(port=0), Router(replicas), services)
    await server.start()
    return server, Gateway(f"http://127.0.0.1:{server.port}", replicas, server), services


@pytest.fixture
async def keyed_upstream() -> AsyncIterator[ScriptedUpstream]:
    server = ScriptedUpstream(required_key="engine-secret")
    await server.start()
    yield server
    await server.stop()


async def test_engine_api_key_is_sent_to_the_replica(
    tmp_path: Path, keyed_upstream: ScriptedUpstream
) -> None:
    server, gateway, _ = await start_gateway(tmp_path, keyed_upstream.url, api_key="engine-secret")
    try:
        status, body, _ = await post(
            gateway.url + "/v1/chat/completions", {"model": "m", "messages": MESSAGES}
        )
        assert status == 200, body
        assert keyed_upstream.authorizations == ["Bearer engine-secret"]
    finally:
        await server.stop()


async def test_client_that_disconnects_is_recorded_499_and_pays_its_tokens(tmp_path: Path) -> None:
    """A stream cut by its client must not refund its reservation: otherwise disconnecting mid-stream is a
    way around TPM limits."""
    slow = ScriptedUpstream(chunks=200)
    await slow.start()
    server, gateway, services = await start_gateway(tmp_path, slow.url)
    try:
        key, record = services.keys.create("t", tpm=1000)
        body = {"model": "m", "messages": MESSAGES, "max_tokens": 600, "stream": True}
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                gateway.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            ) as response,
        ):
            assert response.status == 200
            await response.content.readline()  # the first event: then the client goes away
        engine = create_engine(f"sqlite:///{tmp_path / 'corral.db'}")
        deadline, statuses = time.monotonic() + 5, []
        while not statuses and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            with Session(engine) as db:
                statuses = list(db.scalars(select(UsageRow.status).where(UsageRow.key_id == record.id)))
        assert statuses == [499]
        again = {"model": "m", "messages": MESSAGES, "max_tokens": 600}
        status, error, _ = await post(gateway.url + "/v1/chat/completions", again, key)
        assert status == 429 and error["error"]["type"] == "rate_limit_error"
    finally:
        await server.stop()
        await slow.stop()


async def _usage_rows(tmp_path: Path, key_id: str) -> list[tuple[int, int]]:
    """(status, output tokens) of the key's usage rows, once any is written."""
    engine = create_engine(f"sqlite:///{tmp_path / 'corral.db'}")
    deadline, rows = time.monotonic() + 5, []
    while not rows and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        with Session(engine) as db:
            found = db.execute(
                select(UsageRow.status, UsageRow.output_tokens).where(UsageRow.key_id == key_id)
            )
            rows = [(int(status), int(tokens)) for status, tokens in found]
    return rows


async def test_an_open_ended_stream_left_mid_way_pays_for_what_it_read(tmp_path: Path) -> None:
    """Without max_tokens a stream reserves the gateway's estimate of its answer (256 tokens); a client
    that reads more than that and leaves before the engine's usage chunk is charged the reads of events it
    was sent, not the estimate (it was: leaving was a way to stream the whole context for 256 tokens)."""
    slow = ScriptedUpstream(chunks=400, gap=0.004)
    await slow.start()
    server, gateway, services = await start_gateway(tmp_path, slow.url)
    try:
        key, record = services.keys.create("t")
        body = {"model": "m", "messages": MESSAGES, "stream": True}
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                gateway.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            ) as response,
        ):
            read = 0
            while read < 320:  # events: a data line and a blank one each
                read += (await response.content.readline()).startswith(b"data: ")
        rows = await _usage_rows(tmp_path, record.id)
        assert len(rows) == 1 and rows[0][0] == 499 and rows[0][1] > 256, rows  # (a read an event, about)
    finally:
        await server.stop()
        await slow.stop()


async def test_a_fanned_out_answer_past_read_timeout_pays_its_reservation(tmp_path: Path) -> None:
    """n > 1 on an engine that makes one choice a request: the gateway sends n requests; when they outlast
    read_timeout the engines worked, so the request pays its reservation as a single one does (it was
    refunded whole: its replica was only noted once every part had answered)."""
    slow = ScriptedUpstream(mode="hang")
    await slow.start()
    server, gateway, services = await start_gateway(
        tmp_path,
        slow.url,
        GatewaySettings(port=0, read_timeout=0.3),
        features=EngineFeatures(multiple_choices=False),
    )
    try:
        key, record = services.keys.create("t", tpm=1000)
        body = {"model": "m", "messages": MESSAGES, "max_tokens": 300, "n": 2}
        status, _, _ = await post(gateway.url + "/v1/chat/completions", body, key)
        assert status == 504
        assert await _usage_rows(tmp_path, record.id) == [(504, 600)]  # both choices' max_tokens
        status, error, _ = await post(gateway.url + "/v1/chat/completions", body, key)
        assert status == 429 and error["error"]["type"] == "rate_limit_error", error
    finally:
        await server.stop()
        await slow.stop()


async def test_nan_in_a_fanned_out_request_is_a_400(tmp_path: Path, keyed_upstream: ScriptedUpstream) -> None:
    """pydantic takes NaN in a field passed through to the engine; the fan-out re-reads the body as JSON,
    which has none: a 400 naming it, not a 500."""
    server, gateway, _ = await start_gateway(
        tmp_path, keyed_upstream.url, features=EngineFeatures(multiple_choices=False)
    )
    try:
        raw = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2, "logit_bias": ' + (
            b'{"1": NaN}}'
        )
        async with (
            aiohttp.ClientSession() as session,
            session.post(gateway.url + "/v1/chat/completions", data=raw) as response,
        ):
            answer = await response.json()
        assert response.status == 400 and "strict JSON" in answer["error"]["message"], answer
    finally:
        await server.stop()


async def test_a_tenants_status_gets_no_more_of_the_clusters_counts_than_it_shows() -> None:
    """With gateway.workers > 1 a worker's /corral/status fills each row with the cluster's counts; a
    tenant's rows leave out other tenants' prompts awaiting prefill, and the counts must not put them back
    (they did)."""
    rows = [{"id": "m-0", "outstanding": 1, "served": 2, "failures": 0, "capacity": 4}]  # a tenant's row
    admin_rows = [{**rows[0], "pending_prefill_tokens": 0}]

    async def counts() -> dict[str, list[int]]:
        return {"m-0": [5, 31337, 9, 1, 8]}  # outstanding, pending prefill, served, failures, capacity

    views = _StatusViews(Router(ReplicaSet(["m"])), None, None, 0.0, cluster_counts=counts)  # type: ignore[arg-type]
    await views._whole_cluster(rows)
    await views._whole_cluster(admin_rows)
    assert rows == [{"id": "m-0", "outstanding": 5, "served": 9, "failures": 1, "capacity": 8}]
    assert admin_rows[0]["pending_prefill_tokens"] == 31337  # (the admin's view shows it)


async def test_an_answer_past_read_timeout_pays_its_reservation(tmp_path: Path) -> None:
    """A long answer not streamed outlasts `read_timeout` (504) while the engine works on it: refunding it
    would make any amount of engine time free of TPM and budget."""
    slow = ScriptedUpstream(mode="hang")
    await slow.start()
    server, gateway, services = await start_gateway(
        tmp_path, slow.url, GatewaySettings(port=0, read_timeout=0.3)
    )
    try:
        key, record = services.keys.create("t", tpm=1000, monthly_token_budget=1000)
        body = {"model": "m", "messages": MESSAGES, "max_tokens": 600}
        status, _, _ = await post(gateway.url + "/v1/chat/completions", body, key)
        assert status == 504
        engine = create_engine(f"sqlite:///{tmp_path / 'corral.db'}")
        deadline, rows = time.monotonic() + 5, []
        while not rows and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            with Session(engine) as db:
                rows = list(
                    db.execute(
                        select(UsageRow.status, UsageRow.output_tokens).where(UsageRow.key_id == record.id)
                    )
                )
        assert [tuple(row) for row in rows] == [(504, 600)]  # recorded at its reservation
        status, error, _ = await post(gateway.url + "/v1/chat/completions", body, key)
        assert status == 429 and error["error"]["type"] == "rate_limit_error", error
    finally:
        await server.stop()
        await slow.stop()


async def test_a_stream_read_to_its_end_is_recorded_served_when_the_client_closes_at_once(
    tmp_path: Path,
) -> None:
    """The openai client closes its connection as soon as it has `[DONE]`, while the gateway may still wait
    for the engine to end its stream (here it lingers 0.3 s after `[DONE]`) or write the closing chunk, and
    aiohttp cancels the handler: such a client got its whole answer and is recorded 200, not 499 (the
    docs test saw 499 for 2 streams of 4 against llama.cpp)."""
    import openai

    upstream = ScriptedUpstream(chunks=16, linger=0.3)
    await upstream.start()
    server, gateway, services = await start_gateway(tmp_path, upstream.url)
    try:
        key, record = services.keys.create("t")
        client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)
        for _ in range(4):
            stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
            pieces = [chunk async for chunk in stream]
            assert pieces
            await stream.close()
        await client.close()
        engine = create_engine(f"sqlite:///{tmp_path / 'corral.db'}")
        deadline, statuses = time.monotonic() + 5, []
        while len(statuses) < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            with Session(engine) as db:
                statuses = list(db.scalars(select(UsageRow.status).where(UsageRow.key_id == record.id)))
        assert statuses == [200] * 4
    finally:
        await server.stop()
        await upstream.stop()


@pytest.mark.parametrize("on_error", ["open", "closed"])
async def test_redis_outage_is_a_configured_choice(
    tmp_path: Path, upstream: ScriptedUpstream, on_error: str
) -> None:
    limits = LimitsSettings(
        backend="redis", redis_url="redis://127.0.0.1:1/0", redis_timeout=0.2, on_redis_error=on_error
    )
    server, gateway, services = await start_gateway(tmp_path, upstream.url, limits=limits)
    try:
        key, _ = services.keys.create("t", rpm=100)
        status, body, headers = await post(
            gateway.url + "/v1/chat/completions", {"model": "m", "messages": MESSAGES}, key
        )
        if on_error == "open":
            assert status == 200, body
        else:
            assert status == 503 and body["error"]["code"] == "limits_unavailable"
            assert int(headers["Retry-After"]) >= 1
        async with aiohttp.ClientSession() as session, session.get(gateway.url + "/metrics") as response:
            assert "corral_limiter_errors_total 1.0" in await response.text()
    finally:
        await server.stop()


def _record(input_tokens: int) -> UsageRecord:
    return UsageRecord(
        at=None,
        key_id=None,
        tenant=None,
        model="m",
        input_tokens=input_tokens,
        output_tokens=0,
        ttft_ms=None,
        latency_ms=1.0,
        status=200,
        replica=None,
    )


class _DownStore:
    def write(self, records: object) -> None:
        raise ConnectionError("the database is down")


async def test_usage_waiting_for_a_dead_store_is_bounded() -> None:
    recorder = UsageRecorder(_DownStore(), flush_interval=60, max_pending=10)
    for i in range(25):
        recorder.record(_record(i))
    assert recorder.pending == 10 and recorder.dropped == 15


class _SlowStore:
    """A store whose every write takes 0.5 s (a busy disk), and says what it holds once written."""

    def __init__(self) -> None:
        self.written: list[object] = []
        self.writing = threading.Event()

    def write(self, records: list[object]) -> None:
        self.writing.set()
        time.sleep(0.5)
        self.written.extend(records)


async def test_a_recorder_stopped_during_a_write_returns_once_it_is_written() -> None:
    """Stopped while its writer was writing a batch (a thread), the recorder cancelled the writer and
    returned at once, the write ending in its thread afterwards: what read the store after shutdown (a
    backup, the next start's budget) missed the last records."""
    store = _SlowStore()
    recorder = UsageRecorder(store, flush_interval=0.01)  # type: ignore[arg-type]
    recorder.start()
    recorder.record(_record(1))
    assert await asyncio.to_thread(store.writing.wait, 5)
    await recorder.stop()
    assert len(store.written) == 1 and recorder.pending == 0


async def test_upstream_connections_are_bounded(tmp_path: Path) -> None:
    slow = ScriptedUpstream(delay=0.3)
    await slow.start()
    settings = GatewaySettings(port=0, max_upstream_connections=2)
    server, gateway, _ = await start_gateway(tmp_path, slow.url, settings=settings)
    try:
        answers = await asyncio.gather(
            *(
                post(gateway.url + "/v1/chat/completions", {"model": "m", "messages": MESSAGES})
                for _ in range(5)
            )
        )
        assert [status for status, _, _ in answers] == [200] * 5
        assert slow.peak_concurrency == 2
    finally:
        await server.stop()
        await slow.stop()


async def test_a_model_can_be_retrieved_by_id(gateway: Gateway, upstream: ScriptedUpstream) -> None:
    gateway.add_replica(upstream.url)
    async with aiohttp.ClientSession() as session:
        async with session.get(gateway.url + "/v1/models/m") as response:
            assert response.status == 200
            assert await response.json() == {
                "id": "m",
                "object": "model",
                "created": (await response.json())["created"],
                "owned_by": "corral",
            }
        async with session.get(gateway.url + "/v1/models/nope") as response:
            assert response.status == 404 and (await response.json())["error"]["code"] == "model_not_found"


def test_an_open_gateway_is_not_served_to_the_network_unless_the_spec_says_so(tmp_path: Path) -> None:
    refused = subprocess.run(
        [*CORRAL, "up", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "open_to_network" in refused.stderr and refused.stderr.startswith("error: an open gateway")
    with pytest.raises(SpecError, match="open_to_network"):
        parse_spec("gateway: {host: 0.0.0.0}\nauth: {open: true}\n" + EXTERNAL)
    allowed = parse_spec("gateway: {host: 0.0.0.0}\nauth: {open: true, open_to_network: true}\n" + EXTERNAL)
    assert allowed.auth.open_to_network


class _Transport:
    """Just enough of a transport for aiohttp to tell a request's peer address."""

    def __init__(self, peer: str) -> None:
        self._peer = (peer, 40000)

    def get_extra_info(self, name: str, default: object = None) -> object:
        return self._peer if name == "peername" else default

    def is_closing(self) -> bool:
        return False


def _admin_views(parts: GatewayParts) -> AdminViews:
    return AdminViews(
        access=parts.access,
        keys=parts.keys,
        usage=parts.usage_store,
        router=Router(ReplicaSet(["m"])),
        queue_depths=parts.queue.depths,
    )


@pytest.mark.parametrize(("peer", "admin"), [("127.0.0.1", True), ("::1", True), ("10.1.2.3", False)])
def test_open_gateway_admin_answers_only_this_machine(tmp_path: Path, peer: str, admin: bool) -> None:
    services = make_services(ReplicaSet(["m"]), tmp_path / "c.db", auth=AuthSettings(open=True))
    views = _admin_views(services)
    request = make_mocked_request("GET", "/admin/keys", transport=_Transport(peer))
    assert views.is_admin(request) is admin


@pytest.mark.parametrize(
    ("answer", "status", "code"),
    [
        ((500, "text/plain", b"Internal Server Error"), 502, "engine_error"),
        (
            (500, "application/json", b'{"error": {"code": 500, "message": "boom", "type": "server_error"}}'),
            502,
            "engine_error",
        ),
        ((401, "application/json", b'{"error": "Unauthorized"}'), 502, "engine_auth_failed"),
        (
            (400, "application/json", b'{"error": {"code": 400, "message": "bad grammar", "type": "x"}}'),
            400,
            None,
        ),
    ],
)
async def test_engine_errors_reach_the_client_in_openais_shape(
    tmp_path: Path, answer: tuple[int, str, bytes], status: int, code: str | None
) -> None:
    engine = ScriptedUpstream(mode="answer", answer=answer)
    await engine.start()
    server, gateway, _ = await start_gateway(tmp_path, engine.url)
    try:
        got, body, _ = await post(gateway.url + "/v1/chat/completions", {"model": "m", "messages": MESSAGES})
        assert got == status
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == code
        said = body["error"]["message"]
        if status == 502:  # the engine's own words (its paths, its internals) stay in the gateway's log
            assert f"answered {answer[0]}" in said and "boom" not in said and "Server Error" not in said
        else:  # the request's fault: the engine's words tell the client what to change
            assert "bad grammar" in said
    finally:
        await server.stop()
        await engine.stop()


async def test_shutdown_goes_on_when_the_usage_store_is_down() -> None:
    recorder = UsageRecorder(_DownStore(), flush_interval=60)
    recorder.start()
    recorder.record(_record(1))
    await recorder.stop()  # does not raise
    assert recorder.pending == 0 and recorder.dropped == 1


def test_admin_behind_a_proxy_on_this_machine_is_not_local(tmp_path: Path) -> None:
    services = make_services(ReplicaSet(["m"]), tmp_path / "c.db", auth=AuthSettings(open=True))
    views = _admin_views(services)
    proxied = make_mocked_request(
        "GET", "/admin/keys", headers={"X-Forwarded-For": "203.0.113.9"}, transport=_Transport("127.0.0.1")
    )
    assert views.is_admin(proxied) is False


async def test_fan_out_is_bounded_and_an_empty_prompt_list_refused(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    from corral.engines import EngineFeatures

    replicas = ReplicaSet(["m"])
    llama = EngineFeatures(multiple_choices=False, prompt_lists=False, echo=False)
    replicas.add(Replica("m-0", "m", "x", url=upstream.url, state=ReplicaState.READY, features=llama))
    server = GatewayServer(
        GatewaySettings(port=0), Router(replicas), make_services(replicas, tmp_path / "c.db")
    )
    await server.start()
    try:
        url = f"http://127.0.0.1:{server.port}/v1/completions"
        status, body, _ = await post(url, {"model": "m", "prompt": ["a", "b"], "n": 100})
        assert status == 400 and body["error"]["code"] == "too_many_choices"
        status, body, _ = await post(url, {"model": "m", "prompt": []})
        assert status == 400 and body["error"]["param"] == "prompt"
        status, body, headers = await post(url, {"model": "m", "prompt": ["a", "b"], "n": 2})
        assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
        # each part its own engine request id (an engine may refuse one already running)
        told = {k.lower(): v for k, v in headers.items()}["x-request-id"]
        assert sorted(upstream.request_ids[-4:]) == [f"{told}-{k}" for k in range(4)]
        # each part's seed the next one; past the highest JSON's engines hold (2**64 - 1) it wraps, where
        # the part's body failed to encode (a 500)
        highest = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2, "seed": 2**64 - 1}
        status, answer, _ = await post(url.replace("/v1/completions", "/v1/chat/completions"), highest)
        assert status == 200, answer
        assert sorted(b.get("seed") for b in upstream.bodies[-2:]) == [0, 2**64 - 1]
    finally:
        await server.stop()


def test_a_client_cannot_pick_its_address_behind_a_proxy_that_adds_its_own_line() -> None:
    """Some proxies (HAProxy's `option forwardfor`) add an X-Forwarded-For line of their own rather than
    extend the client's: every line is read, so the client's own first line does not name it; a hop that
    is no address ends the walk at the proxy; the access log writes the path as sent (a decoded newline in
    it would forge a line of its own)."""
    import logging

    from multidict import CIMultiDict

    from corral.gateway.clients import ClientAddresses, access_logger

    addresses = ClientAddresses(["127.0.0.1"])
    lines = CIMultiDict([("X-Forwarded-For", "6.6.6.6"), ("X-Forwarded-For", "203.0.113.9")])
    proxied = make_mocked_request("GET", "/v1/models", headers=lines, transport=_Transport("127.0.0.1"))
    assert addresses.of(proxied) == "203.0.113.9"
    # the scheme: an edge that ends TLS says https (X-Forwarded-Proto), believed from it alone
    https = CIMultiDict([("X-Forwarded-Proto", "https")])
    edge = make_mocked_request("GET", "/console/signin", headers=https, transport=_Transport("127.0.0.1"))
    assert addresses.scheme(edge) == "https"
    other = make_mocked_request("GET", "/console/signin", headers=https, transport=_Transport("203.0.113.5"))
    assert addresses.scheme(other) == "http"
    ported = CIMultiDict([("X-Forwarded-For", "203.0.113.9:52000")])  # (as some proxies write it)
    with_port = make_mocked_request("GET", "/v1/models", headers=ported, transport=_Transport("127.0.0.1"))
    assert addresses.of(with_port) == "203.0.113.9"
    garbage = CIMultiDict([("X-Forwarded-For", "x<script>")])
    told = make_mocked_request("GET", "/v1/models", headers=garbage, transport=_Transport("127.0.0.1"))
    assert addresses.of(told) == "127.0.0.1"
    assert not addresses.is_local(told)  # (the proxy's own address, but not a client on this machine)
    forged = make_mocked_request(
        "GET",
        "/v1/x%0a2026-12-05T10:00:00Z%20INFO%20corral.access?code=signin-secret",
        transport=_Transport("203.0.113.5"),
    )
    written: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            written.append(record.getMessage())

    log = logging.getLogger("test.access")
    log.addHandler(Keep())
    log.setLevel(logging.INFO)
    response = aiohttp.web.Response(status=404)
    access_logger(addresses)(log, "").log(forged, response, 0.001)
    assert len(written) == 1 and "\n" not in written[0] and "%0a" in written[0].lower()
    assert "signin-secret" not in written[0]  # (no query string: a sign-in's code is one)


async def test_an_audited_call_whose_caller_goes_away_is_recorded_as_gone(tmp_path: Path) -> None:
    """An apply goes on when its caller leaves (cluster/reconcile.py): its audit record says the caller
    left (499), not that the gateway failed (500), and is kept however many refusals its actor had."""
    services = make_services(ReplicaSet(["m"]), tmp_path / "c.db", AuthSettings(open=False), admin_key="a")
    audit = services.audit
    assert audit is not None
    views = AdminViews(
        access=services.access, keys=services.keys, usage=services.usage_store,
        router=Router(ReplicaSet(["m"])), queue_depths=services.queue.depths, audit=audit,
    )  # fmt: skip
    began = asyncio.Event()

    async def applying(request: object) -> object:
        began.set()
        await asyncio.sleep(60)
        raise AssertionError("not reached")

    handler = views._audited("spec.apply", applying)  # type: ignore[arg-type]
    request = make_mocked_request("POST", "/admin/apply", headers={"Authorization": "Bearer a"})
    call = asyncio.create_task(handler(request))
    await began.wait()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    (entry,) = await asyncio.to_thread(audit.list, action="spec.apply")
    assert entry["status"] == 499


async def test_no_web_page_of_another_site_acts_as_a_laptop_s_local_admin(tmp_path: Path) -> None:
    """An open gateway without an admin key answers its admin API to clients on this machine: a page of
    another site in this machine's browser is one (it reaches 127.0.0.1), sending a form's POST (no
    preflight) or rebinding its own name to 127.0.0.1. Neither makes a key; the CLI, curl and the
    gateway's own console (same origin) still do."""
    import aiohttp

    replicas = ReplicaSet(["m"])
    server = GatewayServer(
        GatewaySettings(port=0), Router(replicas), make_services(replicas, tmp_path / "c.db")
    )
    await server.start()
    url = f"http://127.0.0.1:{server.port}/admin/keys"
    body = '{"tenant": "evil", "role": "admin"}'
    try:
        async with aiohttp.ClientSession() as session:

            async def made(headers: dict[str, str]) -> int:
                async with session.post(url, data=body, headers=headers) as answer:
                    return answer.status

            form = {
                "Content-Type": "text/plain",
                "Origin": "http://attacker.example",
                "Sec-Fetch-Site": "cross-site",
            }
            assert await made(form) == 403
            assert await made({"Origin": "http://attacker.example"}) == 403  # (an older browser)
            rebound = f"attacker.example:{server.port}"  # its name now 127.0.0.1: the page's own origin
            assert (
                await made({"Host": rebound, "Origin": f"http://{rebound}", "Sec-Fetch-Site": "same-origin"})
                == 403
            )
            console = {"Origin": f"http://127.0.0.1:{server.port}", "Sec-Fetch-Site": "same-origin"}
            assert await made(console) == 201
            assert await made({"Host": f"localhost:{server.port}"}) == 201
            assert await made({}) == 201  # the CLI, curl
    finally:
        await server.stop()


async def test_inter_token_latency_is_per_choice(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    """A stream of n choices generates them side by side: its inter-token latency is its time after the
    first token over each choice's tokens, not over all n choices' (which read n times faster)."""
    import aiohttp

    replicas = ReplicaSet(["m"])
    replicas.add(Replica("m-0", "m", "x", url=upstream.url, state=ReplicaState.READY))
    server = GatewayServer(
        GatewaySettings(port=0), Router(replicas), make_services(replicas, tmp_path / "c.db")
    )
    await server.start()
    upstream.chunks, upstream.gap = 6, 0.05
    url = f"http://127.0.0.1:{server.port}"

    async def itl_after(n: int) -> float:
        upstream.usage = {"prompt_tokens": 3, "completion_tokens": 6 * n, "total_tokens": 3 + 6 * n}
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": n, "stream": True}
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/chat/completions", json=body) as answer:
                assert answer.status == 200
                await answer.read()
            async with session.get(url + "/metrics") as page:
                text = await page.text()
        values = {
            line.split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(
                ("corral_inter_token_latency_seconds_sum{", "corral_inter_token_latency_seconds_count{")
            )
            and 'model="m"' in line
        }
        return values["corral_inter_token_latency_seconds_sum"]

    try:
        one = await itl_after(1)
        both = await itl_after(2) - one
        assert both > 0.6 * one, (one, both)  # (without: about 5/11 of it)
    finally:
        await server.stop()
