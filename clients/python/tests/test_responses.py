"""OpenAI's Responses and Conversations APIs on durable sessions, with the
official SDK against a real daemon: a previous_response_id chain across a
SIGKILL and restart, two branches from one response, streaming with the SDK's
semantic events, store: false leaving nothing in the log, a conversation read
back after a restart, and bad inputs in OpenAI's error shape."""

import json
import os
import socket
import struct
import time

import openai
import pytest

from compat import KEY, issued_id, oai, raw

EXTRA_ARGS = ["--api-key", KEY]


def wal_size(daemon):
    return os.path.getsize(os.path.join(daemon.sessions, "wal.log"))


def texts(r):
    return [(o.type, o.id, getattr(o, "call_id", None),
             [c.text for c in (o.content or [])] if o.type == "message" else o.arguments if o.type == "function_call" else None)
            for o in r.output]


def test_chain_survives_sigkill_and_reads_back(daemon):
    c = oai(daemon)
    r1 = c.responses.create(model="default", instructions="You are terse.", input="Name a river.",
                            max_output_tokens=12, temperature=0)
    assert r1.id.startswith("resp_") and r1.status in ("completed", "incomplete")
    assert r1.output_text
    assert r1.usage.input_tokens > 0 and r1.usage.output_tokens > 0
    r2 = c.responses.create(model="default", previous_response_id=r1.id, input="Another one.",
                            max_output_tokens=12, temperature=0)
    assert r2.previous_response_id == r1.id
    # The continuation forked at r1's end: its prompt holds r1's whole
    # history, and that history was cached.
    assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens
    assert r2.usage.input_tokens_details.cached_tokens > 0
    before = [c.responses.retrieve(r.id) for r in (r1, r2)]
    daemon.restart()  # SIGKILL, then start on the same dir
    c = oai(daemon)
    after = [c.responses.retrieve(r.id) for r in (r1, r2)]
    for b, a, orig in zip(before, after, (r1, r2)):
        assert a.id == orig.id
        assert texts(a) == texts(orig) == texts(b)
        assert a.output_text == orig.output_text
        assert a.usage.input_tokens == orig.usage.input_tokens
        assert a.usage.output_tokens == orig.usage.output_tokens
        assert a.previous_response_id == orig.previous_response_id
    assert after[0].instructions == "You are terse."
    r3 = c.responses.create(model="default", previous_response_id=r2.id, input="And a third.",
                            max_output_tokens=12, temperature=0)
    assert r3.usage.input_tokens > r2.usage.input_tokens + r2.usage.output_tokens
    items = c.responses.input_items.list(r3.id, order="asc")
    assert [i.content[0].text for i in items.data] == ["And a third."]
    assert c.responses.retrieve(r3.id).output_text == r3.output_text


