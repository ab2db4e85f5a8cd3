"""LoRA adapters: resolve an adapter source to a PEFT folder or an adapter GGUF in corral's cache, and make
llama.cpp's LoRA GGUF from a PEFT folder.

Sources: a local path; a Hugging Face repository (or one file of it); a URL, downloaded once into
`models/adapters/` (a GGUF kept as a file, a .zip or .tar.gz unpacked into a folder), written to a
temporary name and renamed under a file lock so concurrent starts neither corrupt nor duplicate it.

The conversion (the PEFT folder vLLM reads → the GGUF llama.cpp's `--lora` reads) names each pair after its
base tensor (blk.N.attn_q.weight.lora_a / .lora_b, A as rank x in, B as out x rank), writes the scale as
adapter.lora.alpha (llama.cpp divides by the rank), and puts B's q and k rows in the order llama.cpp's own
converter permutes the base's into: that order depends on the base's architecture and head counts, read
from the base GGUF.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import math
import os
import re
import shutil
import stat
import tarfile
import time
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, TypeGuard

from corral.artifacts.errors import ArtifactError, ArtifactTimeout
from corral.artifacts.gguf_meta import GGUFError, gguf_fields, gguf_string, gguf_tensor_dims
from corral.artifacts.locks import file_lock
from corral.artifacts.models import Progress, resolve_model
from corral.config import AdapterSource, HuggingFaceSource, LocalSource, Paths, UrlSource

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = ["BaseLayout", "adapter_gguf", "adapter_rank", "peft_to_gguf", "resolve_adapter"]

_CONFIG, _WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_MAX_DOWNLOAD_BYTES = 16 << 30  # an adapter (even of a 400B model at high rank) is far smaller
# what a downloaded archive may unpack to (its members' sizes, summed before unpacking: a zip bomb's are
# refused), and never more than the disk has free
_MAX_UNPACKED_BYTES = 4 * _MAX_DOWNLOAD_BYTES
_DOWNLOAD_TIMEOUT_S = 60.0  # for the connection and each read, not the whole download
# the whole download (a server trickling bytes never trips the read timeout): 1 GB takes 2 min at 10 MB/s
_DOWNLOAD_LIMIT_S = 3600.0
# PEFT module name → llama.cpp's tensor name (the same in every architecture below)
_PROJECTIONS = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}
# architectures the converter knows: whether llama.cpp's converter permutes their q and k rows (LlamaModel
# does, Qwen2Model does not)
_PERMUTES_QK = {"llama": True, "qwen2": False}
_HEAD_COUNTS = (".attention.head_count", ".attention.head_count_kv")  # the base's keys the converter reads
_MODULE = re.compile(r"\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)$")


def resolve_adapter(source: AdapterSource, paths: Paths, progress: Progress = lambda _: None) -> Path:
    """The local path of the adapter `source` names, fetching it into the cache once: a PEFT folder (it
    holds adapter_config.json) or an adapter GGUF file."""
    if isinstance(source, LocalSource):
        shown = str(source.path)
    else:
        shown = source.hf if isinstance(source, HuggingFaceSource) else shown_url(source.url)
    with _reading(f"the LoRA adapter {shown}"):
        if isinstance(source, LocalSource):
            return _adapter_at(Path(source.path).expanduser().resolve())
        if isinstance(source, HuggingFaceSource):
            return _adapter_at(resolve_model(source, paths, progress))
        return _from_url(source, paths, progress)


def adapter_rank(path: Path) -> int | None:
    """The adapter's LoRA rank (the largest, where PEFT's rank_pattern gives some modules another); None
    when the adapter does not say."""
    with _reading(f"the LoRA adapter {path}"):
        if path.is_dir():
            return _config_rank(path) if (path / _CONFIG).is_file() else None
        try:
            dims = gguf_tensor_dims(path, ".lora_a")  # ggml order: (in, rank)
        except GGUFError as exc:
            raise ArtifactError(f"cannot read the LoRA adapter {path}: {exc}") from exc
        if dims is None:
            return None
        if len(dims) != 2 or dims[1] < 1:
            raise ArtifactError(f"{path}: a LoRA A tensor of shape {list(dims)} gives no rank")
        return dims[1]


def adapter_gguf(path: Path, base_gguf: Path, paths: Paths, progress: Progress = lambda _: None) -> Path:
    """What llama.cpp's `--lora` loads for the adapter at `path` on the model `base_gguf`: the GGUF itself,
    the one adapter GGUF in the folder (general.type "adapter": a model's GGUF put beside the PEFT files is
    not taken), else the PEFT folder converted (once) into the cache."""
    with _reading(f"the LoRA adapter {path}"):
        return _adapter_gguf(path, base_gguf, paths, progress)


def _adapter_gguf(path: Path, base_gguf: Path, paths: Paths, progress: Progress) -> Path:
    if path.is_file():
        return path
    shipped = [p for p in sorted(path.glob("*.gguf")) if gguf_string(p, "general.type") == "adapter"]
    if len(shipped) == 1:
        return shipped[0]
    target = paths.models / "adapters" / "converted" / f"{path.name}-{_conversion_key(path, base_gguf)}.gguf"
    if target.is_file():
        return target
    with file_lock(target.with_suffix(".lock")):
        if target.is_file():  # another process converted it while this one waited
            return target
        progress(f"converting the LoRA adapter {path.name} to GGUF for llama.cpp")
        partial = target.with_name(target.name + ".part")
        try:
            peft_to_gguf(path, partial, BaseLayout.read(base_gguf))
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    return target


@dataclass(frozen=True)
class BaseLayout:
    """What converting an adapter needs to know of its base model."""

    architecture: str
    heads: int
    kv_heads: int

    @classmethod
    def read(cls, base_gguf: Path) -> BaseLayout:
        """The layout from a model GGUF's metadata (general.architecture, <arch>.attention.head_count*),
        read by corral's bounded header walk (`gguf`'s reader believes whatever counts a file claims)."""
        with _reading(f"the base model {base_gguf}"):
            try:
                fields = gguf_fields(base_gguf, _layout_key)
            except (OSError, GGUFError) as exc:
                raise ArtifactError(f"cannot read the base model {base_gguf}: {exc}") from exc
            architecture = fields.get("general.architecture")
            heads = fields.get(f"{architecture}.attention.head_count")  # (None: an array, per layer)
            if not isinstance(architecture, str) or not _is_count(heads):
                raise ArtifactError(f"{base_gguf} does not say its architecture and attention head count")
            kv_heads = fields.get(f"{architecture}.attention.head_count_kv", heads)
            if kv_heads is not None and not _is_count(kv_heads):
                raise ArtifactError(f"{base_gguf} has {kv_heads!r} key-value heads")
            return cls(architecture, heads, kv_heads if isinstance(kv_heads, int) else heads)


def _layout_key(key: str) -> bool:
    return key == "general.architecture" or key.endswith(_HEAD_COUNTS)


def _is_count(value: object) -> TypeGuard[int]:
    """A whole number above 0 (JSON's and GGUF's true are ints to Python, and not counts)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@contextmanager
