"""What a replica reserves where a runtime places it (Ray) comes with its launch plan, from its own
deployment: each deployment of a model its own `ray_gpus` and `threads`, however the plans are prepared
(`corral up` at start, `corral apply` later: both through `launch_plans`)."""

from __future__ import annotations

from pathlib import Path

from corral.cli.up import _prepare_all
from corral.config import Paths, parse_spec
from corral.engines import Resources

SPEC = """
auth: {open: true}
models:
  - name: m
    arch: llama-3.1-8b
    deployments:
      - {engine: sim, gpu: l4, threads: 1, ray_gpus: 2, replicas: 2}
      - {engine: sim, gpu: l4, threads: 3}
"""


def test_each_deployment_reserves_its_own_resources(tmp_path: Path) -> None:
    spec = parse_spec(SPEC, source="test")
    (_, _, first), (_, _, second) = _prepare_all(spec, Paths(tmp_path))
    assert [plan.resources for plan in first] == [Resources(gpus=2, cpus=1.0)] * 2
    assert [plan.resources for plan in second] == [Resources(gpus=0, cpus=3.0)]  # a simulator holds none
