"""The simulator's tool calls and structured output: well-formed, on a schedule a test can count on.

With `tools`, a chat request whose last message is the user's gets a call of one tool (tool_choice `auto`
or `required`; the named one for a named choice; none for `none`); once a tool's result is the last
message, `auto` answers in text, so an agent loop ends after one round. The tool is drawn from the
request's seed, its arguments are JSON made from the tool's `parameters` schema (its required properties
and the rest), and so are answers with `response_format` (`json_schema`: from the schema; `json_object`:
an object). The text comes a few characters per token, as an engine's does.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from corral.protocol import ChatCompletionRequest, InvalidRequest
from corral.sim.text import TextGenerator

__all__ = ["Script", "script_for"]

_PIECE = 4  # characters of JSON per generated token


@dataclass
class Script:
    """What a choice will say, piece by piece: a tool call's arguments, or a JSON answer."""

    pieces: list[str]
    call_id: str | None = None  # a tool call (else structured text)
    name: str | None = None


def script_for(body: ChatCompletionRequest, rng: random.Random) -> Script | None:
    """The scripted answer of a chat request, or None for ordinary text."""
    extra = body.model_extra or {}
    tools = extra.get("tools")
    if tools is not None:
        call = _call(body, tools, extra.get("tool_choice", "auto"), rng)
        if call is not None:
            return call
    fmt = extra.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequest(
                "response_format.json_schema.schema must be an object.", param="response_format"
            )
        return Script(_pieces(orjson.dumps(_sample(schema, rng)).decode()))
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        words = TextGenerator(rng.getrandbits(32))
        answer = "".join(words.next_word(first=i == 0) for i in range(6))
        return Script(_pieces(orjson.dumps({"answer": answer}).decode()))
    return None


def _call(body: ChatCompletionRequest, tools: Any, choice: Any, rng: random.Random) -> Script | None:
    if not isinstance(tools, list) or not all(_function_name(t) for t in tools):
        raise InvalidRequest(
            "tools must be a list of {type: function, function: {name, ...}}.", param="tools"
        )
    names = [_function_name(t) for t in tools]
    if not names or choice == "none":
        return None
    if isinstance(choice, dict):
        wanted = (choice.get("function") or {}).get("name")
        if wanted not in names:
            raise InvalidRequest(
                f"tool_choice names a function not in tools: {wanted!r}.", param="tool_choice"
            )
        name = wanted
    elif choice in ("auto", "required"):
        if choice == "auto" and body.messages[-1].role != "user":
            return None  # the tool's result is in: the model answers
        name = names[rng.randrange(len(names))]
    else:
        raise InvalidRequest(
            "tool_choice must be none, auto, required or a named function.", param="tool_choice"
        )
    tool = tools[names.index(name)]
    schema = tool["function"].get("parameters") or {"type": "object"}
    arguments = orjson.dumps(_sample(schema, rng)).decode()
    return Script(
        _pieces(arguments), call_id="call_" + uuid.UUID(int=rng.getrandbits(128)).hex[:24], name=name
    )


def _function_name(tool: Any) -> str | None:
    if isinstance(tool, dict) and tool.get("type") == "function":
        name = (tool.get("function") or {}).get("name")
        return name if isinstance(name, str) and name else None
    return None


def _pieces(text: str) -> list[str]:
    return [text[i : i + _PIECE] for i in range(0, len(text), _PIECE)] or [""]


def _sample(schema: dict[str, Any], rng: random.Random, depth: int = 0) -> Any:
    """A value the schema accepts (enough of JSON Schema for tool parameters); a schema it cannot read
    gets a string, as an engine would answer something."""
    try:
        return _value(schema, rng, depth)
    except (TypeError, ValueError, AttributeError, KeyError, IndexError):
        return "value"


def _value(schema: dict[str, Any], rng: random.Random, depth: int) -> Any:
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][rng.randrange(len(schema["enum"]))]
    for union in ("anyOf", "oneOf"):
        if isinstance(schema.get(union), list) and schema[union]:
            return _sample(schema[union][0], rng, depth + 1)
    kind = schema.get("type", "object" if "properties" in schema else "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        properties = schema.get("properties") or {}
        if depth > 4:
            return {}
        return {
            name: _sample(sub, rng, depth + 1) for name, sub in properties.items() if isinstance(sub, dict)
        }
    if kind == "array":
        items: dict[str, Any] = (
            schema["items"] if isinstance(schema.get("items"), dict) else {"type": "string"}
        )
        count = max(int(schema.get("minItems") or 1), 1)
        return [_sample(items, rng, depth + 1) for _ in range(min(count, 3))] if depth <= 4 else []
    if kind == "integer":
        low, high = int(schema.get("minimum", 0)), int(schema.get("maximum", 100))
        return rng.randint(low, max(low, high))
    if kind == "number":
        bottom, top = float(schema.get("minimum", 0)), float(schema.get("maximum", 100))
        return round(rng.uniform(bottom, max(bottom, top)), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    words = TextGenerator(rng.getrandbits(32))
    return "".join(words.next_word(first=i == 0) for i in range(2))
