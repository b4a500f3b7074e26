"""Two models in one daemon (`serve MODEL --model MODEL`), driven by the
official `openai`, `anthropic` and `ollama` clients and by superfluid's own:
every route lists both and picks by its `model` field, a request for a model
not served is a 404 naming the served ones, the second model loads on first
use, Ollama's `ps` shows what is loaded and `keep_alive: 0` unloads it, and
each model keeps its own sessions.

The second model is a derived test model whose template puts a Llama 3 style
header on each turn: the same messages come to a different prompt length on
it, which shows which model's template served a request."""

import time

import anthropic
import ollama
import openai
import pytest

from compat import KEY, ant, oai, raw
from superfluid_client import Client, SuperfluidError
from superfluid_client.daemon import derived_model

SECOND = "SmolLM2-135M-llama3-style"
EXTRA_ARGS = ["--api-key", KEY, "--model", derived_model(SECOND + ".gguf"), "--keep-alive", "-1"]
GREEDY = {"temperature": 0, "seed": 7}
MSGS = [{"role": "user", "content": "Name a colour."}]


def oll(daemon):
    return ollama.Client(host=daemon.url, headers={"Authorization": "Bearer " + KEY}, timeout=120)


def first_id(daemon):
    return oai(daemon).models.list().data[0].id


def ps_names(daemon):
    return [m.model for m in oll(daemon).ps().models]


def wait_for(what, f, secs=20):
    until = time.time() + secs
    while not f():
        assert time.time() < until, "timed out waiting for " + what
        time.sleep(0.1)


def test_the_second_model_is_listed_everywhere_and_loads_on_first_use(daemon):
    ids = [m.id for m in oai(daemon).models.list().data]
    assert len(ids) == 2 and ids[1] == SECOND, ids
    assert oai(daemon).models.retrieve(SECOND).id == SECOND
    tags = [m.model for m in oll(daemon).list().models]
    assert tags == [ids[0] + ":latest", SECOND + ":latest"], tags
    listed = daemon.client().models()
    assert [m["id"] for m in listed] == ids and listed[0]["default"] and not listed[1]["default"]
    # Not used yet: not loaded, and ps shows only the first.
    assert listed[1]["state"] == "unloaded"
    assert ps_names(daemon) == [ids[0] + ":latest"]


def test_openai_and_anthropic_pick_the_model_by_name(daemon):
    c = oai(daemon)
    a = c.chat.completions.create(model=first_id(daemon), messages=MSGS, max_tokens=8, **GREEDY)
    b = c.chat.completions.create(model=SECOND, messages=MSGS, max_tokens=8, **GREEDY)
    assert a.model == first_id(daemon) and b.model == SECOND
    # The second template's header on each turn makes its prompt longer.
    assert b.usage.prompt_tokens != a.usage.prompt_tokens
    # The file name and "default" name models too.
    d = c.chat.completions.create(model="default", messages=MSGS, max_tokens=8, **GREEDY)
    assert d.usage.prompt_tokens == a.usage.prompt_tokens
    f = c.chat.completions.create(model=SECOND + ".gguf", messages=MSGS, max_tokens=8, **GREEDY)
    assert f.usage.prompt_tokens == b.usage.prompt_tokens
    # Anthropic's count_tokens renders with the named model's template.
    n_a = ant(daemon).messages.count_tokens(model=first_id(daemon), messages=MSGS).input_tokens
    n_b = ant(daemon).messages.count_tokens(model=SECOND, messages=MSGS).input_tokens
    assert n_a != n_b
    m = ant(daemon).messages.create(model=SECOND, messages=MSGS, max_tokens=8, extra_body={"temperature": 0})
    assert m.model == SECOND
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == n_b
    assert daemon.client().models()[1]["state"] == "ready"
    # /metrics?model= reports that model's lane.
    status, _, body = raw(daemon, "GET", "/metrics?model=" + SECOND, None, {"Authorization": "Bearer " + KEY})
    assert status == 200 and b'superfluid_lane_state{state="ready"} 1' in body
    status, _, _ = raw(daemon, "GET", "/metrics?model=nope", None, {"Authorization": "Bearer " + KEY})
    assert status == 404


def test_a_model_not_served_is_a_404_naming_the_served_ones(daemon):
    with pytest.raises(openai.NotFoundError) as e:
        oai(daemon).chat.completions.create(model="gpt-4o", messages=MSGS, max_tokens=4)
    assert SECOND in str(e.value) and first_id(daemon) in str(e.value)
    with pytest.raises(anthropic.NotFoundError):
        ant(daemon).messages.create(model="claude-x", messages=MSGS, max_tokens=4)
    with pytest.raises(ollama.ResponseError) as e:
        oll(daemon).chat(model="llama3:8b", messages=MSGS)
    assert e.value.status_code == 404
    t = daemon.token()
    h = {"Authorization": "Bearer " + t, "x-superfluid-csrf": t}
    status, _, body = raw(daemon, "POST", "/web/rpc?model=nope", "List", h)
    assert status == 404 and SECOND.encode() in body


