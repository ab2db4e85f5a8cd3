"""/v1/embeddings in OpenAI's shape, whatever the engine: the gateway does `encoding_format` and `dimensions`
itself, so they behave the same on llama.cpp, vLLM and the simulator.

Engines are asked for the model's own vectors, as base64 where every replica of the model sends it when
asked (llama.cpp's server, vLLM and the simulator do; an `external` engine is asked for floats): base64 is a
quarter of the bytes of the same floats written in JSON, and reads in a tenth of their time. `base64` is the
vectors' little-endian float32 bytes, base64-encoded (what the `openai` client decodes); a vector the engine
sent that way is passed on as it came when the client asks for base64 at the model's size.
`dimensions` equal to the model's size is a no-op; a smaller one is allowed only for a model declared
`matryoshka: true` (trained so that a prefix of its vector is itself an embedding): the first
`dimensions` values are kept and renormalised to unit length, as OpenAI's text-embedding-3 models do.
Other models refuse it with 400, as vLLM does: truncating their vectors silently would lose meaning.

An answer is read vector by vector: each vector's JSON text is found in the body and read on its own, and
the rest of the body, without them, is parsed. One parse of the whole would hold the GIL throughout (0.65 s
for 2,048 vectors of 4,096 floats, 160 MB of JSON), even in a worker thread; short steps let the event
loop take it between them. So a large answer is shaped in a worker thread and the loop serves every other
request meanwhile; a small one is shaped on the loop, where one vector costs less than a thread hop.
"""

from __future__ import annotations

import asyncio
import base64
import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import numpy as np
import orjson

from corral.protocol import EmbeddingRequest, InvalidRequest, UpstreamError
from corral.protocol.usage import engine_usage
from corral.routing import Replica

__all__ = ["EmbeddingShaper", "asks_base64", "in_base64", "upstream_body"]

_BASE64_ENGINES = frozenset({"llamacpp", "vllm", "sim"})  # they answer `encoding_format: base64` in kind
_IN_THREAD_BYTES = 256 * 1024  # an engine answer this large is shaped in a worker thread
_VECTOR = re.compile(rb'"embedding"\s*:\s*')  # an item's vector follows
_CLOSING = {b"[": b"]", b'"': b'"'}  # what ends a vector written as floats, or as base64


def upstream_body(raw: bytes) -> bytes:
    """The request as engines get it: float vectors at the model's own size."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:  # NaN, Infinity or a huge number that pydantic let through
        raise InvalidRequest(f"The body is not valid JSON for the engines: {exc}.") from exc
    data.pop("encoding_format", None)
    data.pop("dimensions", None)
    return orjson.dumps(data)


def asks_base64(replicas: Iterable[Replica]) -> bool:
    """Whether every one of a model's replicas runs an engine that sends base64 vectors when asked."""
    engines = {replica.engine for replica in replicas}
    return bool(engines) and engines <= _BASE64_ENGINES


def in_base64(upstream: bytes) -> bytes:
    """`upstream_body`'s request asking for base64 vectors (it has no `encoding_format`: one member more)."""
    return upstream[:-1] + b',"encoding_format":"base64"}'


class EmbeddingShaper:
    """Turns an engine's embedding answer into the one the client asked for; remembers each model's size
    so a `dimensions` the model cannot give is refused before the engine works on it."""

    def __init__(self, in_thread_bytes: int = _IN_THREAD_BYTES) -> None:
        # model → the size of its vectors, and the generation of its replicas that made them
        self._sizes: dict[str, tuple[int, int]] = {}
        self._in_thread_bytes = in_thread_bytes
        # large answers are shaped on a thread of their own, one at a time: in the default pool a tenant's
        # many large answers took every thread the key lookups and usage writes of all tenants wait for
        # (and shaping holds the GIL most of its time: more threads would not shape faster)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="corral-embeddings")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def check(self, body: EmbeddingRequest, matryoshka: bool, generation: int = 0) -> None:
        """Refuse a `dimensions` the model cannot give, by the size its replicas answered since they last
        changed (`ReplicaSet.generation`): a redeployed model may make vectors of another size, and then
        its engine's answer decides."""
        learnt = self._sizes.get(body.model)
        if body.dimensions is not None and learnt is not None and learnt[1] == generation:
            _check_dimensions(body, learnt[0], matryoshka)

    async def answer(
        self,
        engine_body: bytes,
        body: EmbeddingRequest,
        matryoshka: bool,
        estimate: int = 0,
        generation: int = 0,
    ) -> tuple[bytes, dict[str, Any]]:
        """`shape`, in a worker thread where the engine's answer is large."""
        if len(engine_body) < self._in_thread_bytes:
            return self.shape(engine_body, body, matryoshka, estimate, generation)
        shaping = partial(self.shape, engine_body, body, matryoshka, estimate, generation)
        return await asyncio.get_running_loop().run_in_executor(self._pool, shaping)

    def shape(
        self,
        engine_body: bytes,
        body: EmbeddingRequest,
        matryoshka: bool,
        estimate: int = 0,
        generation: int = 0,
    ) -> tuple[bytes, dict[str, Any]]:
        """The client's answer and its usage (the prompt's `estimate` where the engine told none that
        reads: what the request is then charged)."""
        try:
            answer, found = _split(engine_body) or _parsed(engine_body)
            items = sorted(answer["data"], key=lambda item: int(item["index"]))
            values = [found[item["embedding"]] for item in items]
            usage = _usage(answer.get("usage"), estimate)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise UpstreamError(f"The engine's embedding answer could not be read: {exc}.") from exc
        if len(values) != len(body.inputs):
            raise UpstreamError(
                f"The engine answered {len(values)} embeddings for {len(body.inputs)} inputs."
            )
        size = _base64_size(values) if body.encoding_format == "base64" else None
        if size is not None and body.dimensions in (None, size):
            self._sizes[body.model] = (size, generation)
            return _listed(values, body.model, usage), usage  # as the engine wrote them
        vectors = _matrix(values)
        self._sizes[body.model] = (vectors.shape[1], generation)
        if body.dimensions is not None and body.dimensions != vectors.shape[1]:
            _check_dimensions(body, vectors.shape[1], matryoshka)
            vectors = _shorten(vectors, body.dimensions)
        encoded = [_encode(vector, body.encoding_format) for vector in vectors]
        return _listed(encoded, body.model, usage), usage


