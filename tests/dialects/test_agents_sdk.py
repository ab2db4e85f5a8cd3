"""The OpenAI Agents SDK runs an agent with one function tool to completion through /v1/responses: the
model calls the tool, the SDK runs it and sends its output back, the model answers (the simulator calls a
tool when the user spoke last, and answers once a tool's result is in)."""

from __future__ import annotations

import openai
from agents import Runner

from tests.dialects.conftest import Cluster
from tests.dialects.weather import weather_agent


async def test_an_agent_with_a_function_tool_runs_to_completion(cluster: Cluster) -> None:
    gateway = await cluster.gateway()
    client = openai.AsyncOpenAI(
        base_url=gateway.url + "/v1", api_key=await gateway.key("acme"), max_retries=0
    )
    agent, asked = weather_agent("m", client, first_tool_ends=False)
    result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    assert len(asked) == 1 and asked[0]  # the tool ran once, with the city the model gave
    assert isinstance(result.final_output, str) and result.final_output
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
