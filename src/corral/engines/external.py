"""Servers corral does not start: any OpenAI-compatible endpoint already running at known URLs."""

from __future__ import annotations

from corral.artifacts import Progress
from corral.config import DeploymentSpec, ModelSpec, Paths
from corral.engines.base import LaunchPlan
from corral.routing import EngineFeatures, EngineLoad

__all__ = ["ExternalEngine"]


class ExternalEngine:
    """Probes `/health` of each URL; load is what this gateway has outstanding (no engine metrics)."""

    name = "external"

    def prepare(
        self, model: ModelSpec, deployment: DeploymentSpec, paths: Paths, progress: Progress
    ) -> list[LaunchPlan]:
        # Whether an unknown server continues a trailing assistant message is not known: no failover.
        features = EngineFeatures(
            continuation=False, embeddings=model.task == "embed", matryoshka=model.matryoshka
        )
        return [
            LaunchPlan(url=url.rstrip("/"), metrics_path=None, features=features) for url in deployment.urls
        ]

    def parse_load(self, metrics_text: str) -> EngineLoad:
        return EngineLoad(running=0, waiting=0)
