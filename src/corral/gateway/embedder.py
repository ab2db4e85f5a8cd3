"""The semantic cache's embeddings, asked of the cluster's own embedding replicas through the router (not
through admission: they are the gateway's work, not a tenant's)."""

from __future__ import annotations

import numpy as np
import orjson

from corral.cache import Vector
from corral.gateway.relay import Relay
from corral.protocol import UpstreamError
from corral.routing import RouteRequest

__all__ = ["ReplicaEmbedder"]


class ReplicaEmbedder:
    """Unit vectors for texts, from a served embedding model."""

    def __init__(self, relay: Relay) -> None:
        self._relay = relay

    async def embed(self, model: str, text: str) -> Vector:
        tokens = max(1, len(text) // 4)
        route = RouteRequest(model=model, tokens=tokens, prompt_tokens=tokens)
        answer = await self._relay.call(
            route, "/v1/embeddings", orjson.dumps({"model": model, "input": text})
        )
        try:
            vector = np.asarray(orjson.loads(answer)["data"][0]["embedding"], dtype=np.float32)
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as exc:
            raise UpstreamError(f"{model} answered an embedding that could not be read: {exc}") from exc
        norm = float(np.linalg.norm(vector))
        if vector.ndim != 1 or not np.isfinite(vector).all() or not norm:
            raise UpstreamError(f"{model} answered a vector that is not finite and non-zero")  # (NaN: null)
        return vector / norm
