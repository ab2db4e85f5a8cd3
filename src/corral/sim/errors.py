"""Errors as vLLM's OpenAI server words them (0.32, `vllm/entrypoints/serve/exception_handling/`).

vLLM's body is OpenAI's shape with its own values: `{"error": {"message", "type", "param", "code"}}`, the
`type` one of vLLM's names (`NotFoundError`, `InvalidUserInput`, `InternalServerError`, ...) and `code` the
HTTP status as an int. Messages go through vLLM's `sanitize_message`, which hides file paths under the
usual system folders (`/tmp/x` reads `<path>`).
"""

from __future__ import annotations

import re

import orjson

__all__ = ["VllmError", "bad_request", "model_not_found", "sanitize"]

_SANITIZERS = (
    (re.compile(r" at 0x[0-9a-fA-F]+>"), ">"),
    (re.compile(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?'), ""),
    (re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+"), "<path>"),
    (re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+"), "<path>"),
)


def sanitize(message: str) -> str:
    """vLLM's `sanitize_message`: memory addresses, tracebacks and file paths taken out."""
    for pattern, replacement in _SANITIZERS:
        message = pattern.sub(replacement, message)
    return message.strip()


class VllmError(Exception):
    """An error answer in vLLM's words, with its HTTP status."""

    def __init__(self, message: str, type_: str, status: int, param: str | None = None) -> None:
        super().__init__(message)
        self.message = sanitize(message)
        self.type = type_
        self.status = status
        self.param = param

    def to_json(self) -> bytes:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.status}
        return orjson.dumps({"error": error})


def model_not_found(model: str, served: str) -> VllmError:
    """vLLM's answer to a request for a model it does not serve (nor an adapter of that name)."""
    return VllmError(
        f"The model `{model}` does not exist. Valid aliases: {served}.", "NotFoundError", 404, param="model"
    )


def bad_request(message: str, param: str | None = None) -> VllmError:
    """vLLM's answer to a request its validation refuses (a `VLLMValidationError`, naming the parameter)."""
    return VllmError(message, "BadRequestError", 400, param=param)
