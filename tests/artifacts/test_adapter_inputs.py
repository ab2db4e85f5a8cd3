"""Hostile or malformed adapter inputs are clear ArtifactErrors naming the file or URL: a base GGUF whose
header claims 2^63 elements (no hang), a malformed adapter_config.json, a Content-Length that is no number,
an archive claiming more than an adapter may unpack to, a broken archive; and a model GGUF left in a PEFT
folder is not handed to llama.cpp as the adapter."""

from __future__ import annotations

import io
import json
import re
import shutil
import struct
import tarfile
import threading
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import gguf
import pytest

from corral.artifacts import ArtifactError, BaseLayout, adapter_gguf, adapter_rank, resolve_adapter
from corral.config import Paths, UrlSource
from tests.artifacts.conftest import FIXTURE, PEFT_FILES

from .test_gguf_meta import hostile_ggufs


def _write_gguf(path: Path, fields: dict[str, Any], arch: str = "llama") -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in fields.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        else:
            writer.add_uint32(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def serve() -> Iterator[dict[str, tuple[bytes, dict[str, str]]]]:
    """A real HTTP server on 127.0.0.1: put a path's body and headers in the dict it yields (its "url" key
    holds the server's address)."""
    routes: dict[str, tuple[bytes, dict[str, str]]] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body, headers = routes.get(self.path, (b"", {}))
            self.send_response(200 if self.path in routes else 404)
            for name, value in {"Content-Length": str(len(body)), **headers}.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    routes["url"] = (f"http://127.0.0.1:{httpd.server_port}".encode(), {})
    yield routes
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def _url(routes: dict[str, tuple[bytes, dict[str, str]]], path: str) -> UrlSource:
    return UrlSource(url=routes["url"][0].decode() + path)


def test_a_hostile_base_gguf_is_a_clear_error_not_a_hang(tmp_path: Path, peft_folder: Path) -> None:
    """gguf's reader walked a header array claiming 2^63 elements one by one, holding the conversion lock."""
    paths = Paths(tmp_path / "home")
    for base in hostile_ggufs(tmp_path):
        with pytest.raises(ArtifactError, match=f"cannot read the base model {re.escape(str(base))}"):
            BaseLayout.read(base)
        with pytest.raises(ArtifactError, match=f"cannot read the base model {re.escape(str(base))}"):
            adapter_gguf(peft_folder, base, paths)


def test_a_hostile_adapter_gguf_s_rank_is_a_clear_error(tmp_path: Path) -> None:
    for adapter in hostile_ggufs(tmp_path):
        with pytest.raises(ArtifactError, match=f"cannot read the LoRA adapter {re.escape(str(adapter))}"):
            adapter_rank(adapter)


def test_the_base_layout_is_read_from_the_header(tmp_path: Path) -> None:
    grouped = _write_gguf(
        tmp_path / "a.gguf", {"llama.attention.head_count": 9, "llama.attention.head_count_kv": 3}
    )
    assert BaseLayout.read(grouped) == BaseLayout("llama", 9, 3)
    plain = _write_gguf(tmp_path / "b.gguf", {"qwen2.attention.head_count": 4}, arch="qwen2")
    assert BaseLayout.read(plain) == BaseLayout("qwen2", 4, 4)
    for heads in (0, True):
        bad = _write_gguf(tmp_path / "c.gguf", {"llama.attention.head_count": heads})
        with pytest.raises(ArtifactError, match="does not say its architecture and attention head count"):
            BaseLayout.read(bad)


@pytest.mark.parametrize(
    ("config", "why"),
    [
        ({"r": 8, "rank_pattern": ["q_proj"]}, "rank_pattern is not a mapping"),
        ({"r": True}, "r is True, not a rank"),
        ({"r": 0}, "r is 0, not a rank"),
        ({"r": 8, "rank_pattern": {"q_proj": "16"}}, r"rank_pattern\['q_proj'\] is '16', not a rank"),
    ],
)
def test_a_malformed_adapter_config_is_a_clear_error(
    tmp_path: Path, config: dict[str, Any], why: str
) -> None:
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ArtifactError, match=f"{re.escape(str(tmp_path))}.*{why}"):
        adapter_rank(tmp_path)


