"""Servers corral does not start: any OpenAI-compatible endpoint already running at known URLs."""

from __future__ import annotations

from corral.artifacts import Progress
from corral.config import DeploymentSpec, ModelSpec, Paths
from corral.engines.base import LaunchPlan
from corral.engines.features import EngineFeatures
from corral.engines.llamacpp import LlamaCppEngine
from corral.engines.load import EngineLoad
from corral.engines.vllm import parse_vllm_load

__all__ = ["ExternalEngine"]


class ExternalEngine:
    """Probes `/health` of each URL, and reads its `/metrics` when the server is one whose page corral
    knows (vLLM's `vllm:` names, which corral's simulator shares, or llama.cpp's `llamacpp:`): its queue,
    KV-cache use and size then count in routing as a started engine's do. Otherwise (no such page, or
    another server's) load is what this gateway has outstanding."""

    name = "external"

    def prepare(
        self, model: ModelSpec, deployment: DeploymentSpec, paths: Paths, progress: Progress
    ) -> list[LaunchPlan]:
        # Whether an unknown server continues a trailing assistant message is not known: no failover.
        features = EngineFeatures(
            continuation=False,
            embeddings=model.task == "embed",
            matryoshka=model.matryoshka,
            media_urls=model.media_urls,
        )
        events: list[str | None] = [*deployment.kv_events_urls] or [None] * len(deployment.urls)
        return [
            LaunchPlan(
                url=url.rstrip("/"),
                features=features,
                kv_events_urls=(kv,) if kv else (),
                api_key=deployment.engine_api_key,  # (the gateway sends it: a server of its own keyed)
            )
            for url, kv in zip(deployment.urls, events, strict=True)
        ]

    def parse_load(self, metrics_text: str) -> EngineLoad:
        if "\nvllm:" in metrics_text or metrics_text.startswith("vllm:"):
            return parse_vllm_load(metrics_text)
        if "\nllamacpp:" in metrics_text or metrics_text.startswith("llamacpp:"):
            return LlamaCppEngine().parse_load(metrics_text)
        return EngineLoad(running=0, waiting=0)