def _split(engine_body: bytes) -> tuple[dict[str, Any], list[Any]] | None:
    """The answer with each item's vector replaced by its place in the list beside it, which holds each
    vector's JSON text (a base64 string or a list of floats: neither holds the character that ends it); None
    where the answer is not of that plain shape (then it is parsed whole)."""
    parts: list[bytes] = []
    vectors: list[Any] = []
    at = 0
    while (found := _VECTOR.search(engine_body, at)) is not None:
        start = found.end()
        closing = _CLOSING.get(engine_body[start : start + 1])
        end = engine_body.find(closing, start + 1) if closing is not None else -1
        if end < 0:
            return None
        parts += (engine_body[at:start], str(len(vectors)).encode())
        vectors.append(engine_body[start : end + 1])
        at = end + 1
    parts.append(engine_body[at:])
    try:
        answer = orjson.loads(b"".join(parts))
    except orjson.JSONDecodeError:
        return None
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list) or not all(isinstance(item, dict) for item in data):
        return None
    if [item.get("embedding") for item in data] != list(range(len(vectors))):
        return None  # a vector found outside the items, or an item without one
    return answer, vectors


def _parsed(engine_body: bytes) -> tuple[dict[str, Any], list[Any]]:
    """`_split`'s result from one parse of the whole answer."""
    answer = orjson.loads(engine_body)
    vectors: list[Any] = []
    for item in answer["data"]:
        vectors.append(item["embedding"])
        item["embedding"] = len(vectors) - 1
    return answer, vectors


def _base64_size(values: list[Any]) -> int | None:
    """The size of vectors the engine wrote as plain base64 text, all of one size; None for any other."""
    sizes = set()
    for value in values:
        if not isinstance(value, bytes) or value[:1] != b'"' or value.find(b"\\") >= 0:
            return None
        text = len(value) - 2
        padding = 2 if value.endswith(b'=="') else 1 if value.endswith(b'="') else 0
        raw = text // 4 * 3 - padding
        if text % 4 or raw % 4:
            return None
        sizes.add(raw // 4)
    return sizes.pop() if len(sizes) == 1 else None


def _matrix(values: list[Any]) -> np.ndarray[Any, np.dtype[np.float32]]:
    """The vectors as rows of float32, read one at a time; UpstreamError unless all are of one size."""
    try:
        rows = [_vector(value) for value in values]
    except (orjson.JSONDecodeError, TypeError, ValueError) as exc:  # (a bad base64 text is a ValueError)
        raise UpstreamError(f"The engine's embedding answer could not be read: {exc}.") from exc
    if any(row.ndim != 1 or len(row) != len(rows[0]) for row in rows):
        raise UpstreamError("The engine's embedding answer could not be read: its vectors differ in shape.")
    return np.stack(rows)


def _vector(value: Any) -> np.ndarray[Any, np.dtype[np.float32]]:
    if isinstance(value, bytes):  # a vector's JSON text
        value = base64.b64decode(value[1:-1]) if value[:1] == b'"' else orjson.loads(value)
    elif isinstance(value, str):  # from a whole parse
        value = base64.b64decode(value)
    if isinstance(value, bytes):
        return np.frombuffer(value, dtype="<f4").astype(np.float32, copy=False)
    return np.asarray(value, dtype=np.float32)


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


def _encode(vector: np.ndarray[Any, Any], encoding: str) -> bytes:
    """A vector's JSON text: its float32 values as base64, or as numbers (each float32 written as the
    double it is, as Python writes it)."""
    if encoding == "base64":
        return b'"' + base64.b64encode(vector.astype("<f4").tobytes()) + b'"'
    return orjson.dumps(vector.astype(np.float64), option=orjson.OPT_SERIALIZE_NUMPY)


def _listed(vectors: list[bytes], model: str, usage: dict[str, int]) -> bytes:
    """The answer's JSON around the vectors' texts, written in one join (no copy of them on the way)."""
    parts = [b'{"object":"list","data":[']
    for i, vector in enumerate(vectors):
        parts += (b'{"object":"embedding","index":', str(i).encode(), b',"embedding":', vector, b"},")
    if vectors:
        parts[-1] = b"}"  # (the last item's, without the comma)
    parts += (b'],"model":', orjson.dumps(model), b',"usage":', orjson.dumps(usage), b"}")
    return b"".join(parts)
