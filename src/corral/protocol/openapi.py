"""The gateway's OpenAPI 3.1 document, generated from the protocol's pydantic models (served at
/openapi.json, and what the schemathesis run in the tests fuzzes the gateway against): every route, the
generation routes, files and batches, the admin API, status, metrics and the console.

The Responses and Messages APIs are described loosely (their own published schemas are OpenAI's and
Anthropic's; tests/data/schemas holds them for the stream tests). Request bodies are the models the gateway
validates with (where a schema cannot say all the gateway
checks, it is looser than the gateway, never stricter); answers are described as loosely as engines write
them (extra fields such as llama.cpp's `timings` are allowed), errors exactly as the gateway writes them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from corral import __version__
from corral.protocol.types import ChatCompletionRequest, CompletionRequest, EmbeddingRequest

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


class Embedding(_Open):
    index: int
    embedding: list[float] | str


class EmbeddingList(_Open):
    object: str
    data: list[Embedding]
    model: str


class FileObject(_Open):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: str
    expires_at: int | None


class FileList(_Open):
    object: Literal["list"]
    data: list[FileObject]
    has_more: bool


class Deleted(_Open):
    id: str
    object: str
    deleted: bool


class NewBatch(_Open):
    """`completion_window`: "24h", or a shorter window ("30m", "90s"); `metadata`: at most 16 pairs."""

    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


class Batch(_Open):
    id: str
    object: Literal["batch"]
    endpoint: str
    input_file_id: str
    status: str


class BatchList(_Open):
    object: Literal["list"]
    data: list[Batch]
    has_more: bool


class Key(_Open):
    id: str
    tenant: str


class NewKeyAnswer(Key):
    key: str


class KeyList(_Open):
    keys: list[Key]


class Ready(_Open):
    ready: bool
    models: dict[str, int]


class Anything(_Open):
    """A JSON object (status, routing, rollouts, cache and console data: see docs/operations/watching.md)."""


class ResponseCreate(_Open):
    """OpenAI's Responses API request (the gateway's checks: dialects/openai_responses.py)."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    stream: bool = False
    store: bool = True
    max_output_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None


class ResponseObject(_Open):
    """A response (`stream: false`); a stream is `text/event-stream` of OpenAI's response events."""

    id: str
    object: Literal["response"]
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]


class InputItemList(_Open):
    object: Literal["list"]
    data: list[dict[str, Any]]
    has_more: bool


class MessageCreate(_Open):
    """Anthropic's Messages API request (the gateway's checks: dialects/anthropic_messages.py)."""

    model: str
    max_tokens: int
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    stream: bool = False


class CountTokens(_Open):
    model: str
    messages: list[dict[str, Any]]


class AnthropicMessage(_Open):
    """A message (`stream: false`); a stream is `text/event-stream` of Anthropic's message events."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    usage: dict[str, int]


class TokenCount(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Every refusal on /v1/messages, in Anthropic's shape."""

    type: Literal["error"]
    error: AnthropicErrorDetail


_MODELS: tuple[type[BaseModel], ...] = (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ChatCompletion,
    Completion,
    EmbeddingList,
    Model,
    ModelList,
    FileObject,
    FileList,
    Deleted,
    NewBatch,
    Batch,
    BatchList,
    Key,
    NewKeyAnswer,
    KeyList,
    Ready,
    Anything,
    ErrorResponse,
    ResponseCreate,
    ResponseObject,
    InputItemList,
    MessageCreate,
    CountTokens,
    AnthropicMessage,
    TokenCount,
    AnthropicError,
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
    "403": "The key may not use this model, or not the admin API",
    "404": "Unknown model, or no such file, batch, key or replica (another tenant's is unknown too)",
    "408": "The body did not arrive within gateway.body_timeout",
    "413": "Body larger than gateway.max_body_bytes (a file: batch.max_file_bytes)",
    "429": "Rate limit, monthly budget, queue share or file/batch quota reached (Retry-After, x-ratelimit-*)",
    "502": "The model's engine failed, or every replica failed before answering",
    "503": "No ready replica, queue full or timed out, or rate limits unavailable (Retry-After)",
    "504": "A replica stayed silent for gateway.read_timeout",
    "501": "This gateway runs without the part the route needs (a response cache, a supervisor)",
    "529": "Anthropic's overloaded: no ready replica, queue full or timed out (Retry-After)",
}
_TENANT = ("400", "401", "404", "408", "413", "429")
_ADMIN = ("400", "401", "403", "404", "408", "413", "501", "503")


