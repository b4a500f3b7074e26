"""Function tools through the Responses API with the official SDK, on the
tools-think test model (a template that declares tools and opens a thinking
block): a forced call, its output sent back as a function_call_output item on
the next response of the chain, a named call streamed with its argument
events, and each response's tool_choice read back as it was asked for."""

import json

import openai
import pytest

from compat import KEY, TIME, WEATHER, forced_call, oai, raw

MODEL = "SmolLM2-135M-tools-think.gguf"
EXTRA_ARGS = ["--api-key", KEY]



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


def answer(call):
    return [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]


def answered(c, conv, call, max_output_tokens):
    """The response on conversation `conv` to `call`'s answer."""
    return c.responses.create(model="default", conversation=conv.id, tools=[WEATHER, TIME],
                              input=answer(call), max_output_tokens=max_output_tokens, temperature=0)


def test_call_ids_are_unique_across_sessions_and_kept_along_a_chain(daemon):
    c = oai(daemon)
    # The same request twice: two sessions, the call at the same event of each.
    r1, a = forced_call(c, input="What is the weather in Paris?")
    r1b, b = forced_call(c, input="What is the weather in Paris?")
    assert a.call_id != b.call_id
    # A call of another conversation is not this one's to answer.
    try:
        c.responses.create(model="default", previous_response_id=r1b.id, input=answer(a),
                           max_output_tokens=8)
        raise AssertionError("answered another session's call")
    except openai.BadRequestError as e:
        assert a.call_id in str(e) and e.param == "input"
    # Down a chain (each response a fork of the one before), every call has
    # its own id, and each is answered and read back by it.
    r2 = c.responses.create(model="default", previous_response_id=r1.id, tools=[WEATHER, TIME],
                            input=answer(a), max_output_tokens=24, temperature=0)
    r3, d = forced_call(c, previous_response_id=r2.id, input="And in Rome?")
    assert d.call_id not in (a.call_id, b.call_id)
    r4 = c.responses.create(model="default", previous_response_id=r3.id, tools=[WEATHER, TIME],
                            input=answer(d), max_output_tokens=8, temperature=0)
    assert [i.call_id for i in c.responses.input_items.list(r4.id).data] == [d.call_id]
    assert [i.call_id for i in c.responses.input_items.list(r2.id).data] == [a.call_id]
    # A stateless continuation of the chain renders the history's calls and
    # outputs under the same ids, so the template pairs them.
    r5 = c.responses.create(model="default", previous_response_id=r4.id, store=False,
                            input="Thanks.", max_output_tokens=4, temperature=0)
    assert r5.status in ("completed", "incomplete")


def tool_use_ids(sf, response_id):
    """The event ids of the ToolUse events of the session a response ran in."""
    variant, payload = sf.call("Read", {"session": int(response_id.split("_")[1]), "cursor": 0})
    return [e["event_id"] for e in payload["events"] if "ToolUse" in e["body"]]


def test_conversation_items_keep_call_ids_across_a_rebase(daemon, sf):
    c = oai(daemon)
    conv = c.conversations.create()
    _, a = forced_call(c, conversation=conv.id, input="What is the weather in Paris?")
    reply = answered(c, conv, a, 24)
    _, d = forced_call(c, conversation=conv.id, input="And in Rome?")
    last = answered(c, conv, d, 4)
    before = tool_use_ids(sf, last.id)

    def pairs():
        items = c.conversations.items.list(conv.id, order="asc").data
        return ([i.call_id for i in items if i.type == "function_call"],
                [i.call_id for i in items if i.type == "function_call_output"], items)

    calls, outputs, items = pairs()
    assert calls == [a.call_id, d.call_id] and outputs == calls
    # Deleting the first reply rebases the conversation onto a new session
    # that shares the rest, the second call and its output moved up by the
    # reply's events (one or more: how many text events a reply is
    # committed as depends on how fast it was decoded): they keep their ids.
    texts = [i for i in items if i.type == "message" and i.role == "assistant"]
    assert [t.id for t in texts][:1] == [o.id for o in reply.output if o.type == "message"]
    c.conversations.items.delete(texts[0].id, conversation_id=conv.id)
    calls, outputs, items = pairs()
    assert texts[0].id not in [i.id for i in items]
    assert calls == [a.call_id, d.call_id] and outputs == calls
    # The second call really moved up on the new branch.
    branch = c.responses.create(model="default", conversation=conv.id, input="Thanks.",
                                max_output_tokens=2, temperature=0)
    after = tool_use_ids(sf, branch.id)
    assert after[0] == before[0] and after[1] < before[1], (before, after)
    # The id still names the second call on the new branch: answering it
    # again is refused as such, not as an unknown call.
    try:
        c.responses.create(model="default", conversation=conv.id, input=answer(d), max_output_tokens=4,
                           temperature=0)
        raise AssertionError("answered a call twice")
    except openai.BadRequestError as e:
        assert "already answered" in str(e), e


