"""OpenAI request bodies, validated at the edge.

Known fields are checked (type and range, as OpenAI documents them); unknown fields are allowed and passed
through to the engine untouched, so engine-specific options keep working.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, TypeVar

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)

from corral.protocol.errors import InvalidRequest

__all__ = [
    "Body",
    "ChatCompletionRequest",
    "CompletionRequest",
    "EmbeddingRequest",
    "GenerationRequest",
    "StreamOptions",
    "encode",
    "parse_body",
    "parse_part",
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True, strict=True)


Body = _Body  # for the dialects' own request bodies: known fields checked, unknown ones kept


class StreamOptions(_Body):
    include_usage: bool = False


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None


Stop = str | Annotated[list[str], Field(max_length=16)] | None
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]  # what JSON libraries (and engines) hold exactly


class _Generation(_Body):
    model: Annotated[str, Field(min_length=1)]
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1, lt=2**31)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    seed: Seed | None = None
    stop: Stop = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @model_validator(mode="after")
    def _options_need_stream(self) -> _Generation:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class ChatCompletionRequest(_Generation):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, lt=2**31)] | None = None


TokenId = Annotated[int, Field(ge=0, lt=2**31)]  # engines index vocabularies with 32-bit integers


class CompletionRequest(_Generation):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )

    @property
    def prompts(self) -> list[Any]:
        """The prompts this request asks about: a string or token-id list is one; a list of them, each."""
        prompt = self.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)

    echo: bool = False


GenerationRequest = ChatCompletionRequest | CompletionRequest

_MAX_INPUTS = 2048  # inputs in one embedding request (OpenAI's limit)
EmbeddingInput = (
    Annotated[str, Field(min_length=1)]
    | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=_MAX_INPUTS)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[
        list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=_MAX_INPUTS)
    ]
)


class EmbeddingRequest(_Body):
    """/v1/embeddings: one input (a string or token ids) or a list of them (OpenAI allows 2048)."""

    model: Annotated[str, Field(min_length=1)]
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None

    # what the pipeline asks of every request: an embedding answer is one JSON body, never a stream
    stream: ClassVar[bool] = False
    include_usage: ClassVar[bool] = False
    n: ClassVar[int] = 1

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        """One clear message for the shapes OpenAI accepts (the union's own errors name its members)."""
        if isinstance(value, str) and value:
            return value
        if isinstance(value, list) and value:
            if all(type(v) is int for v in value):  # one input's token ids, however many
                return value
            texts = all(isinstance(v, str) and v for v in value)
            if texts or all(isinstance(v, list) and v and all(type(t) is int for t in v) for v in value):
                if len(value) > _MAX_INPUTS:
                    raise ValueError(f"input holds at most {_MAX_INPUTS} inputs; this one holds {len(value)}")
                return value
        raise ValueError(
            "input must be a non-empty string, a list of non-empty strings, a list of token ids, or a list "
            "of token-id lists"
        )

    @property
    def inputs(self) -> list[str | list[int]]:
        value = self.input
        if isinstance(value, str) or isinstance(value[0], int):
            return [value]
        return list(value)


_G = TypeVar("_G", bound=_Body)


def parse_part(kind: type[_G], value: Any, where: str) -> _G:
    """Validate a part of a body already read (a tool, a block); a problem becomes InvalidRequest naming
    it by `where` (its place in the body)."""
    try:
        return kind.model_validate(value)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        loc = ".".join([where, *(str(p) for p in err["loc"] if not _is_type_tag(p))])
        raise InvalidRequest(f"Invalid value for '{loc}': {err['msg']}.", param=loc) from exc


def encode(value: Any) -> bytes:
    """A request (or part of one) as JSON for the engine. What JSON parsing took but orjson cannot write
    again, an integer beyond 64 bits or nesting past its 254 levels, is the client's 400, not a 500."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError as exc:
        raise InvalidRequest(
            f"The request holds a value the gateway cannot pass on ({exc}): integers must fit in 64 bits "
            "and objects nest at most 254 deep."
        ) from exc


def parse_body(kind: type[_G], body: bytes) -> _G:
    """Validate a JSON body; a problem becomes InvalidRequest naming the field."""
    if not body:
        raise InvalidRequest("The request body is empty; send a JSON object.")
    try:
        return kind.model_validate_json(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            raise InvalidRequest(f"The body is not valid JSON: {err['msg']}") from exc
        loc = [str(p) for p in err["loc"] if not _is_type_tag(p)]
        param = ".".join(loc) or None
        if err["type"] == "model_type":
            raise InvalidRequest("The body must be a JSON object.") from exc
        what = f"'{param}'" if param else "the body"
        raise InvalidRequest(f"Invalid value for {what}: {err['msg']}.", param=param) from exc


def _is_type_tag(part: int | str) -> bool:
    """pydantic adds union members (`str`, `list[str]`) to locations; they are not field names."""
    return isinstance(part, str) and (
        "[" in part
        or part in {"str", "int", "float", "bool"}
        or part.startswith(("constrained-", "function-"))
    )
