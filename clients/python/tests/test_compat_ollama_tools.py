"""Ollama's /api/chat with tools and thinking, through the official `ollama`
client, on the tools-think test model (a template that declares tools and
opens a thinking block): a tool round trip (the call forced by superfluid's
`tool_choice` extension, passed in `options`), a streamed call, reasoning in
`message.thinking`, `think: false`, and `/api/show`'s capabilities."""

import ollama
import pytest

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


def test_a_tool_name_that_names_no_open_call_is_refused(daemon):
    # A tool message whose tool_name matched no unanswered call used to
    # answer the earliest call of another name; it is a 400 now, before any
    # generation. Without tool_name, it answers the earliest unanswered call.
    c = oll(daemon)
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    asked = {"role": "user", "content": "What is the weather in Paris?"}
    opts = {"temperature": 0, "num_predict": 1}
    before = len(access_lines(daemon))
    for msgs in (
        [asked, call, {"role": "tool", "content": "12:00", "tool_name": "get_time"}],
        # The call is answered already: a second result of its name answers nothing.
        [asked, call, {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
         {"role": "tool", "content": "rainy", "tool_name": "get_weather"}],
        [asked, {"role": "tool", "content": "sunny", "tool_name": "get_weather"}],
    ):
        with pytest.raises(ollama.ResponseError) as e:
            c.chat(model="default", messages=msgs, tools=[WEATHER, TIME], stream=False, options=opts)
        assert e.value.status_code == 400, e.value
        assert "messages[{}].tool_name".format(len(msgs) - 1) in e.value.error, e.value.error
    lines = access_lines(daemon)[before:]
    assert len(lines) == 3 and all("POST /api/chat 400" in l and "generated=0" in l for l in lines), lines
    for tool in ({"role": "tool", "content": "sunny", "tool_name": "get_weather"},
                 {"role": "tool", "content": "sunny"}):
        r = c.chat(model="default", messages=[asked, call, tool], tools=[WEATHER, TIME], stream=False,
                   options=opts)
        assert r.done, r


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
