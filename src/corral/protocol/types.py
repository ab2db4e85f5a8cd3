"""OpenAI request bodies, validated at the edge.

Known fields are checked (type and range, as OpenAI documents them); unknown fields are allowed and passed
through to the engine untouched, so engine-specific options keep working.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, model_validator

from corral.protocol.errors import InvalidRequest

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "GenerationRequest",
    "StreamOptions",
    "parse_body",
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True, strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None


Stop = str | Annotated[list[str], Field(max_length=16)] | None


class _Generation(_Body):
    model: Annotated[str, Field(min_length=1)]
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    seed: int | None = None
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
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None


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
_G = TypeVar("_G", bound=_Generation)


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
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool"})
