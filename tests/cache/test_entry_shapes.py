"""A stored answer told the other way round, as engines write them: vLLM's whole chat answer (before it
dropped empty lists, its message carries `"tool_calls": []` and a null for every field it did not use)
answers a stream request and loses nothing, while one with a real tool call is still told only as stored."""

from __future__ import annotations

from typing import Any

import orjson

from corral.cache.entry import entry_from_whole

# A whole answer of vLLM 0.10's OpenAI server (ChatCompletionResponse, ChatMessage with its
# `tool_calls: list = Field(default_factory=list)`), as it serialises it.
VLLM_WHOLE = (
    b'{"id":"chatcmpl-4f7f2c6a1b9e4d0c","object":"chat.completion","created":1754000000,"model":"m",'
    b'"choices":[{"index":0,"message":{"role":"assistant","content":"Paris is the capital of France.",'
    b'"refusal":null,"annotations":null,"audio":null,"function_call":null,"tool_calls":[],'
    b'"reasoning_content":null},"logprobs":null,"finish_reason":"stop","stop_reason":null}],'
    b'"service_tier":null,"system_fingerprint":null,"usage":{"prompt_tokens":16,"total_tokens":24,'
    b'"completion_tokens":8,"prompt_tokens_details":null},"prompt_logprobs":null,"kv_transfer_params":null}'
)


def _events(sse: bytes) -> list[dict[str, Any]]:
    lines = [e.removeprefix(b"data: ") for e in sse.split(b"\n\n") if e]
    assert lines[-1] == b"[DONE]"
    return [orjson.loads(line) for line in lines[:-1]]


def test_a_whole_vllm_answer_with_empty_tool_calls_answers_a_stream_request() -> None:
    entry = entry_from_whole(VLLM_WHOLE, chat=True)
    assert entry is not None
    sse = entry.sse(with_usage=True)
    assert sse is not None
    chunks = _events(sse)
    text = "".join(str(c["choices"][0]["delta"].get("content") or "") for c in chunks if c["choices"])
    assert text == "Paris is the capital of France."
    assert chunks[1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"] == {"prompt_tokens": 16, "completion_tokens": 8, "total_tokens": 24}


def test_a_whole_answer_with_a_real_tool_call_is_told_only_as_stored() -> None:
    call = b'"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]'
    entry = entry_from_whole(VLLM_WHOLE.replace(b'"tool_calls":[]', call), chat=True)
    assert entry is not None and entry.sse(with_usage=False) is None and entry.whole() is not None
