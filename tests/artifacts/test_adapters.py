"""LoRA adapter sources resolve to a PEFT folder or an adapter GGUF in the cache; a PEFT folder converts to
the GGUF llama.cpp loads."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFReader
from safetensors.numpy import save_file

from corral.artifacts import (
    ArtifactError,
    ArtifactTimeout,
    BaseLayout,
    adapter_gguf,
    adapter_rank,
    peft_to_gguf,
    resolve_adapter,
    resolve_model,
)
from corral.artifacts.adapters import _download
from corral.config import LocalSource, Paths, UrlSource, default_spec
from tests.artifacts.conftest import FIXTURE, PEFT_FILES


@pytest.fixture(scope="module")
def base_gguf() -> Path:
    """SmolLM2-135M-Instruct, the model the committed adapter was trained on (the suite's cached default)."""
    source = default_spec().models[0].source
    assert source is not None
    return resolve_model(source, Paths.from_env())


@dataclass
class FileServer:
    """A real HTTP server on 127.0.0.1 serving `folder`; `requests` holds the paths it was asked for."""

    url: str
    folder: Path
    requests: list[str]

    def serve(self, name: str, data: bytes) -> UrlSource:
        (self.folder / name).write_bytes(data)
        return UrlSource(url=f"{self.url}/{name}")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[FileServer]:
    folder, requests = tmp_path / "served", []
    folder.mkdir()

    class Handler(SimpleHTTPRequestHandler):
        def do_GET(self) -> None:
            requests.append(self.path)
            super().do_GET()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(folder)))
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield FileServer(f"http://127.0.0.1:{httpd.server_port}", folder, requests)
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def _zip(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buffer.getvalue()


def _peft_members(prefix: str = "") -> dict[str, bytes]:
    return {prefix + name: (FIXTURE / name).read_bytes() for name in PEFT_FILES}


def _gguf_contents(path: Path) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]]]:
    reader = GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    tensors = {t.name: (t.tensor_type, t.shape.tolist(), t.data.tobytes()) for t in reader.tensors}
    return fields, tensors


def _cache_entries(paths: Paths) -> list[str]:
    """What the adapter cache holds beside its lock files."""
    cache = paths.models / "adapters"
    return sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) if cache.is_dir() else []


def test_a_local_peft_folder_or_adapter_gguf_resolves_to_itself(tmp_path: Path) -> None:
    paths = Paths(tmp_path)
    assert resolve_adapter(LocalSource(path=FIXTURE), paths) == FIXTURE.resolve()
    gguf = FIXTURE / "adapter.gguf"
    assert resolve_adapter(LocalSource(path=gguf), paths) == gguf.resolve()


def test_a_local_path_that_is_no_adapter_is_refused(tmp_path: Path, base_gguf: Path) -> None:
    paths = Paths(tmp_path / "home")
    with pytest.raises(ArtifactError, match="does not exist"):
        resolve_adapter(LocalSource(path=tmp_path / "missing"), paths)
    with pytest.raises(ArtifactError, match=r"a PEFT adapter folder holds adapter_config\.json"):
        resolve_adapter(LocalSource(path=tmp_path), paths)
    (tmp_path / "notes.txt").write_text("not an adapter")
    with pytest.raises(ArtifactError, match=r"neither a PEFT folder nor an adapter GGUF$"):
        resolve_adapter(LocalSource(path=tmp_path / "notes.txt"), paths)
    with pytest.raises(ArtifactError, match=r"general\.type 'model'"):
        resolve_adapter(LocalSource(path=base_gguf), paths)


def test_rank_is_read_from_the_peft_config_or_the_gguf_tensors(tmp_path: Path) -> None:
    assert adapter_rank(FIXTURE) == 8
    assert adapter_rank(FIXTURE / "adapter.gguf") == 8
    folder = tmp_path / "patterned"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "rank_pattern": {"v_proj": 32}}))
    assert adapter_rank(folder) == 32


def test_llama_cpp_gets_the_gguf_itself_or_the_one_in_the_folder(tmp_path: Path, base_gguf: Path) -> None:
    paths = Paths(tmp_path)
    assert adapter_gguf(FIXTURE / "adapter.gguf", base_gguf, paths) == FIXTURE / "adapter.gguf"
    assert adapter_gguf(FIXTURE, base_gguf, paths) == FIXTURE / "adapter.gguf"
    assert not (tmp_path / "models").exists()  # nothing converted


