"""This machine's devices: the GPUs a spec needs, checked before anything is installed or started, and the
CPUs this process may use (a container's CPU limit, not the host's core count)."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from pathlib import Path

from corral.config import ClusterSpec

__all__ = ["DeviceError", "check_local_gpus", "local_gpu_count", "usable_cpus"]


class DeviceError(Exception):
    """The spec needs GPUs this machine does not have."""


def usable_cpus(cgroup: Path = Path("/sys/fs/cgroup")) -> list[int]:
    """The CPUs this process may run on, as many as its CPU limit allows: its affinity (taskset, cpuset),
    cut to the cgroup's CPU quota rounded up (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`): a container
    limited to 2 CPUs on a 96-core node gets 2, where `os.cpu_count()` says 96. Never empty."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (not Linux)
        cpus = list(range(os.cpu_count() or 1))
    quota = _cgroup_quota(cgroup)
    if quota is not None:
        cpus = cpus[: max(1, math.ceil(quota))]
    return cpus or [0]


def _cgroup_quota(cgroup: Path) -> float | None:
    """CPUs' worth of time the cgroup may use per period, or None where it is not limited."""
    try:
        limit, every = (cgroup / "cpu.max").read_text().split()[:2]  # v2: "max 100000" or "200000 100000"
        return None if limit == "max" else int(limit) / int(every)
    except (OSError, ValueError):
        pass
    try:
        quota = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())  # v1: -1 where unlimited
        period = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


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
