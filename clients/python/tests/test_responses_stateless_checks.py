"""A store: false continuation of a previous_response_id chain checks its
input's calls as a stored continuation does, with the official SDK against a
real daemon on the tools-think test model: a function_call_output must answer
an open call of the chain once, and a resent function_call's call_id must be
new to the chain (no earlier resent call's, no call of the model's). Each
refusal is a 400 with param "input" naming the call id, before anything is
generated; the same resent call ids are refused on the stored routes too."""

import json
import os
import time

import openai
import pytest

from compat import KEY, TIME, WEATHER, forced_call, metrics, oai

MODEL = "SmolLM2-135M-tools-think.gguf"
EXTRA_ARGS = ["--api-key", KEY]

HI = {"type": "message", "role": "user", "content": "hi"}


def output(call_id, text="sunny, 21 C"):
    return {"type": "function_call_output", "call_id": call_id, "output": text}


def resent(call_id):
    return {"type": "function_call", "call_id": call_id, "name": "get_weather",
            "arguments": json.dumps({"city": "Oslo"})}


def legacy(call_id):
    """The older name (call_<event>) of a call the model made in the session
    a response chain forks from: call_<session>_<event> without the session."""
    _, _, event = call_id.split("_")
    return "call_" + event


def wal_size(daemon):
    return os.path.getsize(os.path.join(daemon.sessions, "wal.log"))


def work(daemon):
    """What generating anything moves: the tokens prefilled and drawn, the
    log's size and the sessions. Read once it has stopped moving (a reply
    may come back before the counters of its generation are updated)."""
    def now():
        m = metrics(daemon)
        return (m["superfluid_prefill_tokens_total"], m["superfluid_generated_tokens_total"],
                wal_size(daemon), len(daemon.client().list()))
    last = now()
    for _ in range(50):
        time.sleep(0.1)
        again = now()
        if again == last:
            return again
        last = again
    return last


def refused(daemon, c, cases, param="input"):
    """Each (call_id, why, make) of `cases` is a 400 invalid_request_error on
    `param` whose message names `call_id` and says `why`; nothing is
    prefilled, generated, written or made."""
    before = work(daemon)
    for call_id, why, make in cases:
        with pytest.raises(openai.BadRequestError) as e:
            make()
        body = e.value.body
        assert body["type"] == "invalid_request_error", (call_id, body)
        assert body["param"] == param, (call_id, body)
        assert call_id in body["message"] and why in body["message"], (call_id, body)
        assert work(daemon) == before, (call_id, body)