@pytest.mark.slow  # the real converter
def test_a_peft_folder_converts_to_the_committed_adapter_gguf(
    tmp_path: Path, peft_folder: Path, base_gguf: Path
) -> None:
    paths, messages = Paths(tmp_path / "home"), list[str]()
    converted = adapter_gguf(peft_folder, base_gguf, paths, messages.append)
    assert converted.parent == paths.models / "adapters" / "converted"
    fields, tensors = _gguf_contents(converted)
    expected_fields, expected_tensors = _gguf_contents(FIXTURE / "adapter.gguf")
    assert fields == expected_fields
    assert fields["general.architecture"] == "llama" and fields["adapter.lora.alpha"] == 16.0
    assert tensors.keys() == expected_tensors.keys() and len(tensors) == 120  # 30 layers x (q, v) x (A, B)
    assert tensors == expected_tensors
    assert adapter_gguf(peft_folder, base_gguf, paths, messages.append) == converted  # made once
    assert sum("converting" in m for m in messages) == 1
    assert sorted(p.name for p in converted.parent.iterdir()) == [converted.name, converted.stem + ".lock"]


@pytest.mark.slow  # the real converter
def test_a_changed_adapter_is_converted_again(tmp_path: Path, peft_folder: Path, base_gguf: Path) -> None:
    paths = Paths(tmp_path / "home")
    first = adapter_gguf(peft_folder, base_gguf, paths)
    config = json.loads((peft_folder / "adapter_config.json").read_text())
    (peft_folder / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 32}))
    second = adapter_gguf(peft_folder, base_gguf, paths)
    assert second != first
    assert _gguf_contents(second)[0]["adapter.lora.alpha"] == 32.0


def test_a_peft_adapter_on_modules_the_converter_does_not_map_is_refused(
    tmp_path: Path, base_gguf: Path
) -> None:
    folder = tmp_path / "head-adapter"
    folder.mkdir()
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "lm_head"]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    pairs = {
        "base_model.model.model.layers.0.self_attn.q_proj": (576, 576),
        "base_model.model.lm_head": (576, 49152),
    }
    tensors = {}
    for module, (n_in, n_out) in pairs.items():
        tensors[f"{module}.lora_A.weight"] = np.zeros((4, n_in), dtype=np.float16)
        tensors[f"{module}.lora_B.weight"] = np.zeros((n_out, 4), dtype=np.float16)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    paths = Paths(tmp_path / "home")
    with pytest.raises(ArtifactError, match=r"not base_model\.model\.lm_head$"):
        adapter_gguf(folder, base_gguf, paths)
    assert not list((paths.models / "adapters" / "converted").glob("*.gguf*"))  # nothing half-written


def test_a_dora_adapter_or_an_unknown_architecture_is_refused(tmp_path: Path, peft_folder: Path) -> None:
    with pytest.raises(ArtifactError, match=r"convert_lora_to_gguf\.py"):
        peft_to_gguf(peft_folder, tmp_path / "out.gguf", BaseLayout("gpt2", 12, 12))
    config = json.loads((peft_folder / "adapter_config.json").read_text())
    (peft_folder / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ArtifactError, match="its use_dora are not supported"):
        peft_to_gguf(peft_folder, tmp_path / "out.gguf", BaseLayout("llama", 9, 3))


def test_an_adapter_gguf_at_a_url_is_downloaded_once_and_checked(tmp_path: Path, server: FileServer) -> None:
    data = (FIXTURE / "adapter.gguf").read_bytes()
    source = server.serve("adapter.gguf", data)
    source = UrlSource(url=source.url, sha256=hashlib.sha256(data).hexdigest())
    paths, messages = Paths(tmp_path / "home"), list[str]()
    path = resolve_adapter(source, paths, messages.append)
    assert path.parent == paths.models / "adapters" and path.name.startswith("adapter-")
    assert path.suffix == ".gguf" and path.read_bytes() == data
    assert resolve_adapter(source, paths, messages.append) == path
    assert server.requests == ["/adapter.gguf"] and sum("downloading" in m for m in messages) == 1
    assert adapter_rank(path) == 8 and _cache_entries(paths) == [path.name]


