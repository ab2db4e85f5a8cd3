"""A hostile client against a closed gateway (tenant keys, an admin key): bytes a well-behaved client never
sends get a clear 4xx in the OpenAI error format, never a 500."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from ..admission.test_gateway_admission import Cluster, start
from ..gateway.conftest import ScriptedUpstream


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
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2] or b"{}")


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
