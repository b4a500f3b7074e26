"""Tool calls through the OpenAI and Anthropic routes, with the official SDKs,
on the tools-think test model (a template that declares tools and opens a
thinking block): a round trip with tool_choice required and auto, a named
tool, reasoning_content, and Anthropic streaming with a tool_use block."""

import json

from compat import KEY, ant, oai

MODEL = "SmolLM2-135M-tools-think.gguf"
EXTRA_ARGS = ["--api-key", KEY]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_openai_tool_round_trip_required_then_auto(daemon):
    c = oai(daemon)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.chat.completions.create(model="default", messages=msgs, tools=[WEATHER, TIME], tool_choice="required",
                                  max_tokens=160, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    call = ch.message.tool_calls[0]
    assert call.function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(call.function.arguments), dict)
    msgs.append(ch.message.model_dump(exclude_none=True))
    msgs.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"})
    r2 = c.chat.completions.create(model="default", messages=msgs, tools=[WEATHER, TIME], tool_choice="auto",
                                   max_tokens=60, temperature=0)
    # The call and its result went back on the input, and the first request's
    # prompt is a cached prefix of the second's up to the assistant header:
    # the template opened its reply with `<think>\n` (3 tokens), which a
    # resent assistant message does not carry.
    assert r2.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens - 3
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_openai_named_tool_and_streamed_call(daemon):
    c = oai(daemon)
    chunks = list(c.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Time in Rome?"}], tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=160, temperature=0,
        stream=True))
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in calls] == ["get_time"]
    assert calls[0].index == 0 and calls[0].id.startswith("call_")
    assert isinstance(json.loads(calls[0].function.arguments), dict)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["tool_calls"]


def test_reasoning_content(daemon):
    r = oai(daemon).chat.completions.create(
        model="default", messages=[{"role": "user", "content": "What is 2 + 2?"}], max_tokens=12, temperature=0)
    m = r.choices[0].message
    # The template opens a thinking block: what the model writes first is reasoning.
    assert getattr(m, "reasoning_content", None), m
    assert "<think>" not in m.reasoning_content
    # usage counts the reasoning's tokens (it said 0): here the whole reply.
    assert not m.content and r.usage.completion_tokens == 12, r
    assert r.usage.completion_tokens_details.reasoning_tokens == 12, r.usage


def test_anthropic_streams_a_tool_use_block(daemon):
    a = ant(daemon)
    tools = [{"name": "get_weather", "description": "Current weather in a city",
              "input_schema": WEATHER["function"]["parameters"]}]
    # Greedy: with a random seed, the forced call's string argument can run
    # past max_tokens before the call closes, and then it is not a call.
    with a.messages.stream(model="default", max_tokens=160, extra_body={"temperature": 0}, tools=tools,
                           tool_choice={"type": "any"},
                           messages=[{"role": "user", "content": "Weather in Oslo?"}]) as s:
        events = list(s)
        final = s.get_final_message()
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert "tool_use" in starts
    assert any(e.type == "input_json" for e in events)
    use = [b for b in final.content if b.type == "tool_use"][0]
    assert use.name == "get_weather" and isinstance(use.input, dict)
    assert final.stop_reason == "tool_use"
    # The result goes back as a tool_result block answering that id.
    m = a.messages.create(model="default", max_tokens=30, tools=tools, messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "snow, -3 C"}]}])
    assert m.usage.cache_read_input_tokens > 0 and m.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_logprobs_are_the_replys_and_a_cut_close_marker_is_not_reasoning(daemon):
    # logprobs.content held the reasoning and the call's markup while
    # content was empty; a reply cut inside the thinking block's forced
    # close left "<", "</" or "</think" in reasoning_content.
    c = oai(daemon)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    forced = c.chat.completions.create(model="default", messages=msgs, tools=[WEATHER],
                                       tool_choice="required", max_tokens=160, temperature=0,
                                       logprobs=True)
    m = forced.choices[0].message
    assert m.tool_calls and not m.content
    assert "".join(t.token for t in forced.choices[0].logprobs.content or []).strip() == ""
    # After the thinking block the reply's leading blank lines are dropped
    # from content, and from its logprobs with it.
    plain = c.chat.completions.create(model="default", messages=msgs, max_tokens=24, temperature=0,
                                      logprobs=True, response_format={"type": "json_object"})
    said = "".join(t.token for t in plain.choices[0].logprobs.content or [])
    assert said == plain.choices[0].message.content, (said, plain.choices[0].message.content)
    for n in (1, 2, 3):
        r = c.chat.completions.create(model="default", messages=msgs, max_tokens=n, temperature=0,
                                      response_format={"type": "json_object"})
        reasoning = r.choices[0].message.model_extra.get("reasoning_content") or ""
        assert "<" not in reasoning, (n, reasoning)


def test_anthropic_takes_a_final_assistant_turn_with_text_then_a_call(daemon):
    # The trailing-whitespace rule is a prefill's: an assistant turn whose
    # text is followed by a tool_use is no prefill, and was refused.
    a = ant(daemon)
    tools = [{"name": "get_weather", "description": "Current weather in a city",
              "input_schema": WEATHER["function"]["parameters"]}]
    r = a.messages.create(model="default", max_tokens=4, tools=tools, messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me check. "},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "It is sunny. "},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Bergen"}}]}])
    assert r.usage.output_tokens > 0
