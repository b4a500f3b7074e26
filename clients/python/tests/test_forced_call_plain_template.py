"""A forced tool call on a template that names no tool-call marker of its own
(SmolLM2's plain ChatML, the default model): the grammar writes a Hermes
`<tool_call>` block, and that block is a call, through the session API
(a ToolUse, an open call in the ledger), OpenAI's chat route (`tool_calls`,
finish_reason "tool_calls") and Anthropic's (a `tool_use` block). Before,
the block came back as plain text on channel 0 and no call was made."""

import json

from compat import KEY, ant, oai

EXTRA_ARGS = ["--api-key", KEY]

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"]}
FN = {"name": "get_weather", "description": "Current weather in a city", "parameters": CITY}
ASK = "What is the weather in Paris?"


def test_a_forced_call_is_a_tool_use_on_the_session_api(daemon, sf):
    s = sf.session()
    s.declare(system="You answer with tools.", tools=[{"type": "function", "function": FN}])
    s.set_tool_choice("required")
    s.user(ASK)
    reply = s.generate(max_tokens=80)
    assert reply.finish == 3, reply
    assert [c.name for c in reply.tool_calls] == ["get_weather"], reply
    assert "city" in json.loads(reply.tool_calls[0].arguments)
    assert [c.name for c in s.open_tool_calls()] == ["get_weather"]
    # The call is no text of the reply.
    assert "<tool_call>" not in reply.text, reply.text


def test_a_forced_call_is_a_tool_call_on_the_chat_and_messages_routes(daemon):
    r = oai(daemon).chat.completions.create(
        model="default", messages=[{"role": "user", "content": ASK}], max_tokens=80, temperature=0,
        tools=[{"type": "function", "function": FN}], tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert [t.function.name for t in choice.message.tool_calls] == ["get_weather"], choice.message
    assert "city" in json.loads(choice.message.tool_calls[0].function.arguments)
    assert not (choice.message.content or "").strip().startswith("<tool_call>"), choice.message
    m = ant(daemon).messages.create(
        model="default", max_tokens=80, messages=[{"role": "user", "content": ASK}],
        tools=[{"name": FN["name"], "description": FN["description"], "input_schema": CITY}],
        tool_choice={"type": "any"})
    assert m.stop_reason == "tool_use", m
    uses = [b for b in m.content if b.type == "tool_use"]
    assert [u.name for u in uses] == ["get_weather"] and "city" in uses[0].input, m.content
