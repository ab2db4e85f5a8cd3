"""Engine adapters, resolved by the `engine` name in a deployment, and the facts they read from their
engines (load, features) in one shape for routing."""

from corral.engines.base import EngineAdapter, LaunchPlan, Resources, launch_plans, read_gauges
from corral.engines.external import ExternalEngine
from corral.engines.features import EngineFeatures
from corral.engines.llamacpp import LlamaCppEngine
from corral.engines.load import EngineLoad
from corral.engines.sim import SimEngineAdapter
from corral.engines.vllm import VllmEngine, parse_vllm_load

__all__ = [
    "ENGINES",
    "EngineAdapter",
    "EngineFeatures",
    "EngineLoad",
    "ExternalEngine",
    "LaunchPlan",
    "LlamaCppEngine",
    "Resources",
    "SimEngineAdapter",
    "VllmEngine",
    "engine_named",
    "launch_plans",
    "parse_vllm_load",
    "read_gauges",
]

ENGINES: dict[str, type[EngineAdapter]] = {
    LlamaCppEngine.name: LlamaCppEngine,
    ExternalEngine.name: ExternalEngine,
    SimEngineAdapter.name: SimEngineAdapter,
    VllmEngine.name: VllmEngine,
}


def engine_named(name: str) -> EngineAdapter:
    try:
        return ENGINES[name]()
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(sorted(ENGINES))}") from None