def test_ollama_picks_by_model_and_keep_alive_zero_unloads(daemon):
    c = oll(daemon)
    # Greedy on each model's own template: two different replies.
    fruit = [{"role": "user", "content": "Name a fruit."}]
    a = c.chat(model=first_id(daemon), messages=fruit, options={**GREEDY, "num_predict": 8})
    b = c.chat(model=SECOND, messages=fruit, options={**GREEDY, "num_predict": 8})
    assert b.model == SECOND + ":latest"
    assert a.message.content != b.message.content
    g = c.generate(model=SECOND, prompt="Name a colour.", options={**GREEDY, "num_predict": 8})
    assert g.model == SECOND + ":latest" and g.response
    shown = c.show(SECOND)
    assert "<empty_output>" in shown.template and "<empty_output>" not in c.show(first_id(daemon)).template
    assert SECOND + ":latest" in ps_names(daemon)
    # keep_alive 0 on the load request: the model unloads once idle.
    r = c.chat(model=SECOND, messages=[], keep_alive=0)
    assert r.done_reason == "unload"
    wait_for("the second model to unload", lambda: SECOND + ":latest" not in ps_names(daemon))
    assert daemon.client().models()[1]["state"] == "unloaded"
    # The load request loads it again; then ps shows when it will unload.
    r = c.chat(model=SECOND, messages=[], keep_alive="10m")
    assert r.done_reason == "load"
    wait_for("the second model to load", lambda: daemon.client().models()[1]["state"] == "ready")
    ps = {m.model: m for m in c.ps().models}
    expires = ps[SECOND + ":latest"].expires_at.timestamp()
    assert 500 < expires - time.time() < 700
    # The first model never unloads: keep_alive 0 answers unload but it stays.
    r = c.chat(model=first_id(daemon), messages=[], keep_alive=0)
    time.sleep(1.5)
    assert first_id(daemon) + ":latest" in ps_names(daemon)


def test_each_model_keeps_its_own_sessions(daemon):
    first = daemon.client()
    second = Client(daemon.url, sessions_dir=daemon.sessions, model=SECOND)
    s1 = first.session()
    s2 = second.session()
    s1.user("Name a colour.")
    s2.user("Name a colour.")
    t1, t2 = s1.inspect()["tokens"], s2.inspect()["tokens"]
    assert t1 != t2, "each model's template rendered its own session"
    reply = s2.generate(max_tokens=6)
    assert reply.text
    # Ids are per model: each client sees its own session under its id.
    assert first.get(s1.id).inspect()["tokens"] == t1
    assert second.get(s2.id).inspect()["tokens"] > t2
    # Both logs handed out their first id: the same number, two sessions.
    assert s1.id == s2.id
    with pytest.raises(SuperfluidError) as e:
        Client(daemon.url, sessions_dir=daemon.sessions, model="nope").list()
    assert SECOND in str(e.value)


def test_a_stored_response_is_found_in_the_log_of_the_model_that_made_it(daemon):
    # Session numbers are per model (above): resp_<session>_<event> alone
    # named a session of the default model's log, so a response the second
    # model made was read back from whichever default-model session had its
    # number. The id's tag names the log.
    c = oai(daemon)
    # The same session number in both logs, holding different things: line
    # up the logs' next numbers, then make one response on each.
    first = daemon.client()
    second = Client(daemon.url, sessions_dir=daemon.sessions, model=SECOND)
    n1, n2 = max(first.list(), default=0), max(second.list(), default=0)
    while n1 < n2:
        n1 = first.session().id
    while n2 < n1:
        n2 = second.session().id
    a = c.responses.create(model="default", input="Name a fruit.", max_output_tokens=4, temperature=0)
    b = c.responses.create(model=SECOND, input="Name a country.", max_output_tokens=6, temperature=0)
    assert a.id.split("_")[1] == b.id.split("_")[1], (a.id, b.id)
    got = c.responses.retrieve(b.id)
    assert (got.model, got.output_text) == (SECOND, b.output_text)
    assert [i.content[0].text for i in c.responses.input_items.list(b.id).data] == ["Name a country."]
    streamed = [e for e in c.responses.retrieve(b.id, stream=True)]
    assert streamed[-1].response.output_text == b.output_text
    assert c.responses.retrieve(a.id).output_text == a.output_text
    # A continuation names its model; the other model's id is not one of its responses.
    b2 = c.responses.create(model=SECOND, previous_response_id=b.id, input="Another.",
                            max_output_tokens=4, temperature=0)
    assert b2.previous_response_id == b.id
    assert c.responses.retrieve(b2.id).previous_response_id == b.id
    for model, prev in (("default", b.id), (SECOND, a.id)):
        with pytest.raises(openai.NotFoundError):
            c.responses.create(model=model, previous_response_id=prev, input="x", max_output_tokens=2)
    # Delete purges the second model's session, not the first's.
    c.responses.delete(b2.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(b2.id)
    assert c.responses.retrieve(b.id).output_text == b.output_text
    assert c.responses.retrieve(a.id).output_text == a.output_text


def test_a_conversation_is_the_default_models(daemon):
    # POST /v1/conversations names no model: the conversation is a session
    # of the default model's log, and a response on it with the second
    # model is a 400 naming the model to ask for (it was a 404 "no
    # conversation", the second model's log holding none).
    c = oai(daemon)
    conv = c.conversations.create(items=[{"type": "message", "role": "user", "content": "Hi."}])
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=SECOND, conversation=conv.id, input="Name a colour.", max_output_tokens=2)
    assert e.value.body["param"] == "model" and first_id(daemon) in e.value.body["message"], e.value.body
    assert len(c.conversations.items.list(conv.id).data) == 1, "nothing was added"
    r = c.responses.create(model="default", conversation=conv.id, input="Name a colour.",
                           max_output_tokens=2, temperature=0)
    assert len(c.conversations.items.list(conv.id).data) == 1 + 1 + len(r.output)
