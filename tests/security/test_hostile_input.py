"""A hostile client against a closed gateway (tenant keys, an admin key): bytes a well-behaved client never
sends get a clear 4xx in the OpenAI error format, never a 500."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from typer.testing import CliRunner
from yarl import URL

from corral.admission import Authenticator
from corral.cli import app
from corral.config import (
    AuthSettings,
    BatchSettings,
    GatewaySettings,
    LimitsSettings,
    QueueSettings,
    StoreSettings,
)
from corral.gateway import GatewayParts, GatewayServer
from corral.protocol import Unauthorized
from corral.routing import Replica, ReplicaSet, ReplicaState, Router
from corral.store import AuditLog, KeyStore, open_database

from ..admission.test_gateway_admission import Cluster, start
from ..gateway.conftest import ScriptedUpstream, make_services


async def raw_request(url: str, head: bytes, body: bytes = b"") -> tuple[int, dict]:
    """Send `head` (request line and header lines, each ending in CRLF) and `body` as they are."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    length = f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
    writer.write(head + length + body)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert answer, "no answer"
    status_line, _, rest = answer.partition(b"\r\n")
    body = rest.partition(b"\r\n\r\n")[2]
    return int(status_line.split()[1]), json.loads(body) if body.startswith(b"{") else {"text": body.decode()}


@pytest.fixture
async def closed(tmp_path: Path, upstream: ScriptedUpstream) -> Cluster:
    server, cluster = await start(tmp_path, upstream)
    yield cluster  # type: ignore[misc]
    await server.stop()


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("GET", "/corral/status"),
        ("GET", "/admin/keys"),
        ("GET", "/v1/files"),
        ("GET", "/v1/batches"),
    ],
)
async def test_an_authorization_header_that_is_not_utf8_is_refused_with_401(
    closed: Cluster, method: str, path: str
) -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}' if method == "POST" else b""
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
    status, answer = await raw_request(
        closed.url, head + b"Authorization: Bearer \xff\xfe-not-a-key\r\n", body
    )
    assert (status, answer["error"]["code"]) == (401, "invalid_api_key"), answer


async def batches_gateway(
    tmp_path: Path, upstream: ScriptedUpstream, settings: GatewaySettings
) -> tuple[GatewayServer, str, str]:
    """A closed gateway with the Files and Batch API, started: (server, url, a tenant key)."""
    replicas = ReplicaSet(["m"])
    replicas.add(Replica(id="m-0", model="m", engine="x", url=upstream.url, state=ReplicaState.READY))
    parts = GatewayParts.build(
        replicas,
        f"sqlite:///{tmp_path / 'c.db'}",
        AuthSettings(open=False),
        StoreSettings(flush_interval=0.1),
        LimitsSettings(),
        QueueSettings(),
        admin_key="admin",
        batch=BatchSettings(),
    )
    secret, _ = parts.keys.create("eve")
    server = GatewayServer(settings, Router(replicas), parts)
    await server.start()
    return server, f"http://127.0.0.1:{server.port}", secret


@pytest.fixture
async def with_batches(tmp_path: Path, upstream: ScriptedUpstream) -> AsyncIterator[tuple[str, str]]:
    """A closed gateway with the Files and Batch API, and a tenant key: (url, key)."""
    server, url, key = await batches_gateway(tmp_path, upstream, GatewaySettings(port=0))
    yield url, key
    await server.stop()


async def post(url: str, key: str, body: bytes, content_type: str = "application/json") -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": content_type}
    async with aiohttp.ClientSession() as session, session.post(url, data=body, headers=headers) as r:
        return r.status, await r.json(content_type=None)


@pytest.mark.parametrize(
    "body",
    [
        b'{"endpoint": [], "input_file_id": "file-x", "completion_window": "24h"}',
        b'{"endpoint": {}, "input_file_id": "file-x", "completion_window": "24h"}',
        b'{"endpoint": "/v1/chat/completions", "input_file_id": "f", '
        b'"completion_window": "99999999999999999999h"}',
        b'{"endpoint": "/v1/chat/completions", "input_file_id": "f", "completion_window": "%sh"}'
        % (b"9" * 5000),
    ],
)
async def test_a_batch_request_of_the_wrong_shape_is_a_400(
    with_batches: tuple[str, str], body: bytes
) -> None:
    url, key = with_batches
    status, answer = await post(url + "/v1/batches", key, body)
    assert status == 400 and answer["error"]["param"] in ("endpoint", "completion_window"), answer


