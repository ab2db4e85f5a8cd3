"""The new APIs on the wire of the embedded default: SmolLM2 on llama.cpp, whose chat template knows no
tools, so the gateway asks for tool calls as JSON (gateway/toolcalls.py) and llama.cpp's constrained
decoding holds the answer to it. Chat completions, the Responses API, Anthropic's Messages API and the
Agents SDK each get well-formed tool calls (their quality, from a 135M model, is not the point). Tool calls
are asked for greedily: sampled, the constrained JSON took 17-36 tokens in 40 tries here, and once in CI
ran past its max_tokens (an answer cut short is told as text, rightly, and the test failed)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import openai
import pytest
from agents import Runner

from tests.conftest import RunningCluster, start_cluster
from tests.dialects.weather import weather_agent

pytestmark = pytest.mark.slow  # a real llama.cpp replica (the simulator's versions run in test-fast)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    """The embedded default (tests/data/cluster.yaml; this folder's `cluster` is simulated)."""
    running = start_cluster(tmp_path_factory.mktemp("llamacpp"))
    yield running
    running.stop()


FUNCTION = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}


def test_chat_completions_get_tool_calls_from_a_model_without_tools(cluster: RunningCluster) -> None:
    client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0)
    tools = [{"type": "function", "function": FUNCTION}]
    whole = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=tools, tool_choice="required", max_tokens=60, temperature=0
    )
    (call,) = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    chunks = list(
        client.chat.completions.create(
            model="smollm2",
            messages=ASK,
            tools=tools,
            tool_choice="required",
            max_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    parts = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert parts and parts[0][0].function.name == "get_weather"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    followed = client.chat.completions.create(  # the result goes back as a turn the template can take
        model="smollm2",
        messages=[
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C."},
        ],
        tools=tools,
        tool_choice="none",
        max_tokens=12,
    )
    assert followed.choices[0].message.content and not followed.choices[0].message.tool_calls


def test_responses_and_messages_on_llamacpp(cluster: RunningCluster) -> None:
    client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0)
    tool = {"type": "function", **FUNCTION}
    first = client.responses.create(
        model="smollm2", input=ASK[0]["content"], tools=[tool], tool_choice="required", temperature=0
    )
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    second = client.responses.create(
        model="smollm2",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."}],
        max_output_tokens=12,
    )
    assert second.output_text
    events = list(
        client.responses.create(model="smollm2", input="Say hello.", max_output_tokens=24, stream=True)
    )
    last = events[-1]  # (completed, or incomplete where the sampled answer ran to max_output_tokens)
    assert last.type in ("response.completed", "response.incomplete") and last.response.output_text
    assert (
        "".join(e.delta for e in events if e.type == "response.output_text.delta")
        == last.response.output_text
    )

    claude = anthropic.Anthropic(base_url=cluster.url, api_key="none", max_retries=0)
    tools = [
        {"name": FUNCTION["name"], "description": "The weather.", "input_schema": FUNCTION["parameters"]}
    ]
    use = claude.messages.create(
        model="smollm2",
        max_tokens=60,
        messages=ASK,
        tools=tools,
        tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    )
    assert use.stop_reason == "tool_use" and use.content[0].type == "tool_use"
    with claude.messages.stream(model="smollm2", max_tokens=12, messages=ASK) as stream:
        message = stream.get_final_message()
    assert message.content[0].type == "text" and message.usage.output_tokens > 0


async def test_the_agents_sdk_runs_a_tool_on_llamacpp(cluster: RunningCluster) -> None:
    client = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="none", max_retries=0)
    agent, cities = weather_agent("smollm2", client, first_tool_ends=True)
    result = await Runner.run(agent, "What is the weather in Paris?", max_turns=3)
    assert len(cities) == 1 and result.final_output == f"Sunny in {cities[0]}."


def test_a_messages_prefill_is_continued_and_not_told_again_on_llamacpp(cluster: RunningCluster) -> None:
    """A last assistant turn is a prefill the answer goes on from, and Anthropic's answer holds only what
    follows it. llama.cpp, asked to continue it, streams only what follows; its whole answer began with the
    prefill (the client read it twice). Both tell what follows, the same text (greedy)."""
    claude = anthropic.Anthropic(base_url=cluster.url, api_key="none", max_retries=0)
    prefill = '{"city": "'
    turns: list = [*ASK, {"role": "assistant", "content": prefill}]
    whole = claude.messages.create(model="smollm2", max_tokens=6, messages=turns, extra_body=GREEDY)
    text = "".join(block.text for block in whole.content if block.type == "text")
    with claude.messages.stream(model="smollm2", max_tokens=6, messages=turns, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
    assert text and not text.startswith(prefill), text
    assert streamed == text
