"""OpenAI-shaped errors.

Tree (every error the gateway answers with is one of these)::

    APIError                      status, type, code, message, param
    ├── InvalidRequest            400  invalid_request_error   (bad JSON, wrong field, bad value)
    ├── Unauthorized              401  invalid_request_error   code=invalid_api_key
    ├── PermissionDenied          403  permission_error        (key not allowed this model / admin API)
    ├── ModelNotFound             404  invalid_request_error   code=model_not_found
    ├── NotFound                  404  invalid_request_error   (unknown path)
    ├── MethodNotAllowed          405  invalid_request_error
    ├── Conflict                  409  invalid_request_error   code=conflict (changed under the request)
    ├── RequestTimeout            408  invalid_request_error   code=request_timeout (body not sent in time)
    ├── PayloadTooLarge           413  invalid_request_error   code=request_too_large
    ├── RateLimited               429  rate_limit_error        code=rate_limit_exceeded | insufficient_quota
    │                                                          (Retry-After, x-ratelimit-* headers)
    ├── NoCapacity                503  service_unavailable     (no ready replica, queue full or wait too long;
    │                                                          carries Retry-After)
    ├── StoreUnavailable          503  service_unavailable     code=store_unavailable (corral's database did
    │                                                          not answer; carries Retry-After)
    ├── UpstreamError             502  upstream_error          (replica failed before answering)
    └── UpstreamTimeout           504  timeout                 (replica did not answer in time)
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import orjson

__all__ = [
    "APIError",
    "Conflict",
    "InvalidRequest",
    "MethodNotAllowed",
    "ModelNotFound",
    "NoCapacity",
    "NotFound",
    "NotSupported",
    "PayloadTooLarge",
    "PermissionDenied",
    "RateLimited",
    "RequestTimeout",
    "StoreUnavailable",
    "Unauthorized",
    "UpstreamError",
    "UpstreamTimeout",
    "error_body",
]


class APIError(Exception):
    """An error the client sees as `{"error": {...}}` with an HTTP status."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    default_code: ClassVar[str | None] = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.retry_after = retry_after
        self.extra_headers = headers or {}

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_json(self) -> bytes:
        return orjson.dumps(self.to_dict())

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return self.extra_headers
        return {**self.extra_headers, "Retry-After": str(max(1, math.ceil(self.retry_after)))}


class InvalidRequest(APIError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(APIError):
    status = 401
    type = "invalid_request_error"
    default_code = "invalid_api_key"


class PermissionDenied(APIError):
    status = 403
    type = "permission_error"
    default_code = "permission_denied"


class RateLimited(APIError):
    status = 429
    type = "rate_limit_error"
    default_code = "rate_limit_exceeded"


class ModelNotFound(APIError):
    status = 404
    type = "invalid_request_error"
    default_code = "model_not_found"


class NotFound(APIError):
    status = 404
    type = "invalid_request_error"
    default_code = "not_found"


class NotSupported(APIError):
    """The request is understood but this deployment cannot do it (e.g. an admin action of a supervisor
    that runs in another process)."""

    status = 501
    type = "invalid_request_error"
    default_code = "not_supported"


class MethodNotAllowed(APIError):
    status = 405
    type = "invalid_request_error"
    default_code = "method_not_allowed"


class Conflict(APIError):
    """What the request changes was changed by another at the same time (two rotations of one key)."""

    status = 409
    type = "invalid_request_error"
    default_code = "conflict"


class RequestTimeout(APIError):
    status = 408
    type = "invalid_request_error"
    default_code = "request_timeout"


class PayloadTooLarge(APIError):
    status = 413
    type = "invalid_request_error"
    default_code = "request_too_large"


class NoCapacity(APIError):
    status = 503
    type = "service_unavailable"
    default_code = "no_ready_replica"


class StoreUnavailable(APIError):
    """corral's own store (SQLite/PostgreSQL) did not answer: try again shortly."""

    status = 503
    type = "service_unavailable"
    default_code = "store_unavailable"


class UpstreamError(APIError):
    status = 502
    type = "upstream_error"
    default_code = "upstream_failed"


class UpstreamTimeout(APIError):
    status = 504
    type = "timeout"
    default_code = "upstream_timeout"


def error_body(message: str, type_: str, code: str | None = None) -> bytes:
    """An error object for places that have no exception, such as an SSE error event."""
    return orjson.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}})