def test_a_stateless_continuation_checks_its_outputs_and_resent_calls(daemon):
    # Each of these was taken by a store: false continuation (its messages
    # went to the model as given), though a stored continuation of the same
    # chain refuses them.
    c = oai(daemon)
    r1, a = forced_call(c, input="What is the weather in Paris?")
    own = r1.id.split("_")[1]
    # r2 answers a and resends a call (c_open) it leaves open; r3 answers it.
    r2 = c.responses.create(model="default", previous_response_id=r1.id, tools=[WEATHER, TIME],
                            input=[output(a.call_id), resent("c_open")], max_output_tokens=4, temperature=0)
    r3 = c.responses.create(model="default", previous_response_id=r2.id, input=[output("c_open")],
                            max_output_tokens=4, temperature=0)

    def stateless(prev, items):
        return lambda: c.responses.create(model="default", previous_response_id=prev.id, store=False,
                                          tools=[WEATHER, TIME], input=items, max_output_tokens=4)

    bad = [
        # No call of the chain has the id.
        ("call_{}_999999".format(own), "not a call", lambda r: [HI, output("call_{}_999999".format(own))]),
        ("call_nowhere", "not a call", lambda r: [HI, output("call_nowhere")]),
        # Answered twice in the same input.
        (a.call_id, "two function_call_output", lambda r: [output(a.call_id), output(a.call_id, "again")]),
        # A resent call with the name of the model's call, in either form.
        (a.call_id, "names a call the model made", lambda r: [resent(a.call_id), output(a.call_id)]),
        (legacy(a.call_id), "names a call the model made", lambda r: [resent(legacy(a.call_id))]),
        # Two resent calls with one id in the same input.
        ("c_twice", "used by an earlier", lambda r: [resent("c_twice"), output("c_twice"), resent("c_twice")]),
    ]
    refused(daemon, c, [(call_id, why, stateless(r1, items(r1))) for call_id, why, items in bad])
    # Down the chain: a's answer and the resent call are history.
    refused(daemon, c, [
        (a.call_id, "already answered", stateless(r2, [HI, output(a.call_id)])),
        (a.call_id, "names a call the model made", stateless(r2, [resent(a.call_id)])),
        ("c_open", "used by an earlier", stateless(r2, [resent("c_open")])),
        ("c_open", "two function_call_output", stateless(r2, [output("c_open"), output("c_open", "again")])),
        ("c_open", "already answered", stateless(r3, [HI, output("c_open")])),
        ("c_open", "used by an earlier", stateless(r3, [resent("c_open"), output("c_open")])),
    ])
    # The stored continuations of the same chain answer the same.
    refused(daemon, c, [
        (a.call_id, "already answered", lambda: c.responses.create(
            model="default", previous_response_id=r2.id, input=[HI, output(a.call_id)], max_output_tokens=4)),
        ("c_open", "used by an earlier", lambda: c.responses.create(
            model="default", previous_response_id=r3.id, input=[resent("c_open")], max_output_tokens=4)),
    ])
    # The open calls are answered: the continuations run, and nothing is
    # written.
    size, sessions = wal_size(daemon), len(daemon.client().list())
    for prev, items in ((r1, [output(a.call_id)]), (r1, [output(legacy(a.call_id))]),
                        (r2, [HI, output("c_open")]), (r3, [resent("c_new"), output("c_new")])):
        r = stateless(prev, items)()
        assert r.status in ("completed", "incomplete") and r.usage.output_tokens > 0, (prev.id, items)
        assert r.store is False and r.previous_response_id == prev.id
    assert (wal_size(daemon), len(daemon.client().list())) == (size, sessions)


def test_a_stateless_response_without_a_chain_has_no_open_call(daemon):
    # Without previous_response_id an output must answer a call resent
    # before it in the same input, as on a new stored response.
    c = oai(daemon)

    def stateless(items):
        return lambda: c.responses.create(model="default", store=False, tools=[WEATHER, TIME], input=items,
                                          max_output_tokens=4)

    refused(daemon, c, [
        ("call_1_2", "not a call", stateless([HI, output("call_1_2")])),
        ("c1", "two function_call_output", stateless([HI, resent("c1"), output("c1"), output("c1", "x")])),
        ("c1", "used by an earlier", stateless([HI, resent("c1"), output("c1"), resent("c1")])),
    ])
    r = stateless([HI, resent("c1"), output("c1")])()
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens > 0


def test_a_resent_call_may_not_take_the_name_of_the_models_call(daemon):
    # A function_call item whose call_id is that of a call the model made in
    # the chain or conversation was taken as a new call: two calls with one
    # id. Refused on every route, naming the id, before anything is written.
    c = oai(daemon)
    conv = c.conversations.create()
    r1, a = forced_call(c, conversation=conv.id, input="What is the weather in Paris?")
    before = c.conversations.items.list(conv.id, limit=100).data
    refused(daemon, c, [
        (a.call_id, "names a call the model made", lambda: c.conversations.items.create(
            conv.id, items=[resent(a.call_id)])),
    ], param="items")
    refused(daemon, c, [
        (a.call_id, "names a call the model made", lambda: c.responses.create(
            model="default", conversation=conv.id, input=[resent(a.call_id), output(a.call_id)],
            max_output_tokens=4)),
        (legacy(a.call_id), "names a call the model made", lambda: c.responses.create(
            model="default", previous_response_id=r1.id, input=[HI, resent(legacy(a.call_id))],
            max_output_tokens=4)),
        (a.call_id, "names a call the model made", lambda: c.responses.create(
            model="default", previous_response_id=r1.id, store=False, input=[resent(a.call_id)],
            max_output_tokens=4)),
    ])
    assert c.conversations.items.list(conv.id, limit=100).data == before
    # Another id is the client's to resend.
    added = c.conversations.items.create(conv.id, items=[output(a.call_id), resent("c_mine")])
    assert [i.type for i in added.data] == ["function_call_output", "function_call"], added.data
