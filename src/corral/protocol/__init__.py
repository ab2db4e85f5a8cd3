"""OpenAI wire types and errors, shared by the gateway, the simulator and bench."""

from corral.protocol.errors import (
    APIError,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotFound,
    NoCapacity,
    NotFound,
    NotSupported,
    PayloadTooLarge,
    PermissionDenied,
    RateLimited,
    RequestTimeout,
    Unauthorized,
    UpstreamError,
    UpstreamTimeout,
    error_body,
)
from corral.protocol.types import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    StreamOptions,
    parse_body,
)

__all__ = [
    "APIError",
    "ChatCompletionRequest",
    "CompletionRequest",
    "GenerationRequest",
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
    "StreamOptions",
    "Unauthorized",
    "UpstreamError",
    "UpstreamTimeout",
    "error_body",
    "parse_body",
]
