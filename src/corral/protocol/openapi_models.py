"""The shapes the OpenAPI document (openapi.py) lists as its schemas: answers described as loosely as engines
write them (extra fields such as llama.cpp's `timings` allowed), errors exactly as the gateway writes them,
files, batches, keys, and the Responses and Messages APIs' bodies (loosely: their own published schemas are
OpenAI's and Anthropic's). `MODELS`: every schema the document lists, the request bodies the gateway
validates with among them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from corral.protocol.types import ChatCompletionRequest, CompletionRequest, EmbeddingRequest

__all__ = ["MODELS"]


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
    models: dict[str, int] | None = None  # (on a closed gateway: only to those who may see its replicas)


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


MODELS: tuple[type[BaseModel], ...] = (
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