def test_usage_counts_the_prompt_as_the_chat_route_does(daemon):
    # The assistant header a response's turn opens with is prompt: it was
    # counted as output (5 output tokens asked, 9 reported; a repeat's
    # cached_tokens above its input_tokens).
    c = oai(daemon)
    ask = dict(instructions="You are terse.", input="Name a mountain.", max_output_tokens=5, temperature=0)
    chat = c.chat.completions.create(model="default", max_tokens=5, temperature=0, messages=[
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a mountain."}])
    for _ in range(3):
        r = c.responses.create(model="default", **ask)
        u = r.usage
        assert u.input_tokens == chat.usage.prompt_tokens, (u, chat.usage)
        assert 0 < u.output_tokens <= 5, u
        assert u.input_tokens_details.cached_tokens <= u.input_tokens, u
        assert u.total_tokens == u.input_tokens + u.output_tokens, u
        back = c.responses.retrieve(r.id).usage
        assert (back.input_tokens, back.output_tokens) == (u.input_tokens, u.output_tokens), (back, u)
        streamed = [e for e in c.responses.create(model="default", stream=True, **ask)][-1].response.usage
        assert (streamed.input_tokens, streamed.output_tokens) == (u.input_tokens, u.output_tokens), streamed


def test_two_branches_from_one_response(daemon):
    c = oai(daemon)
    root = c.responses.create(model="default", input="Pick a colour.", max_output_tokens=8, temperature=0)
    a = c.responses.create(model="default", previous_response_id=root.id, input="Why that one?",
                           max_output_tokens=8, temperature=0)
    b = c.responses.create(model="default", previous_response_id=root.id, input="Pick another.",
                           max_output_tokens=8, temperature=0)
    assert a.id != b.id
    assert a.previous_response_id == b.previous_response_id == root.id
    assert [i.content[0].text for i in c.responses.input_items.list(a.id).data] == ["Why that one?"]
    assert [i.content[0].text for i in c.responses.input_items.list(b.id).data] == ["Pick another."]
    # Both branches start from root's committed point: the same prompt prefix.
    assert a.usage.input_tokens_details.cached_tokens > 0
    assert b.usage.input_tokens_details.cached_tokens > 0
    # The root is unchanged by either branch.
    assert c.responses.retrieve(root.id).output_text == root.output_text


def test_streaming_events_and_retrieve(daemon):
    c = oai(daemon)
    with c.responses.stream(model="default", input="Say hello.", max_output_tokens=16, temperature=0) as s:
        events = list(s)
    # The SDK's get_final_response() wants response.completed; a cut reply
    # ends with response.incomplete, as OpenAI's does.
    final = events[-1].response
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert "response.output_item.added" in types and "response.content_part.added" in types
    assert "response.output_text.delta" in types and "response.output_text.done" in types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text and deltas
    got = c.responses.retrieve(final.id)
    assert got.output_text == final.output_text
    assert texts(got) == texts(final)


def test_a_streamed_stored_response_sends_its_warm_prefix_in_the_header(daemon):
    """The x-superfluid-warm header of a streamed stored response was always
    0 (it went out before the session's generation started) while its usage
    and the access log counted the cached tokens. Now the header waits for
    the start and agrees with cached_tokens, fresh and chained."""
    c = oai(daemon)
    prompt = "Describe the sea in one sentence. " + " ".join("wave{}".format(i) for i in range(60))

    def streamed(**kw):
        with c.responses.with_streaming_response.create(
                model="default", input=prompt, max_output_tokens=8, temperature=0, stream=True, **kw) as r:
            warm = int(r.headers["x-superfluid-warm"])
            events = list(r.parse())
        final = events[-1].response
        return warm, final.usage.input_tokens_details.cached_tokens, final

    streamed()
    warm, cached, final = streamed()
    assert warm == cached and cached > 50, (warm, cached)
    # A chained response: the previous turn's whole input is in the cache.
    warm, cached, _ = streamed(previous_response_id=final.id)
    assert warm == cached and cached > final.usage.input_tokens, (warm, cached)


def test_store_false_leaves_no_trace(daemon):
    c = oai(daemon)
    sessions = len(daemon.client().list())
    size = wal_size(daemon)
    r = c.responses.create(model="default", input="Name a mountain.", store=False, max_output_tokens=8)
    assert r.output_text and r.store is False
    with c.responses.stream(model="default", input="Name a lake.", store=False, max_output_tokens=8) as s:
        assert [e for e in s][-1].response.output_text
    assert len(daemon.client().list()) == sessions
    assert wal_size(daemon) == size
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    # A stateless continuation of a stored response reads its history and
    # leaves the log alone too.
    stored = c.responses.create(model="default", input="Name a tree.", max_output_tokens=8)
    size = wal_size(daemon)
    more = c.responses.create(model="default", previous_response_id=stored.id, input="Another.",
                              store=False, max_output_tokens=8)
    assert more.usage.input_tokens > stored.usage.input_tokens + stored.usage.output_tokens - 2
    assert wal_size(daemon) == size


def test_conversation_five_turns_survives_restart(daemon):
    c = oai(daemon)
    conv = c.conversations.create(metadata={"topic": "rivers"},
                                  items=[{"type": "message", "role": "system", "content": "Be terse."}])
    assert conv.id.startswith("conv_")
    replies = []
    for i in range(5):
        r = c.responses.create(model="default", conversation=conv.id, input="Turn {}: name a river.".format(i),
                               max_output_tokens=8, temperature=0)
        assert r.conversation.id == conv.id
        replies.append(r)
    items = c.conversations.items.list(conv.id, order="asc", limit=100).data
    users = [i.content[0].text for i in items if i.type == "message" and i.role == "user"]
    assert users == ["Turn {}: name a river.".format(i) for i in range(5)]
    assistants = [i.content[0].text for i in items if i.type == "message" and i.role == "assistant"]
    assert assistants == [r.output_text for r in replies]
    daemon.restart()
    c = oai(daemon)
    assert c.conversations.retrieve(conv.id).metadata == {"topic": "rivers"}
    again = c.conversations.items.list(conv.id, order="asc", limit=100).data
    assert [i.model_dump() for i in again] == [i.model_dump() for i in items]
    for r in replies:
        assert c.responses.retrieve(r.id).output_text == r.output_text
    # Items added by hand, then one dropped: a new branch under the same id.
    c.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "Added."}])
    listed = c.conversations.items.list(conv.id, order="asc", limit=100).data
    assert listed[-1].content[0].text == "Added."
    # Each listed item is retrieved by its id (the route was missing: a bare 404).
    for item in (listed[0], listed[-1]):
        got = c.conversations.items.retrieve(item.id, conversation_id=conv.id)
        assert got.model_dump() == item.model_dump()
    with pytest.raises(openai.NotFoundError):
        c.conversations.items.retrieve("msg_nope", conversation_id=conv.id)
    c.conversations.items.delete(listed[-1].id, conversation_id=conv.id)
    dropped = c.conversations.items.list(conv.id, order="asc", limit=100).data
    assert [i.content[0].text for i in dropped] == [i.content[0].text for i in items]
    c.conversations.update(conv.id, metadata={"topic": "lakes"})
    assert c.conversations.retrieve(conv.id).metadata == {"topic": "lakes"}
    c.conversations.delete(conv.id)
    with pytest.raises(openai.NotFoundError):
        c.conversations.retrieve(conv.id)


def session_params(sf, response_id):
    """The sampling settings of the session a stored response ran in."""
    variant, payload = sf.call("Inspect", {"session": int(response_id.split("_")[1])})
    assert variant == "Inspection", payload
    return payload["inspection"]["params"]


