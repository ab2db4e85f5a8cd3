"""A deployment's `ray_gpus` is what its replicas reserve on Ray: the runtime `corral up` builds from a spec
with `ray:` starts a replica of a model with `ray_gpus: 2` in an actor holding two GPUs (its engine sees
exactly two in CUDA_VISIBLE_DEVICES), while a simulated model without it reserves none (a one-node Ray
started here, declaring two GPUs; the engine is the probe that reports where Ray put it)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from corral.cli.up import _prepare_all, _runtime
from corral.config import Paths, parse_spec
from corral.engines import LaunchPlan

from .test_ray import PROBE, placement_of, start_ready

pytestmark = pytest.mark.slow  # starts Ray (`make test-fast` skips)

SPEC = """
auth: {open: true}
ray: {placement_timeout: 30}
models:
  - name: wide
    arch: llama-3.1-8b
    deployments: [{engine: sim, gpu: l4, threads: 1, ray_gpus: 2}]
  - name: plain
    arch: llama-3.1-8b
    deployments: [{engine: sim, gpu: l4, threads: 1}]
"""


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """One Ray node on 127.0.0.1 that declares two GPUs (Ray hands out their ids; no device is needed)."""
    ray.init(
        num_cpus=2,
        num_gpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
    )
    yield
    ray.shutdown()


async def visible_gpus(runtime: Any, replica_id: str, prepared: LaunchPlan) -> str | None:
    """Start the probe as `replica_id` on `runtime`, reserving what `prepared` (the replica's plan, as `corral
    up` prepares it) does; the CUDA_VISIBLE_DEVICES its engine saw."""
    argv = (sys.executable, str(PROBE), "--host", "{host}", "--port", "{port}")
    replica = await start_ready(runtime, replica_id, LaunchPlan(argv=argv, resources=prepared.resources))
    try:
        return (await placement_of(replica.url))["cuda_visible_devices"]  # type: ignore[no-any-return]
    finally:
        await replica.stop(5)


async def test_a_replica_reserves_the_ray_gpus_its_deployment_names(local_ray: None, tmp_path: Path) -> None:
    spec = parse_spec(SPEC, source="test")
    runtime = _runtime(spec, Paths(tmp_path))  # what `corral up` runs replicas on, with the plans it prepares
    (_, _, (wide_plan,)), (_, _, (plain_plan,)) = _prepare_all(spec, Paths(tmp_path))
    wide = await visible_gpus(runtime, "wide-0", wide_plan)
    assert wide is not None and sorted(wide.split(",")) == ["0", "1"]  # both of the node's GPUs
    assert not await visible_gpus(runtime, "plain-0", plain_plan)  # a simulated engine reserves none
