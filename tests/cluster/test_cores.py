"""vLLM CPU replicas on this machine are bound to cores no other live replica holds (cluster/cores.py)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from corral.cluster import LocalProcessRuntime
from corral.cluster.cores import CoreBook
from corral.cluster.runtime import PortBook
from corral.engines import LaunchPlan

from .test_supervisor import until

BIND = "VLLM_CPU_OMP_THREADS_BIND"


def _replica(out: Path, bind: str) -> LaunchPlan:
    """A process that writes the cores it was bound to, then waits to be stopped."""
    return LaunchPlan(
        argv=("sh", "-c", f'echo "${BIND}" > {out}; exec sleep 30'),
        env={"VLLM_CPU_KVCACHE_SPACE": "1", BIND: bind},
    )


async def test_two_deployments_replicas_run_on_cores_of_their_own(tmp_path: Path) -> None:
    """Each deployment's plans bind from the first core (it knows only itself): replica 0 of two vLLM CPU
    deployments were both bound to core 0 while the others idled. The runtime binds each to the cores no
    live replica holds, keeps a plan's shape (two cores; a core per rank), and a stopped replica's cores
    go to the next."""
    runtime = LocalProcessRuntime(tmp_path / "logs", cores=CoreBook([4, 5, 6, 7, 8]))
    outs = [tmp_path / f"bind-{n}" for n in range(4)]
    first = await runtime.start("a-0", _replica(outs[0], "0-1"))
    second = await runtime.start("b-0", _replica(outs[1], "0|1"))
    third = await runtime.start("c-0", _replica(outs[2], "0"))
    try:
        await until(lambda: all(out.exists() and out.read_text() for out in outs[:3]), within=10)
        assert [out.read_text().strip() for out in outs[:3]] == ["4-5", "6|7", "8"]
        await second.stop(1.0)
        fourth = await runtime.start("b-1", _replica(outs[3], "0|1"))
        await until(lambda: outs[3].exists() and outs[3].read_text(), within=10)
        assert outs[3].read_text().strip() == "6|7"
        await fourth.stop(1.0)
    finally:
        await asyncio.gather(first.stop(1.0), second.stop(1.0), third.stop(1.0))


def test_past_the_cores_the_least_held_are_shared_and_a_warning_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    book = CoreBook([2, 3, 8])
    env, first = book.take({BIND: "0-1"})
    assert (env[BIND], first) == ("2-3", [2, 3])
    assert caplog.text == ""
    with caplog.at_level(logging.WARNING, logger="corral.cluster.cores"):
        taken = book.take({BIND: "0-1"})  # (8 is free; 2 is held by one, as 3 is)
    assert taken == ({BIND: "2,8"}, [2, 8]) and "every usable core (2-3,8) is held" in caplog.text
    book.release(first)  # (3 is free again: a rank each on 3 and a core held by one, 2 before 8)
    assert book.take({BIND: "5|6"}) == ({BIND: "2|3"}, [2, 3])


def test_plans_that_bind_no_cores_are_left_alone() -> None:
    book = CoreBook([0, 1])
    for env in ({"CUDA_VISIBLE_DEVICES": "0"}, {BIND: "auto"}, {BIND: "nobind"}):
        assert book.take(env) == (env, [])
    assert book.take({BIND: "0"}) == ({BIND: "0"}, [0])  # (nothing was booked by the others)


async def test_a_start_whose_cores_cannot_be_given_keeps_no_port(tmp_path: Path) -> None:
    ports = PortBook(draw=lambda host: 40123)
    runtime = LocalProcessRuntime(tmp_path / "logs", ports=ports, cores=CoreBook([]))
    with pytest.raises(ZeroDivisionError):
        await runtime.start("a-0", _replica(tmp_path / "bind", "0"))
    assert ports.book("127.0.0.1", 40123)  # (free again)
