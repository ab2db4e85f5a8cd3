"""An engine's refusals as a client reads them: in OpenAI's shape, with a status that says whose fault
it was (the request's 4xx kept; the engine's own failures, and its refusing the gateway's credentials,
502), and how long a busy engine asked to be left alone; and what a client is told of an exception no stage
turned into an answer (`unexpected`)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import orjson
from aiohttp import web

from corral.gateway.clients import REQUEST_ID
from corral.protocol import APIError, StoreUnavailable, error_body
from corral.store import store_is_down

__all__ = ["busy_wait", "engine_error", "error_fields", "unexpected"]

logger = logging.getLogger(__name__)

_INPUT_TOO_LONG = re.compile(r"input (?:\((\d+) tokens\) )?is too large to process")


def busy_wait(retry_after: bytes) -> float:
    """A busy engine's Retry-After in seconds, within 1 to 60 (1 where it sent none, or a date)."""
    try:
        return float(min(max(int(retry_after), 1), 60))
    except ValueError:
        return 1.0


def engine_error(status: int, body: bytes) -> tuple[int, bytes]:
    """An engine's refusal in OpenAI's shape, whatever shape the engine used (llama.cpp puts a number in
    `code`, some servers answer plain text). A 4xx keeps its status: the request was at fault. The engine
    refusing the gateway's own credentials (401/403: a wrong engine_api_key) and any engine failure become
    502, so clients never mistake them for their own key or input being wrong."""
    message, param, code = error_fields(body)
    message = message or f"the engine answered {status}"
    too_long = _INPUT_TOO_LONG.search(message) if status >= 500 else None
    if too_long is not None:  # llama.cpp answers an over-long embedding input with a 500: the input's fault
        count = f": {too_long[1]} tokens" if too_long[1] else ""
        refusal: dict[str, str | None] = {
            "message": f"An input is too long for the model{count}, more than its replicas take per input. "
            "Shorten or split it.",
            "type": "invalid_request_error",
            "param": "input",
            "code": "context_length_exceeded",
        }
        return 400, orjson.dumps({"error": refusal})
    if status in (401, 403) or status >= 500:
        kind = "engine_auth_failed" if status in (401, 403) else "engine_error"
        return 502, error_body(f"The model's engine failed: {message}", "upstream_error", kind)
    refusal = {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    return status, orjson.dumps({"error": refusal})


def error_fields(body: bytes) -> tuple[str, str | None, str | None]:
    """(message, param, code) from an error body in any of the shapes engines use."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode("utf-8", errors="replace").strip()[:1000], None, None
    error = data.get("error", data) if isinstance(data, dict) else {}
    if not isinstance(error, dict):
        return str(error)[:1000], None, None
    param, code = error.get("param"), error.get("code")
    return (
        str(error.get("message") or error.get("detail") or "")[:1000],
        param if isinstance(param, str) else None,
        code if isinstance(code, str) else None,
    )


def unexpected(request: web.Request, exc: Exception, store_unanswered: Callable[[], None]) -> APIError:
    """What a client is told of an exception no stage turned into an answer: the store not answering is a
    503 to retry (one log line, counted by `store_unanswered`); anything else a 500, logged with its trace."""
    if store_is_down(exc):
        store_unanswered()
        logger.error(
            "the store did not answer %s %s (request %s): %s",
            request.method,
            request.path,
            request.get(REQUEST_ID),
            exc,
        )
        return StoreUnavailable("corral's store is not answering; try again shortly.", retry_after=5)
    logger.error(
        "unhandled error on %s %s (request %s)",
        request.method,
        request.path,
        request.get(REQUEST_ID),
        exc_info=exc,
    )
    return APIError("The gateway hit an internal error; it has been logged.")
