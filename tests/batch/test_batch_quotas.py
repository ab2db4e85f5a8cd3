"""What bounds a tenant's files: its uploads in flight (`batch.tenant_max_uploads` at once, each refused as
it arrives once it would pass `batch.tenant_max_bytes`), and its batches' results (counted as they are
committed: past the quota, the lines left fail with `files_quota_exceeded` instead of running)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import aiohttp
import orjson
import pytest

from corral.admission import Principal
from corral.batch import BatchRunner, BatchStore, NewBatch
from corral.config import BatchSettings
from corral.gateway import GatewayParts
from corral.routing import Replica, ReplicaSet, ReplicaState
from corral.store import FileQuotaExceeded, KeyStore, open_database
from tests.batch.running import running, until
from tests.gateway.conftest import start_closed_gateway

ADMIN = "batch-admin"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
LINE = orjson.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": BODY}) + b"\n"
PURPOSE = b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
FILE_PART = b'--B\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n'
END = b"\r\n--B--\r\n"
FORM = {"Content-Type": "multipart/form-data; boundary=B"}


@dataclass
class Gateway:
    url: str
    parts: GatewayParts

    async def key(self, tenant: str) -> str:
        key, _ = await asyncio.to_thread(lambda: self.parts.keys.create(tenant))
        return str(key)


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    """A closed gateway whose tenants each send one upload at a time and hold at most 1 MB of files."""
    replicas = ReplicaSet()
    replicas.add(Replica(id="m-0", model="m", engine="x", url="http://127.0.0.1:9", state=ReplicaState.READY))
    url, server, parts = await start_closed_gateway(
        replicas,
        f"sqlite:///{tmp_path / 'gateway.db'}",
        ADMIN,
        batch=BatchSettings(tenant_max_uploads=1, tenant_max_bytes=1_000_000),
    )
    try:
        yield Gateway(url, parts)
    finally:
        await server.stop()


async def _upload(url: str, key: str, body: bytes | AsyncIterator[bytes]) -> tuple[int, dict, str | None]:
    """(status, answer, Retry-After) of one upload."""
    headers = {"Authorization": f"Bearer {key}", **FORM}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/files", data=body, headers=headers) as r,
    ):
        return r.status, await r.json(), r.headers.get("Retry-After")


async def _held_open(first: bytes, release: asyncio.Event) -> AsyncIterator[bytes]:
    """An upload's body that stops after `first` until `release` (a slow client)."""
    yield PURPOSE + FILE_PART + first
    await release.wait()
    yield END


async def test_a_tenants_uploads_in_flight_are_capped_by_tenant_max_uploads(gateway: Gateway) -> None:
    """A tenant with a 1 MB quota held ten uploads open at once, spooling 234 MB to the gateway's disk before
    any was refused: only the file count was checked before a body was read."""
    acme, globex = await gateway.key("acme"), await gateway.key("globex")
    release = asyncio.Event()
    uploads = [asyncio.create_task(_upload(gateway.url, acme, _held_open(LINE, release))) for _ in range(2)]
    try:  # (both held open: whichever came second is refused at once, the first holds the slot)
        done, (holding,) = await asyncio.wait(uploads, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        status, answer, retry_after = next(iter(done)).result()
        assert (status, answer["error"]["code"], retry_after) == (429, "too_many_uploads", "5"), answer
        assert answer["error"]["type"] == "rate_limit_error"
        assert (await _upload(gateway.url, globex, PURPOSE + FILE_PART + LINE + END))[0] == 200  # its own
    finally:
        release.set()
    assert (await holding)[0] == 200
    assert (await _upload(gateway.url, acme, PURPOSE + FILE_PART + LINE + END))[0] == 200  # a slot again


async def test_an_upload_is_refused_as_it_arrives_once_it_passes_the_tenants_quota(gateway: Gateway) -> None:
    """The quota's bytes were checked only once the whole body was in: a 1 MB tenant's 20 MB upload was
    spooled to the end before its 429."""
    acme = await gateway.key("acme")
    release = asyncio.Event()
    try:
        held_open = _held_open(LINE * 20_000, release)  # ~2 MB, and then it waits
        status, answer, _ = await asyncio.wait_for(_upload(gateway.url, acme, held_open), 5)
    finally:
        release.set()
    assert (status, answer["error"]["code"]) == (429, "files_quota_exceeded"), answer


class Answers:
    """Answers every line at once with 1 KB, as a chat replica would."""

    def __init__(self) -> None:
        self.answered = 0

    async def run_line(
        self, principal: Principal, path: str, body: bytes, request_id: str | None = None
    ) -> tuple[int, bytes]:
        self.answered += 1
        return 200, orjson.dumps({"object": "chat.completion", "choices": [], "pad": "x" * 1000})


def _status(store: BatchStore, batch_id: str) -> str | None:
    found = store.batch("acme", batch_id)
    return found.status if found is not None else None


async def test_a_batchs_results_stop_at_its_tenants_files_quota(tmp_path: Path) -> None:
    """Result files were written whatever their size: one batch of embedding lines could fill hundreds of GB
    of a tenant with a 10 GiB quota. Its results count against the quota as they are committed; once
    they pass it, the lines left fail with `files_quota_exceeded` instead of running."""
    database = open_database(f"sqlite:///{tmp_path / 'batch.db'}")
    store = BatchStore(database)
    replicas = ReplicaSet()
    replicas.add(Replica(id="m-0", model="m", engine="sim", state=ReplicaState.READY, capacity=4))
    settings = BatchSettings(poll_s=0.02, headroom=0, max_share=1.0, tenant_max_bytes=3000)
    answers, waiting = Answers(), dict[str, int]()
    runner = BatchRunner(store, answers, KeyStore(database), replicas, lambda: waiting, settings)
    batch = store.create_batch(NewBatch("acme", None, "/v1/chat/completions", "file-x", timedelta(hours=1)))
    assert store.start(batch.id, "m", [(f"c{i}", orjson.dumps(BODY)) for i in range(30)])
    async with running(runner):
        await until(lambda: answers.answered >= 3)  # (what counts: results committed)
        await until(lambda: store.files.bytes_held(["acme"])["acme"] > 3000)
        with pytest.raises(FileQuotaExceeded):  # an upload is refused meanwhile too
            store.files.check_room("acme", (1000, 3000), 1)
        await until(lambda: _status(store, batch.id) == "completed")
    found = store.batch("acme", batch.id)
    assert found is not None and found.error_file_id is not None
    assert 3 <= answers.answered <= 8  # the lines running as the quota was reached: a lease or two
    assert found.counts == {"total": 30, "completed": answers.answered, "failed": 30 - answers.answered}
    content = store.files.file_content("acme", found.error_file_id) or b""
    errors = [orjson.loads(x) for x in content.splitlines()]
    assert len(errors) == 30 - answers.answered
    assert {(e["response"]["status_code"], e["response"]["body"]["error"]["code"]) for e in errors} == {
        (429, "files_quota_exceeded")
    }