def test_an_output_for_no_open_call_writes_nothing(daemon):
    # The call ids were checked only as names of an event: an id past the
    # session's events, an older call_<n> naming any event, or a call
    # already answered passed, and the session refused the output only
    # after the items before it were written (a 400, "hi" left behind).
    c = oai(daemon)
    conv = c.conversations.create()
    _, a = forced_call(c, conversation=conv.id, input="What is the weather in Paris?")
    first = answered(c, conv, a, 4)
    last, d = forced_call(c, conversation=conv.id, input="And in Rome?")
    own = last.id.split("_")[1]
    headers = {"Authorization": "Bearer " + KEY}

    def items():
        return [i.id for i in c.conversations.items.list(conv.id, limit=100).data]

    def output(call_id):
        return {"type": "function_call_output", "call_id": call_id, "output": "x"}

    hi = {"role": "user", "content": "hi"}
    before, sessions = items(), len(daemon.client().list())
    bad = [[hi, output("call_{}_999999".format(own))],  # past the session's events
           [hi, output("call_0")],  # the older form, naming an event that is no call
           [hi, output(a.call_id)],  # answered already
           [hi, output(d.call_id), output(d.call_id)]]  # answered twice at once
    for new in bad:
        status, _, body = raw(daemon, "POST", "/v1/conversations/{}/items".format(conv.id), {"items": new},
                              headers)
        assert status == 400, (new, body)
        assert json.loads(body)["error"]["type"] == "invalid_request_error"
        assert items() == before, new
        for where in (dict(conversation=conv.id), dict(previous_response_id=last.id)):
            try:
                c.responses.create(model="default", tools=[WEATHER, TIME], input=new, max_output_tokens=4,
                                   **where)
                raise AssertionError("took {} on {}".format(new, where))
            except openai.BadRequestError as e:
                assert e.param == "input" and new[-1]["call_id"] in str(e), e
            assert items() == before, (new, where)
            assert len(daemon.client().list()) == sessions, (new, where)
    try:
        c.responses.create(model="default", previous_response_id=first.id, input=[hi, output(a.call_id)],
                           max_output_tokens=4)
        raise AssertionError("answered a call twice down a chain")
    except openai.BadRequestError as e:
        assert "already answered" in str(e), e
    assert len(daemon.client().list()) == sessions
    # The open call is still answered.
    status, _, body = raw(daemon, "POST", "/v1/conversations/{}/items".format(conv.id),
                          {"items": [output(d.call_id)]}, headers)
    assert status == 200, body
    assert len(items()) == len(before) + 1


def test_a_handoff_to_other_instructions_and_tools_declares_them(daemon):
    # An agent handing off mid-chain (the Agents SDK's previous_response_id
    # mode) sends the next agent's instructions and tools with the pending
    # call's output: the model is prompted with those tools, and the output
    # still answers the call the chain's last response made.
    c = oai(daemon)
    r1 = c.responses.create(model="default", input="What is the weather in Paris?", tools=[WEATHER],
                            tool_choice="required", max_output_tokens=160, temperature=0)
    call = [o for o in r1.output if o.type == "function_call"][0]
    r2 = c.responses.create(model="default", previous_response_id=r1.id,
                            instructions="You are the travel agent.", tools=[WEATHER, TIME],
                            input=[{"type": "function_call_output", "call_id": call.call_id,
                                    "output": "sunny, 21 C"}],
                            tool_choice={"type": "function", "name": "get_time"},
                            max_output_tokens=160, temperature=0)
    # A tool r1's prompt never declared is called: r2's tools are the ones
    # its prompt declares.
    assert [o.name for o in r2.output if o.type == "function_call"] == ["get_time"], r2.output
    back = c.responses.retrieve(r2.id)
    assert back.instructions == "You are the travel agent."
    assert [t.name for t in back.tools] == ["get_weather", "get_time"]
    assert back.previous_response_id == r1.id
    # The call and its output, read back in the new prompt's input.
    items = c.responses.input_items.list(r2.id, order="asc").data
    assert [(i.type, getattr(i, "call_id", None)) for i in items][-2:] == [
        ("function_call", call.call_id), ("function_call_output", call.call_id)]
    # An output for the same call again is refused: it was answered.
    try:
        c.responses.create(model="default", previous_response_id=r2.id,
                           instructions="You are the travel agent.", tools=[WEATHER, TIME],
                           input=[{"type": "function_call_output", "call_id": call.call_id,
                                   "output": "again"}], max_output_tokens=8)
        raise AssertionError("a second output for one call was taken")
    except openai.BadRequestError as e:
        assert "already answered" in str(e), e


