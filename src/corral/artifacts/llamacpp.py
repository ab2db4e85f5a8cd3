"""The llama.cpp server binary: use one on PATH or build it once into corral's cache.

The build takes llama.cpp's sources from the `llama-cpp-python` sdist on PyPI (which vendors them), and
compiles only the `llama-server` target as a static binary tuned to this CPU, without the web UI (whose
build would download it). On 2 cores this takes about 5 minutes, once per CPU kind. Each step has a time
limit, with a wide margin for slow machines (the compile: an hour): a step that hangs is stopped with every
process it started (`tools.run_tool`), and the build's lock is freed.

A CPU may advertise AMX (Sapphire Rapids and later) in a virtual machine that does not enable it: measured
on such a host, ggml's AMX kernels die with SIGILL at the first matrix product (`tilezero`). So when the CPU
lists `amx_tile`, a five-line probe is compiled and run first, and the build leaves AMX out unless the
probe's tile instructions execute.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import re
import shutil
import tarfile
import tempfile
from pathlib import Path

from corral.artifacts.errors import ArtifactError
from corral.artifacts.locks import file_lock
from corral.artifacts.models import Progress, pip_download
from corral.artifacts.tools import run_tool, tool_error
from corral.config import Paths

__all__ = ["LLAMA_CPP_SDIST", "build_llama_server", "find_llama_server", "llama_server"]

LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"
_CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_CURL=OFF",
]
_PROGRESS_LINE = re.compile(rb"^\[\s*(\d+)%\]")
_RECIPE = "2"  # bumped when the build's flags change, so older cached builds are not reused
# seconds each step may take: the sdist download (about 60 MB), the AMX probe's compile and run, cmake's
# configure (under a minute), and the compile (about 5 min on 2 cores; an hour leaves room for a slow core)
_DOWNLOAD_LIMIT_S, _PROBE_LIMIT_S, _CONFIGURE_LIMIT_S, _COMPILE_LIMIT_S = 900.0, 120.0, 600.0, 3600.0
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # explicit, so -march=native does not add them back
_AMX_PROBE = r"""
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    unsigned char config[64];
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) return 2;
    memset(config, 0, sizeof config);
    config[0] = 1;   /* palette 1 */
    config[16] = 64; /* tile 0: 64 bytes a row */
    config[48] = 16; /* tile 0: 16 rows */
    _tile_loadconfig(config);
    _tile_zero(0);
    _tile_release();
    return 0;
}
"""


def _cached_binary(paths: Paths) -> Path:
    """The build is tuned to this CPU (-march=native), so the cache is keyed by the CPU's features."""
    version = LLAMA_CPP_SDIST.split("==")[1]
    return paths.engines / f"llama.cpp-{version}-{_cpu_tag()}" / "llama-server"


def _cpu_flags() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    return ""


def _cpu_tag() -> str:
    digest = hashlib.sha256(f"{_cpu_flags()}|{_RECIPE}".encode()).hexdigest()[:10]
    return f"{platform.machine()}-{digest}"


def amx_runs(workdir: Path) -> bool:
    """Whether AMX tile instructions execute here (the CPU lists them and the OS enabled them)."""
    if "amx_tile" not in _cpu_flags().split():
        return False
    source, probe = workdir / "amx_probe.c", workdir / "amx_probe"
    source.write_text(_AMX_PROBE)
    compile_probe = ["cc", "-O1", "-mamx-tile", str(source), "-o", str(probe)]
    try:
        built = run_tool(compile_probe, "compile the AMX probe", _PROBE_LIMIT_S)
        return (
            built.returncode == 0
            and run_tool([str(probe)], "run the AMX probe", _PROBE_LIMIT_S).returncode == 0
        )
    except ArtifactError:  # (no compiler, or a probe that hangs: build without AMX, which runs everywhere)
        return False


