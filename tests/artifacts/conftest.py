"""The committed LoRA adapter (tests/data/lora/corral-marker) as the artifact tests copy it, and waits on
the processes a tool started."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

FIXTURE = Path(__file__).parents[1] / "data" / "lora" / "corral-marker"
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture
def peft_folder(tmp_path: Path) -> Path:
    """The committed adapter's PEFT files, without the GGUF made from them."""
    folder = tmp_path / "corral-marker"
    folder.mkdir()
    for name in PEFT_FILES:
        shutil.copy(FIXTURE / name, folder / name)
    return folder


def _gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie waiting for init to reap it has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def wait_gone(pids: list[int], within: float = 10.0) -> list[int]:
    """The pids still running after `within` seconds of polling (none, when they all died)."""
    deadline = time.monotonic() + within
    while (alive := [pid for pid in pids if not _gone(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def read_pids(path: Path, within: float = 10.0) -> list[int]:
    """The process ids a test's tool wrote to `path` (whole lines, once it is there)."""
    deadline = time.monotonic() + within
    while not (path.is_file() and path.read_text().endswith("\n")) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [int(word) for word in path.read_text().split()]
