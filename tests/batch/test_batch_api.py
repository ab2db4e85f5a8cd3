"""The Files and Batch API with the openai client, through a gateway in front of simulated replicas: a
batch runs to completion with one output line per request; uploads and batches with bad lines are refused
or failed naming the line; a line the engine refuses lands in the error file; cancel keeps finished lines;
expiry keeps partial results; another tenant's key sees nothing; usage is recorded per line."""

from __future__ import annotations

import asyncio
import io
import os
import re
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import orjson
import pytest
from sqlalchemy import text

from corral.config import BatchSettings, GatewaySettings
from corral.engines import EngineFeatures
from corral.gateway import GatewayParts, GatewayServer
from corral.perf import load_catalog
from corral.perf.calibration import calibrated_efficiency
from corral.routing import Replica, ReplicaSet, ReplicaState
from corral.sim import SimFleet, SimOptions, build_server
from tests.gateway.conftest import start_closed_gateway

ADMIN = "batch-admin"


@dataclass
class Gateway:
    url: str
    server: GatewayServer
    services: GatewayParts


@pytest.fixture
async def engines() -> AsyncIterator[list[str]]:
    """A fast chat replica `m` (8 slots), a slow one `slow` (1 slot, real time) and an embedder `e`."""
    catalog, efficiency = load_catalog(), calibrated_efficiency()
    fleet = SimFleet(
        [
            build_server(
                SimOptions(
                    model="llama-3.1-8b", gpu="h100-sxm", time_scale=50, served_name="m", max_model_len=512
                ),
                catalog,
                efficiency,
            ),
            build_server(
                SimOptions(model="llama-3.1-8b", gpu="l4", time_scale=1, served_name="slow"),
                catalog,
                efficiency,
            ),
            build_server(
                SimOptions(
                    model="llama-3.1-8b", gpu="h100-sxm", time_scale=50, served_name="e", embed_dim=16
                ),
                catalog,
                efficiency,
            ),
        ]
    )
    await fleet.start([0, 0, 0])
    yield fleet.urls
    await fleet.stop()


@pytest.fixture
async def gateway(
    engines: list[str], tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[Gateway]:
    """The gateway, its lines queued in SQL (SQLite), or with `param` "redis" in Redis Streams."""
    replicas = ReplicaSet()
    replicas.add(
        Replica(
            id="m-0",
            model="m",
            engine="sim",
            url=engines[0],
            state=ReplicaState.READY,
            capacity=8,
            context_length=512,
        )
    )
    replicas.add(
        Replica(id="slow-0", model="slow", engine="sim", url=engines[1], state=ReplicaState.READY, capacity=2)
    )
    embedder = EngineFeatures(embeddings=True)
    replicas.add(
        Replica(
            id="e-0",
            model="e",
            engine="sim",
            url=engines[2],
            state=ReplicaState.READY,
            capacity=4,
            features=embedder,
        )
    )
    gw = Gateway(
        *await start_closed_gateway(
            replicas,
            f"sqlite:///{tmp_path / f'{uuid.uuid4().hex}.db'}",
            ADMIN,
            batch=BatchSettings(poll_s=0.05, lease_s=30, queue=getattr(request, "param", "sql")),
        )
    )
    yield gw
    await gw.server.stop()


async def key_for(gw: Gateway, tenant: str, models: list[str] | None = None) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.post(
            gw.url + "/admin/keys",
            json={"tenant": tenant, "models": models or []},
            headers={"Authorization": f"Bearer {ADMIN}"},
        ) as response:
            return str((await response.json())["key"])


def client(gw: Gateway, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def chat_lines(count: int, model: str = "m", max_tokens: int = 4) -> bytes:
    return b"".join(
        orjson.dumps(
            {
                "custom_id": f"req-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": f"Question {i}?"}],
                },
            }
        )
        + b"\n"
        for i in range(count)
    )


async def submit(
    c: openai.AsyncOpenAI, content: bytes, endpoint: str = "/v1/chat/completions", window: str = "24h"
):
    uploaded = await c.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    return await c.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window=window)  # type: ignore[arg-type]


async def until_done(c: openai.AsyncOpenAI, batch_id: str, within: float = 60.0):
    deadline = asyncio.get_running_loop().time() + within
    while True:
        batch = await c.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert asyncio.get_running_loop().time() < deadline, (
            f"batch still {batch.status}: {batch.request_counts}"
        )
        await asyncio.sleep(0.1)


