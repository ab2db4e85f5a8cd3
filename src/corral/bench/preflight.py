"""One request before a load run: is the server there, does the endpoint exist, does it serve the model?

Without it a wrong `--model` or a `--base-url` ending in `/v1` turns every request of a run into an error
and the run into a table of zeros.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any

__all__ = ["PreflightError", "preflight"]


class PreflightError(Exception):
    """The endpoint cannot serve the run; the message says why and what to change."""


def preflight(base_url: str, model: str, endpoint: str, api_key: str | None, timeout: float = 30) -> None:
    """Send one short streamed request; raise PreflightError unless the server accepts it (or is merely
    busy: 429 and 503 mean it is there)."""
    base = base_url.rstrip("/")
    if base.endswith("/v1") and endpoint.startswith("/v1/"):
        raise PreflightError(
            f"--base-url {base_url} ends in /v1, and the endpoint {endpoint} adds another: "
            f"use --base-url {base.removesuffix('/v1')}"
        )
    url = base + endpoint
    body: dict[str, Any] = {"model": model, "max_tokens": 1, "stream": True}
    if "chat" in endpoint:
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = "Hi"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read(65536)
    except urllib.error.HTTPError as exc:
        if exc.code in (429, 503):
            return
        raise PreflightError(_refusal(exc, url, base, model, api_key)) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise PreflightError(f"cannot reach {url}: {reason}") from None
    except http.client.HTTPException as exc:  # a broken answer: cut off, or not HTTP at all
        raise PreflightError(
            f"{url} broke off its answer to a one-token test request ({type(exc).__name__}: {exc}); "
            "is it an OpenAI-compatible server?"
        ) from None


def _refusal(exc: urllib.error.HTTPError, url: str, base: str, model: str, api_key: str | None) -> str:
    message = _message(exc)
    if exc.code == 401:
        return f"{url} needs an API key (--api-key): {message}"
    if exc.code == 404 and ("model" in message.lower() or _code(message) == "model_not_found"):
        served = _served_models(base, api_key)
        listing = f"; it serves: {', '.join(served)}" if served else ""
        return f"the server at {base} does not serve the model {model!r}{listing} (--model)"
    if exc.code in (404, 405):
        return f"{url} answered {exc.code}: no such endpoint there; check --base-url and --endpoint"
    return f"{url} refused a one-token test request with {exc.code}: {message}"


def _message(exc: urllib.error.HTTPError) -> str:
    try:
        text = exc.read(65536).decode("utf-8", errors="replace")
    except (OSError, http.client.HTTPException):
        return str(exc.reason)
    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return text.strip()[:200] or str(exc.reason)
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error or text[:200])


def _code(message: str) -> str | None:
    return "model_not_found" if "does not exist" in message else None


def _served_models(base: str, api_key: str | None) -> list[str]:
    request = urllib.request.Request(base + "/v1/models")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return [str(m["id"]) for m in json.load(response).get("data", [])]
    except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError, AttributeError):
        return []
