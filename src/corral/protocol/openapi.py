"""The gateway's OpenAPI 3.1 document, generated from the protocol's pydantic models (served at
/openapi.json, and what the schemathesis run in the tests fuzzes the gateway against).

Request bodies are the models the gateway validates with; answers are described as loosely as engines
write them (extra fields such as llama.cpp's `timings` are allowed), errors exactly as the gateway writes
them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from corral import __version__
from corral.protocol.types import ChatCompletionRequest, CompletionRequest

__all__ = ["openapi_document"]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every refusal and failure, in OpenAI's shape."""

    error: ErrorDetail


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatMessageOut(_Open):
    role: str
    content: str | None = None


class ChatChoice(_Open):
    index: int
    message: ChatMessageOut
    finish_reason: str | None = None


class ChatCompletion(_Open):
    """A whole chat answer (`stream: false`); a stream is `text/event-stream` of chunks."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class TextChoice(_Open):
    index: int
    text: str
    finish_reason: str | None = None


class Completion(_Open):
    """A whole text completion (`stream: false`)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage | None = None


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


_MODELS: tuple[type[BaseModel], ...] = (
    ChatCompletionRequest,
    CompletionRequest,
    ChatCompletion,
    Completion,
    Model,
    ModelList,
    ErrorResponse,
)
_REF = "#/components/schemas/{model}"
# One server-sent event (OpenAPI 3.1 describes each event of a stream): `data` is a JSON chunk, a final
# `[DONE]`, or an error object when a stream is cut.
_SSE_EVENT = {
    "type": "object",
    "properties": {
        "data": {"type": "string"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
    "required": ["data"],
}
_REFUSALS = {
    "400": "Malformed JSON, a wrong type or value (param names the field), or more than the model holds",
    "401": "Missing, unknown or revoked API key (a closed gateway)",
    "403": "The key may not use this model",
    "404": "Unknown model",
    "413": "Body larger than gateway.max_body_bytes",
    "429": "Rate limit or monthly budget reached (Retry-After, x-ratelimit-*)",
    "502": "The model's engine failed, or every replica failed before answering",
    "503": "No ready replica, queue full or timed out, or rate limits unavailable (Retry-After)",
    "504": "A replica stayed silent for gateway.read_timeout",
}


def openapi_document(models: list[str] | None = None) -> dict[str, Any]:
    """The document as a JSON-able dict; `models` (those the gateway serves) become the `model` field's
    examples, so generated requests reach the engines rather than stopping at 404."""
    schemas: dict[str, Any] = {}
    for model in _MODELS:
        schema = model.model_json_schema(ref_template=_REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    for request in ("ChatCompletionRequest", "CompletionRequest"):
        if models:
            schemas[request]["properties"]["model"]["examples"] = models
            schemas[request]["properties"]["model"]["enum"] = models
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "corral",
            "version": __version__,
            "description": "An OpenAI-compatible inference gateway in front of a pool of engine replicas.",
        },
        "paths": {
            "/v1/chat/completions": {"post": _generation("ChatCompletionRequest", "ChatCompletion", "chat")},
            "/v1/completions": {"post": _generation("CompletionRequest", "Completion", "text")},
            "/v1/models": {"get": _read("List the models this key may use", "ModelList", ("401",))},
            "/v1/models/{model}": {
                "get": {
                    **_read("Retrieve one model", "Model", ("401", "404")),
                    "parameters": [
                        {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
                    ],
                }
            },
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{}, {"bearer": []}],
    }


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(model=name)}


def _errors(statuses: tuple[str, ...]) -> dict[str, Any]:
    content = {"application/json": {"schema": _ref("ErrorResponse")}}
    return {status: {"description": _REFUSALS[status], "content": content} for status in statuses}


def _generation(request: str, answer: str, kind: str) -> dict[str, Any]:
    return {
        "summary": f"Create a {kind} completion (streamed as server-sent events with stream: true)",
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {
                "description": "The answer, whole or streamed",
                "content": {
                    "application/json": {"schema": _ref(answer)},
                    "text/event-stream": {"schema": _SSE_EVENT},
                },
            },
            **_errors(tuple(_REFUSALS)),
        },
    }


def _read(summary: str, answer: str, statuses: tuple[str, ...]) -> dict[str, Any]:
    return {
        "summary": summary,
        "responses": {
            "200": {"description": summary, "content": {"application/json": {"schema": _ref(answer)}}},
            **_errors(statuses),
        },
    }
