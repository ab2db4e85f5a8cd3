"""vLLM cannot load llama.cpp's GGUF files as they are: convert one, once, into a cached Hugging Face folder.

The conversion runs in vLLM's environment (`gguf_to_hf.py`, about 40 s for SmolLM2-135M on this CPU):
transformers dequantizes the GGUF weights, and the tokenizer and chat template come from the GGUF too.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

from corral.artifacts.locks import build_once
from corral.artifacts.models import ArtifactError, Progress
from corral.config import Paths

__all__ = ["hf_folder_from_gguf"]

_SCRIPT = Path(__file__).with_name("gguf_to_hf.py")


def hf_folder_from_gguf(
    gguf: Path, python: Path, paths: Paths, dtype: str = "float32", progress: Progress = lambda _: None
) -> Path:
    """The converted folder for `gguf` (made once, with vLLM's interpreter `python`): named for the file
    as it is (its path, size and modification time), so a new revision or version of a file with the same
    name (a re-quantised GGUF, a package bumped, a file replaced in place) is converted again, not served
    as the old one's weights."""
    found = gguf.resolve().stat()
    seen = f"{gguf.resolve()}\0{found.st_size}\0{found.st_mtime_ns}".encode()
    target = paths.models / "hf-from-gguf" / f"{gguf.stem}-{dtype}-{hashlib.sha256(seen).hexdigest()[:12]}"

    def convert() -> str:
        partial = target.with_name(target.name + ".part")
        shutil.rmtree(partial, ignore_errors=True)
        progress(f"converting {gguf.name} for vLLM (about a minute)")
        done = subprocess.run(
            [str(python), str(_SCRIPT), str(gguf), str(partial), dtype],
            capture_output=True,
            text=True,
            check=False,
            timeout=1800,
        )
        if done.returncode != 0:
            raise ArtifactError(
                f"converting {gguf.name} failed: {(done.stderr or done.stdout).strip()[-800:]}"
            )
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
        return gguf.name

    build_once(target / ".complete", target.parent / f".{target.name}.lock", convert)
    return target