@pytest.mark.parametrize(
    "purpose_headers",
    [
        b'Content-Type: text/plain; charset="x-no-such-charset"\r\n',
        b"Content-Transfer-Encoding: x-no-such-encoding\r\n",
        b"X-Control: a\x01b\r\n",  # a part header aiohttp cannot parse (schemathesis found it: a 500)
    ],
)
async def test_a_purpose_part_in_an_unknown_encoding_is_a_400(
    with_batches: tuple[str, str], purpose_headers: bytes
) -> None:
    url, key = with_batches
    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}\n'
    form = (
        b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n' + purpose_headers + b"\r\nbatch\r\n"
        b'--B\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
        b"Content-Type: application/jsonl\r\n\r\n" + line + b"\r\n--B--\r\n"
    )
    status, answer = await post(url + "/v1/files", key, form, "multipart/form-data; boundary=B")
    assert status == 400, answer


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity"])
async def test_a_number_json_does_not_have_is_a_400_beside_stream_options(
    with_batches: tuple[str, str], value: bytes
) -> None:
    url, key = with_batches
    body = (
        b'{"model": "m", "stream": true, "stream_options": {"x": {"y": 1}}, "logit_bias": {"50": '
        + value
        + b'}, "messages": [{"role": "user", "content": "hi"}]}'
    )
    status, answer = await post(url + "/v1/chat/completions", key, body)
    assert status == 400 and "JSON" in answer["error"]["message"], answer


class _CountingKeys(KeyStore):
    """A key store that counts the authenticator's lookups."""

    lookups = 0

    def by_secret_hash(self, key_hash: str):  # type: ignore[no-untyped-def]
        self.lookups += 1
        return super().by_secret_hash(key_hash)


async def test_a_flood_of_random_keys_never_sends_a_working_key_to_the_database(tmp_path: Path) -> None:
    """Random keys filled the one auth cache and flushed it whole at its bound, working keys with it: each
    flood sent every tenant's next request to the database. Misses are now cached apart."""
    keys = _CountingKeys(open_database(f"sqlite:///{tmp_path / 'k.db'}"))
    secret, _ = keys.create("bob")
    auth = Authenticator(keys, open_access=False, ttl=600, max_cached=50)
    await auth.authenticate(f"Bearer {secret}")
    for i in range(200):  # four times the bound
        with pytest.raises(Unauthorized):
            await auth.authenticate(f"Bearer sk-corral-random-{i}")
    before = keys.lookups
    assert (await auth.authenticate(f"Bearer {secret}")).tenant == "bob"
    assert keys.lookups == before  # from the cache


@pytest.fixture
async def impatient(tmp_path: Path, upstream: ScriptedUpstream) -> AsyncIterator[tuple[str, str]]:
    """The same with a 0.5 s body timeout: (url, tenant key)."""
    server, url, key = await batches_gateway(tmp_path, upstream, GatewaySettings(port=0, body_timeout=0.5))
    yield url, key
    await server.stop()


@pytest.mark.parametrize(
    ("path", "key", "content_type", "start"),
    [
        ("/v1/batches", "eve", "application/json", b'{"endpoint": "/v1/chat'),
        ("/admin/keys", "admin", "application/json", b'{"tenant": "mal'),
        ("/v1/files", "eve", "multipart/form-data; boundary=B", b"--B\r\nContent-Disposition: form-data; na"),
        ("/v1/chat/completions", "eve", "application/json", b'{"model": "m", "mess'),
    ],
)
async def test_a_body_that_stalls_is_cut_off_at_the_body_timeout_on_every_route(
    impatient: tuple[str, str], path: str, key: str, content_type: str, start: bytes
) -> None:
    """A client sends its headers and the first bytes of a body, then nothing: the connection was held
    until the client gave up on /v1/batches, /admin/keys and /v1/files; now a 408 at the body timeout."""
    url, eve = impatient
    secret = eve if key == "eve" else "admin"
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {secret}\r\n"
        f"Content-Type: {content_type}\r\nContent-Length: 4096\r\n\r\n"
    )
    writer.write(head.encode() + start)
    await writer.drain()
    try:
        status_line = await asyncio.wait_for(reader.readline(), 5)  # (without the timeout: minutes)
    finally:
        writer.close()
    assert status_line.split()[1] == b"408", status_line