def _reading(what: str) -> Iterator[None]:
    """Any error reading `what`'s files (a malformed config, a broken archive) as an ArtifactError that
    names it, not a Python error naming nothing."""
    try:
        yield
    except ArtifactError:
        raise
    except Exception as exc:
        raise ArtifactError(f"cannot read {what}: {type(exc).__name__}: {exc}") from exc


def peft_to_gguf(folder: Path, out: Path, base: BaseLayout) -> None:
    """Write the PEFT LoRA adapter in `folder` as llama.cpp's LoRA GGUF `out`, for a model of `base`'s
    layout; refuses (ArtifactError) what llama.cpp could not apply as PEFT does."""
    import gguf
    import numpy as np

    if base.architecture not in _PERMUTES_QK:
        raise ArtifactError(
            f"cannot convert {folder} for a {base.architecture} model (this converter knows "
            f"{', '.join(_PERMUTES_QK)}): convert it with llama.cpp's convert_lora_to_gguf.py and put the "
            ".gguf in the adapter's folder"
        )
    alpha = _lora_alpha(folder, _read_config(folder))
    writer = gguf.GGUFWriter(str(out), base.architecture)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for name, projection, a, b in _lora_pairs(folder):
        if projection in ("q_proj", "k_proj") and _PERMUTES_QK[base.architecture]:
            b = _permute(b, base.heads if projection == "q_proj" else base.kv_heads, folder)
        writer.add_tensor(f"{name}.lora_a", np.ascontiguousarray(a))
        writer.add_tensor(f"{name}.lora_b", np.ascontiguousarray(b))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _adapter_at(path: Path) -> Path:
    """`path` when it is a PEFT adapter folder or an adapter GGUF file, else a clear error."""
    if path.is_dir():
        if (path / _CONFIG).is_file():
            return path
        raise ArtifactError(f"{path} is not a LoRA adapter: a PEFT adapter folder holds {_CONFIG}")
    if not path.is_file():
        raise ArtifactError(f"LoRA adapter {path} does not exist")
    kind = gguf_string(path, "general.type")  # llama.cpp loads only GGUFs that say "adapter"
    if kind != "adapter":
        what = "" if kind is None else f" (a GGUF file of general.type {kind!r})"
        raise ArtifactError(f"{path} is not a LoRA adapter: neither a PEFT folder nor an adapter GGUF{what}")
    return path


