"""Start vLLM's OpenAI server so that its Ray workers use the placement group corral reserved.

Run by vLLM's own Python (corral is not importable there), as
`python vllm_ray_entry.py MODULE [ARGS...]`, where MODULE is `vllm.entrypoints.openai.api_server`.

With `--distributed-executor-backend ray`, vLLM places one Ray worker per GPU in a placement group: the
group of the Ray actor it runs in, else one it creates. corral's Ray runtime runs vLLM as a process started
by its replica actor, not inside it, so vLLM would see no group and reserve GPUs a second time, anywhere on
the cluster. This entry point closes that gap:

- `CORRAL_RAY_PLACEMENT_GROUP` (the group's id, hex) becomes `parallel_config.placement_group` of the engine
  config vLLM builds: the same field vLLM fills from the enclosing actor's group. Its workers then go one per
  GPU bundle, on the nodes corral chose.
- Every Ray worker the engine starts runs this interpreter (the job's `py_executable`), so the workers import
  the same vLLM, on any node where that path exists.
- `RAY_ADDRESS` (set by corral) joins the cluster corral runs on.

Without `CORRAL_RAY_PLACEMENT_GROUP` (local runtime) it only runs MODULE.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from typing import Any

_JOB_CONFIG = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # read by ray.init in this process and its children


def use_placement_group(group_hex: str) -> Any:
    """Make every engine config built in this process use the Ray placement group `group_hex`."""
    from ray import PlacementGroupID
    from ray.util.placement_group import PlacementGroup
    from vllm.engine.arg_utils import EngineArgs

    group = PlacementGroup(PlacementGroupID(bytes.fromhex(group_hex)))
    build = EngineArgs.create_engine_config

    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = build(self, *args, **kwargs)
        config.parallel_config.placement_group = group
        return config

    EngineArgs.create_engine_config = create_engine_config
    return group


def main() -> None:
    # Python put this file's folder first on sys.path, where corral's engines/vllm.py would shadow vLLM.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    if len(sys.argv) < 2:
        sys.exit("usage: vllm_ray_entry.py MODULE|SCRIPT.py [ARGS...]")
    target, args = sys.argv[1], sys.argv[2:]
    group_hex = os.environ.get("CORRAL_RAY_PLACEMENT_GROUP")
    if group_hex:
        os.environ.setdefault(_JOB_CONFIG, json.dumps({"runtime_env": {"py_executable": sys.executable}}))
        use_placement_group(group_hex)
    sys.argv = [target, *args]
    if target.endswith(".py"):
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
