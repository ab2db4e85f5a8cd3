"""The Responses API request's input and tools as a chat-completions request's: input items (messages,
function calls and their outputs, reasoning) as chat turns, function tools (and a namespace's) as chat
tools, `tool_choice` and `text.format` as theirs (dialects/openai_responses.py builds the request)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from corral.dialects.chat import not_shown
from corral.protocol import InvalidRequest
from corral.protocol.types import Body, encode, parse_part

__all__ = [
    "FunctionTool",
    "allowed_tools",
    "chat_messages",
    "chat_tool_choice",
    "chat_tools",
    "continues",
    "input_items",
    "response_format",
]


class FunctionTool(Body):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


def input_items(value: str | list[dict[str, Any]], token: str) -> list[dict[str, Any]]:
    """The request's input as items with ids (a string is one user message)."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    items = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise InvalidRequest(f"input[{i}] must be an object.", param=f"input[{i}]")
        kind = item.get("type") or "message"
        if kind == "message" or (kind is None and "role" in item):
            prefix = "msg_"
        elif kind in ("function_call", "function_call_output", "reasoning"):
            prefix = {"function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}[kind]
        else:
            raise InvalidRequest(
                f"input[{i}] is of type '{kind}', which this server does not take (it takes message, "
                "function_call, function_call_output and reasoning items).",
                param=f"input[{i}].type",
                code="unsupported_input_item",
            )
        normal = {"id": "", **item}  # (an id first, as OpenAI lists items; null or "" is none: made here)
        normal["id"], normal["type"] = item.get("id") or f"{prefix}{token}i{i:x}", kind
        if kind == "message" and isinstance(item.get("content"), str):  # listed as OpenAI lists it
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            normal["content"] = [{"type": part, "text": item["content"]}]
        items.append(normal)
    return items


def continues(item: dict[str, Any]) -> bool:
    """An earlier output item the next turn's input holds (its message, its calls, its reasoning), unless
    its stream was cut before it ended (a call's arguments would be broken JSON to the engine)."""
    return (
        item.get("type") in ("message", "function_call", "reasoning") and item.get("status") != "incomplete"
    )


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items as chat messages: consecutive function calls become one assistant turn's tool_calls."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequest(
                    f"input[{i}].role must be user, system, developer or assistant.", param=f"input[{i}].role"
                )
            # (a developer turn is a system turn to an engine's chat template)
            role = "system" if role == "developer" else role
            messages.append({"role": role, "content": _content(item.get("content"), i)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id") or item.get("id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # (its text and its calls: one turn)
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _output(item.get("output"), i)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
    return messages


def _output(output: Any, i: int) -> str:
    """A function call's output as a tool message's text: a string, its text parts joined, or (neither)
    its JSON. An image or file part is told as a note that it is not shown (a tool's message carries text
    only; refusing it would refuse every later turn of the agent's conversation, which keeps it)."""
    if isinstance(output, str):
        return output
    if not isinstance(output, list):
        return encode(output).decode()
    texts: list[str] = []
    for k, part in enumerate(output):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            texts.append(str(part.get("text") or ""))
        elif kind in ("input_image", "input_file"):
            texts.append(not_shown("an image" if kind == "input_image" else "a file"))
        else:
            where = f"input[{i}].output[{k}]"
            raise InvalidRequest(
                f"{where} is a part of type '{kind}', which this server does not take.",
                param=where,
                code="unsupported_content",
            )
    return "".join(texts)


def _content(content: Any, i: int) -> str | list[dict[str, Any]]:
    where = f"input[{i}].content"
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of parts.", param=where)
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal"):
            parts.append({"type": "text", "text": str(part.get("text") or part.get("refusal") or "")})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise InvalidRequest(
                    "input_image parts need an image_url (file_id is not served here).", param=where
                )
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise InvalidRequest(
                f"{where} holds a part of type '{kind}', which this server does not take.",
                param=where,
                code="unsupported_content",
            )
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The function tools the model is offered: each function, and those of a `namespace` (Codex groups
    its sub-agent tools so). Hosted tools (web search, file search, code interpreter, ...) are OpenAI's to
    run: the cluster has none, so they are not offered (Codex sends web_search with every request)."""
    offered: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            offered.append(_chat_tool(tool, f"tools[{i}]"))
        elif kind == "namespace" and isinstance(tool.get("tools"), list):
            offered += [_chat_tool(t, f"tools[{i}].tools[{j}]") for j, t in enumerate(tool["tools"])]
        elif not isinstance(kind, str):
            raise InvalidRequest(f"tools[{i}] needs a type.", param=f"tools[{i}].type")
    return offered


def _chat_tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidRequest(f"{where} must be a function tool.", param=f"{where}.type")
    parsed = parse_part(FunctionTool, tool, where)
    function: dict[str, Any] = {"name": parsed.name, "parameters": parsed.parameters or {"type": "object"}}
    if parsed.description is not None:
        function["description"] = parsed.description
    if parsed.strict is not None:
        function["strict"] = parsed.strict
    return {"type": "function", "function": function}


def allowed_tools(offered: list[dict[str, Any]], choice: dict[str, Any]) -> list[dict[str, Any]]:
    """The offered function tools an `allowed_tools` choice names (its hosted tools: none to run here)."""
    listed = choice.get("tools")
    if not isinstance(listed, list) or not all(isinstance(tool, dict) for tool in listed):
        raise InvalidRequest("tool_choice.tools must be a list of tools.", param="tool_choice.tools")
    names = {str(tool.get("name")) for tool in listed if tool.get("type") == "function"}
    unknown = names - {tool["function"]["name"] for tool in offered}
    if unknown:
        raise InvalidRequest(
            f"tool_choice allows the function '{sorted(unknown)[0]}', which is not among the tools.",
            param="tool_choice",
        )
    return [tool for tool in offered if tool["function"]["name"] in names]


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise InvalidRequest(
                "tool_choice must be auto, none, required or a function.", param="tool_choice"
            )
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice.get("type") == "allowed_tools" and choice.get("mode") in ("auto", "required"):
        return str(choice["mode"])
    raise InvalidRequest(
        f"tool_choice of type '{choice.get('type')}' is not served here: use auto, none, required or "
        "{type: function, name} (the hosted tools are OpenAI's to run).",
        param="tool_choice",
        code="unsupported_tool",
    )


def response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest(
                "text.format.schema must be a JSON schema object.", param="text.format.schema"
            )
        schema = {"name": fmt.get("name") or "answer", "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            schema["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": schema}
    raise InvalidRequest(
        "text.format.type must be text, json_object or json_schema.", param="text.format.type"
    )
