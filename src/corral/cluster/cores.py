"""The CPU cores handed to live vLLM CPU replicas on this machine, booked like their ports.

An engine's plan binds each replica to `threads` cores (`VLLM_CPU_OMP_THREADS_BIND`, one core list per
rank), counted from the first core: it knows its own deployment only. Two deployments, a rollout's new
replica beside its old one, or an autoscaled replica would then share cores while others idle. So the
local runtime takes the plan's shape (how many cores each rank gets) and binds the replica to cores no live
replica holds, the lowest first; when every core is held it takes those held by the fewest, and says so.
A replica's cores are given back when it has stopped.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence

from corral.engines.devices import CPU_BIND, cpu_list, parse_cpu_list, usable_cpus

__all__ = ["CoreBook"]

logger = logging.getLogger(__name__)


class CoreBook:
    """The cores of `cores` (by default those this process may use) that live replicas hold."""

    def __init__(self, cores: Sequence[int] | None = None) -> None:
        self._cores = list(cores) if cores is not None else usable_cpus()
        self._held: Counter[int] = Counter()

    def take(self, env: Mapping[str, str]) -> tuple[Mapping[str, str], list[int]]:
        """`env` with its CPU_BIND moved to the least held cores, and the cores booked; `env` as it is, and
        none booked, where it binds none (a GPU replica) or names no core list (`auto`, `nobind`)."""
        try:
            shape = [len(set(parse_cpu_list(rank))) for rank in env[CPU_BIND].split("|")]
        except (KeyError, ValueError):
            return env, []
        order = {core: position for position, core in enumerate(self._cores)}
        ranked = sorted(self._cores, key=lambda core: (self._held[core], order[core]))
        need = min(sum(shape), len(ranked))
        chosen = sorted(ranked[:need], key=order.__getitem__)
        if any(self._held[core] for core in chosen):
            logger.warning(
                "every usable core (%s) is held by a vLLM CPU replica: a new one shares cores %s (give "
                "the deployments fewer threads or replicas, or the machine more cores)",
                cpu_list(self._cores),
                cpu_list(chosen),
            )
        groups, start = [], 0
        for size in shape:  # (past the cores, ranks share them, from the first chosen again)
            groups.append(cpu_list([chosen[(start + k) % need] for k in range(size)]))
            start += size
        self._held.update(chosen)
        return {**env, CPU_BIND: "|".join(groups)}, chosen

    def release(self, cores: Sequence[int]) -> None:
        """Their replica has stopped: its cores may be handed out again."""
        self._held.subtract(cores)
        self._held += Counter()  # (drops the counts at zero)