def test_conversation_responses_sample_with_what_they_ask(daemon, sf):
    c = oai(daemon)
    conv = c.conversations.create()
    hot = c.responses.create(model="default", conversation=conv.id, input="Name a colour.",
                             max_output_tokens=4)
    assert session_params(sf, hot.id)["temperature"] == 1.0
    # A response asking for greedy decoding gets it, on the conversation.
    cold = c.responses.create(model="default", conversation=conv.id, input="Name another.",
                              max_output_tokens=4, temperature=0, top_p=0.5)
    params = session_params(sf, cold.id)
    assert (params["temperature"], params["top_p"]) == (0.0, 0.5)
    assert params["seed"] == session_params(sf, hot.id)["seed"]
    assert cold.temperature == 0 and cold.conversation.id == conv.id
    # Read back, it is the conversation's, not a continuation of a response.
    again = c.responses.retrieve(cold.id)
    assert (again.previous_response_id, again.conversation.id, again.temperature) == \
        (None, conv.id, 0)
    # The same settings again stay on that session; the default moves back.
    same = c.responses.create(model="default", conversation=conv.id, input="And one more.",
                              max_output_tokens=4, temperature=0, top_p=0.5)
    assert same.id.split("_")[1] == cold.id.split("_")[1]
    back = c.responses.create(model="default", conversation=conv.id, input="Last one.",
                              max_output_tokens=4)
    assert session_params(sf, back.id)["temperature"] == 1.0
    # One conversation throughout: every turn listed once, ids unchanged.
    items = c.conversations.items.list(conv.id, order="asc", limit=100).data
    users = [i.content[0].text for i in items if i.type == "message" and i.role == "user"]
    assert users == ["Name a colour.", "Name another.", "And one more.", "Last one."]
    firsts = [o.id for r in (hot, cold, same, back) for o in r.output if o.type == "message"]
    assert set(firsts) <= {i.id for i in items}
    # The response on the moved-to branch is the conversation's, not its own
    # to delete.
    with pytest.raises(openai.BadRequestError):
        c.responses.delete(cold.id)
    assert c.conversations.items.list(conv.id, limit=100).data


def test_a_conversation_moved_many_times_still_resolves(daemon):
    # Each change of temperature moves the conversation to a new branch;
    # its id must keep resolving past any cap on moved_to hops (64).
    c = oai(daemon)
    conv = c.conversations.create()
    for i in range(70):
        c.responses.create(model="default", conversation=conv.id, input=str(i), max_output_tokens=1,
                           temperature=(i % 2) * 0.5)
    items = c.conversations.items.list(conv.id, order="desc", limit=100).data
    assert [i.content[0].text for i in items if i.type == "message" and i.role == "user"][:3] == \
        ["69", "68", "67"]


def test_a_conversation_takes_one_response_at_a_time(daemon):
    c = oai(daemon)
    conv = c.conversations.create()
    with c.responses.stream(model="default", conversation=conv.id, input="Tell me a long story.",
                            max_output_tokens=2000) as running:
        first = next(iter(running))
        assert first.type == "response.created"
        # Another response on it, asking for other settings, while the first
        # generates: refused, the conversation not moved.
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model="default", conversation=conv.id, input="Hello?",
                               max_output_tokens=4, temperature=0)
        assert e.value.body["param"] == "conversation" and "in progress" in str(e.value)
        c.responses.cancel(first.response.id)
    items = c.conversations.items.list(conv.id, order="asc").data
    assert [i.content[0].text for i in items if i.role == "user"] == ["Tell me a long story."]
    later = c.responses.create(model="default", conversation=conv.id, input="Hello?",
                               max_output_tokens=4, temperature=0)
    assert later.conversation.id == conv.id


def test_delete_response(daemon):
    c = oai(daemon)
    r = c.responses.create(model="default", input="Name a city.", max_output_tokens=6)
    child = c.responses.create(model="default", previous_response_id=r.id, input="Another.", max_output_tokens=6)
    c.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(model="default", previous_response_id=r.id, input="More.", max_output_tokens=6)
    assert e.value.body["param"] == "previous_response_id"
    # The continuation keeps its history: the delete is logical.
    assert c.responses.retrieve(child.id).output_text == child.output_text


