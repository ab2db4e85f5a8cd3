"""The JSON an engine without tool calls is asked for: each shape it may answer in closed to other keys."""

from __future__ import annotations

import orjson

from corral.gateway.toolcalls import ToolEmulation


def test_each_answer_shape_allows_no_key_beyond_its_own() -> None:
    """With `auto`, the engine answers a call or a text; a text branch open to other keys let an answer of
    `{"content": .., "name": .., "arguments": ..}` become a call whose arguments no schema held."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [tool],
        "tool_choice": "auto",
    }
    sent = orjson.loads(ToolEmulation(body).request(body))
    schema = sent["response_format"]["json_schema"]["schema"]
    shapes = schema["anyOf"]
    assert len(shapes) == 2
    assert all(shape["additionalProperties"] is False for shape in shapes)
