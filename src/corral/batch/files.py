"""Batch input files: JSONL checked line by line, as OpenAI's Batch API defines them.

Each line is `{"custom_id": str, "method": "POST", "url": endpoint, "body": {...}}`. An upload with
`purpose=batch` is checked for that shape (a 400 names the first bad line); a batch created from it is
checked again against its endpoint and the cluster (one model, served; each body a valid request of the
endpoint; no streaming), and a batch whose lines do not pass fails at once with an error per line, as
OpenAI's does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import IO, Any

import orjson

from corral.dialects.openai_responses import ResponsesRequest, check_line
from corral.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    InvalidRequest,
    parse_body,
)
from corral.protocol.types import encode

__all__ = ["ENDPOINTS", "BatchInput", "check_upload", "read_batch_input"]

ENDPOINTS: dict[str, type[Any]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/responses": ResponsesRequest,
}
_MAX_ERRORS = 100  # listed in a failed batch's errors


@dataclass(frozen=True)
class BatchInput:
    """A batch file's requests, checked: one endpoint, one model."""

    model: str
    lines: list[tuple[str, bytes]]  # (custom_id, body)


def check_upload(source: IO[bytes], max_lines: int, max_line_bytes: int) -> int:
    """The number of requests in a `purpose=batch` upload, read a line at a time from `source` (a line
    longer than `max_line_bytes` is refused unread); InvalidRequest naming the first bad line."""
    count = 0
    for number, raw in enumerate(iter(lambda: source.readline(max_line_bytes + 1), b""), start=1):
        if len(raw) > max_line_bytes:
            raise InvalidRequest(
                f"Line {number} of the file is longer than {max_line_bytes:,} bytes (the largest request "
                "body this gateway takes).",
                param="file",
            )
        if not raw.strip():
            continue
        count += 1
        if count > max_lines:
            raise InvalidRequest(f"The file has more than {max_lines} requests (the most a batch holds).")
        problem = _shape_problem(raw)
        if problem is not None:
            raise InvalidRequest(
                f"Line {number} of the file is not a batch request: {problem}.", param="file"
            )
    if not count:
        raise InvalidRequest("The file holds no requests: a batch file has one JSON request per line.")
    return count


def read_batch_input(
    content: bytes, endpoint: str, served: dict[str, bool]
) -> tuple[BatchInput | None, list[dict[str, Any]]]:
    """The batch's requests, or the errors that fail it (each naming its line). `served` maps each model
    to whether it is an embedding model."""
    kind = ENDPOINTS[endpoint]
    errors: list[dict[str, Any]] = []
    lines: list[tuple[str, bytes]] = []
    seen: set[str] = set()
    models: set[str] = set()
    for number, raw in enumerate(content.split(b"\n"), start=1):  # (as the upload was read: \r is JSON space)
        if not raw.strip():
            continue
        problem = _shape_problem(raw)
        item = orjson.loads(raw) if problem is None else {}
        if problem is None:
            problem = _line_problem(item, endpoint, kind, served, seen)
        if problem is not None:
            if len(errors) < _MAX_ERRORS:
                errors.append({"code": "invalid_request", "message": problem, "param": None, "line": number})
            continue
        seen.add(item["custom_id"])
        models.add(item["body"]["model"])
        lines.append((item["custom_id"], orjson.dumps(item["body"])))
    if not errors and len(models) > 1:
        errors.append(
            {
                "code": "mixed_models",
                "message": "A batch's requests must all use one model; this file uses "
                f"{', '.join(_shown(m) for m in sorted(models)[:5])}{' …' if len(models) > 5 else ''}.",
                "param": "body.model",
                "line": None,
            }
        )
    if errors or not lines:
        return None, errors or [
            {"code": "empty_file", "message": "The file holds no requests.", "line": None}
        ]
    return BatchInput(models.pop(), lines), []


def _shape_problem(raw: bytes) -> str | None:
    try:
        item = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return f"not valid JSON ({exc})"
    if not isinstance(item, dict):
        return "not a JSON object"
    if not isinstance(item.get("custom_id"), str) or not 0 < len(item["custom_id"]) <= 512:
        return "'custom_id' must be a non-empty string of at most 512 characters"
    if "\x00" in item["custom_id"]:  # (PostgreSQL's text holds none: the batch could never be queued)
        return "'custom_id' must not hold the control character U+0000"
    if item.get("method") != "POST":
        return "'method' must be \"POST\""
    if item.get("url") not in ENDPOINTS:
        return f"'url' must be one of {', '.join(ENDPOINTS)}"
    if not isinstance(item.get("body"), dict):
        return "'body' must be a JSON object (the request)"
    return None


def _line_problem(
    item: dict[str, Any], endpoint: str, kind: type[Any], served: dict[str, bool], seen: set[str]
) -> str | None:
    if item["custom_id"] in seen:
        return f"custom_id {item['custom_id']!r} is used by an earlier line; each must be unique"
    if item["url"] != endpoint:
        return f"'url' is {item['url']} but the batch's endpoint is {endpoint}"
    body = item["body"]
    if body.get("stream"):
        return "'body.stream' must be false: a batch's answers are whole"
    try:
        request = encode(body)  # (JSON read it; a value orjson cannot write again is the line's error)
        parse_body(kind, request)
        if endpoint == "/v1/responses":  # (its input, tools and formats, as the request would be read)
            check_line(request)
    except InvalidRequest as exc:
        return f"body: {exc.message}"
    model = body["model"]
    if model not in served:
        return f"body.model: the model '{_shown(model)}' does not exist on this server"
    if served[model] != (endpoint == "/v1/embeddings"):
        what = "an embedding model" if served[model] else "not an embedding model"
        return f"body.model: '{_shown(model)}' is {what}; it cannot serve {endpoint}"
    return None


def _shown(value: str, most: int = 128) -> str:
    """A client's value as an error message repeats it: cut short (a failed batch keeps its errors, so a
    long model name on every line would be stored once a line)."""
    return value if len(value) <= most else value[:most] + "…"
