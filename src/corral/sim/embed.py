"""The simulator as an embedding model (vLLM's pooling runner): `/v1/embeddings` with deterministic vectors.

A vector is the feature hashing of the text's lower-cased words and their character trigrams (a signed
count per hashed feature, L2-normalised), so texts that share words and spellings are close, paraphrases
with other words are not: enough to exercise a semantic cache's plumbing at scale, not to judge its
quality (the real embedding model does that). Each input takes the engine one prefill (its tokens
scheduled like a one-token generation), as vLLM's pooling runner spends.
"""

from __future__ import annotations

import asyncio
import base64
import re
import zlib

import numpy as np
import orjson
from aiohttp import web

from corral.protocol import EmbeddingRequest, InvalidRequest, parse_body
from corral.sim.engine import DEAD, EngineDeadError, SimEngine, SimRequest
from corral.sim.errors import bad_request, model_not_found
from corral.sim.text import tokenize

__all__ = ["SimEmbedder", "embed_text"]

_WORDS = re.compile(r"\w+")


def embed_text(text: str, dim: int) -> np.ndarray[tuple[int], np.dtype[np.float32]]:
    """The simulator's vector for `text`."""
    vector = np.zeros(dim, dtype=np.float32)
    for word in _WORDS.findall(text.lower()):
        padded = f"#{word}#"
        features = [word, *(padded[i : i + 3] for i in range(len(padded) - 2))]
        for weight, feature in zip([2.0] + [1.0] * (len(features) - 1), features, strict=True):
            h = zlib.crc32(feature.encode())
            vector[h % dim] += weight if h & 0x80000000 else -weight
    norm = float(np.linalg.norm(vector))
    return vector / norm if norm else vector


class SimEmbedder:
    """The `/v1/embeddings` handler of one simulated replica."""

    def __init__(self, engine: SimEngine, dim: int, max_model_len: int, vocab: int) -> None:
        self.engine = engine
        self.dim = dim
        self.max_model_len = max_model_len
        self.vocab = vocab

    async def embeddings(self, request: web.Request) -> web.Response:
        body = parse_body(EmbeddingRequest, await request.read())
        if body.model != self.engine.model:
            raise model_not_found(body.model, self.engine.model)
        if body.dimensions is not None and body.dimensions != self.dim:
            raise InvalidRequest("Model does not support matryoshka representation", param="dimensions")
        texts = [item if isinstance(item, str) else " ".join(map(str, item)) for item in body.inputs]
        prompts = [tokenize(text, self.vocab) or [0] for text in texts]
        for i, tokens in enumerate(prompts):
            if len(tokens) > self.max_model_len:
                raise InvalidRequest(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, input {i} "
                    f"has {len(tokens)} tokens.",
                    param="input",
                )
        await self._prefill(prompts)
        vectors = [embed_text(text, self.dim) for text in texts]
        if body.encoding_format == "base64":
            encoded: list[object] = [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in vectors]
        else:
            encoded = [v.tolist() for v in vectors]
        used = sum(len(p) for p in prompts)
        answer = {
            "object": "list",
            "model": self.engine.model,
            "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(encoded)],
            "usage": {"prompt_tokens": used, "total_tokens": used},
        }
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    async def _prefill(self, prompts: list[list[int]]) -> None:
        """Each input's prefill; it ends there (vLLM's pooling runner stops a request at its pooled
        output), so an input as long as the context fits."""
        requests: list[SimRequest] = []
        try:
            for tokens in prompts:
                requests.append(self.engine.submit(tokens, 1, finished_reason="stop"))
            if DEAD in await asyncio.gather(*(r.tokens.get() for r in requests)):
                raise EngineDeadError()
        except ValueError as exc:  # more KV than the engine has: the input's fault, as every other refusal
            raise bad_request(str(exc), param="input") from exc
        finally:
            for r in requests:
                self.engine.abort(r)
