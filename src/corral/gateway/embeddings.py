"""/v1/embeddings in OpenAI's shape, whatever the engine: the gateway asks every engine for float vectors
and does `encoding_format` and `dimensions` itself, so they behave the same on llama.cpp, vLLM and the
simulator.

`base64` is the vectors' little-endian float32 bytes, base64-encoded (what the `openai` client decodes).
`dimensions` equal to the model's size is a no-op; a smaller one is allowed only for a model declared
`matryoshka: true` (trained so that a prefix of its vector is itself an embedding): the first
`dimensions` values are kept and renormalised to unit length, as OpenAI's text-embedding-3 models do.
Other models refuse it with 400, as vLLM does: truncating their vectors silently would lose meaning.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import orjson

from corral.protocol import EmbeddingRequest, InvalidRequest, UpstreamError
from corral.protocol.usage import engine_usage

__all__ = ["EmbeddingShaper", "upstream_body"]


def upstream_body(raw: bytes) -> bytes:
    """The request as engines get it: float vectors at the model's own size."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:  # NaN, Infinity or a huge number that pydantic let through
        raise InvalidRequest(f"The body is not valid JSON for the engines: {exc}.") from exc
    data.pop("encoding_format", None)
    data.pop("dimensions", None)
    return orjson.dumps(data)


class EmbeddingShaper:
    """Turns an engine's embedding answer into the one the client asked for; remembers each model's size
    so a `dimensions` the model cannot give is refused before the engine works on it."""

    def __init__(self) -> None:
        self._sizes: dict[str, int] = {}

    def check(self, body: EmbeddingRequest, matryoshka: bool) -> None:
        size = self._sizes.get(body.model)
        if body.dimensions is not None and size is not None:
            _check_dimensions(body, size, matryoshka)

    def shape(
        self, engine_body: bytes, body: EmbeddingRequest, matryoshka: bool, estimate: int = 0
    ) -> tuple[bytes, dict[str, Any]]:
        """The client's answer and its usage (the prompt's `estimate` where the engine told none that
        reads: what the request is then charged)."""
        try:
            answer = orjson.loads(engine_body)
            items = sorted(answer["data"], key=lambda item: int(item["index"]))
            vectors = np.asarray([item["embedding"] for item in items], dtype=np.float32)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise UpstreamError(f"The engine's embedding answer could not be read: {exc}.") from exc
        if vectors.ndim != 2 or len(vectors) != len(body.inputs):
            raise UpstreamError(
                f"The engine answered {len(vectors)} embeddings for {len(body.inputs)} inputs."
            )
        self._sizes[body.model] = vectors.shape[1]
        if body.dimensions is not None and body.dimensions != vectors.shape[1]:
            _check_dimensions(body, vectors.shape[1], matryoshka)
            vectors = _shorten(vectors, body.dimensions)
        usage = _usage(answer.get("usage"), estimate)
        data = [
            {"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
            for i, v in enumerate(vectors)
        ]
        shaped = {"object": "list", "data": data, "model": body.model, "usage": usage}
        return orjson.dumps(shaped, option=orjson.OPT_SERIALIZE_NUMPY), usage


def _usage(reported: Any, estimate: int) -> dict[str, int]:
    """The engine's usage, or the prompt's estimate where it reported none that can be read."""
    usage = engine_usage(reported)
    if usage is None:
        return {"prompt_tokens": estimate, "total_tokens": estimate}
    return {"prompt_tokens": usage["prompt_tokens"], "total_tokens": usage["total_tokens"]}


def _check_dimensions(body: EmbeddingRequest, size: int, matryoshka: bool) -> None:
    wanted = body.dimensions
    if wanted is None or wanted == size:
        return
    if wanted > size:
        raise InvalidRequest(
            f"dimensions is too large: {wanted}. The model '{body.model}' makes vectors of {size}.",
            param="dimensions",
        )
    if not matryoshka:
        raise InvalidRequest(
            f"The model '{body.model}' does not support shortened vectors (it is not a Matryoshka model); "
            f"leave dimensions unset or ask for {size}.",
            param="dimensions",
        )


def _shorten(vectors: np.ndarray[Any, Any], size: int) -> np.ndarray[Any, Any]:
    cut = vectors[:, :size]
    norms = np.linalg.norm(cut, axis=1, keepdims=True)
    return np.asarray(cut / np.where(norms == 0, 1, norms), dtype=np.float32)


def _encode(vector: np.ndarray[Any, Any], encoding: str) -> Any:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()