async def lines_of(c: openai.AsyncOpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    content = await c.files.content(file_id)
    return [orjson.loads(line) for line in content.read().splitlines() if line.strip()]


@pytest.mark.parametrize("gateway", ["sql", "redis"], indirect=True)
async def test_a_batch_runs_to_one_output_line_per_request_and_tenants_see_only_theirs(
    gateway: Gateway,
) -> None:
    acme = client(gateway, await key_for(gateway, "acme"))
    batch = await submit(acme, chat_lines(60))
    assert batch.status == "validating" and batch.request_counts.total == 0  # type: ignore[union-attr]
    done = await until_done(acme, batch.id)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
        60,
        60,
        0,
    )  # type: ignore[union-attr]
    output = await lines_of(acme, done.output_file_id)
    assert sorted(line["custom_id"] for line in output) == sorted(f"req-{i}" for i in range(60))
    assert all(line["response"]["status_code"] == 200 for line in output)
    assert all(line["response"]["body"]["choices"][0]["message"]["content"] for line in output)
    assert done.error_file_id is None and done.completed_at and done.in_progress_at and done.finalizing_at

    listed = await acme.batches.list()
    assert [b.id for b in listed.data] == [batch.id]
    globex = client(gateway, await key_for(gateway, "globex"))
    with pytest.raises(openai.NotFoundError):
        await globex.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        await globex.files.content(done.output_file_id)  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        await globex.batches.cancel(batch.id)
    assert (await globex.batches.list()).data == []
    assert (await globex.files.list()).data == []

    # usage is recorded per line, for the tenant, under the request id its output line names
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        rows = [r for r in gateway.services.usage_store.report("tenant") if r["tenant"] == "acme"]
        if rows and rows[0]["requests"] >= 60:
            break
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.1)
    with gateway.services.keys.engine.connect() as connection:  # (the one store: keys, usage, batches)
        query = text("SELECT request_id FROM corral_usage WHERE tenant = 'acme'")
        recorded = {request_id for (request_id,) in connection.execute(query)}
    assert recorded == {line["response"]["request_id"] for line in output}


async def test_bad_uploads_are_refused_naming_the_line_and_bad_batches_fail_with_their_lines(
    gateway: Gateway,
) -> None:
    key = await key_for(gateway, "acme")
    acme = client(gateway, key)
    good = chat_lines(2)
    for bad, words in (
        (good + b"not json\n", "Line 3"),
        (
            good + b'{"custom_id": "x", "method": "GET", "url": "/v1/chat/completions", "body": {}}\n',
            "Line 3",
        ),
        (b'{"method": "POST", "url": "/v1/chat/completions", "body": {}}\n', "Line 1"),
    ):
        with pytest.raises(openai.BadRequestError, match=words):
            await acme.files.create(file=("in.jsonl", io.BytesIO(bad)), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        await acme.files.create(file=("in.jsonl", io.BytesIO(good)), purpose="fine-tune")

    duplicate = good + chat_lines(1)  # req-0 again
    unknown = chat_lines(1, model="nope")
    wrong_kind = chat_lines(1, model="e")
    deep = good + (  # JSON reads it; orjson cannot write it again (the batch sat in validating)
        b'{"custom_id": "deep", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", '
        b'"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 300 + b"]" * 300 + b"}}\n"
    )
    for content, words in (
        (duplicate, "unique"),
        (unknown, "does not exist"),
        (wrong_kind, "embedding model"),
        (deep, "nest at most 254"),
    ):
        failed = await until_done(acme, (await submit(acme, content)).id)
        assert failed.status == "failed" and failed.errors is not None and failed.failed_at
        assert any(words in e.message for e in failed.errors.data), failed.errors  # type: ignore[union-attr,operator]
    failed = await until_done(acme, (await submit(acme, duplicate)).id)
    assert failed.errors.data[0].line == 3  # type: ignore[union-attr]
    # a client's value its errors repeat is cut short (a failed batch keeps them: 100 lines of a 1 MB model
    # name were 100 MB a batch)
    long_name = await until_done(acme, (await submit(acme, chat_lines(3, model="x" * 5000))).id)
    assert long_name.status == "failed" and len(long_name.errors.data) == 3  # type: ignore[union-attr]
    assert all(len(e.message or "") < 400 for e in long_name.errors.data)  # type: ignore[union-attr]
    # a carriage return is JSON's whitespace inside a line, as the upload's check read it
    spaced = await until_done(
        acme, (await submit(acme, chat_lines(1).replace(b'"method":', b'"method":\r'))).id
    )
    assert spaced.status == "completed", spaced.errors
    # one file a form: a second file part's bytes joined the first's, past every size check
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    for name in ("a.jsonl", "b.jsonl"):
        form.add_field("file", good, filename=name)
    async with (
        aiohttp.ClientSession() as session,
        session.post(gateway.url + "/v1/files", data=form, headers={"Authorization": f"Bearer {key}"}) as got,
    ):
        assert got.status == 400 and "one file part" in (await got.json())["error"]["message"]
    # the tenant's batches, a page at a time, newest first, as one listing has them
    everything = [b.id for b in (await acme.batches.list(limit=100)).data]
    paged: list[str] = []
    after: str | None = None
    while True:
        page = await (acme.batches.list(limit=2, after=after) if after else acme.batches.list(limit=2))
        paged += [b.id for b in page.data]
        if not page.has_more:
            break
        after = page.data[-1].id
    assert paged == everything and len(everything) >= 6
    only_slow = client(gateway, await key_for(gateway, "acme", models=["slow"]))
    refused = await until_done(only_slow, (await submit(only_slow, good)).id)
    assert refused.status == "failed" and refused.errors.data[0].code == "model_not_allowed"  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        uploaded = await acme.files.create(file=("in.jsonl", io.BytesIO(good)), purpose="batch")
        await acme.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/moderations", completion_window="24h"
        )  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        await acme.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )


