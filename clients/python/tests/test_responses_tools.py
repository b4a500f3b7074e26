"""Function tools through the Responses API with the official SDK, on the
tools-think test model (a template that declares tools and opens a thinking
block): a forced call, its output sent back as a function_call_output item on
the next response of the chain, a named call streamed with its argument
events, and each response's tool_choice read back as it was asked for."""

import json

from compat import KEY, oai

MODEL = "SmolLM2-135M-tools-think.gguf"
EXTRA_ARGS = ["--api-key", KEY]

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"]}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": CITY}
TIME = {"type": "function", "name": "get_time", "description": "Current time in a city", "parameters": CITY}


def test_function_call_round_trip(daemon):
    c = oai(daemon)
    r1 = c.responses.create(model="default", input="What is the weather in Paris?", tools=[WEATHER, TIME],
                            tool_choice="required", max_output_tokens=160, temperature=0)
    calls = [o for o in r1.output if o.type == "function_call"]
    assert len(calls) == 1, r1.output
    call = calls[0]
    assert call.name in ("get_weather", "get_time")
    assert "city" in json.loads(call.arguments)
    assert call.call_id.startswith("call_") and r1.status == "completed"
    assert r1.tool_choice == "required"
    r2 = c.responses.create(model="default", previous_response_id=r1.id, tools=[WEATHER, TIME],
                            input=[{"type": "function_call_output", "call_id": call.call_id,
                                    "output": "sunny, 21 C"}],
                            max_output_tokens=40, temperature=0)
    # The output went on the input after the call, and r1's whole prompt was
    # a cached prefix of r2's.
    assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens
    items = c.responses.input_items.list(r2.id).data
    assert [(i.type, i.call_id, i.output) for i in items] == [("function_call_output", call.call_id,
                                                               "sunny, 21 C")]
    # r2 asked for no forced call: it is "auto", in the reply and read back,
    # though the chain's first response forced one.
    assert r2.tool_choice == "auto"
    assert c.responses.retrieve(r1.id).tool_choice == "required"
    assert c.responses.retrieve(r2.id).tool_choice == "auto"
    # The call reads back with the same id, so a client can answer it later.
    again = [o for o in c.responses.retrieve(r1.id).output if o.type == "function_call"]
    assert [(o.call_id, o.name, o.arguments) for o in again] == [(call.call_id, call.name, call.arguments)]


def test_named_call_streamed_with_argument_events(daemon):
    c = oai(daemon)
    with c.responses.stream(model="default", input="Time in Rome?", tools=[WEATHER, TIME],
                            tool_choice={"type": "function", "name": "get_time"},
                            max_output_tokens=160, temperature=0) as s:
        events = list(s)
        final = s.get_final_response()
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types
    assert "response.function_call_arguments.done" in types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = [e for e in events if e.type == "response.function_call_arguments.done"][0]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == done.arguments
    calls = [o for o in final.output if o.type == "function_call"]
    assert [o.name for o in calls] == ["get_time"]
    assert json.loads(calls[0].arguments) == json.loads(done.arguments)
    assert final.tool_choice.type == "function" and final.tool_choice.name == "get_time"
