"""vLLM cannot load llama.cpp's GGUF files as they are: convert one, once, into a cached Hugging Face folder.

The conversion runs in vLLM's environment (`gguf_to_hf.py`, about 40 s for SmolLM2-135M on this CPU):
transformers dequantizes the GGUF weights, and the tokenizer and chat template come from the GGUF too. A
conversion that runs past `_CONVERT_LIMIT_S` (an hour: a 70B model's weights dequantized are some 140 GB
to write) is stopped (`tools.run_tool`) and its lock freed.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from corral.artifacts.errors import ArtifactError
from corral.artifacts.locks import build_once
from corral.artifacts.models import Progress
from corral.artifacts.tools import run_tool
from corral.config import Paths

__all__ = ["hf_folder_from_gguf"]

_SCRIPT = Path(__file__).with_name("gguf_to_hf.py")
_CONVERT_LIMIT_S = 3600.0


def hf_folder_from_gguf(
    gguf: Path, python: Path, paths: Paths, dtype: str = "float32", progress: Progress = lambda _: None
) -> Path:
    """The converted folder for `gguf` (made once, with vLLM's interpreter `python`): named for the file's
    content (its size and samples of its bytes: `_content_key`), so a new revision or version of a file
    with the same name (a re-quantised GGUF, a package bumped, a file replaced in place) is converted
    again, not served as the old one's weights, while a copy or a `touch` is not."""
    target = paths.models / "hf-from-gguf" / f"{gguf.stem}-{dtype}-{_content_key(gguf)}"

    def convert() -> str:
        partial = target.with_name(target.name + ".part")
        shutil.rmtree(partial, ignore_errors=True)
        progress(f"converting {gguf.name} for vLLM (about a minute)")
        command = [str(python), str(_SCRIPT), str(gguf), str(partial), dtype]
        done = run_tool(command, f"convert {gguf.name} for vLLM", _CONVERT_LIMIT_S)
        if done.returncode != 0:
            raise ArtifactError(f"converting {gguf.name} failed: {done.output.strip()[-800:]}")
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
        return gguf.name

    build_once(target / ".complete", target.parent / f".{target.name}.lock", convert)
    return target


def _content_key(gguf: Path, edge: int = 8 << 20, stripes: int = 64, stripe: int = 64 << 10) -> str:
    """A short digest of a GGUF's size, its first and last `edge` bytes (the header, which a large
    vocabulary may fill, and the last tensors) and `stripes` samples spread through the rest (the middle
    layers: a merged adapter changes them): about 20 MiB read, where the whole file of gigabytes would cost
    seconds at every prepare."""
    size = gguf.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with gguf.open("rb") as file:
        digest.update(file.read(edge))
        for at in [edge + k * max(0, size - 2 * edge) // stripes for k in range(stripes)] + [size - edge]:
            if at >= edge:
                file.seek(at)
                digest.update(file.read(stripe if at < size - edge else edge))
    return digest.hexdigest()[:12]