def _from_url(source: UrlSource, paths: Paths, progress: Progress) -> Path:
    """The downloaded GGUF file, or the folder its archive unpacked to (made once, under a lock)."""
    cache = paths.models / "adapters"
    key = _url_key(source)
    if (found := _cached(cache, key)) is not None:
        return found
    with file_lock(cache / f".{key}.lock"):
        if (found := _cached(cache, key)) is not None:  # another process fetched it while this one waited
            return found
        download = cache / f".{key}.download"
        try:
            progress(f"downloading the LoRA adapter {shown_url(source.url)}")
            _download(source, download)
            if _is_gguf(download):
                if gguf_string(download, "general.type") != "adapter":
                    raise ArtifactError(f"{shown_url(source.url)} is a GGUF file but not a LoRA adapter's")
                download.replace(cache / f"{key}.gguf")
                return cache / f"{key}.gguf"
            return _unpack_adapter(download, cache / key, shown_url(source.url))
        finally:
            download.unlink(missing_ok=True)


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as file:
        return file.read(4) == b"GGUF"


def _url_key(source: UrlSource) -> str:
    """A cache name: the URL's file name and a digest of the URL and the expected SHA-256 (a new digest
    for the same URL is a new download)."""
    name = PurePosixPath(urllib.parse.urlsplit(source.url).path).name
    stem = re.sub(r"(\.gguf|\.zip|\.tar\.gz|\.tgz)$", "", name)
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip(".-")[:64] or "adapter"
    digest = hashlib.sha256(f"{source.url}\0{source.sha256 or ''}".encode()).hexdigest()[:12]
    return f"{stem}-{digest}"


def _cached(cache: Path, key: str) -> Path | None:
    if (cache / f"{key}.gguf").is_file():
        return cache / f"{key}.gguf"
    if (cache / key).is_dir():
        return _peft_folder(cache / key)
    return None