def test_bad_inputs_in_openai_shape(daemon):
    c = oai(daemon)
    cases = [
        (dict(previous_response_id="resp_999999_0", input="x"), openai.NotFoundError, "previous_response_id"),
        # Tagged as the daemon tags, for a session that does not exist.
        (dict(previous_response_id=issued_id(daemon, 999999, 0, made_ms=0), input="x"), openai.NotFoundError,
         "previous_response_id"),
        (dict(previous_response_id="nonsense", input="x"), openai.NotFoundError, "previous_response_id"),
        (dict(conversation="conv_424242", input="x"), openai.NotFoundError, "conversation"),
        (dict(input=[{"type": "message", "role": "robot", "content": "x"}]), openai.BadRequestError, "input"),
        (dict(input=[{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]),
         openai.BadRequestError, "input"),
        (dict(input=[{"type": "function_call_output", "call_id": "call_1"}]), openai.BadRequestError, "input"),
        (dict(input="x", tools=[{"type": "web_search"}]), openai.BadRequestError, "tools"),
        (dict(input="x", max_output_tokens=0), openai.BadRequestError, "max_output_tokens"),
        (dict(input="x", temperature=5), openai.BadRequestError, "temperature"),
        (dict(input="x", text={"format": {"type": "xml"}}), openai.BadRequestError, "text.format"),
        (dict(input="x", text={"format": {"type": "json_schema", "name": "a"}}), openai.BadRequestError,
         "text.format"),
        (dict(input="x", text={"format": {"type": "json_schema", "name": "a",
                                          "schema": {"type": "string", "maxLength": 5000}}}),
         openai.BadRequestError, "text.format"),
    ]
    sessions = len(daemon.client().list())
    for kwargs, err, param in cases:
        with pytest.raises(err) as e:
            c.responses.create(model="default", **kwargs)
        assert e.value.body["type"] == "invalid_request_error", kwargs
        assert e.value.body["param"] == param, (kwargs, e.value.body)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="nope", input="x")
    # Ids that pass the tag check but name no response: a session that does
    # not exist, and an event past a real session's end.
    real = c.responses.create(model="default", input="Say hi.", max_output_tokens=2)
    sessions += 1
    tagged = [issued_id(daemon, 999999, 0, made_ms=0), issued_id(daemon, session_of(real.id), 999)]
    for missing in ["resp_5_999", "resp_x", "resp_999_0"] + tagged:
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(missing)
        with pytest.raises(openai.NotFoundError):
            c.responses.input_items.list(missing)
        with pytest.raises(openai.NotFoundError):
            c.responses.create(model="default", previous_response_id=missing, input="x", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        c.conversations.retrieve("conv_999999")
    # Too many items is refused before anything runs.
    with pytest.raises(openai.BadRequestError):
        c.responses.create(model="default", input=[{"role": "user", "content": "x"}] * 513)
    with pytest.raises(openai.BadRequestError):
        c.conversations.create(items=[{"role": "user", "content": "x"}] * 21)
    with pytest.raises(openai.BadRequestError):
        c.conversations.create(metadata={str(i): "v" for i in range(17)})
    # A refused request from its first checks leaves no session behind.
    assert len(daemon.client().list()) == sessions
    status, _, body = raw(daemon, "POST", "/v1/responses", b"{nope", {"Authorization": "Bearer " + KEY})
    assert status == 400 and b"invalid_request_error" in body
    status, _, _ = raw(daemon, "GET", "/v1/responses/resp_1_0", None, {"Authorization": "Bearer wrong"})
    assert status == 401


def test_a_refused_conversation_create_leaves_nothing_behind(daemon):
    # An output whose call_id is a call id by its syntax passed the checks
    # made before the session; create then made the session, set its record,
    # and only the append refused the output (a new conversation has no open
    # call): a 400, and an empty conversation left in the log.
    c = oai(daemon)

    def output(call_id):
        return {"type": "function_call_output", "call_id": call_id, "output": "x"}

    hi = {"type": "message", "role": "user", "content": "hi"}
    resent = {"type": "function_call", "call_id": "call_1_2", "name": "get_weather",
              "arguments": json.dumps({"city": "Paris"})}
    sessions, size = len(daemon.client().list()), wal_size(daemon)
    for items, call_id in (([hi, output("call_1_2")], "call_1_2"),  # names a call of no open session
                           ([output("call_3")], "call_3"),  # the older form
                           ([hi, resent, output("call_1_2"), output("call_9_9")], "call_9_9")):
        with pytest.raises(openai.BadRequestError) as e:
            c.conversations.create(items=items, metadata={"topic": "orphans"})
        assert e.value.body["type"] == "invalid_request_error", items
        assert e.value.body["param"] == "items", e.value.body
        assert call_id in e.value.body["message"] and "not a call" in e.value.body["message"], e.value.body
        # No session, and nothing written at all.
        assert len(daemon.client().list()) == sessions, items
        assert wal_size(daemon) == size, items
    # An output answering a call resent before it in the same items is taken.
    conv = c.conversations.create(items=[hi, resent, output("call_1_2")])
    assert len(daemon.client().list()) == sessions + 1
    listed = c.conversations.items.list(conv.id, order="asc", limit=100).data
    assert len(listed) == 3 and listed[-1].type == "function_call_output", listed
    assert listed[-1].output == "x"



def resent_call(call_id, city):
    # Arguments as a client writes them (json.dumps puts a space after each
    # separator): they must read back as given, not re-serialised.
    return {"type": "function_call", "call_id": call_id, "name": "get_weather",
            "arguments": json.dumps({"city": city, "units": "metric"})}


def call_output(call_id, output="x"):
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def test_resent_calls_read_back_as_the_calls_given(daemon):
    # A function_call item was stored as the model's call text and read
    # back as an assistant message holding that text, and the output
    # answering it listed with call_id "": a client listing a conversation
    # must get back the items it put in, in kind.
    c = oai(daemon)
    hi = {"type": "message", "role": "user", "content": "hi"}

    def check(items, call_id, city, output):
        kinds = [(i.type, getattr(i, "role", None)) for i in items]
        assert kinds == [("function_call", None), ("function_call_output", None)], items
        call, out = items
        assert call.id.startswith("fc_") and out.id.startswith("fco_"), items
        assert (call.call_id, call.name, call.arguments) == (
            call_id, "get_weather", resent_call(call_id, city)["arguments"]), call
        assert (out.call_id, out.output) == (call_id, output), out

    conv = c.conversations.create(items=[hi, resent_call("call_abc", "Paris"), call_output("call_abc", "sunny")])
    listed = c.conversations.items.list(conv.id, order="asc", limit=100).data
    assert listed[0].type == "message" and listed[0].content[0].text == "hi", listed
    check(listed[1:], "call_abc", "Paris", "sunny")
    # Added to it: the reply lists them, and so does the conversation.
    added = c.conversations.items.create(conv.id, items=[resent_call("fc-7", "Rome"), call_output("fc-7", "rain")])
    check(added.data, "fc-7", "Rome", "rain")
    listed = c.conversations.items.list(conv.id, order="asc", limit=100).data
    check(listed[3:], "fc-7", "Rome", "rain")
    # They read back after a restart, from the log.
    daemon.restart()
    c = oai(daemon)
    again = c.conversations.items.list(conv.id, order="asc", limit=100).data
    assert [i.model_dump() for i in again] == [i.model_dump() for i in listed]
    # A response's input items, the same.
    r = c.responses.create(model="default", input=[hi, resent_call("call_xyz", "Oslo"), call_output("call_xyz", "snow")],
                           max_output_tokens=4, temperature=0)
    got = c.responses.input_items.list(r.id, order="asc").data
    check(got[1:], "call_xyz", "Oslo", "snow")
    # A store: false continuation of it sees the call and its answer.
    c.responses.create(model="default", previous_response_id=r.id, store=False, input="and?", max_output_tokens=4)


def test_an_output_for_no_open_call_on_the_items_route_names_items(daemon):
    # POST /v1/conversations/{id}/items reported the refusal of an output
    # answering no open call with param "input", the responses route's
    # field: the items route's is "items".
    c = oai(daemon)
    conv = c.conversations.create(items=[{"type": "message", "role": "user", "content": "hi"}])
    before = c.conversations.items.list(conv.id, limit=100).data
    for call_id in ("call_1_2", "call_999999_0", "call_0"):
        with pytest.raises(openai.BadRequestError) as e:
            c.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "x"},
                                                         call_output(call_id)])
        assert e.value.body["type"] == "invalid_request_error", call_id
        assert e.value.body["param"] == "items", e.value.body
        assert call_id in e.value.body["message"], e.value.body
        assert c.conversations.items.list(conv.id, limit=100).data == before


