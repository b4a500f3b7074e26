"""Tool calls and reasoning on the tools-think test model (a template with
tools and <think>): Session.tool_result, Session.open_tool_calls, and the
"reasoning" and "tool_call" chunks of a stream."""

import pytest

from superfluid_client import Sampling, SuperfluidError

MODEL = "SmolLM2-135M-tools-think.gguf"

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def forced_call(sf):
    s = sf.session(Sampling(seed=1), system="Answer with the tools.", tools=[WEATHER])
    s.user("Is it raining in Paris?")
    s.set_tool_choice("required")
    return s


def test_stream_shows_reasoning_and_the_tool_call(sf):
    s = forced_call(sf)
    stream = s.stream(max_tokens=128)
    chunks = list(stream)
    kinds = {c.kind for c in chunks}
    assert "tool_call" in kinds
    calls = [c.call for c in chunks if c.call is not None]
    assert [c.name for c in calls] == ["get_weather"] and calls == stream.reply.tool_calls
    assert stream.reply.finish == 3


def test_reasoning_chunks(sf):
    s = sf.session(Sampling(seed=1))
    s.user("What is 2 + 2?")
    chunks = list(s.stream(max_tokens=6))
    assert chunks and chunks[0].kind == "reasoning"


def test_open_tool_calls_and_tool_result(sf):
    s = forced_call(sf)
    reply = s.generate(128)
    (call,) = reply.tool_calls
    assert s.open_tool_calls() == [call]
    result = s.tool_result(call, {"rain": True})
    assert result.kind == "ToolResult" and result.data["call_id"] == call.id
    assert result.data["content"] == '{"rain": true}'
    assert s.open_tool_calls() == []
    with pytest.raises(SuperfluidError, match="already answered"):
        s.tool_result(call, "again")
    msgs = s.messages()
    assert msgs[-2].tool_calls == [call] and msgs[-1].role == "tool" and msgs[-1].call_id == call.id
    s.set_tool_choice("auto")
    after = s.generate(16)
    assert after.tokens > 0


def test_a_malformed_call_from_a_real_generation_is_a_tool_parse_failure(sf):
    """The model writes a tool call whose body is not JSON: the output
    decoder commits a ToolParseFailure with the text and the reason, and no
    ToolUse. A grammar (SetOutputFormat with a constant) makes the real
    generation write exactly that; the decoder does not know a grammar ran."""
    s = sf.session(Sampling(seed=1), system="Answer with the tools.", tools=[WEATHER])
    s.user("Is it raining in Paris?")
    s.set_output_format({"const": "<tool_call>\nno json here\n</tool_call>"})
    reply = s.generate(64)
    assert reply.tool_calls == []
    kinds = [e.kind for e in s.events()]
    failures = [e for e in s.events() if e.kind == "ToolParseFailure"]
    assert len(failures) == 1, kinds
    assert "no json here" in failures[0].data["text"] and failures[0].data["error"]
    assert "ToolUse" not in kinds
    assert s.open_tool_calls() == []
    # Set back to free text, the session goes on.
    s.set_output_format(None)
    s.user("And in Rome?")
    assert s.generate(8).tokens > 0


def test_an_output_format_that_cannot_become_a_grammar_is_refused_when_set(sf):
    """SetOutputFormat converts the schema before it commits: a $ref to
    nothing is refused there, naming the ref, and the session's later
    generations run as before (they each failed with "ffi error -3")."""
    s = sf.session(Sampling(seed=1))
    s.user("Say hello.")
    before = len(s.events())
    with pytest.raises(SuperfluidError, match=r'cannot become a grammar.*\$ref "#/definitions/x" points at nothing'):
        s.set_output_format({"type": "object", "properties": {"a": {"$ref": "#/definitions/x"}}})
    assert len(s.events()) == before, "a refused format committed something"
    assert s.generate(4).tokens > 0
    # A ref that resolves is taken.
    s.set_output_format({"definitions": {"x": {"enum": ["yes", "no"]}}, "$ref": "#/definitions/x"})
    s.user("Yes or no?")
    assert s.generate(24).text.strip() in ('"yes"', '"no"')
