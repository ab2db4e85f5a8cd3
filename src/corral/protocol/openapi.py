"""The gateway's OpenAPI 3.1 document, generated from the protocol's pydantic models (served at
/openapi.json, and what the schemathesis run in the tests fuzzes the gateway against): every route, the
generation routes, files and batches, the admin API, status, metrics and the console.

Its schemas are the shapes in openapi_models.py: request bodies are the models the gateway validates with
(where a schema cannot say all the gateway checks, it is looser than the gateway, never stricter); answers
are described as loosely as engines write them, errors exactly as the gateway writes them. The Responses and
Messages APIs are described loosely (their own published schemas are OpenAI's and Anthropic's;
tests/data/schemas holds them for the stream tests).
"""

from __future__ import annotations

from typing import Any

from corral import __version__
from corral.protocol.openapi_models import MODELS

__all__ = ["openapi_document"]


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
    "503": "No ready replica, every replica busy, queue full or timed out, or rate limits unavailable "
    "(Retry-After)",
    "504": "A replica stayed silent for gateway.read_timeout",
    "501": "This gateway runs without the part the route needs (a response cache, a supervisor)",
    "529": "Anthropic's overloaded: no ready replica, every replica busy, queue full or timed out "
    "(Retry-After)",
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
    for model in MODELS:
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
                query={
                    name: {"type": "string"}
                    for name in ("action", "actor", "tenant", "since", "request_id", "limit")
                },
            )
        },
        "/admin/usage": {
            "get": _read(
                "Usage by key, tenant, model, api or day from `since` up to `until` (ISO 8601 or epoch "
                "seconds, UTC; neither: this calendar month), or one request's records (`request_id`)",
                "Anything",
                _ADMIN,
                query={
                    "by": {"type": "string"},
                    "request_id": {"type": "string"},
                    "since": {"type": "string"},
                    "until": {"type": "string"},
                },
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