def openapi_document(
    models: list[str] | None = None, key_schema: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The document as a JSON-able dict; `models` (those the gateway serves) become the `model` field's
    examples, so generated requests reach the engines rather than stopping at 404. `key_schema`: the
    admin API's new-key body (the store's model; any object when not given)."""
    schemas: dict[str, Any] = {}
    for model in _MODELS:
        schema = model.model_json_schema(ref_template=_REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    for request in ("ChatCompletionRequest", "CompletionRequest", "ResponseCreate", "MessageCreate"):
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
            "/v1/embeddings": {"post": _embeddings()},
            "/v1/models": {"get": _read("List the models this key may use", "ModelList", ("401",))},
            "/v1/models/{model}": {
                "get": _read("Retrieve one model", "Model", ("401", "404"), path=("model",))
            },
            **_dialects(),
            **_files(),
            **_batches(),
            **_admin(key_schema or {"type": "object"}),
            **_operations(),
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


def _read(
    summary: str,
    answer: str | None,
    statuses: tuple[str, ...],
    *,
    path: tuple[str, ...] = (),
    query: dict[str, dict[str, Any]] | None = None,
    body: dict[str, Any] | None = None,
    status: str = "200",
    content: str = "application/json",
) -> dict[str, Any]:
    """An operation answering `answer` (a schema name; None: any body of type `content`) with `status`,
    or one of the `statuses` in the error shape; path parameters are strings, `query` maps optional
    query parameters to their schemas."""
    schema = _ref(answer) if answer else {}
    operation: dict[str, Any] = {
        "summary": summary,
        "responses": {
            status: {"description": summary, "content": {content: {"schema": schema}}},
            **_errors(statuses),
        },
    }
    parameters = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}} for n in path]
    parameters += [{"name": n, "in": "query", "schema": q} for n, q in (query or {}).items()]
    if parameters:
        operation["parameters"] = parameters
    if body is not None:
        operation["requestBody"] = {"required": True, "content": body}
    return operation


def _json(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(name)}}


_PAGING: dict[str, dict[str, Any]] = {
    "limit": {"type": "integer", "minimum": 1, "maximum": 10000},
    "after": {"type": "string"},
}


def _embeddings() -> dict[str, Any]:
    return _read(
        "Create embeddings", "EmbeddingList", (*_TENANT, "502", "503", "504"), body=_json("EmbeddingRequest")
    )


def _dialects() -> dict[str, Any]:
    """The Responses API and Anthropic's Messages API (errors in Anthropic's shape there)."""
    one = ("401", "404")
    create = _generation("ResponseCreate", "ResponseObject", "model response")
    create["summary"] = "Create a model response (OpenAI's Responses API; streamed with stream: true)"
    messages = _generation("MessageCreate", "AnthropicMessage", "message")
    messages["summary"] = "Create a message (Anthropic's Messages API; streamed with stream: true)"
    anthropic = {"application/json": {"schema": _ref("AnthropicError")}}
    statuses = (*(s for s in _REFUSALS if s not in ("501", "503")), "529")
    messages["responses"] = {
        "200": messages["responses"]["200"],
        **{s: {"description": _REFUSALS[s], "content": anthropic} for s in statuses},
    }
    count = _read(
        "Count a message's input tokens (Anthropic's count_tokens)",
        "TokenCount",
        (),
        body=_json("CountTokens"),
    )
    count["responses"].update(
        {
            s: {"description": _REFUSALS[s], "content": anthropic}
            for s in ("400", "401", "403", "404", "408", "413")
        }
    )
    order: dict[str, dict[str, Any]] = {
        "order": {"type": "string", "enum": ["asc", "desc"]},
        "limit": {"type": "integer"},
    }
    return {
        "/v1/responses": {"post": create},
        "/v1/responses/{response_id}": {
            "get": _read("Retrieve a stored response", "ResponseObject", one, path=("response_id",)),
            "delete": _read("Delete a stored response", "Deleted", one, path=("response_id",)),
        },
        "/v1/responses/{response_id}/cancel": {
            "post": _read(
                "Cancel a background response", "ResponseObject", ("400", *one), path=("response_id",)
            )
        },
        "/v1/responses/{response_id}/input_items": {
            "get": _read(
                "A stored response's input items",
                "InputItemList",
                ("400", *one),
                path=("response_id",),
                query=order,
            )
        },
        "/v1/messages": {"post": messages},
        "/v1/messages/count_tokens": {"post": count},
    }


def _files() -> dict[str, Any]:
    upload = {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "properties": {
                    "purpose": {"type": "string", "enum": ["batch"]},
                    "file": {"type": "string", "format": "binary"},
                    "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
                    "expires_after[seconds]": {"type": "integer", "minimum": 3600, "maximum": 2592000},
                },
                "required": ["purpose", "file"],
            }
        }
    }
    one = ("401", "404")
    return {
        "/v1/files": {
            "post": _read("Upload a batch input file (JSONL)", "FileObject", _TENANT, body=upload),
            "get": _read(
                "List this tenant's files",
                "FileList",
                ("400", "401"),
                query={"purpose": {"type": "string"}, **_PAGING},
            ),
        },
        "/v1/files/{file_id}": {
            "get": _read("Retrieve a file", "FileObject", one, path=("file_id",)),
            "delete": _read("Delete a file", "Deleted", one, path=("file_id",)),
        },
        "/v1/files/{file_id}/content": {
            "get": _read("A file's content", None, one, path=("file_id",), content="application/octet-stream")
        },
    }


def _batches() -> dict[str, Any]:
    one = ("401", "404")
    return {
        "/v1/batches": {
            "post": _read("Create a batch from an uploaded file", "Batch", _TENANT, body=_json("NewBatch")),
            "get": _read("List this tenant's batches", "BatchList", ("400", "401"), query=_PAGING),
        },
        "/v1/batches/{batch_id}": {"get": _read("Retrieve a batch", "Batch", one, path=("batch_id",))},
        "/v1/batches/{batch_id}/cancel": {"post": _read("Cancel a batch", "Batch", one, path=("batch_id",))},
    }


def _admin(key_schema: dict[str, Any]) -> dict[str, Any]:
    key_body = {"application/json": {"schema": key_schema}}
    spec_body = {"application/yaml": {"schema": {"type": "string"}}}
    grace = {"grace": {"type": "string"}, "force": {"type": "string"}}
    return {
        "/admin/keys": {
            "get": _read("List keys", "KeyList", _ADMIN, query={"include_revoked": {"type": "string"}}),
            "post": _read(
                "Create a key (its secret is shown once)", "NewKeyAnswer", _ADMIN, body=key_body, status="201"
            ),
        },
        "/admin/keys/{key_id}": {
            "get": _read("Show a key", "Key", _ADMIN, path=("key_id",)),
            "patch": _read(
                "Change a key's limits or monthly budget",
                "Key",
                _ADMIN,
                path=("key_id",),
                body={"application/json": {"schema": {"type": "object"}}},
            ),
            "delete": _read("Revoke a key", "Key", _ADMIN, path=("key_id",)),
        },
        "/admin/keys/{key_id}/rotate": {
            "post": _read(
                "A new secret for a key (the old one accepted for ?grace= seconds)",
                "NewKeyAnswer",
                _ADMIN,
                path=("key_id",),
                query={"grace": {"type": "string"}},
            )
        },
        "/admin/audit": {
            "get": _read(
                "The audit trail (read only)",
                "Anything",
                _ADMIN,
                query={name: {"type": "string"} for name in ("action", "actor", "tenant", "since", "limit")},
            )
        },
        "/admin/usage": {
            "get": _read(
                "Usage by key, tenant or model", "Anything", _ADMIN, query={"by": {"type": "string"}}
            )
        },
        "/admin/routing": {"get": _read("Routing state of every replica", "Anything", _ADMIN)},
        "/admin/replicas/{replica_id}/drain": {
            "post": _read("Drain a replica", "Anything", _ADMIN, path=("replica_id",), query=grace)
        },
        "/admin/nodes/{node}/drain": {
            "post": _read("Drain every replica on a node", "Anything", _ADMIN, path=("node",), query=grace)
        },
        "/admin/spec": {
            "post": _read("Apply a cluster spec (YAML) live", "Anything", _ADMIN, body=spec_body)
        },
        "/admin/rollouts": {"get": _read("Rollouts and their phases", "Anything", _ADMIN)},
        "/admin/rollouts/{model}/{action}": {
            "post": _read(
                "Pause, resume or roll back a rollout", "Anything", _ADMIN, path=("model", "action")
            )
        },
        "/admin/cache": {
            "get": _read("Response cache statistics", "Anything", _ADMIN),
            "delete": _read(
                "Purge cached answers",
                "Anything",
                _ADMIN,
                query={"tenant": {"type": "string"}, "model": {"type": "string"}},
            ),
        },
    }


def _operations() -> dict[str, Any]:
    ready = _read("Every model can serve", "Ready", ())
    ready["responses"]["503"] = {"description": "A model has no ready replica", "content": _json("Ready")}
    sd = {"type": "array", "items": {"type": "object"}}
    discovery = _read("Prometheus service discovery: the replicas", None, ("401", "403"))
    discovery["responses"]["200"]["content"]["application/json"]["schema"] = sd
    return {
        "/health": {"get": _read("The gateway is up", "Anything", ())},
        "/ready": {"get": ready},
        "/corral/status": {"get": _read("Models and replicas", "Anything", ("401",))},
        "/corral/sd": {"get": discovery},
        "/metrics": {"get": _read("Prometheus metrics", None, ("401", "403"), content="text/plain")},
        "/openapi.json": {"get": _read("This document", None, ())},
        "/console": {"get": _read("The web console", None, (), content="text/html")},
        "/console/{name}": {
            "get": _read("A console asset", None, ("404",), path=("name",), content="application/javascript")
        },
        "/corral/console/data": {"get": _read("The console's figures (admin)", "Anything", ("401", "403"))},
        "/console/me": {"get": _read("Who is signed in to the console (auth.oidc)", "Anything", ())},
    }