def test_a_resent_call_is_answered_once(daemon):
    # A call resent in the items and answered twice in the same items was
    # taken, both outputs appended: the second is a 400 naming the call,
    # and nothing is written.
    c = oai(daemon)
    hi = {"type": "message", "role": "user", "content": "hi"}
    twice = [hi, resent_call("call_abc", "Paris"), call_output("call_abc"), call_output("call_abc", "y")]
    conv = c.conversations.create(items=[hi])
    refused_writing_nothing(daemon, c, conv, "call_abc", (
        (lambda: c.conversations.create(items=twice), "items"),
        (lambda: c.conversations.items.create(conv.id, items=twice), "items"),
        (lambda: c.responses.create(model="default", input=twice, max_output_tokens=4), "input"),
        (lambda: c.responses.create(model="default", conversation=conv.id, input=twice,
                                    max_output_tokens=4), "input")))


def refused_writing_nothing(daemon, c, conv, call_id, cases):
    """Each (make, param) of `cases` is a 400 invalid_request_error on
    `param` naming `call_id`, and writes nothing: the sessions, wal.log's
    size and `conv`'s items are as before."""
    before = c.conversations.items.list(conv.id, limit=100).data
    sessions, size = len(daemon.client().list()), wal_size(daemon)
    for make, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            make()
        assert e.value.body["type"] == "invalid_request_error", e.value.body
        assert e.value.body["param"] == param, e.value.body
        assert call_id in e.value.body["message"], e.value.body
        assert len(daemon.client().list()) == sessions
        assert wal_size(daemon) == size
        assert c.conversations.items.list(conv.id, limit=100).data == before


def session_of(id_):
    """The session a conv_ or resp_ id names (before any move)."""
    return int(id_.split("_")[1])


def input_tokens(sf, session, through_prompt=False):
    """The tokens session's events put on the model's input, up to its
    first generation's assistant header (included when through_prompt)."""
    _, payload = sf.call("Read", {"session": session, "cursor": 0})
    out = []
    for e in payload["events"]:
        if not isinstance(e["body"], dict):  # a unit record (EpochBump)
            continue
        (kind, body), = e["body"].items()
        if kind == "GenerationPrompt" and not through_prompt:
            break
        out.extend(body.get("span", []) if isinstance(body, dict) else [])
        if kind == "GenerationPrompt":
            break
    return out


def test_a_resent_call_is_answered_in_a_later_request(daemon, sf):
    # A call resent in one request and answered in a later one was a 400
    # ("which no earlier item or response made"): the later request's
    # output had only the session's own calls to answer. OpenAI takes it.
    c = oai(daemon)
    hi = {"type": "message", "role": "user", "content": "hi"}

    def shape(items):
        return [(i.type, getattr(i, "call_id", None), getattr(i, "output", None)) for i in items]

    # The call and its answer in one request: what the model must see.
    whole = c.conversations.create(items=[hi, resent_call("call_abc", "Paris"), call_output("call_abc", "sunny")])
    later = c.conversations.create(items=[hi, resent_call("call_abc", "Paris")])
    added = c.conversations.items.create(later.id, items=[call_output("call_abc", "sunny")])
    assert shape(added.data) == [("function_call_output", "call_abc", "sunny")], added.data
    assert added.data[0].id.startswith("fco_")
    listed = c.conversations.items.list(later.id, order="asc", limit=100).data
    assert shape(listed) == shape(c.conversations.items.list(whole.id, order="asc", limit=100).data)
    # The model sees the answer as a tool result, token for token as when
    # it came with the call.
    assert input_tokens(sf, session_of(later.id)) == input_tokens(sf, session_of(whole.id))
    # Answered once: a second answer is a 400 naming the call, nothing written.
    size = wal_size(daemon)
    for items in ([call_output("call_abc", "again")], [hi, call_output("call_abc", "again")]):
        with pytest.raises(openai.BadRequestError) as e:
            c.conversations.items.create(later.id, items=items)
        assert e.value.body["param"] == "items", e.value.body
        assert "call_abc" in e.value.body["message"], e.value.body
        assert wal_size(daemon) == size
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="default", conversation=later.id, input=[call_output("call_abc")],
                           max_output_tokens=4)
    assert e.value.body["param"] == "input" and "call_abc" in e.value.body["message"], e.value.body
    assert c.conversations.items.list(later.id, order="asc", limit=100).data == listed
    # A response on the conversation whose input answers the call: the
    # same prompt as a response given the call and its answer at once.
    conv = c.conversations.create(items=[hi, resent_call("call_q", "Rome")])
    r = c.responses.create(model="default", conversation=conv.id, input=[call_output("call_q", "rain")],
                           max_output_tokens=4, temperature=0)
    assert shape(c.responses.input_items.list(r.id, order="asc").data) == [
        ("function_call_output", "call_q", "rain")]
    at_once = c.responses.create(model="default", input=[hi, resent_call("call_q", "Rome"), call_output("call_q", "rain")],
                                 max_output_tokens=4, temperature=0)
    assert r.usage.input_tokens == at_once.usage.input_tokens
    assert input_tokens(sf, session_of(r.id), True) == input_tokens(sf, session_of(at_once.id), True)
    # A previous_response_id chain, the same; answered once along it.
    r1 = c.responses.create(model="default", input=[hi, resent_call("call_z", "Oslo")], max_output_tokens=4,
                            temperature=0)
    r2 = c.responses.create(model="default", previous_response_id=r1.id, input=[call_output("call_z", "snow")],
                            max_output_tokens=4, temperature=0)
    assert shape(c.responses.input_items.list(r2.id).data) == [("function_call_output", "call_z", "snow")]
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="default", previous_response_id=r2.id, input=[call_output("call_z")],
                           max_output_tokens=4)
    assert e.value.body["param"] == "input" and "call_z" in e.value.body["message"], e.value.body


