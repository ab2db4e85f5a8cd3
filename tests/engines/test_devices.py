"""The CPUs corral counts as its own: a container's CPU limit (cgroup quota) and its affinity (taskset,
cpuset), not the host's cores, size the gateway's `auto` workers and place vLLM CPU's threads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from corral.engines.devices import usable_cpus

MINE = sorted(os.sched_getaffinity(0))
EIGHT = list(range(8))


@pytest.fixture
def eight_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """An affinity of 8 CPUs, whatever this machine has: a quota's cut is then seen."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(EIGHT))


def member_of(tmp_path: Path, *lines: str) -> Path:
    membership = tmp_path / "self-cgroup"
    membership.write_text("".join(line + "\n" for line in lines))
    return membership


@pytest.mark.usefixtures("eight_cpus")
def test_a_cgroup_v2_quota_cuts_the_cpus_to_its_share_rounded_up(tmp_path: Path) -> None:
    namespaced = member_of(tmp_path, "0::/")  # a container with its own cgroup namespace: the root is its own
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs' worth
    assert usable_cpus(tmp_path, namespaced) == EIGHT[:2]
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert usable_cpus(tmp_path, namespaced) == EIGHT[:1]  # never none
    (tmp_path / "cpu.max").write_text("max 100000\n")  # no limit
    assert usable_cpus(tmp_path, namespaced) == EIGHT


