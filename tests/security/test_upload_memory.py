"""Eve uploads a 100 MiB batch file to a real `corral up`: the gateway spools it to disk, checks it line
by line and stores it a part at a time, so its resident memory rises by at most 16 MiB (a 51 MiB upload
cost about 157 MB when the file was read into memory, copied and stored whole); the download streams the
stored parts back, byte for byte."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import aiohttp
import pytest

from ..conftest import cluster_of

MIB = 1 << 20
SPEC = """\
auth: {{open: false, admin_key: admin}}
store: {{url: 'sqlite:///{db}'}}
batch: {{max_lines: 60000}}
models:
  - name: m
    arch: llama-3.1-8b
    deployments: [{{engine: sim, gpu: h100-sxm, replicas: 1}}]
"""


def peak_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM), bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def batch_file(path: Path, size: int) -> str:
    """A valid batch file of about `size` bytes (lines of 2 KiB); its sha256."""
    digest = hashlib.sha256()
    with path.open("wb") as out:
        written, n = 0, 0
        while written < size:
            body = {"model": "m", "messages": [{"role": "user", "content": f"{n} " + "x" * 1900}]}
            line = json.dumps(
                {"custom_id": str(n), "method": "POST", "url": "/v1/chat/completions", "body": body}
            )
            data = line.encode() + b"\n"
            out.write(data)
            digest.update(data)
            written, n = written + len(data), n + 1
    return digest.hexdigest()


async def upload(session: aiohttp.ClientSession, url: str, key: str, path: Path) -> dict:
    with path.open("rb") as content:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", content, filename=path.name, content_type="application/jsonl")
        async with session.post(
            f"{url}/v1/files", data=form, headers={"Authorization": f"Bearer {key}"}
        ) as answer:
            assert answer.status == 200, await answer.text()
            return await answer.json()


@pytest.mark.slow
async def test_a_100_mib_upload_raises_gateway_memory_by_at_most_16_mib(tmp_path: Path) -> None:
    small, large = tmp_path / "small.jsonl", tmp_path / "large.jsonl"
    batch_file(small, 64 * 1024)
    digest = batch_file(large, 100 * MIB - 4096)
    with cluster_of(tmp_path, SPEC.format(db=tmp_path / "c.db"), admin_key="admin") as running:
        pid = running.process.pid
        async with aiohttp.ClientSession() as session:
            admin = {"Authorization": "Bearer admin"}
            async with session.post(
                f"{running.url}/admin/keys", json={"tenant": "eve"}, headers=admin
            ) as made:
                key = (await made.json())["key"]
            await upload(session, running.url, key, small)  # every code path of an upload, once
            before = peak_rss(pid)
            stored = await upload(session, running.url, key, large)
            after_upload = peak_rss(pid)
            assert stored["bytes"] == large.stat().st_size
            got = hashlib.sha256()
            headers = {"Authorization": f"Bearer {key}"}
            async with session.get(
                f"{running.url}/v1/files/{stored['id']}/content", headers=headers
            ) as answer:
                assert answer.status == 200
                async for chunk in answer.content.iter_chunked(MIB):
                    got.update(chunk)
            after_download = peak_rss(pid)
    assert got.hexdigest() == digest
    assert after_upload - before <= 16 * MIB, f"upload: +{(after_upload - before) / MIB:.1f} MiB"
    assert after_download - before <= 16 * MIB, f"download: +{(after_download - before) / MIB:.1f} MiB"