def shown_url(url: str) -> str:
    """The URL as messages and logs show it: without user, password or query (a presigned URL's
    signature is a secret)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _download(source: UrlSource, out: Path, limit_s: float = _DOWNLOAD_LIMIT_S) -> None:
    """Stream the URL into `out` (at most `_MAX_DOWNLOAD_BYTES`, in `limit_s` seconds and one read's
    timeout at most), checking its length and (when given) its SHA-256."""
    digest, size = hashlib.sha256(), 0
    deadline = time.monotonic() + limit_s
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with (
            urllib.request.urlopen(source.url, timeout=_DOWNLOAD_TIMEOUT_S) as response,
            out.open("wb") as file,
        ):
            expected = response.headers.get("Content-Length")
            while chunk := response.read1(1 << 20):  # (what has come: read() waits for the whole MiB)
                digest.update(chunk)
                size += file.write(chunk)
                if size > _MAX_DOWNLOAD_BYTES:
                    raise ArtifactError(
                        f"{shown_url(source.url)} is larger than {_MAX_DOWNLOAD_BYTES >> 30} GiB: "
                        "not an adapter"
                    )
                if time.monotonic() > deadline:
                    raise ArtifactTimeout(
                        f"the download of {shown_url(source.url)} did not finish within {limit_s:g} s, "
                        f"its limit ({size >> 20} MiB came): is the server that slow? Download the adapter "
                        "yourself and name its local path"
                    )
    except (OSError, http.client.HTTPException) as exc:  # (URLError, HTTPError, timeouts; a cut chunk)
        why = exc if isinstance(exc, OSError) else type(exc).__name__  # (http.client's may hold the URL)
        raise ArtifactError(f"cannot download the LoRA adapter {shown_url(source.url)}: {why}") from exc
    if expected is not None and not expected.strip().isdecimal():
        raise ArtifactError(f"{shown_url(source.url)} sent a malformed Content-Length {expected[:40]!r}")
    if expected is not None and int(expected) != size:
        raise ArtifactError(f"the download of {shown_url(source.url)} broke off ({size} of {expected} bytes)")
    if source.sha256 is not None and digest.hexdigest() != source.sha256:
        raise ArtifactError(
            f"{shown_url(source.url)} has SHA-256 {digest.hexdigest()}, "
            f"not the {source.sha256} its source names"
        )


def _unpack_adapter(archive: Path, target: Path, url: str) -> Path:
    """Unpack the .zip or .tar(.gz) into `target`; the PEFT folder in it."""
    partial = target.with_name(target.name + ".part")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        if zipfile.is_zipfile(archive):
            _unzip(archive, partial, url)
        elif tarfile.is_tarfile(archive):
            _untar(archive, partial, url)
        else:
            raise ArtifactError(f"{url} is neither a GGUF file nor a .zip or .tar.gz archive")
        inner = _peft_folder(partial).relative_to(partial)
        partial.replace(target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target / inner


def _unzip(archive: Path, into: Path, url: str) -> None:
    with zipfile.ZipFile(archive) as zf:
        members = zf.infolist()
        for info in members:
            _check_member(info.filename, stat.S_ISLNK(info.external_attr >> 16), url)
        _check_unpacked_size(sum(info.file_size for info in members), into, url)
        zf.extractall(into)  # (each member stops at its stated size: a longer one fails its CRC)


def _untar(archive: Path, into: Path, url: str) -> None:
    with tarfile.open(archive) as tf:
        members = tf.getmembers()
        for member in members:
            _check_member(member.name, not (member.isfile() or member.isdir()), url)
        _check_unpacked_size(sum(member.size for member in members), into, url)
        tf.extractall(into, members, filter="data")


def _check_unpacked_size(total: int, into: Path, url: str) -> None:
    """Refuse an archive whose members sum to more than an adapter may take, or than the disk has free."""
    if total > _MAX_UNPACKED_BYTES:
        raise ArtifactError(
            f"{url}: the archive unpacks to {total >> 30} GiB, more than the {_MAX_UNPACKED_BYTES >> 30} GiB "
            "an adapter may"
        )
    free = shutil.disk_usage(into.parent).free
    if total > free:
        raise ArtifactError(
            f"{url}: the archive unpacks to {total >> 20} MiB, more than the {free >> 20} MiB free on "
            f"{into.parent}"
        )


def _check_member(name: str, special: bool, url: str) -> None:
    """Refuse a member that would land outside the folder, or a link (or device) that could point out."""
    parts = PurePosixPath(name.replace("\\", "/"))
    if parts.is_absolute() or ".." in parts.parts:
        raise ArtifactError(f"{url}: the archive's member {name!r} would land outside its folder")
    if special:
        raise ArtifactError(f"{url}: the archive's member {name!r} is a link or special file, not a file")


def _peft_folder(folder: Path) -> Path:
    """`folder` when it holds adapter_config.json, else its single top-level folder that does."""
    if (folder / _CONFIG).is_file():
        return folder
    entries = [p for p in folder.iterdir() if not p.name.startswith((".", "__MACOSX"))]
    if len(entries) == 1 and (entries[0] / _CONFIG).is_file():
        return entries[0]
    raise ArtifactError(f"the archive unpacked to {folder} holds no PEFT adapter ({_CONFIG})")


def _read_config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / _CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"cannot read {folder / _CONFIG}: {exc}") from exc
    if not isinstance(config, dict):
        raise ArtifactError(f"{folder / _CONFIG} is not a JSON object")
    return config


def _config_rank(folder: Path) -> int | None:
    """The largest rank adapter_config.json gives (r, and rank_pattern's per module); None without r."""
    config = _read_config(folder)
    pattern = config.get("rank_pattern") or {}
    if not isinstance(pattern, dict):
        raise ArtifactError(f"{folder / _CONFIG}: rank_pattern is not a mapping of module names to ranks")
    given = [("r", config.get("r")), *((f"rank_pattern[{name!r}]", r) for name, r in pattern.items())]
    ranks: list[int] = []
    for name, rank in given:
        if rank is None and name == "r":
            continue
        if not _is_count(rank):
            raise ArtifactError(f"{folder / _CONFIG}: {name} is {rank!r}, not a rank (a whole number over 0)")
        ranks.append(rank)
    return max(ranks) if ranks else None


def _lora_alpha(folder: Path, config: dict[str, Any]) -> float:
    """The alpha llama.cpp scales by (alpha / rank), after refusing what that one scale cannot express."""
    refused = {
        "peft_type": config.get("peft_type", "LORA") != "LORA",
        "use_dora": bool(config.get("use_dora")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
    }
    if any(refused.values()):
        settings = ", ".join(key for key, bad in refused.items() if bad)
        raise ArtifactError(f"cannot convert {folder} for llama.cpp: its {settings} are not supported")
    alpha, rank = config.get("lora_alpha"), config.get("r")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not _is_count(rank):
        raise ArtifactError(f"{folder / _CONFIG} lacks lora_alpha or r")
    # rsLoRA scales by alpha / sqrt(r): the alpha that gives that scale over llama.cpp's rank
    return float(alpha) * math.sqrt(rank) if config.get("use_rslora") else float(alpha)


def _lora_pairs(folder: Path) -> list[tuple[str, str, npt.NDArray[Any], npt.NDArray[Any]]]:
    """(llama.cpp's base tensor name, PEFT module, A, B) for every pair, in the order of their names."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        tensors = load_file(str(folder / _WEIGHTS))
    except (OSError, TypeError, SafetensorError) as exc:  # TypeError: bfloat16, which numpy lacks
        raise ArtifactError(f"cannot read {folder / _WEIGHTS} (float32 or float16 weights): {exc}") from exc
    pairs, unmapped = [], set()
    for key in sorted(tensors):
        if key.endswith(".lora_B.weight") and key.replace(".lora_B.", ".lora_A.") in tensors:
            continue  # taken with its A
        module = key.removesuffix(".lora_A.weight")
        match = _MODULE.search(module)
        b = tensors.get(f"{module}.lora_B.weight")
        if module == key or b is None or match is None or match[2] not in _PROJECTIONS:
            unmapped.add(re.sub(r"\.\d+\.", ".N.", module))  # one name for all the layers
            continue
        name = f"blk.{match[1]}.{_PROJECTIONS[match[2]]}.weight"
        pairs.append((name, match[2], tensors[key], b))
    if unmapped or not pairs:
        names = ", ".join(sorted(unmapped)) or "(it has no LoRA pairs)"
        raise ArtifactError(
            f"cannot convert {folder} for llama.cpp: the converter maps LoRA on "
            f"{', '.join(_PROJECTIONS)} in the decoder layers, not {names}"
        )
    return pairs


def _permute(rows: npt.NDArray[Any], heads: int, folder: Path) -> npt.NDArray[Any]:
    """Rows in the order llama.cpp's converter puts q and k rows (rotary halves interleaved per head)."""
    if rows.shape[0] % (2 * heads):
        raise ArtifactError(f"{folder}: {rows.shape[0]} q/k rows do not split into {heads} heads of the base")
    return (
        rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def _conversion_key(folder: Path, base_gguf: Path) -> str:
    """A digest of what the conversion reads: the adapter's files, and which base file (its layout)."""
    digest = hashlib.sha256()
    for name in (_CONFIG, _WEIGHTS):
        digest.update(name.encode() + b"\0")
        try:
            with (folder / name).open("rb") as file:
                while chunk := file.read(1 << 20):
                    digest.update(chunk)
        except FileNotFoundError as exc:
            raise ArtifactError(f"{folder} has no {name} to convert for llama.cpp") from exc
    base = base_gguf.resolve()
    digest.update(f"\0{base}\0{base.stat().st_size}".encode())
    return digest.hexdigest()[:16]