def test_an_adapter_url_with_a_password_is_refused_and_never_shown() -> None:
    """Python's HTTP client read `user:password@host` as a host and port: the download failed with the
    password in its message, on the terminal or in an apply's answer. Refused in the spec instead."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="may not hold a user or password"):
        UrlSource(url="https://me:s3cret@files.example.com/adapter.gguf")


def test_a_zipped_peft_folder_at_a_url_unpacks_to_its_folder(tmp_path: Path, server: FileServer) -> None:
    source = server.serve("marker.zip", _zip(_peft_members("corral-marker/")))
    paths = Paths(tmp_path / "home")
    folder = resolve_adapter(source, paths)
    assert folder.name == "corral-marker" and folder.parent.parent == paths.models / "adapters"
    for name in PEFT_FILES:
        assert (folder / name).read_bytes() == (FIXTURE / name).read_bytes()
    assert adapter_rank(folder) == 8
    assert resolve_adapter(source, paths) == folder and len(server.requests) == 1


def test_a_tarred_peft_folder_at_a_url_unpacks_to_a_folder(tmp_path: Path, server: FileServer) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tf:
        for name in PEFT_FILES:
            tf.add(FIXTURE / name, arcname=name)
    source = server.serve("marker.tar.gz", buffer.getvalue())
    folder = resolve_adapter(source, Paths(tmp_path / "home"))
    assert sorted(p.name for p in folder.iterdir()) == sorted(PEFT_FILES)


def test_a_model_gguf_at_a_url_is_not_taken_for_an_adapter(
    tmp_path: Path, server: FileServer, base_gguf: Path
) -> None:
    header = base_gguf.read_bytes()[: 1 << 20]  # the metadata (general.type model) is at the start
    paths = Paths(tmp_path / "home")
    with pytest.raises(ArtifactError, match="is a GGUF file but not a LoRA adapter's"):
        resolve_adapter(server.serve("model.gguf", header), paths)
    assert _cache_entries(paths) == []


def test_a_download_with_another_sha256_is_refused_and_not_kept(tmp_path: Path, server: FileServer) -> None:
    data = (FIXTURE / "adapter.gguf").read_bytes()
    wrong = "0" * 64
    source = UrlSource(url=server.serve("adapter.gguf", data).url, sha256=wrong)
    paths = Paths(tmp_path / "home")
    with pytest.raises(ArtifactError, match=f"SHA-256 {hashlib.sha256(data).hexdigest()}, not the {wrong}"):
        resolve_adapter(source, paths)
    assert _cache_entries(paths) == []


def test_an_archive_member_escaping_its_folder_is_refused(tmp_path: Path, server: FileServer) -> None:
    source = server.serve("evil.zip", _zip({**_peft_members(), "../escaped.txt": b"outside"}))
    paths = Paths(tmp_path / "home")
    with pytest.raises(ArtifactError, match=r"'\.\./escaped\.txt' would land outside its folder"):
        resolve_adapter(source, paths)
    assert _cache_entries(paths) == []
    assert not list(tmp_path.rglob("escaped.txt"))


def test_an_archive_holding_a_link_is_refused(tmp_path: Path, server: FileServer) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tf:
        link = tarfile.TarInfo("adapter_model.safetensors")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tf.addfile(link)
    source = server.serve("linked.tgz", buffer.getvalue())
    paths = Paths(tmp_path / "home")
    with pytest.raises(ArtifactError, match="is a link or special file"):
        resolve_adapter(source, paths)
    assert _cache_entries(paths) == []


def test_an_archive_without_an_adapter_or_a_missing_url_is_a_clear_error(
    tmp_path: Path, server: FileServer
) -> None:
    paths = Paths(tmp_path / "home")
    source = server.serve("empty.zip", _zip({"README.md": b"no adapter here"}))
    with pytest.raises(ArtifactError, match="holds no PEFT adapter"):
        resolve_adapter(source, paths)
    with pytest.raises(ArtifactError, match=r"cannot download the LoRA adapter .*404"):
        resolve_adapter(UrlSource(url=f"{server.url}/missing.gguf"), paths)
    assert _cache_entries(paths) == []


def test_concurrent_starts_download_a_url_once(tmp_path: Path, server: FileServer) -> None:
    source = server.serve("marker.zip", _zip(_peft_members()))
    paths, results = Paths(tmp_path / "home"), list[Path]()
    threads = [threading.Thread(target=lambda: results.append(resolve_adapter(source, paths))) for _ in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(results) == 2 and results[0] == results[1]
    assert server.requests == ["/marker.zip"]


@pytest.fixture
def trickling_url() -> Iterator[str]:
    """A URL on 127.0.0.1 whose server promises a MiB and sends it a byte every 10 ms (each read gets
    something: no read timeout ends it), stopping after 20 s."""
    stop = threading.Event()

    class Trickle(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(1 << 20))
            self.end_headers()
            for _ in range(2000):
                if stop.wait(0.01):
                    return
                try:
                    self.wfile.write(b"x")
                    self.wfile.flush()
                except OSError:  # (the client gave up)
                    return

        def log_message(self, format: str, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,))
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_port}/adapter.gguf"
    stop.set()
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def test_a_download_trickling_past_its_limit_is_stopped(tmp_path: Path, trickling_url: str) -> None:
    started = time.monotonic()
    with pytest.raises(ArtifactTimeout, match=r"adapter\.gguf did not finish within 1 s, its limit"):
        _download(UrlSource(url=trickling_url), tmp_path / "adapter.download", limit_s=1.0)
    assert time.monotonic() - started < 10  # (the server would trickle on for 20 s)