def test_a_handoff_refused_before_anything_is_written(daemon):
    # A tool_choice the new agent's tools cannot take, and an output for a
    # call the chain answered, are refused before any session is made (a
    # refused tool choice left a new session behind), with the same
    # messages as on a fork. A deleted previous response is no longer named.
    import os
    c = oai(daemon)
    wal = os.path.join(daemon.sessions, "wal.log")
    r1 = c.responses.create(model="default", input="What is the weather in Paris?", tools=[WEATHER],
                            tool_choice="required", max_output_tokens=160, temperature=0)
    call = [o for o in r1.output if o.type == "function_call"][0]
    answer = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    r2 = c.responses.create(model="default", previous_response_id=r1.id, instructions="Agent B.",
                            tools=[WEATHER, TIME], input=answer, max_output_tokens=8, temperature=0)
    size = os.path.getsize(wal)
    for ask, param, phrase in [
        (dict(instructions="Agent C.", tool_choice={"type": "function", "name": "get_time"}),
         "tool_choice", "declares no tools"),
        (dict(instructions="Agent C.", tools=[WEATHER], tool_choice={"type": "function", "name": "get_time"}),
         "tool_choice", "none of the response's tools (get_weather)"),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "name": "get_time"}),
         "tool_choice", "none of the response's tools (get_weather)"),
        (dict(instructions="Agent C.", tools=[WEATHER], input=answer), "input", "already answered"),
        # A fork (the chain's instructions and tools kept) is checked too.
        (dict(tool_choice={"type": "function", "name": "get_nothing"}),
         "tool_choice", "none of the response's tools (get_weather, get_time)"),
    ]:
        ask.setdefault("input", "Go on.")
        try:
            c.responses.create(model="default", previous_response_id=r2.id, max_output_tokens=8, **ask)
            raise AssertionError(f"taken: {ask}")
        except openai.BadRequestError as e:
            assert e.body["param"] == param and phrase in e.body["message"], (ask, e.body)
        assert os.path.getsize(wal) == size, ask
    assert c.responses.retrieve(r2.id).previous_response_id == r1.id
    c.responses.delete(r1.id)
    assert c.responses.retrieve(r2.id).previous_response_id is None


def test_a_refused_tool_choice_writes_nothing_to_a_conversation(daemon):
    # The check before any write covers conversations too: the request's
    # system turn was appended (and stood for every later request), or the
    # conversation forked to a branch, before the refusal.
    import os
    c = oai(daemon)
    wal = os.path.join(daemon.sessions, "wal.log")
    conv = c.conversations.create()
    size = os.path.getsize(wal)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="default", conversation=conv.id, input="Hi.", instructions="Agent X.",
                           tools=[WEATHER], tool_choice={"type": "function", "name": "get_time"},
                           max_output_tokens=8)
    assert e.value.body["param"] == "tool_choice", e.value.body
    assert os.path.getsize(wal) == size
    r = c.responses.create(model="default", conversation=conv.id, input="Hi.", max_output_tokens=4,
                           temperature=0)
    size = os.path.getsize(wal)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="default", conversation=conv.id, input="Go on.", tool_choice="required",
                           temperature=0.3, max_output_tokens=8)
    assert e.value.body["param"] == "tool_choice" and "declares no tools" in e.value.body["message"]
    assert os.path.getsize(wal) == size
    assert c.responses.retrieve(r.id).instructions is None


def test_usage_counts_reasoning_and_the_echo_keeps_strict_and_truncation(daemon):
    """A response whose output is all reasoning says so in
    output_tokens_details.reasoning_tokens (it said 0), live, streamed and
    read back; a tool's `strict` and the request's `truncation` come back
    as sent (they came back false and "disabled")."""
    c = oai(daemon)
    strict_weather = dict(WEATHER, strict=True)
    r = c.responses.create(model="default", input="Explain in detail why the sky is blue.",
                           max_output_tokens=12, temperature=0, tools=[strict_weather, TIME],
                           truncation="auto")
    assert [o.type for o in r.output] == ["reasoning"] and r.status == "incomplete", r
    assert r.usage.output_tokens == 12, r.usage
    assert r.usage.output_tokens_details.reasoning_tokens == 12, r.usage
    assert [t.strict for t in r.tools] == [True, False] and r.truncation == "auto", (r.tools, r.truncation)
    back = c.responses.retrieve(r.id)
    assert back.usage.output_tokens_details.reasoning_tokens == 12, back.usage
    # A stream cut by max_output_tokens ends with response.incomplete (the
    # SDK's get_final_response raises on it): read its usage from the event.
    with c.responses.create(model="default", input="Explain in detail why grass is green.", max_output_tokens=12,
                            temperature=0, store=False, stream=True) as events:
        last = [e for e in events][-1]
    assert last.type == "response.incomplete", last.type
    assert last.response.usage.output_tokens_details.reasoning_tokens == 12, last.response.usage
    status, _, body = raw(daemon, "POST", "/v1/responses", {
        "model": "default", "input": "hi", "max_output_tokens": 4, "truncation": "middle"},
        {"Authorization": "Bearer " + KEY})
    assert status == 400 and json.loads(body)["error"]["param"] == "truncation", body[:300]
