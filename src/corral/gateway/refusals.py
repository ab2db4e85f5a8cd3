"""An engine's refusals as a client reads them: in OpenAI's shape, with a status that says whose fault
it was (the request's 4xx kept; the engine's own failures, and its refusing the gateway's credentials,
502), and how long a busy engine asked to be left alone; what a client is told when no replica answered
(`unanswered`: how many were tried and how, never a replica's id or address, which the log keeps); and
what a client is told of an exception no stage turned into an answer (`unexpected`)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import orjson
from aiohttp import web

from corral.engines.client import EngineConnectionError, EngineUnreachable
from corral.gateway.adapters import AdapterLoadFailed
from corral.gateway.clients import REQUEST_ID
from corral.gateway.context import RequestContext
from corral.protocol import APIError, NoCapacity, StoreUnavailable, UpstreamError, error_body
from corral.routing import Replica
from corral.routing.adapters import ASK_AGAIN_S
from corral.store import store_is_busy, store_is_down

__all__ = ["busy_wait", "engine_error", "error_fields", "failed_how", "unanswered", "unexpected"]

logger = logging.getLogger(__name__)

_INPUT_TOO_LONG = re.compile(r"input (?:\((\d+) tokens\) )?is too large to process")


def busy_wait(retry_after: bytes) -> float:
    """A busy engine's Retry-After in seconds, within 1 to 60 (1 where it sent none, or a date)."""
    try:
        return float(min(max(int(retry_after), 1), 60))
    except ValueError:
        return 1.0


def engine_error(status: int, body: bytes, request_id: str | None = None) -> tuple[int, bytes]:
    """An engine's refusal in OpenAI's shape, whatever shape the engine used (llama.cpp puts a number in
    `code`, some servers answer plain text). A 4xx keeps its status and message: the request was at fault.
    The engine refusing the gateway's own credentials (401/403: a wrong engine_api_key) and any engine
    failure become 502, so clients never mistake them for their own key or input being wrong; their message
    (a server's paths, its internals) goes to the log under the request's id, not to the client."""
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
        logger.warning("request %s: the engine answered %d: %s", request_id or "-", status, message[:300])
        if status in (401, 403):
            said = f"The model's engine refused the gateway's credentials (it answered {status})."
            return 502, error_body(said, "upstream_error", "engine_auth_failed")
        said = f"The model's engine failed (it answered {status}); the gateway's log has its message."
        return 502, error_body(said, "upstream_error", "engine_error")
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


def unanswered(
    ctx: RequestContext, tried: list[Replica], failure: str, busy: float, refused: int
) -> APIError:
    """What the client is told when no replica answered: the model, how many replicas were tried and how the
    last one failed, never a replica's id or address (a closed gateway hides them: the log has them)."""
    if busy > 0:  # every replica tried was full or loading: not broken, and no fault of the client's
        return NoCapacity(
            f"The model's replicas are busy (the last {failure}); try again shortly.",
            code="replicas_busy",
            retry_after=busy,
        )
    adapter = ctx.route.adapter
    if refused and refused == len(tried) and adapter is not None:  # its files, which no replica can load
        logger.warning(
            "request %s: adapter %s refused by every replica tried (%s)",
            ctx.request_id,
            adapter.name,
            ", ".join(r.id for r in tried),
        )
        return NoCapacity(
            f"The adapter '{adapter.name}' could not be loaded: the {_replicas(refused)} tried refused it. "
            "Try again later; if it goes on, its operator must look at its files.",
            param="model",
            code="adapter_unavailable",
            retry_after=ASK_AGAIN_S,
        )
    return UpstreamError(
        f"The model '{ctx.model}' failed to answer: {_replicas(len(tried))} tried, the last {failure}."
    )


def _replicas(count: int) -> str:
    return "1 replica" if count <= 1 else f"{count} replicas"


def failed_how(exc: EngineConnectionError | AdapterLoadFailed) -> str:
    """How a replica failed, as a client is told (the exception's text names the engine's address)."""
    if isinstance(exc, AdapterLoadFailed):
        return "could not be reached to load the adapter"
    if isinstance(exc, EngineUnreachable):
        return "could not be reached"
    return "dropped the connection"


def unexpected(request: web.Request, exc: Exception, store_unanswered: Callable[[], None]) -> APIError:
    """What a client is told of an exception no stage turned into an answer: the store not answering is a
    503 to retry (one log line, counted by `store_unanswered`); anything else a 500, logged with its trace."""
    if store_is_busy(exc):  # (it answers: not counted as the store down, nor alerted on)
        logger.warning(
            "the store cut %s %s short (request %s): %s",
            request.method,
            request.path,
            request.get(REQUEST_ID),
            getattr(exc, "orig", exc),
        )
        return StoreUnavailable(
            "corral's store took too long on this request (a report over a long span, or another upload of "
            "the tenant's holding its lock): ask for less, or try again shortly.",
            code="store_busy",
            retry_after=5,
        )
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
