"""Engine adapters, resolved by the `engine` name in a deployment."""

from corral.engines.base import EngineAdapter, LaunchPlan, read_gauges
from corral.engines.external import ExternalEngine
from corral.engines.llamacpp import LlamaCppEngine

__all__ = [
    "ENGINES",
    "EngineAdapter",
    "ExternalEngine",
    "LaunchPlan",
    "LlamaCppEngine",
    "engine_named",
    "read_gauges",
]

ENGINES: dict[str, type[EngineAdapter]] = {
    LlamaCppEngine.name: LlamaCppEngine,
    ExternalEngine.name: ExternalEngine,
}


def engine_named(name: str) -> EngineAdapter:
    try:
        return ENGINES[name]()
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(sorted(ENGINES))}") from None
