"""This machine's devices: the GPUs a spec needs, checked before anything is installed or started, and the
CPUs this process may use (a container's CPU limit, not the host's core count), shared out among vLLM CPU
replicas."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from corral.config import ClusterSpec, DeploymentSpec
from corral.engines.base import given_gpus, visible_gpus
from corral.engines.kv_events import data_parallel_size

__all__ = [
    "CPU_BIND",
    "DeviceError",
    "check_local_gpus",
    "cpu_list",
    "local_gpu_count",
    "parse_cpu_list",
    "replica_cpus",
    "usable_cpus",
]

CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM's CPU build: its OpenMP threads' cores, `|` between ranks


class DeviceError(Exception):
    """The spec needs GPUs this machine does not have."""


def usable_cpus(
    cgroup: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")
) -> list[int]:
    """The CPUs this process may run on, as many as its CPU limit allows: its affinity (taskset, cpuset),
    cut to the smallest CPU quota of its cgroup and the cgroups above it, rounded up (v2 `cpu.max`, v1
    `cpu.cfs_quota_us`): a container limited to 2 CPUs on a 96-core node gets 2, where `os.cpu_count()`
    says 96; so does a systemd unit with `CPUQuota=200%`. Never empty."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (not Linux)
        cpus = list(range(os.cpu_count() or 1))
    quotas = [q for folder in _cgroup_folders(cgroup, membership) if (q := _quota(folder)) is not None]
    if quotas:
        cpus = cpus[: max(1, math.ceil(min(quotas)))]
    return cpus or [0]


def _cgroup_folders(cgroup: Path, membership: Path) -> list[Path]:
    """The folders of this process's CPU cgroup and of each cgroup above it, up to the hierarchy's root:
    v2 (`0::/path`) under `cgroup`, v1 (`N:cpu,cpuacct:/path`) under its `cpu` controller's folder. In a
    container with its own cgroup namespace the path is `/`: the root is its own cgroup."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        lines = []
    folders = []
    for line in lines:
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        if controllers == "":
            root = cgroup
        elif "cpu" in controllers.split(","):
            root = cgroup / "cpu"
        else:
            continue
        here = root / path.strip("/")
        folders += [here, *[p for p in here.parents if p.is_relative_to(root) and p != here]]
    return folders or [cgroup, cgroup / "cpu"]


def _quota(folder: Path) -> float | None:
    """CPUs' worth of time the cgroup at `folder` may use per period, or None where it sets no limit."""
    try:
        limit, every = (folder / "cpu.max").read_text().split()[:2]  # v2: "max 100000" or "200000 100000"
        return None if limit == "max" else int(limit) / int(every)
    except (OSError, ValueError):
        pass
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())  # v1: -1 where unlimited
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def local_gpu_count(dev: Path = Path("/dev"), given: list[str] | None = None) -> int:
    """NVIDIA GPUs corral may use on this machine: those its own CUDA_VISIBLE_DEVICES lists, where the
    operator set it (`given`: engines/base.py's `given_gpus`), else all: `nvidia-smi -L` where it runs,
    else the /dev/nvidiaN device nodes."""
    given = given_gpus() if given is None else given
    if given is not None:  # (a list naming GPUs on a machine with none: none)
        return len(given) if _physical_gpus(dev) else 0
    return _physical_gpus(dev)


def _physical_gpus(dev: Path) -> int:
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
    """Refuse a spec whose local vLLM GPU deployments need more GPUs than `available`, or put more on one
    GPU than it holds: deployments that list no `gpus` all start at GPU 0, and two that share a GPU must
    leave each other room (`gpu_memory_utilization` adding up to at most 1), else the second runs out of
    memory at every start."""
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
                seen = "can be seen (nvidia-smi, /dev/nvidia*)"
                if given_gpus() is not None:
                    seen = "are given to corral (its CUDA_VISIBLE_DEVICES)"
                raise DeviceError(
                    f"model {model.name!r} runs vLLM on GPUs and needs {needed} GPU(s) on this machine, but "
                    f"{found} {seen}; run it on a GPU server, across "
                    "machines with --ray, or on the CPU with `device: cpu`"
                )
    _check_shared_gpus(spec)  # (after: an id past the GPUs given would read as another GPU's)


def _check_shared_gpus(spec: ClusterSpec) -> None:
    shares: dict[str, list[tuple[str, float]]] = {}
    for model in spec.models:
        for number, deployment in enumerate(model.deployments):
            if deployment.engine != "vllm" or deployment.device != "gpu":
                continue
            where = f"models[{model.name}].deployments[{number}]"
            for index in range(deployment.most_replicas):
                for device in visible_gpus(deployment, index).split(","):
                    shares.setdefault(device, []).append((where, deployment.gpu_memory_utilization))
    for gpu, users in sorted(shares.items()):
        if sum(share for _, share in users) > 1.0 + 1e-9:
            named = ", ".join(sorted({where for where, _ in users}))
            raise DeviceError(
                f"GPU {gpu} is given to {named} (replicas of one deployment count once each), whose "
                f"gpu_memory_utilization adds up to {sum(share for _, share in users):.2f}, more than the "
                "GPU holds: give each deployment GPUs of its own with `gpus: [...]` (a deployment that "
                "lists none starts at GPU 0), or lower their gpu_memory_utilization to share one"
            )


def replica_cpus(deployment: DeploymentSpec, cores: Sequence[int]) -> list[str]:
    """CPU_BIND for each of a vLLM CPU deployment's replicas: the next `threads` of `cores` for each (as
    many as it has ranks, if more), from the first, shared among its ranks (data parallel × pipeline ×
    tensor; at least one core each, the first ranks one more where they do not divide evenly) and joined
    with `|`, as vLLM's CPU build wants one core list per rank (it refuses another count). Past the last
    core it starts from the first again. The local runtime moves a replica to cores no live replica holds
    when it starts it (cluster/cores.py): these give the shape."""
    ranks = data_parallel_size(deployment.engine_args) * deployment.gpus_per_replica
    per_replica = max(deployment.threads, ranks)
    sizes = [per_replica // ranks + (rank < per_replica % ranks) for rank in range(ranks)]
    binds = []
    for replica in range(deployment.replicas):
        start, groups = replica * per_replica, []
        for size in sizes:
            groups.append(cpu_list([cores[(start + k) % len(cores)] for k in range(size)]))
            start += size
        binds.append("|".join(groups))
    return binds


def parse_cpu_list(text: str) -> list[int]:
    """The cores a CPU list names (`0-3`, `2-3,8`), in order; ValueError if it is not one."""
    cores: list[int] = []
    for part in text.split(","):
        low, dash, high = part.partition("-")
        first, last = int(low), int(high) if dash else int(low)
        if first < 0 or last < first:
            raise ValueError(f"not a CPU list: {text!r}")
        cores += range(first, last + 1)
    return cores


def cpu_list(cores: Sequence[int]) -> str:
    """Cores as a CPU list: `0-3`, `0,2,4`, `1-2,6-7` (sorted, each once; vLLM and taskset read it)."""
    ordered = sorted(set(cores))
    runs: list[list[int]] = []
    for core in ordered:
        if runs and core == runs[-1][-1] + 1:
            runs[-1].append(core)
        else:
            runs.append([core])
    return ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