@pytest.mark.parametrize("sent", [b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthoriz"])
async def test_a_connection_without_a_whole_request_is_closed_at_the_idle_timeout(
    tmp_path: Path, sent: bytes
) -> None:
    """A connection that sends nothing, or half a header, and no key: aiohttp kept it for an hour (its
    default keep-alive), so a client could run the gateway out of file descriptors."""
    replicas = ReplicaSet(["m"])
    parts = make_services(replicas, tmp_path / "c.db", auth=AuthSettings(open=False))
    server = GatewayServer(GatewaySettings(port=0, idle_timeout=0.5), Router(replicas), parts)
    await server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(sent)
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 5) in (b"", b"HTTP/1.1 ")  # closed by the gateway
        writer.close()
    finally:
        await server.stop()


async def test_a_header_longer_than_max_header_bytes_is_a_400(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    replicas = ReplicaSet(["m"])
    parts = make_services(replicas, tmp_path / "c.db", auth=AuthSettings(open=False))
    server = GatewayServer(GatewaySettings(port=0, max_header_bytes=2048), Router(replicas), parts)
    await server.start()
    try:
        head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 4096 + b"\r\n"
        status, answer = await raw_request(f"http://127.0.0.1:{server.port}", head)
        assert status == 400
        error = answer["error"]  # OpenAI's shape (was aiohttp's plain text)
        assert (error["type"], error["code"]) == ("invalid_request_error", "header_too_long")
        assert "gateway.max_header_bytes" in error["message"]
        head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 1024 + b"\r\n"
        status, _ = await raw_request(f"http://127.0.0.1:{server.port}", head)
        assert status == 401  # within the bound: an ordinary refusal (no key)
    finally:
        await server.stop()


async def test_a_seed_past_64_bits_is_a_400(closed: Cluster) -> None:
    _, eve = await closed.admin("POST", "/admin/keys", {"tenant": "eve"})
    body = b'{"model": "m", "seed": 18446744073709551617, "messages": [{"role": "user", "content": "hi"}]}'
    status, answer = await post(closed.url + "/v1/chat/completions", eve["key"], body)
    assert (status, answer["error"]["param"]) == (400, "seed")


async def test_an_integer_past_64_bits_reaches_the_engine_as_sent_when_the_body_is_rewritten(
    closed: Cluster, upstream: ScriptedUpstream
) -> None:
    """A body naming `stream_options` is re-serialised (to ask the engine for usage); orjson wrote an
    integer past 64 bits as a float (18446744073709551617 became 1.8446744073709552e+19)."""
    _, eve = await closed.admin("POST", "/admin/keys", {"tenant": "eve"})
    body = (
        b'{"model": "m", "stream": true, "stream_options": {"include_usage": false}, '
        b'"vendor_seed": 18446744073709551617, "messages": [{"role": "user", "content": "hi"}]}'
    )
    headers = {"Authorization": f"Bearer {eve['key']}", "Content-Type": "application/json"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(closed.url + "/v1/chat/completions", data=body, headers=headers) as answer,
    ):
        assert answer.status == 200
        await answer.read()
    assert upstream.bodies[-1]["vendor_seed"] == 18446744073709551617
    assert upstream.bodies[-1]["stream_options"] == {"include_usage": True}


@pytest.fixture
async def on_postgres(
    fresh_postgres: str, upstream: ScriptedUpstream
) -> AsyncIterator[tuple[str, GatewayParts]]:
    """A closed gateway with the Files and Batch API on PostgreSQL: (its url, its parts)."""
    replicas = ReplicaSet(["m"])
    replicas.add(Replica(id="m-0", model="m", engine="x", url=upstream.url, state=ReplicaState.READY))
    parts = GatewayParts.build(
        replicas,
        fresh_postgres,
        AuthSettings(open=False),
        StoreSettings(flush_interval=0.1),
        LimitsSettings(),
        QueueSettings(),
        admin_key="admin",
        batch=BatchSettings(),
    )
    server = GatewayServer(GatewaySettings(port=0), Router(replicas), parts)
    await server.start()
    try:
        yield f"http://127.0.0.1:{server.port}", parts
    finally:
        await server.stop()
        parts.keys.engine.dispose()


async def send(url: str, method: str, key: str, body: object = None) -> tuple[int, dict, str]:
    """(status, JSON answer, x-request-id) of one request, its URL sent as it is (no re-quoting)."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    data = json.dumps(body) if body is not None else None
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, URL(url, encoded=True), data=data, headers=headers) as r,
    ):
        return r.status, await r.json(content_type=None), r.headers.get("x-request-id", "")


NUL_ROUTES = [
    ("GET", "/admin/keys/%00"),
    ("PATCH", "/admin/keys/%00"),
    ("DELETE", "/admin/keys/%00"),
    ("POST", "/admin/keys/%00/rotate"),
    ("GET", "/admin/usage?request_id=%00"),
    *(("GET", f"/admin/audit?{name}=%00") for name in ("actor", "action", "tenant", "request_id")),
    ("GET", "/v1/files/%00"),
    ("GET", "/v1/batches/a%00b"),
    ("GET", "/v1/responses/resp_%00"),
    ("DELETE", "/admin/cache?tenant=%00"),
]


async def test_a_nul_in_a_path_or_query_is_a_400_on_postgresql_and_a_refused_change_is_audited(
    on_postgres: tuple[str, GatewayParts],
) -> None:
    """PostgreSQL's text holds no NUL: `%00` in an id or a filter reached it and was a 500 with a traceback
    (psycopg's DataError), and DELETE /admin/keys/%00 lost its audit record. Refused before any route now,
    with the request's id, and a refused change is on the trail as the route's other refusals are."""
    url, parts = on_postgres
    manager, _ = await asyncio.to_thread(lambda: parts.keys.create("acme", role="tenant-admin"))
    for method, path in NUL_ROUTES:
        key = manager if path.startswith("/admin/keys") else "admin"
        body = {"rpm": 5} if method == "PATCH" else None
        status, answer, told = await send(url + path, method, key, body)
        assert (status, answer["error"]["type"]) == (400, "invalid_request_error"), (path, answer)
        assert "NUL" in answer["error"]["message"] and told.startswith("req_"), (path, answer, told)
    trail = await asyncio.to_thread(AuditLog(parts.keys.engine).list, limit=100)
    changes = [(e["action"], e["status"], e["target"]) for e in reversed(trail)]
    assert changes == [
        ("key.update", 400, "\\x00"),
        ("key.revoke", 400, "\\x00"),
        ("key.rotate", 400, "\\x00"),
        ("cache.purge", 400, None),
    ], changes
    revoke = next(e for e in trail if e["action"] == "key.revoke")
    assert revoke["actor"].startswith("key:") and revoke["request_id"].startswith("req_")


async def test_a_response_id_holding_nul_in_a_body_is_no_stored_response_on_postgresql(
    on_postgres: tuple[str, GatewayParts],
) -> None:
    """A previous_response_id is a body's string: a NUL in it reached PostgreSQL (a 500, and no request of
    the key's spent). An id of no shape the gateway makes is none of its stored responses, without a
    lookup."""
    url, parts = on_postgres
    key, _ = await asyncio.to_thread(lambda: parts.keys.create("acme"))
    body = {"model": "m", "input": "hi", "previous_response_id": "resp_\u0000" + "a" * 4000}
    status, answer, _ = await send(url + "/v1/responses", "POST", key, body)
    assert (status, answer["error"]["code"]) == (400, "previous_response_not_found"), answer
    assert len(answer["error"]["message"]) < 200, answer  # (the id named, cut short)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tenant": "ac\u0000me"}, "tenant"),
        ({"tenant": "acme", "name": "x\u0000y"}, "name"),
        ({"tenant": "acme", "name": "line\nbreak"}, "name"),
        ({"tenant": "acme", "models": ["m", "m\u001b[31m"]}, "models.1"),
        ({"tenant": "ok\u009b31mRED"}, "tenant"),
    ],
)
async def test_a_new_keys_text_with_a_control_character_is_a_400_naming_its_field(
    on_postgres: tuple[str, GatewayParts], body: dict, param: str
) -> None:
    """A key's name or tenant holding a NUL reached PostgreSQL (a 500); a line break or an escape sequence
    would forge lines where keys are listed. Refused by the key's own validation, for the API and the CLI."""
    url, parts = on_postgres
    status, answer, _ = await send(url + "/admin/keys", "POST", "admin", body)
    assert (status, answer["error"]["param"]) == (400, param), answer
    assert "control characters" in answer["error"]["message"], answer
    assert await asyncio.to_thread(parts.keys.list) == []


@pytest.mark.parametrize(
    ("option", "value"),
    [("--tenant", "ac\tme"), ("--name", "a\nb"), ("--models", "m,m\x1b[31m")],
)
def test_the_cli_refuses_a_new_keys_text_with_a_control_character_naming_its_option(
    tmp_path: Path, option: str, value: str
) -> None:
    args = ["keys", "create", "--tenant", "acme", option, value, "--store", f"sqlite:///{tmp_path / 'c.db'}"]
    refused = CliRunner().invoke(app, args, env={"COLUMNS": "160"})
    assert refused.exit_code == 2, refused.output
    assert f"error: {option}: must not hold control characters" in refused.stderr, refused.stderr
    assert not (tmp_path / "c.db").exists()