async def test_a_line_the_engine_refuses_goes_to_the_error_file_and_embeddings_batch(
    gateway: Gateway,
) -> None:
    acme = client(gateway, await key_for(gateway, "acme"))
    lines = (
        chat_lines(3)
        + orjson.dumps(
            {
                "custom_id": "too-long",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "m", "max_tokens": 100000, "messages": [{"role": "user", "content": "hi"}]},
            }
        )
        + b"\n"
    )
    done = await until_done(acme, (await submit(acme, lines)).id)
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 1)  # type: ignore[union-attr]
    (error,) = await lines_of(acme, done.error_file_id)
    assert error["custom_id"] == "too-long" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["code"] == "context_length_exceeded"

    embed = b"".join(
        orjson.dumps(
            {
                "custom_id": f"e{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": "e", "input": f"text {i}"},
            }
        )
        + b"\n"
        for i in range(5)
    )
    done = await until_done(acme, (await submit(acme, embed, endpoint="/v1/embeddings")).id)
    vectors = await lines_of(acme, done.output_file_id)
    assert len(vectors) == 5 and all(
        len(v["response"]["body"]["data"][0]["embedding"]) == 16 for v in vectors
    )


@pytest.mark.slow
@pytest.mark.parametrize("gateway", ["sql", "redis"], indirect=True)
async def test_cancel_keeps_finished_lines_and_expiry_keeps_partial_results(gateway: Gateway) -> None:
    acme = client(gateway, await key_for(gateway, "acme"))
    batch = await submit(
        acme, chat_lines(40, model="slow", max_tokens=20)
    )  # 2 slots (1 for batches), ~1 s a line
    deadline = asyncio.get_running_loop().time() + 30
    while (await acme.batches.retrieve(batch.id)).request_counts.completed < 2:  # type: ignore[union-attr]
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.1)
    cancelling = await acme.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = await until_done(acme, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    output, errors = await lines_of(acme, done.output_file_id), await lines_of(acme, done.error_file_id)
    counts = done.request_counts
    assert counts.completed == len(output) >= 2 and counts.failed == len(errors) > 0  # type: ignore[union-attr]
    assert len(output) + len(errors) == 40
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert {line["custom_id"] for line in output}.isdisjoint(e["custom_id"] for e in errors)

    expiring = await submit(acme, chat_lines(40, model="slow", max_tokens=20), window="3s")
    done = await until_done(acme, expiring.id, within=30)
    assert done.status == "expired" and done.expired_at
    output, errors = await lines_of(acme, done.output_file_id), await lines_of(acme, done.error_file_id)
    assert 0 < len(output) < 40 and len(output) + len(errors) == 40
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}


