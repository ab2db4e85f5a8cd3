"""The llama-server build: tuned to this CPU, without instructions this machine cannot run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from corral.artifacts import ArtifactTimeout, llama_server
from corral.artifacts.llamacpp import _run_build, amx_runs
from corral.config import Paths
from tests.artifacts.conftest import read_pids, wait_gone


@pytest.mark.slow
def test_the_built_server_uses_amx_only_where_amx_runs(tmp_path: Path) -> None:
    binary = llama_server(Paths.from_env())  # the cached build (`make test` prepares it)
    disassembly = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(binary)], capture_output=True, text=True, check=True
    ).stdout
    uses_amx = any(op in disassembly for op in ("tilezero", "ldtilecfg", "tdpbssd", "tdpbf16ps"))
    assert uses_amx == amx_runs(tmp_path)  # where AMX faults, a tile instruction is a SIGILL at first use


def test_a_build_step_past_its_limit_is_stopped_with_make_and_what_it_ran(tmp_path: Path) -> None:
    """The build's real cmake and make, with a compile step that hangs: cmake, make and the hung command
    are stopped at the limit, and the error names the step, its limit and the log."""
    source, pids = tmp_path / "llama.cpp", tmp_path / "pids"
    source.mkdir()
    (source / "hang.sh").write_text(f'echo "$$ $PPID" > {pids}.tmp; mv {pids}.tmp {pids}; exec sleep 300\n')
    (source / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.10)\nproject(hangs NONE)\n"
        "add_custom_target(llama-server COMMAND sh ${CMAKE_SOURCE_DIR}/hang.sh)\n"
    )
    log, told = tmp_path / "build.log", []
    with pytest.raises(ArtifactTimeout) as stopped:
        _run_build(source, [], log, told.append, limits_s=(120.0, 2.0))
    hung, its_parent = read_pids(pids)
    assert wait_gone([hung, its_parent]) == []
    message = str(stopped.value)
    assert message.startswith("could not compile llama-server (cmake --build): it did not finish within 2 s")
    assert f"its output is in {log}" in message
    assert told == ["configuring llama.cpp", "compiling llama-server (about 6 min on 2 cores)"]
    assert b"Configuring done" in log.read_bytes()  # (the configure step's output, in the log)