def test_a_call_id_is_resent_once(daemon):
    # Two function_call items with one call_id (in the same items, or one
    # already resent earlier in the conversation or chain) were taken:
    # OpenAI refuses a duplicate call id. A 400 naming it, nothing written.
    c = oai(daemon)
    hi = {"type": "message", "role": "user", "content": "hi"}
    twice = [hi, resent_call("call_dup", "Paris"), resent_call("call_dup", "Rome"), call_output("call_dup")]
    conv = c.conversations.create(items=[hi, resent_call("call_dup", "Paris"), call_output("call_dup")])
    chain = c.responses.create(model="default", input=[hi, resent_call("call_dup", "Paris"), call_output("call_dup")],
                               max_output_tokens=4)
    again = [resent_call("call_dup", "Rome"), call_output("call_dup")]
    refused_writing_nothing(daemon, c, conv, "call_dup", (
        (lambda: c.conversations.create(items=twice), "items"),
        (lambda: c.conversations.items.create(conv.id, items=twice), "items"),
        (lambda: c.responses.create(model="default", input=twice, max_output_tokens=4), "input"),
        (lambda: c.responses.create(model="default", conversation=conv.id, input=twice,
                                    max_output_tokens=4), "input"),
        # Already resent earlier in the conversation or chain.
        (lambda: c.conversations.items.create(conv.id, items=again), "items"),
        (lambda: c.conversations.items.create(conv.id, items=again[:1]), "items"),
        (lambda: c.responses.create(model="default", conversation=conv.id, input=again,
                                    max_output_tokens=4), "input"),
        (lambda: c.responses.create(model="default", previous_response_id=chain.id, input=again,
                                    max_output_tokens=4), "input")))


