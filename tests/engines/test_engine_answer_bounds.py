"""Engine answers read whole are read up to a bound: an adapter (un)load answer past it is the replica's
failure (another replica may serve the request), never read whole; and an external server's URL holds no
user or password (they would never be sent, and the URL is logged)."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from corral.config import ModelSpec
from corral.engines.client import EngineClient
from corral.gateway.adapters import AdapterLoader, AdapterLoadFailed, AdapterRefused
from corral.routing import Replica, ReplicaSet, Router
from corral.routing.adapters import Adapter, AdapterCatalogue


async def _engine_answering(status: int, body: bytes) -> tuple[asyncio.Server, str]:
    """A server answering every request with `status` and `body`."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":", 1)[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n" % (status, len(body)) + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_an_adapter_load_answered_past_the_bound_is_the_replica_s_failure_not_a_refusal() -> None:
    refusal = b'{"error": {"message": "' + b"x" * 2**20 + b'"}}'  # a 1 MiB "refusal"
    server, url = await _engine_answering(400, refusal)
    adapter = Adapter(name="sql", base="base", engine_name="sql@1", path="/adapters/sql")
    loader = AdapterLoader(EngineClient(2.0, 2.0, 4), Router(ReplicaSet()), AdapterCatalogue([adapter]))
    replica = Replica(id="base-0", model="base", engine="vllm", url=url, adapter_slots=4)
    try:
        with pytest.raises(AdapterLoadFailed) as failed:
            await loader._load(replica, adapter, None)
        assert not isinstance(failed.value, AdapterRefused)  # (a refusal: the adapter's trouble, not retried)
        assert "larger than" in str(failed.value)
    finally:
        server.close()


@pytest.mark.parametrize(
    "url", ["http://svc:s3cret@127.0.0.1:8000", "http://svc@127.0.0.1:8000", "https://u:p@[::1:8000"]
)
def test_an_external_url_with_a_user_or_password_is_refused_without_showing_it(url: str) -> None:
    with pytest.raises(ValidationError) as refused:
        ModelSpec.model_validate({"name": "m", "deployments": [{"engine": "external", "urls": [url]}]})
    (error,) = refused.value.errors()
    assert "may not hold a user or password" in error["msg"] and "engine_api_key" in error["msg"]
    assert "s3cret" not in error["msg"] and "svc" not in error["msg"]
    ok = ModelSpec.model_validate(
        {"name": "m", "deployments": [{"engine": "external", "urls": ["http://[::1]:8000", "http://a:1/x"]}]}
    )
    assert ok.deployments[0].urls == ["http://[::1]:8000", "http://a:1/x"]
