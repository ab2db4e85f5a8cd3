"""A real llama-server launch plan for SmolLM2, shared by the supervisor and Ray runtime tests."""

from __future__ import annotations

import pytest

from corral.config import Paths, default_spec
from corral.engines import LaunchPlan, LlamaCppEngine


@pytest.fixture(scope="package")
def llama_plan() -> LaunchPlan:
    """One replica's plan (built/fetched into the cache if missing), small enough for two cores."""
    model = default_spec().models[0]
    deployment = model.deployments[0].model_copy(
        update={"replicas": 1, "parallel": 2, "context_length": 1024}
    )
    return LlamaCppEngine().prepare(model, deployment, Paths.from_env(), lambda _: None)[0]