def find_llama_server(paths: Paths, explicit: Path | None = None) -> Path | None:
    """An explicit binary, else `llama-server` on PATH, else corral's cached build; None if none."""
    if explicit is not None:
        if not (explicit.is_file() and os.access(explicit, os.X_OK)):
            raise ArtifactError(f"llama-server binary {explicit} is missing or not executable")
        return explicit
    on_path = shutil.which("llama-server")
    if on_path:
        return Path(on_path)
    cached = _cached_binary(paths)
    return cached if cached.is_file() else None


def llama_server(paths: Paths, explicit: Path | None = None, progress: Progress = lambda _: None) -> Path:
    """A usable llama-server binary, building it if none is found."""
    found = find_llama_server(paths, explicit)
    return found if found is not None else build_llama_server(paths, progress)


def build_llama_server(paths: Paths, progress: Progress = lambda _: None) -> Path:
    """Build llama-server from the vendored llama.cpp sources into the cache (once; locked)."""
    target = _cached_binary(paths)
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / ".lock"):
        if target.is_file():
            return target
        for tool in ("cmake", "c++"):
            if shutil.which(tool) is None:
                raise ArtifactError(
                    f"building llama-server needs '{tool}'; install it or put llama-server on PATH"
                )
        with tempfile.TemporaryDirectory(prefix="corral-llama-") as tmp:
            source = _fetch_sources(Path(tmp), progress)
            log = target.parent / "build.log"
            flags = list(_CMAKE_FLAGS)
            if "amx_tile" in _cpu_flags().split() and not amx_runs(Path(tmp)):
                progress("this CPU lists AMX but cannot run it here: building without AMX")
                flags += [f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}"]
            _run_build(source, flags, log, progress)
            partial = target.with_suffix(".part")
            shutil.copy2(source / "build" / "bin" / "llama-server", partial)
            partial.replace(target)
    return target


def _fetch_sources(tmp: Path, progress: Progress) -> Path:
    progress(f"downloading llama.cpp sources ({LLAMA_CPP_SDIST} sdist)")
    archive = pip_download(LLAMA_CPP_SDIST, tmp, "--no-binary", ":all:", limit_s=_DOWNLOAD_LIMIT_S)
    progress("unpacking llama.cpp sources")
    with tarfile.open(archive) as tf:
        tf.extractall(tmp, filter="data")
    vendored = next(tmp.glob("*/vendor/llama.cpp"), None)
    if vendored is None:
        raise ArtifactError(f"{archive.name} does not vendor llama.cpp")
    return vendored


def _run_build(
    source: Path,
    cmake_flags: list[str],
    log: Path,
    progress: Progress,
    limits_s: tuple[float, float] = (_CONFIGURE_LIMIT_S, _COMPILE_LIMIT_S),
) -> None:
    """Configure, then compile llama-server in `source`/build, each within its limit in `limits_s`
    (seconds), writing their output to `log`."""
    jobs = str(max(1, os.cpu_count() or 1))
    steps = [
        ("configuring llama.cpp", "configure llama.cpp (cmake)", ["cmake", "-B", "build", *cmake_flags]),
        (
            "compiling llama-server (about 6 min on 2 cores)",
            "compile llama-server (cmake --build)",
            ["cmake", "--build", "build", "--target", "llama-server", "-j", jobs],
        ),
    ]
    hint = f"its output is in {log}; or put a llama-server binary on PATH"
    with log.open("wb") as out:

        def on_line(line: bytes) -> None:
            out.write(line)
            match = _PROGRESS_LINE.match(line)
            if match:
                progress(f"compiling llama-server: {int(match.group(1))}%")

        for (told, what, command), limit_s in zip(steps, limits_s, strict=True):
            progress(told)
            done = run_tool(command, what, limit_s, cwd=source, on_line=on_line, hint=hint)
            if done.returncode != 0:
                raise ArtifactError(f"could not {what}: {tool_error(done.output)}; see {log}")
