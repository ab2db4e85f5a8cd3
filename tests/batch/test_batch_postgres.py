"""Batch jobs and files on PostgreSQL, whose text holds no NUL: a custom_id holding U+0000 is refused at
upload, and lines the store refuses anyway (a file uploaded before that check) fail their batch instead of
leaving it `validating`, checked again every tick for its whole window; an id, a file's name or metadata
holding one in a request's body is a 404 or kept as the store can hold it, never a 500."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from datetime import timedelta

import aiohttp
import orjson
import pytest

from corral.batch import BatchStore, NewBatch, check_upload, read_batch_input
from corral.config import BatchSettings
from corral.gateway import GatewayParts
from corral.protocol import InvalidRequest
from corral.routing import Replica, ReplicaSet, ReplicaState
from corral.store import open_database
from tests.gateway.conftest import start_closed_gateway

ADMIN = "batch-admin"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _line(custom_id: str) -> bytes:
    item = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": BODY}
    return orjson.dumps(item) + b"\n"


@pytest.fixture
async def gateway(fresh_postgres: str) -> AsyncIterator[tuple[str, GatewayParts]]:
    """A closed gateway with the Files and Batch API on PostgreSQL: (its url, its parts)."""
    replicas = ReplicaSet()
    replicas.add(Replica(id="m-0", model="m", engine="x", url="http://127.0.0.1:9", state=ReplicaState.READY))
    url, server, parts = await start_closed_gateway(
        replicas, fresh_postgres, ADMIN, batch=BatchSettings(poll_s=0.05)
    )
    try:
        yield url, parts
    finally:
        await server.stop()
        parts.keys.engine.dispose()


def test_a_custom_id_holding_nul_is_refused_at_upload_and_fails_a_batch_naming_its_line() -> None:
    """It passed the upload's check, and PostgreSQL refused the line when the batch was queued."""
    content = _line("fine") + _line("evil\u0000id")
    with pytest.raises(InvalidRequest, match=r"Line 2 .*U\+0000"):
        check_upload(io.BytesIO(content), max_lines=10, max_line_bytes=10_000)
    parsed, errors = read_batch_input(content, "/v1/chat/completions", {"m": False})
    assert parsed is None and [e["line"] for e in errors] == [2]


def test_a_batch_whose_lines_the_store_refuses_is_failed_not_left_validating(fresh_postgres: str) -> None:
    """Before, psycopg's DataError went up to the runner, which logged it and left the batch `validating`:
    its whole input was read and checked again every tick, for 24 hours."""
    store = BatchStore(open_database(fresh_postgres))
    batch = store.create_batch(NewBatch("acme", None, "/v1/chat/completions", "file-x", timedelta(hours=1)))
    body = orjson.dumps(BODY)
    assert not store.start(batch.id, "m", [("fine", body), ("evil\u0000id", body)])
    found = store.batch("acme", batch.id)
    assert found is not None and found.status == "failed" and found.errors
    assert found.errors[0]["code"] == "batch_not_queued"
    assert store.validating() == [] and store.lease("runner", "m", 5, lease_s=30) == []


async def test_ids_names_and_metadata_holding_nul_in_a_body_are_never_a_500(
    gateway: tuple[str, GatewayParts],
) -> None:
    url, parts = gateway
    key, _ = await asyncio.to_thread(lambda: parts.keys.create("acme"))
    headers = {"Authorization": f"Bearer {key}"}
    form = (
        b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b"--B\r\nContent-Disposition: form-data; name=\"file\"; filename*=UTF-8''in%00.jsonl\r\n\r\n"
        + _line("a")
        + b"\r\n--B--\r\n"
    )
    async with aiohttp.ClientSession(headers=headers) as session:
        upload = {"Content-Type": "multipart/form-data; boundary=B"}
        async with session.post(url + "/v1/files", data=form, headers=upload) as answer:
            assert answer.status == 200, await answer.text()
            stored = await answer.json()
        assert stored["filename"] == "in_.jsonl"  # (a control character is not kept in a name)
        asked = {"input_file_id": "file-\u0000", "endpoint": "/v1/chat/completions"}
        async with session.post(url + "/v1/batches", json=asked) as answer:
            assert answer.status == 404, await answer.text()
            assert (await answer.json())["error"]["message"] == "No such file: file-\\x00."
        asked = {
            "input_file_id": stored["id"],
            "endpoint": "/v1/chat/completions",
            "metadata": {"k": "a\u0000"},
        }
        async with session.post(url + "/v1/batches", json=asked) as answer:
            assert answer.status == 200, await answer.text()
            assert (await answer.json())["metadata"] == {"k": "a\u0000"}
        async with session.get(url + "/v1/files", params={"purpose": "fine-tune"}) as answer:
            assert answer.status == 200 and (await answer.json())["data"] == []
