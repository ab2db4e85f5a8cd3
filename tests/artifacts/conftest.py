"""The committed LoRA adapter (tests/data/lora/corral-marker) as the artifact tests copy it."""

from __future__ import annotations

import shutil
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