def reset_after(daemon, method, path, body, delay):
    """Sends one request and resets the connection (RST, not FIN) `delay`
    seconds after, without reading the reply: a client that goes away
    mid-request. A FIN is taken as a half-close and the request runs on;
    a reset makes actix drop the handler's future where it waits."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", daemon.port))
    s.sendall("{} {} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nAuthorization: Bearer {}\r\n"
              "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n"
              .format(method, path, daemon.port, KEY, len(data)).encode() + data)
    time.sleep(delay)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def test_a_create_dropped_by_its_client_leaves_no_half_made_conversation(daemon):
    # POST /v1/conversations makes a session, sets its record, then appends
    # the items, one request each. actix drops a handler's future when its
    # client resets the connection, and a drop between those steps left a
    # session without its record or with part of its items, for good.
    c = oai(daemon)
    n = 20
    items = [{"type": "message", "role": "user", "content": "item {}".format(i)} for i in range(n)]
    known = set(daemon.client().list())

    def settled():
        # Every new session is a whole conversation: its record and all
        # its items (a create still running is not yet).
        for s in set(daemon.client().list()) - known:
            try:
                listed = c.conversations.items.list("conv_{}".format(s), limit=100).data
            except openai.NotFoundError:
                return False
            if len(listed) != n:
                return False
        return True

    for delay in (0.0, 0.002, 0.005, 0.01, 0.02, 0.04, 0.08):
        reset_after(daemon, "POST", "/v1/conversations", {"items": items}, delay)
        deadline = time.monotonic() + 20
        while not settled():
            assert time.monotonic() < deadline, (
                "a half-made conversation after a reset at {} s: sessions {}".format(
                    delay, sorted(set(daemon.client().list()) - known)))
            time.sleep(0.05)
        known = set(daemon.client().list())


def test_an_items_append_dropped_by_its_client_is_whole_or_absent(daemon):
    # POST /v1/conversations/{id}/items appends each item as a session
    # request of its own: a client that resets the connection between two
    # of them must not leave part of its items in the conversation.
    c = oai(daemon)
    n = 20
    conv = c.conversations.create(items=[{"type": "message", "role": "user", "content": "hi"}])
    items = [{"type": "message", "role": "user", "content": "item {}".format(i)} for i in range(n)]
    delays = (0.0, 0.002, 0.005, 0.01)  # at most 1 + 4 * 20 items: one page

    def added():
        return len(c.conversations.items.list(conv.id, limit=100).data) - 1

    for delay in delays:
        reset_after(daemon, "POST", "/v1/conversations/{}/items".format(conv.id), {"items": items}, delay)
    # Settled: the same count three polls in a row. Whole appends only, so
    # a multiple of n; a part left behind never becomes one.
    deadline = time.monotonic() + 30
    seen = []
    while len(seen) < 3 or len(set(seen[-3:])) != 1 or seen[-1] % n != 0:
        assert time.monotonic() < deadline, "part of an append after a reset: {} items added".format(seen[-1])
        seen.append(added())
        time.sleep(0.1)


def test_list_routes_check_the_caller_before_the_query(daemon):
    # A list route's query was parsed by actix before the credential, Origin
    # and Host checks ran: a bad `limit` got actix's plain-text 400 where a
    # foreign Host must get 403 and a missing key 401, in OpenAI's shape.
    c = oai(daemon)
    r = c.responses.create(model="default", input="Say hi.", max_output_tokens=4, temperature=0)
    conv = c.conversations.create(items=[{"type": "message", "role": "user", "content": "hi"}])
    key = {"Authorization": "Bearer " + KEY}
    for path in ("/v1/responses/{}/input_items".format(r.id), "/v1/conversations/{}/items".format(conv.id)):
        cases = [
            (dict(key, Host="evil.example:{}".format(daemon.port)), 403, "permission_error", None),
            (dict(key, Origin="http://evil.example"), 403, "permission_error", None),
            ({}, 401, "authentication_error", None),
            ({"Authorization": "Bearer wrong"}, 401, "authentication_error", None),
            (key, 400, "invalid_request_error", "limit"),
        ]
        for headers, status, kind, param in cases:
            got, _, body = raw(daemon, "GET", path + "?limit=x", None, headers)
            assert got == status, (path, headers, got, body)
            err = json.loads(body)["error"]
            assert (err["type"], err["param"]) == (kind, param), (path, headers, err)
        # The rest of a bad query is still the route's 400, naming its field.
        for query, param in (("limit=0", "limit"), ("limit=-1", "limit"), ("order=sideways", "order")):
            got, _, body = raw(daemon, "GET", path + "?" + query, None, key)
            assert got == 400 and json.loads(body)["error"]["param"] == param, (path, query, body)
        got, _, body = raw(daemon, "GET", path + "?limit=1&order=asc", None, key)
        assert got == 200 and len(json.loads(body)["data"]) == 1, body


CITY = {"type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24},
                       "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
        "required": ["city", "population"], "additionalProperties": False}


def test_text_format_json_schema_follows_the_schema_and_reads_back(daemon):
    c = oai(daemon)
    fmt = {"format": {"type": "json_schema", "name": "city_info", "schema": CITY, "strict": True}}
    r1 = c.responses.create(model="default", input="Name a big city and its population.", text=fmt,
                            max_output_tokens=80, temperature=0)
    assert r1.status == "completed", r1.output_text
    got = json.loads(r1.output_text)
    assert set(got) == {"city", "population"} and isinstance(got["population"], int), got
    assert r1.text.format.type == "json_schema" and r1.text.format.name == "city_info"
    # The next response of the chain asks for text: the schema is a setting
    # of each request, not carried along the chain.
    r2 = c.responses.create(model="default", previous_response_id=r1.id, input="Now say hello in words.",
                            max_output_tokens=10, temperature=0)
    assert r2.text.format.type == "text"
    assert not r2.output_text.lstrip().startswith("{"), r2.output_text
    # json_object: any JSON object.
    r3 = c.responses.create(model="default", previous_response_id=r2.id, input="Name a cat.",
                            text={"format": {"type": "json_object"}}, max_output_tokens=120, temperature=0)
    assert r3.status == "completed", r3.output_text
    assert isinstance(json.loads(r3.output_text), dict), r3.output_text
    # Stateless, the same schema is followed.
    r4 = c.responses.create(model="default", input="Name a big city and its population.", text=fmt,
                            store=False, max_output_tokens=80, temperature=0)
    assert set(json.loads(r4.output_text)) == {"city", "population"}
    daemon.restart()
    c = oai(daemon)
    back = c.responses.retrieve(r1.id)
    assert back.output_text == r1.output_text
    assert back.text.format.type == "json_schema" and back.text.format.schema_ == CITY
    assert c.responses.retrieve(r2.id).text.format.type == "text"


# An output the grammar keeps long (at least 400 digits), so the response is
# still being written while the test drops, resumes and cancels it.
DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 400}


def key(e):
    return (e.type, e.sequence_number, getattr(e, "delta", None))


def digits_stream(c, n):
    """A streamed response kept long by DIGITS: the stream, its iterator and
    its first `n` events."""
    s = c.responses.create(model="default", input="Write digits.", max_output_tokens=3000, temperature=0,
                           stream=True, text={"format": {"type": "json_schema", "name": "digits", "schema": DIGITS}})
    it = iter(s)
    return s, it, [next(it) for _ in range(n)]


def test_dropped_stream_resumed_with_starting_after_then_cancelled(daemon):
    c = oai(daemon)
    s, it, seen = digits_stream(c, 6)
    s.close()  # the client drops the stream
    rid = seen[0].response.id
    # The drop did not cancel the stored response: it is still being written.
    assert c.responses.retrieve(rid).status == "in_progress"
    resumed = c.responses.retrieve(rid, stream=True, starting_after=seen[-1].sequence_number)
    it = iter(resumed)
    more = [next(it) for _ in range(12)]
    got = seen + more
    assert [e.sequence_number for e in got] == list(range(len(got))), "no event missed or repeated"
    cancelled = c.responses.cancel(rid)
    assert cancelled.status == "cancelled" and cancelled.id == rid
    rest = list(it)
    assert rest[-1].response.status == "cancelled"
    got += rest
    assert [e.sequence_number for e in got] == list(range(len(got)))
    text = "".join(e.delta for e in got if e.type == "response.output_text.delta")
    assert text.startswith("[") and text == c.responses.retrieve(rid).output_text
    with pytest.raises(openai.BadRequestError):
        c.responses.cancel(rid)  # no longer in progress
    # A stream resumed from the middle after a restart replays the rest.
    cut = len(got) // 2
    daemon.restart()
    c = oai(daemon)
    again = list(c.responses.retrieve(rid, stream=True, starting_after=got[cut - 1].sequence_number))
    assert [key(e) for e in again] == [key(e) for e in got[cut:]]
    assert [key(e) for e in c.responses.retrieve(rid, stream=True)] == [key(e) for e in got]
    for missing in ("resp_999999_0", issued_id(daemon, 999999, 0, made_ms=0), issued_id(daemon, session_of(rid), 999)):
        with pytest.raises(openai.NotFoundError):
            list(c.responses.retrieve(missing, stream=True))


def test_a_response_cut_by_sigkill_reads_back_cancelled_not_in_progress(daemon):
    c = oai(daemon)
    s, it, seen = digits_stream(c, 8)
    rid = seen[0].response.id
    assert c.responses.retrieve(rid).status == "in_progress"
    daemon.restart()  # SIGKILL mid-generation, then start on the same dir
    c = oai(daemon)
    back = c.responses.retrieve(rid)
    # Nothing is generating it any more: it reads as cut, with what was kept.
    assert back.status == "cancelled", back.status
    text = back.output_text
    assert text.startswith("["), text
    replay = list(c.responses.retrieve(rid, stream=True))
    assert replay[-1].response.status == "cancelled"
    assert "".join(e.delta for e in replay if e.type == "response.output_text.delta") == text


def test_other_instructions_on_a_chain_are_the_ones_the_model_sees(daemon):
    # OpenAI's instructions are each request's own: a continuation giving
    # others is prompted with them, not the chain's first (they were echoed
    # but not applied), and its prompt is the chat route's for the same
    # conversation under the new system message, stored or not.
    c = oai(daemon)
    r1 = c.responses.create(model="default", instructions="You are terse.", input="Name a river.",
                            max_output_tokens=8, temperature=0)
    said = r1.output_text.strip()
    new = "You answer in French, at length."
    chat = c.chat.completions.create(model="default", max_tokens=1, temperature=0, messages=[
        {"role": "system", "content": new}, {"role": "user", "content": "Name a river."},
        {"role": "assistant", "content": said}, {"role": "user", "content": "Another one."}])
    made = {}
    for store in (True, False):
        r2 = c.responses.create(model="default", previous_response_id=r1.id, instructions=new,
                                input="Another one.", max_output_tokens=8, temperature=0, store=store)
        assert r2.instructions == new and r2.previous_response_id == r1.id
        assert r2.usage.input_tokens == chat.usage.prompt_tokens, (store, r2.usage, chat.usage)
        made[store] = r2
    back = c.responses.retrieve(made[True].id)
    assert back.instructions == new and back.previous_response_id == r1.id
    # The chain goes on from it with the same instructions as a fork (its
    # prompt cached), and names it as its previous response.
    r3 = c.responses.create(model="default", previous_response_id=back.id, instructions=new,
                            input="And a third.", max_output_tokens=8, temperature=0)
    assert r3.usage.input_tokens_details.cached_tokens >= back.usage.input_tokens
    assert c.responses.retrieve(r3.id).previous_response_id == back.id
    # A continuation that gives no instructions keeps the chain's.
    kept = c.responses.create(model="default", previous_response_id=r1.id, input="Another one.",
                              max_output_tokens=8, temperature=0)
    assert c.responses.retrieve(kept.id).instructions == "You are terse."
    assert kept.usage.input_tokens_details.cached_tokens > 0


def test_a_path_no_route_serves_is_a_404_in_each_apis_shape(daemon):
    """Under /v1/ and /api/ a path (or method) no route serves answers 404 in
    the API's own error shape, after the credential check (it was an empty
    404 the SDKs showed as a bare "Error code: 404")."""
    auth = {"Authorization": "Bearer " + KEY}
    with pytest.raises(openai.NotFoundError) as e:
        oai(daemon).get("/no-such-route", cast_to=object)
    assert "no route serves GET /v1/no-such-route" in str(e.value)
    status, _, body = raw(daemon, "GET", "/v1/chat/completions", None, auth)
    assert status == 404 and json.loads(body)["error"]["type"] == "invalid_request_error", body
    status, _, body = raw(daemon, "POST", "/v1/messages/nope", {}, auth)
    reply = json.loads(body)
    assert status == 404 and reply["type"] == "error" and reply["error"]["type"] == "not_found_error", reply
    status, _, body = raw(daemon, "GET", "/api/nope", None, auth)
    assert status == 404 and "no route serves" in json.loads(body)["error"], body
    status, _, body = raw(daemon, "GET", "/v1/nope", None, {})
    assert status == 401, (status, body)


@pytest.mark.parametrize("stream", [False, True])
def test_the_access_log_counts_the_responses_input_as_usage_does(daemon, stream):
    """The access line's prompt= is the response's usage.input_tokens (it
    left out the assistant header a stored response's turn opens with, and
    could read below cached=)."""
    from compat import access_lines
    c = oai(daemon)
    if stream:
        with c.responses.create(model="default", input="Name a lake.", max_output_tokens=6,
                                temperature=0, stream=True) as events:
            usage = [e for e in events][-1].response.usage
    else:
        usage = c.responses.create(model="default", input="Name a lake.", max_output_tokens=6,
                                   temperature=0).usage
    line = [ln for ln in access_lines(daemon) if "POST /v1/responses" in ln][-1]
    assert "prompt={} ".format(usage.input_tokens) in line, (line, usage)
    assert "cached={} ".format(usage.input_tokens_details.cached_tokens) in line, (line, usage)
