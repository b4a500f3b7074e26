"""An agent built with the OpenAI Agents SDK (openai-agents), pointed at the
daemon's Responses API, runs a two-tool task to completion on the
tools-think test model: it looks the weather up, then reports it, and the
run stops at the report. Each tool is enabled only when its step is due, so
the small model's choice is the task's order, and tool_choice "required"
keeps it calling tools; the calls, their arguments and the stored responses
are checked, not the model's prose."""

import asyncio
import json
from typing import Annotated

import openai
import pytest

from compat import KEY

agents = pytest.importorskip("agents")

MODEL = "SmolLM2-135M-tools-think.gguf"
EXTRA_ARGS = ["--api-key", KEY]


def test_two_tool_task_runs_to_completion(daemon):
    from agents import (Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, StopAtTools,
                        function_tool, set_tracing_disabled)

    set_tracing_disabled(True)  # no trace export to OpenAI: nothing leaves the machine
    calls = []

    def weather_due(ctx, agent):
        return not any(name == "get_weather" for name, _ in calls)

    def report_due(ctx, agent):
        return any(name == "get_weather" for name, _ in calls)

    from pydantic import Field

    # Bounded strings: the grammar built from each tool's schema ends the
    # call within max_tokens, whatever the small model would ramble.
    @function_tool(is_enabled=weather_due)
    def get_weather(city: Annotated[str, Field(max_length=24)]) -> str:
        """Current weather in a city."""
        calls.append(("get_weather", city))
        return "sunny, 21 C"

    @function_tool(is_enabled=report_due)
    def report(summary: Annotated[str, Field(max_length=60)]) -> str:
        """Report the answer to the user."""
        calls.append(("report", summary))
        return "REPORTED: " + summary

    client = openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    agent = Agent(
        name="weather",
        instructions="Look up the weather, then report it.",
        tools=[get_weather, report],
        model=OpenAIResponsesModel(model="default", openai_client=client),
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=160),
        reset_tool_choice=False,
        tool_use_behavior=StopAtTools(stop_at_tool_names=["report"]),
    )
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=6,
                                    run_config=RunConfig(tracing_disabled=True)))
    assert [name for name, _ in calls] == ["get_weather", "report"], calls
    assert all(isinstance(arg, str) for _, arg in calls)
    assert result.final_output == "REPORTED: " + calls[1][1]
    # Every model call was a stored response on the daemon, readable by id.
    ids = [r.response_id for r in result.raw_responses]
    assert len(ids) == 2 and all(i and i.startswith("resp_") for i in ids)
    sync = openai.OpenAI(base_url=daemon.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    for rid, (name, arg) in zip(ids, calls):
        got = [o for o in sync.responses.retrieve(rid).output if o.type == "function_call"]
        assert [o.name for o in got] == [name]
        assert list(json.loads(got[0].arguments).values()) == [arg]
