"""The llama-server build: tuned to this CPU, without instructions this machine cannot run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from corral.artifacts import llama_server
from corral.artifacts.llamacpp import amx_runs
from corral.config import Paths


@pytest.mark.slow
def test_the_built_server_uses_amx_only_where_amx_runs(tmp_path: Path) -> None:
    binary = llama_server(Paths.from_env())  # the cached build (`make test` prepares it)
    disassembly = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(binary)], capture_output=True, text=True, check=True
    ).stdout
    uses_amx = any(op in disassembly for op in ("tilezero", "ldtilecfg", "tdpbssd", "tdpbf16ps"))
    assert uses_amx == amx_runs(tmp_path)  # where AMX faults, a tile instruction is a SIGILL at first use
