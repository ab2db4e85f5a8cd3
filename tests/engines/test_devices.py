"""The CPUs corral counts as its own: a container's CPU limit (cgroup quota) and its affinity (taskset,
cpuset), not the host's cores, size the gateway's `auto` workers and place vLLM CPU's threads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from corral.engines.devices import usable_cpus

MINE = sorted(os.sched_getaffinity(0))


def test_a_cgroup_v2_quota_cuts_the_cpus_to_its_share_rounded_up(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs' worth
    assert usable_cpus(tmp_path) == MINE[:2]
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert usable_cpus(tmp_path) == MINE[:1]  # never none
    (tmp_path / "cpu.max").write_text("max 100000\n")  # no limit
    assert usable_cpus(tmp_path) == MINE


def test_a_cgroup_v1_quota_and_no_cgroup_at_all(tmp_path: Path) -> None:
    v1 = tmp_path / "cpu"
    v1.mkdir()
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")  # unlimited
    assert usable_cpus(tmp_path) == MINE
    (v1 / "cpu.cfs_quota_us").write_text("100000\n")
    assert usable_cpus(tmp_path) == MINE[:1]
    assert usable_cpus(tmp_path / "nowhere") == MINE


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