@pytest.mark.usefixtures("eight_cpus")
def test_the_smallest_quota_of_the_process_s_cgroup_and_those_above_it(tmp_path: Path) -> None:
    """systemd's `CPUQuota=300%` on the unit, a slice's limit above it; no cgroup namespace."""
    unit = tmp_path / "system.slice" / "corral.service"
    unit.mkdir(parents=True)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "system.slice" / "cpu.max").write_text("600000 100000\n")
    (unit / "cpu.max").write_text("300000 100000\n")
    membership = member_of(tmp_path, "0::/system.slice/corral.service")
    assert usable_cpus(tmp_path, membership) == EIGHT[:3]
    (unit / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(tmp_path, membership) == EIGHT[:6]  # the slice's


@pytest.mark.usefixtures("eight_cpus")
def test_a_cgroup_v1_quota_and_no_cgroup_at_all(tmp_path: Path) -> None:
    v1 = tmp_path / "cpu" / "docker" / "abc"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")  # unlimited
    membership = member_of(tmp_path, "4:memory:/docker/abc", "2:cpu,cpuacct:/docker/abc", "0::/")
    assert usable_cpus(tmp_path, membership) == EIGHT
    (v1 / "cpu.cfs_quota_us").write_text("100000\n")
    assert usable_cpus(tmp_path, membership) == EIGHT[:1]
    assert usable_cpus(tmp_path / "nowhere", tmp_path / "no-membership") == EIGHT


def test_a_process_pinned_to_one_core_counts_that_core_and_binds_vllm_cpu_to_it(tmp_path: Path) -> None:
    last = MINE[-1]
    probe = (
        "from corral.engines.devices import usable_cpus; from corral.engines.vllm import VllmEngine; "
        "from corral.config import DeploymentSpec; "
        "print(usable_cpus(), VllmEngine._env(DeploymentSpec(engine='vllm', device='cpu'), 0))"
    )
    done = subprocess.run(
        ["taskset", "-c", str(last), sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    assert done.stdout.split(" {")[0] == f"[{last}]", done.stdout
    assert f"'VLLM_CPU_OMP_THREADS_BIND': '{last}'" in done.stdout  # a core it may run on, not core 0


def test_deployments_that_share_a_gpu_must_leave_each_other_room() -> None:
    """Deployments that list no `gpus` all start at GPU 0: two vLLM models at the default 0.9 on one GPU
    (the second would run out of memory at every start) are refused at `corral up`, naming the GPU and
    the deployments; separate GPUs, or shares that add up to at most 1, pass."""
    from corral.config import parse_spec
    from corral.engines.devices import DeviceError, check_local_gpus

    def spec(first: str, second: str) -> object:
        return parse_spec(
            "models:\n"
            f"  - {{name: a, source: {{hf: a/b}}, deployments: [{{engine: vllm, {first}}}]}}\n"
            f"  - {{name: e, source: {{hf: a/c}}, deployments: [{{engine: vllm, {second}}}]}}\n"
        )

    with pytest.raises(DeviceError, match=r"GPU 0 is given to models\[a\].deployments\[0\], models\[e\]"):
        check_local_gpus(spec("replicas: 1", "replicas: 1"), available=2)  # type: ignore[arg-type]
    with pytest.raises(DeviceError, match="GPU 1"):
        check_local_gpus(spec("replicas: 2", "gpus: [1]"), available=2)  # type: ignore[arg-type]
    check_local_gpus(spec("replicas: 1", "gpus: [1]"), available=2)  # type: ignore[arg-type]
    shared = "gpu_memory_utilization: 0.45"
    check_local_gpus(spec(shared, shared), available=1)  # type: ignore[arg-type]


def _fake_smi(tmp_path: Path, gpus: int) -> Path:
    """A folder holding an `nvidia-smi` that lists `gpus` GPUs (`-L`), to put first on PATH."""
    folder = tmp_path / "bin"
    folder.mkdir()
    smi = folder / "nvidia-smi"
    lines = "".join(f"echo 'GPU {i}: NVIDIA H100 (UUID: GPU-{i:04d})'\n" for i in range(gpus))
    smi.write_text("#!/bin/sh\n" + lines)
    smi.chmod(0o755)
    return folder


@pytest.mark.parametrize(
    ("given", "count", "replicas"),
    [
        (None, 4, ["0", "1"]),  # (no list: every GPU, numbered as nvidia-smi numbers them)
        ("2,3", 2, ["2", "3"]),
        ("GPU-0002, MIG-7a1b", 2, ["GPU-0002", "MIG-7a1b"]),
        ("3,-1,0", 1, ["3", "1"]),  # (CUDA stops at the first entry naming no device)
        ("", 0, ["0", "1"]),
    ],
)
def test_the_operators_cuda_visible_devices_is_what_corral_counts_and_gives_out(
    tmp_path: Path, given: str | None, count: int, replicas: list[str]
) -> None:
    """corral counted every GPU of the machine and gave its replicas GPUs 0, 1, … whatever it was given:
    under CUDA_VISIBLE_DEVICES=2,3 on a shared 4-GPU host its replicas took GPUs 0 and 1, another service's.
    It counts the GPUs it is given, and a deployment's GPU indexes are into that list (as CUDA numbers
    them for corral itself); an index past it is refused by the GPU check."""
    probe = (
        "from corral.engines.devices import local_gpu_count; from corral.engines.vllm import VllmEngine; "
        "from corral.config import DeploymentSpec; d = DeploymentSpec(engine='vllm', replicas=2); "
        "print(local_gpu_count(), *(VllmEngine._env(d, i)['CUDA_VISIBLE_DEVICES'] for i in (0, 1)))"
    )
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PATH"] = f"{_fake_smi(tmp_path, 4)}:{env['PATH']}"
    if given is not None:
        env["CUDA_VISIBLE_DEVICES"] = given
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env)
    assert done.stdout.split() == [str(count), *replicas]


def test_a_gpu_id_past_those_given_is_told_as_such_not_as_a_shared_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under CUDA_VISIBLE_DEVICES=2,3, `gpus: [0, 2]`: the id past the list stayed `2`, which the sharing
    check (run first) read as the first GPU's, reporting GPU 2 shared at 1.80 instead of too few GPUs."""
    from corral.config import parse_spec
    from corral.engines.devices import DeviceError, check_local_gpus

    deployments = "[{engine: vllm, replicas: 2, gpus: [0, 2]}]"
    spec = parse_spec(f"models:\n  - {{name: a, source: {{hf: a/b}}, deployments: {deployments}}}\n")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # (the operator's: corral's own environment)
    with pytest.raises(DeviceError, match="needs 3 GPU"):
        check_local_gpus(spec, available=2)