async def test_the_cli_submits_follows_and_fetches_a_batch(gateway: Gateway, tmp_path: Path) -> None:
    key = await key_for(gateway, "acme")
    source = tmp_path / "in.jsonl"
    source.write_bytes(chat_lines(12))

    async def corral(*args: str) -> tuple[int, str, str]:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "corral.cli",
            "batch",
            *args,
            "--url",
            gateway.url,
            "--api-key",
            key,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "COLUMNS": "200"},
        )
        out, err = await process.communicate()
        return process.returncode or 0, out.decode(), err.decode()

    code, out, err = await corral("submit", str(source))
    assert code == 0, out
    batch_id = re.search(r"batch (batch_\w+): completed; 12 completed, 0 failed of 12", err)
    assert batch_id is not None, (out, err)
    assert out.strip() == batch_id[1]  # the id on stdout: ID=$(corral batch submit …)
    assert f"corral batch results {batch_id[1]}" in err  # where the answers are
    code, out, _ = await corral("results", batch_id[1])
    lines = [orjson.loads(line) for line in out.splitlines() if line.strip()]
    assert code == 0 and sorted(line["custom_id"] for line in lines) == sorted(f"req-{i}" for i in range(12))
    saved = tmp_path / "answers.jsonl"  # (written as it comes, under its name once whole)
    code, _, err = await corral("results", batch_id[1], "-o", str(saved))
    assert code == 0 and saved.read_text().splitlines() == out.splitlines(), err
    assert not (tmp_path / "answers.jsonl.part").exists()
    code, out, _ = await corral("status", batch_id[1], "--json")
    assert code == 0 and orjson.loads(out)["request_counts"]["completed"] == 12
    code, _, err = await corral("results", batch_id[1], "--errors")
    assert code == 1 and "has no error file" in err
    code, _, err = await corral("status", "batch_nope")
    assert code == 1 and "404" in err and "No such batch" in err
    code, out, _ = await corral("list")
    assert code == 0 and batch_id[1] in out and "completed" in out
    # A batch that fails its checks ends the command with 1 and every bad line named (a duplicate custom_id
    # on line 2 and a missing model on line 3, not only the first).
    bad = tmp_path / "bad.jsonl"
    line = orjson.loads(chat_lines(1))
    bad.write_bytes(
        b"\n".join(
            [
                orjson.dumps(line),
                orjson.dumps(line),
                orjson.dumps({**line, "custom_id": "other", "body": {**line["body"], "model": "nope"}}),
            ]
        )
        + b"\n"
    )
    code, out, err = await corral("submit", str(bad))
    assert code == 1 and "failed" in err, err
    assert "line 2:" in err and "line 3:" in err, err


async def test_a_shutdown_leases_no_more_and_hands_lines_back_without_spending_their_attempt(
    engines: list[str], tmp_path: Path
) -> None:
    """A gateway stopped mid-batch (a rolling upgrade) leases nothing once its shutdown begins and gives the
    lines still running back with the try undone: with `max_attempts: 1` the next gateway completes them
    all (counted, each stop would bring a line closer to failing as 'gave up')."""
    database = f"sqlite:///{tmp_path / 'b.db'}"

    async def start() -> Gateway:
        replicas = ReplicaSet()
        replicas.add(
            Replica(
                id="slow-0", model="slow", engine="sim", url=engines[1], state=ReplicaState.READY, capacity=2
            )
        )
        return Gateway(
            *await start_closed_gateway(
                replicas,
                database,
                ADMIN,
                GatewaySettings(port=0, shutdown_grace=0.5),
                batch=BatchSettings(poll_s=0.05, lease_s=30, max_attempts=1),
            )
        )

    first = await start()
    c = client(first, await key_for(first, "acme"))
    batch = await submit(c, chat_lines(3, model="slow", max_tokens=60))  # about 2 s a line, 2 at a time
    for _ in range(100):
        if (await c.batches.retrieve(batch.id)).status == "in_progress":
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # two lines running, one waiting
    await first.server.stop()
    second = await start()
    try:
        done = await until_done(client(second, c.api_key), batch.id, within=90)
        assert done.status == "completed" and done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (3, 0), done.request_counts
    finally:
        await second.server.stop()