def test_a_config_that_is_not_json_or_gives_no_rank(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text(json.dumps({"lora_alpha": 16}))
    assert adapter_rank(tmp_path) is None
    (tmp_path / "adapter_config.json").write_text("{")
    with pytest.raises(ArtifactError, match=f"cannot read {re.escape(str(tmp_path))}"):
        adapter_rank(tmp_path)


def test_a_model_gguf_in_a_peft_folder_is_not_handed_to_llama_cpp(tmp_path: Path, peft_folder: Path) -> None:
    """A model GGUF beside the PEFT files (the base copied in) is not an adapter: the PEFT files are
    converted instead (here they cannot be: the base says an architecture the converter does not know)."""
    model = _write_gguf(peft_folder / "model.gguf", {"general.type": "model"})
    base = _write_gguf(tmp_path / "base.gguf", {"gpt2.attention.head_count": 4}, arch="gpt2")
    with pytest.raises(ArtifactError, match=f"cannot convert {re.escape(str(peft_folder))} for a gpt2 model"):
        adapter_gguf(peft_folder, base, Paths(tmp_path / "home"))
    model.unlink()
    shipped = shutil.copy(FIXTURE / "adapter.gguf", peft_folder / "lora.gguf")
    assert adapter_gguf(peft_folder, base, Paths(tmp_path / "home")) == Path(shipped)


def test_a_content_length_that_is_no_number_is_a_clear_error(
    tmp_path: Path, serve: dict[str, tuple[bytes, dict[str, str]]]
) -> None:
    serve["/bad.gguf"] = ((FIXTURE / "adapter.gguf").read_bytes(), {"Content-Length": "12abc"})
    with pytest.raises(ArtifactError, match=r"bad\.gguf sent a malformed Content-Length '12abc'"):
        resolve_adapter(_url(serve, "/bad.gguf"), Paths(tmp_path))


def _zip_claiming(members: dict[str, tuple[bytes, int]]) -> bytes:
    """A stored zip whose central directory says each member unpacks to the size given (zip64)."""
    out, central = io.BytesIO(), io.BytesIO()
    for name, (data, claimed) in members.items():
        offset, raw, crc = out.tell(), name.encode(), zlib.crc32(data)
        out.write(
            struct.pack("<IHHHHHIIIHH", 0x04034B50, 45, 0, 0, 0, 0, crc, len(data), len(data), len(raw), 0)
        )
        out.write(raw + data)
        extra = struct.pack("<HHQ", 1, 8, claimed)
        sizes = (len(data), 0xFFFFFFFF, len(raw), len(extra), 0, 0, 0, 0, offset)
        central.write(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45, 0, 0, 0, 0, crc, *sizes))
        central.write(raw + extra)
    directory = central.getvalue()
    start = out.tell()
    out.write(directory)
    out.write(
        struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), len(directory), start, 0)
    )
    return out.getvalue()


def test_an_archive_unpacking_past_the_limit_is_refused_before_unpacking(
    tmp_path: Path, serve: dict[str, tuple[bytes, dict[str, str]]]
) -> None:
    """A small download claiming 1 TiB unpacked (a zip bomb) is refused from its members' sizes."""
    config = (FIXTURE / "adapter_config.json").read_bytes()
    members = {"adapter_config.json": (config, len(config)), "adapter_model.safetensors": (b"x", 1 << 40)}
    serve["/bomb.zip"] = (_zip_claiming(members), {})
    paths = Paths(tmp_path / "home")
    with pytest.raises(
        ArtifactError, match=r"bomb\.zip: the archive unpacks to 1024 GiB, more than the 64 GiB"
    ):
        resolve_adapter(_url(serve, "/bomb.zip"), paths)
    assert [p.name for p in (paths.models / "adapters").iterdir() if not p.name.endswith(".lock")] == []


def test_a_broken_archive_is_a_clear_error_naming_its_url(
    tmp_path: Path, serve: dict[str, tuple[bytes, dict[str, str]]]
) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tf:
        for name in PEFT_FILES:
            tf.add(FIXTURE / name, arcname=f"adapter/{name}")
    serve["/cut.tar.gz"] = (buffer.getvalue()[: len(buffer.getvalue()) // 2], {})
    with pytest.raises(
        ArtifactError, match=r"cannot read the LoRA adapter http://127\.0\.0\.1:\d+/cut\.tar\.gz"
    ):
        resolve_adapter(_url(serve, "/cut.tar.gz"), Paths(tmp_path / "home"))
