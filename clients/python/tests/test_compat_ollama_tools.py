"""Ollama's /api/chat with tools and thinking, through the official `ollama`
client, on the tools-think test model (a template that declares tools and
opens a thinking block): a tool round trip (the call forced by superfluid's
`tool_choice` extension, passed in `options`), a streamed call, reasoning in
`message.thinking`, `think: false`, and `/api/show`'s capabilities."""

import ollama

from compat import KEY, access_lines, number

MODEL = "SmolLM2-135M-tools-think.gguf"
EXTRA_ARGS = ["--api-key", KEY]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def oll(daemon):
    return ollama.Client(host=daemon.url, headers={"Authorization": "Bearer " + KEY}, timeout=120)


def test_tool_round_trip(daemon):
    c = oll(daemon)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.chat(model="default", messages=msgs, tools=[WEATHER, TIME], stream=False,
               options={"temperature": 0, "num_predict": 160, "tool_choice": "required"})
    calls = r.message.tool_calls
    assert calls and calls[0].function.name in ("get_weather", "get_time"), r
    # Arguments come back as an object, not as JSON text.
    assert isinstance(calls[0].function.arguments, dict)
    assert r.done_reason == "stop"
    msgs.append(r.message)
    msgs.append({"role": "tool", "content": "sunny, 21 C", "tool_name": calls[0].function.name})
    # The second turn through the client too: it serializes the tools (and
    # the resent message) its own way, the same way both times.
    r2 = c.chat(model="default", messages=msgs, tools=[WEATHER, TIME], stream=False,
                options={"temperature": 0, "num_predict": 40})
    assert r2.done and r2.message.role == "assistant"
    # The call and its result went back on the input, and the first request's
    # prompt (all of it evaluated then) is a cached prefix of the second's up
    # to the assistant header: the template opened its reply with `<think>\n`
    # (3 tokens), which a resent assistant message does not carry.
    line = access_lines(daemon)[-1]
    assert "POST /api/chat 200" in line
    prompt = int(line.split("prompt=")[1].split()[0])
    cached = int(line.split("cached=")[1].split()[0])
    assert cached >= r.prompt_eval_count - 3, (cached, r.prompt_eval_count)
    assert r2.prompt_eval_count == prompt - cached


def test_named_tool_streams_one_call(daemon):
    parts = list(oll(daemon).chat(
        model="default", messages=[{"role": "user", "content": "Time in Rome?"}], tools=[WEATHER, TIME],
        stream=True, options={"temperature": 0, "num_predict": 160,
                              "tool_choice": {"type": "function", "function": {"name": "get_time"}}}))
    calls = [tc for p in parts for tc in (p.message.tool_calls or [])]
    assert [tc.function.name for tc in calls] == ["get_time"]
    assert isinstance(calls[0].function.arguments, dict)
    assert parts[-1].done and parts[-1].done_reason == "stop"


def test_thinking_comes_back_in_message_thinking(daemon):
    c = oll(daemon)
    r = c.chat(model="default", messages=[{"role": "user", "content": "What is 2 + 2?"}], think=True,
               options={"temperature": 0, "num_predict": 12}, stream=False)
    assert r.message.thinking and "<think>" not in r.message.thinking
    # Streamed, the reasoning arrives in message.thinking too. Its text is not
    # compared with the reply above: greedy replies need not repeat bit for
    # bit across cache states (the pool's other contents change the rounding).
    parts = list(c.chat(model="default", messages=[{"role": "user", "content": "What is 2 + 2?"}], think=True,
                        options={"temperature": 0, "num_predict": 12}, stream=True))
    streamed = "".join(p.message.thinking or "" for p in parts)
    assert streamed.strip() and "<think>" not in streamed and "</think>" not in streamed
    assert parts[-1].done and 0 < parts[-1].eval_count <= 12
    # think: false closes the thinking block empty on the prompt: the model
    # answers at once, every token it draws is content, and the prompt is
    # longer by the closing tag.
    with_think = number(r"prompt=(\d+)", access_lines(daemon)[-1])
    r = c.chat(model="default", messages=[{"role": "user", "content": "What is 2 + 2?"}], think=False,
               options={"temperature": 0, "num_predict": 12}, stream=False)
    assert not r.message.thinking
    assert r.message.content.strip() and "</think>" not in r.message.content
    assert number(r"prompt=(\d+)", access_lines(daemon)[-1]) > with_think
    g = c.generate(model="default", prompt="What is 2 + 2?", think=True, options={"temperature": 0, "num_predict": 12},
                   stream=False)
    assert g.thinking and "<think>" not in g.thinking


def test_show_reports_tools_and_thinking(daemon):
    s = oll(daemon).show("default")
    assert {"completion", "tools", "thinking"} <= set(s.capabilities)
    assert "<think>" in s.template
