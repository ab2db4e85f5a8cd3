"""The GPUs a spec needs on this machine, checked before anything is installed or started."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from corral.config import ClusterSpec

__all__ = ["DeviceError", "check_local_gpus", "local_gpu_count"]


class DeviceError(Exception):
    """The spec needs GPUs this machine does not have."""


def local_gpu_count(dev: Path = Path("/dev")) -> int:
    """NVIDIA GPUs on this machine: `nvidia-smi -L` where it runs, else the /dev/nvidiaN device nodes."""
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            done = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, check=False)
        except (OSError, subprocess.TimeoutExpired):
            done = None
        if done is not None and done.returncode == 0:
            return sum(1 for line in done.stdout.splitlines() if line.startswith("GPU "))
    try:
        return sum(1 for node in dev.iterdir() if re.fullmatch(r"nvidia\d+", node.name))
    except OSError:
        return 0


def check_local_gpus(spec: ClusterSpec, available: int) -> None:
    """Refuse a spec whose local vLLM GPU deployments need more GPUs than `available`."""
    for model in spec.models:
        for deployment in model.deployments:
            if deployment.engine != "vllm" or deployment.device != "gpu":
                continue
            needed = (
                max(deployment.gpus) + 1
                if deployment.gpus
                else deployment.most_replicas * deployment.gpus_per_replica
            )
            if needed > available:
                found = f"only {available}" if available else "none"
                raise DeviceError(
                    f"model {model.name!r} runs vLLM on GPUs and needs {needed} GPU(s) on this machine, but "
                    f"{found} can be seen (nvidia-smi, /dev/nvidia*); run it on a GPU server, across "
                    "machines with --ray, or on the CPU with `device: cpu`"
                )
