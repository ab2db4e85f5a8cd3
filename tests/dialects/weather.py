"""What the agent tests share: a weather tool in each API's shape, and an Agents SDK agent that calls it."""

from __future__ import annotations

import openai
from agents import Agent, ModelSettings, OpenAIResponsesModel, function_tool, set_tracing_disabled

__all__ = ["MESSAGES_TOOL", "RESPONSES_TOOL", "weather_agent"]

RESPONSES_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"],
    },
}
MESSAGES_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city"],
    },
}


def weather_agent(model: str, client: openai.AsyncOpenAI, first_tool_ends: bool) -> tuple[Agent, list[str]]:
    """An agent with one function tool, get_weather, and the cities it was called with. With
    `first_tool_ends` the model must call the tool and its output is the run's answer (for a model whose
    own choice is not to be relied on); else the model answers once the tool's result is in."""
    set_tracing_disabled(True)  # the SDK would send its traces to OpenAI
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"Sunny in {city}."

    agent = Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=model, openai_client=client),
        model_settings=ModelSettings(tool_choice="required", temperature=0)
        if first_tool_ends
        else ModelSettings(),
        tool_use_behavior="stop_on_first_tool" if first_tool_ends else "run_llm_again",
    )
    return agent, cities
