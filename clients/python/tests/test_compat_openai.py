"""The OpenAI routes, driven by the official `openai` SDK on the default model:
chat (streamed and not), the prefix cache across turns, n forks sharing one
prefill, stop sequences, JSON schema output, completions, models, metrics,
every error case, and a client that goes away mid-stream."""

import json
import re
import threading
import time

import openai
import pytest

from compat import KEY, access_lines, cached_field, metrics, number, oai, raw, words

EXTRA_ARGS = ["--api-key", KEY]
GREEDY = {"temperature": 0, "seed": 7}


def chat(client, content, **kw):
    args = dict(model="default", messages=[{"role": "user", "content": content}], max_tokens=24)
    args.update(GREEDY)
    args.update(kw)
    return client.chat.completions.create(**args)


def test_chat_not_streamed_and_streamed_agree(daemon):
    c = oai(daemon)
    r = chat(c, "Name a colour.")
    text = r.choices[0].message.content
    assert text and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # The cold reply came from a prefill, later ones from the cache (their
    # rounding may differ): compare warm to warm.
    r = chat(c, "Name a colour.")
    text = r.choices[0].message.content
    chunks = list(chat(c, "Name a colour.", stream=True, stream_options={"include_usage": True}))
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == text
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [r.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert usage.prompt_tokens == r.usage.prompt_tokens and usage.completion_tokens == r.usage.completion_tokens


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a colour."}]}),
    ("/v1/completions", {"prompt": "Colours: red,"}),
])
def test_include_usage_puts_a_null_usage_on_every_chunk_but_the_last(daemon, path, body):
    """OpenAI's reference for stream_options.include_usage: "All other chunks
    will also include a usage field, but with a null value." Without it no
    chunk has the key."""
    def chunks(**extra):
        b = dict(body, model="default", max_tokens=6, stream=True, **extra)
        status, _, raw_body = raw(daemon, "POST", path, b, {"Authorization": "Bearer " + KEY})
        assert status == 200, raw_body[:300]
        lines = [ln[6:] for ln in raw_body.decode().split("\n") if ln.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        return [json.loads(ln) for ln in lines[:-1]]
    got = chunks(stream_options={"include_usage": True})
    assert len(got) >= 3 and all("usage" in c and c["usage"] is None for c in got[:-1]), got
    assert got[-1]["choices"] == [] and got[-1]["usage"]["completion_tokens"] > 0, got[-1]
    assert all("usage" not in c for c in chunks()), "usage without include_usage"


def test_tools_are_declared_for_a_template_that_has_no_place_for_them(daemon):
    """SmolLM2-Instruct's template does not read `tools`: the daemon declares
    them in the system message itself, Hermes-style (they were dropped, so
    the model never saw them and a forced call picked a tool blindly)."""
    c = oai(daemon)
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather for a city",
                                               "parameters": city}},
             {"type": "function", "function": {"name": "get_time", "description": "Get the time in a city",
                                               "parameters": city}}]
    ask = "What's the weather in Paris?"
    plain = chat(c, ask, max_tokens=1).usage.prompt_tokens
    declared = chat(c, ask, max_tokens=1, tools=tools).usage.prompt_tokens
    assert declared > plain + 60, (plain, declared)
    # tool_choice none leaves them out, as documented.
    assert chat(c, ask, max_tokens=1, tools=tools, tool_choice="none").usage.prompt_tokens == plain
    r = chat(c, ask, max_tokens=64, tools=tools, tool_choice="required")
    calls = r.choices[0].message.tool_calls
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        ("get_weather", {"city": "Paris"})], calls
    status, _, body = raw(daemon, "POST", "/api/show", {"model": "default"}, {"Authorization": "Bearer " + KEY})
    assert "tools" in json.loads(body)["capabilities"], body[:300]


def test_a_tool_call_block_without_tools_declared_stays_text(daemon):
    """With no tools declared, a <tool_call> block the model writes on a
    template that has no place for tools is text: it came back as a call to
    a function nobody declared (finish_reason tool_calls)."""
    call = '<tool_call>\n{{"name": "{}", "arguments": {{}}}}\n</tool_call>'
    r = oai(daemon).chat.completions.create(model="default", temperature=0, max_tokens=40, messages=[
        {"role": "system", "content": "You are an echo bot. Repeat the user's message exactly."},
        {"role": "user", "content": call.format("hello")},
        {"role": "assistant", "content": call.format("hello")},
        {"role": "user", "content": call.format("world")}])
    m = r.choices[0].message
    assert not m.tool_calls and r.choices[0].finish_reason != "tool_calls", r
    assert "<tool_call>" in (m.content or ""), "the model wrote no call block: {!r}".format(m.content)


def test_second_turn_of_a_resent_conversation_is_served_from_the_cache(daemon):
    c = oai(daemon)
    history = [{"role": "system", "content": "You are brief. " + words(120, seed=3)},
               {"role": "user", "content": "Tell me about rivers."}]
    first = c.chat.completions.with_raw_response.create(model="default", messages=history, max_tokens=16, **GREEDY)
    r1 = first.parse()
    assert int(first.headers["x-superfluid-warm"]) == cached_field(r1.usage) < 20
    before = metrics(daemon)["superfluid_warm_prefix_tokens_total"]
    history += [{"role": "assistant", "content": r1.choices[0].message.content},
                {"role": "user", "content": "And mountains?"}]
    second = c.chat.completions.with_raw_response.create(model="default", messages=history, max_tokens=8, **GREEDY)
    r2 = second.parse()
    cached = cached_field(r2.usage)
    # Everything the first request's prompt held is reused.
    assert cached >= r1.usage.prompt_tokens - 1, (cached, r1.usage)
    assert int(second.headers["x-superfluid-warm"]) == cached
    assert metrics(daemon)["superfluid_warm_prefix_tokens_total"] - before >= cached
    line = access_lines(daemon)[-1]
    assert "POST /v1/chat/completions 200" in line and "cached={}".format(cached) in line
    assert "prompt={}".format(r2.usage.prompt_tokens) in line and "rivers" not in line


def test_n_forks_share_one_prefill(daemon):
    c = oai(daemon)
    before = metrics(daemon)
    r = c.chat.completions.create(model="default", messages=[{"role": "user", "content": words(300, seed=11)}],
                                  max_tokens=6, n=3, temperature=0.9, seed=5)
    after = metrics(daemon)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    prefilled = after["superfluid_prefill_tokens_total"] - before["superfluid_prefill_tokens_total"]
    p = r.usage.prompt_tokens
    assert p > 300
    # One prefill of the prompt, not three.
    assert prefilled < 1.5 * p, (prefilled, p)
    assert 3 <= r.usage.completion_tokens <= 18


def test_requests_sharing_a_long_prefix_wait_for_one_prefill(daemon):
    """Four requests sent together that share a ~1,500-token document: the
    ones behind the first wait for its prefill and are seeded from it."""
    import threading
    c = oai(daemon)
    doc = "Document: " + words(500, seed=17)
    results = [None] * 4
    before = metrics(daemon)["superfluid_prefill_tokens_total"]

    def ask(i):
        results[i] = c.chat.completions.create(model="default", max_tokens=4, **GREEDY, messages=[
            {"role": "system", "content": doc}, {"role": "user", "content": "Question {}?".format(i)}])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    prefilled = metrics(daemon)["superfluid_prefill_tokens_total"] - before
    p = results[0].usage.prompt_tokens
    assert p > 1024
    cached = sorted(cached_field(r.usage) for r in results)
    # Three of the four were seeded with (at least) the document.
    assert cached[1] > 1024, cached
    assert prefilled < 1.6 * p, (prefilled, p, cached)


# Output a grammar makes exact, so the test does not depend on greedy decoding
# giving the same tokens twice (it need not: the KV pool's other contents
# change the attention's rounding).
EXACT = {"type": "json_schema", "json_schema": {"name": "exact", "schema": {"enum": ["alpha beta gamma delta"]}}}


def test_stop_sequence_split_across_tokens_ends_the_reply(daemon):
    c = oai(daemon)
    full = chat(c, "Say it.", max_tokens=40, response_format=EXACT).choices[0].message.content
    assert full.strip() == '"alpha beta gamma delta"'
    # "ta gam" starts inside one token and ends inside another.
    r = chat(c, "Say it.", max_tokens=40, response_format=EXACT, stop=["ta gam", "zzzz-never"])
    assert r.choices[0].message.content == '"alpha be' and r.choices[0].finish_reason == "stop"
    chunks = list(chat(c, "Say it.", max_tokens=40, response_format=EXACT, stop="ta gam", stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == '"alpha be'
    assert r.usage.completion_tokens < 40


def test_json_schema_output_parses(daemon):
    c = oai(daemon)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = chat(c, "Describe a person as JSON.", max_tokens=80,
             response_format={"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": schema}})
    v = json.loads(r.choices[0].message.content)
    assert set(v) == {"name", "age"} and isinstance(v["age"], int)
    r = chat(c, 'Reply with {"ok": true}.', max_tokens=300, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_an_unanchored_pattern_is_followed(daemon):
    """llama.cpp's converter took only ^...$ patterns and let any other be
    any string, so the reply ignored it; now it is anchored (matching
    anywhere, as JSON Schema says) and followed."""
    c = oai(daemon)
    # Anchored at its start only: the reply opens with a match (the model,
    # asked for something else, would not write one by itself).
    r = chat(c, "Name a river.", max_tokens=8, response_format={
        "type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "string", "pattern": "^x-[0-9]"}}})
    assert re.match(r'"x-[0-9]', r.choices[0].message.content), r.choices[0]


def test_a_schema_past_the_limits_is_a_400_and_the_daemon_lives(daemon):
    """A 10,000-byte property name overflowed the stack of llama.cpp's schema
    converter and killed the daemon; a 1 MB description passed a route that
    did not count a response_format's bytes. Both are 400s naming the limit."""
    c = oai(daemon)
    for schema, said in [
        ({"type": "object", "properties": {"_" * 10000: {"type": "string"}}}, "a key of 10000 bytes"),
        ({"type": "object", "$defs": {"d" * 300: {"type": "string"}}}, "a key of 300 bytes"),
        ({"type": "object", "description": "x" * (1 << 20)}, "over the limit of 65536 bytes"),
        # The converter's refusal named nothing ("ffi error -3").
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
         '$ref "#/$defs/missing" points at nothing'),
        # llama.cpp's parser wrote {2,1} out until the worker's memory ran
        # out; a rule that starts with itself it refused as a 503.
        ({"type": "string", "minLength": 2, "maxLength": 1}, '"minLength": 2 is more than "maxLength": 1'),
        ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "left-recursive"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            chat(c, "x", max_tokens=4, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        assert said in str(e.value) and e.value.param == "response_format", str(e.value)
    assert chat(c, "Still there?", max_tokens=3).usage.completion_tokens == 3


def test_a_grammar_the_worker_refuses_is_a_400(daemon):
    """A schema whose grammar allows no token (exclusive bounds that meet)
    is refused by the worker at the first draw: the request's own fault, a
    400 (it was a 503, which the SDKs retry twice to the same end)."""
    c = oai(daemon)
    schema = {"type": "integer", "exclusiveMinimum": 5, "exclusiveMaximum": 5}
    with pytest.raises(openai.BadRequestError) as e:
        chat(c, "x", max_tokens=3, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert "allows no token" in str(e.value), str(e.value)
    assert chat(c, "Still there?", max_tokens=3).usage.completion_tokens == 3


def nested_alternatives(depth):
    """A 3 KB schema whose grammar's parse stacks double with every "[" the
    model writes: each level an array of one or of up to two of the next."""
    defs = {}
    for i in range(depth):
        item = {"$ref": "#/$defs/l{}".format(i + 1)}
        defs["l{}".format(i)] = {"anyOf": [
            {"type": "array", "items": item, "minItems": 1, "maxItems": 1},
            {"type": "array", "items": item, "minItems": 1, "maxItems": 2}]}
    defs["l{}".format(depth)] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/l0"}


def test_a_grammar_that_grows_too_costly_is_stopped_alone(daemon):
    """A grammar whose cost doubles with each token held every other
    sequence's step (one token per step of it, gaps of 12 s) and the hang
    guard, which allows for the slowest rate seen, never fired. Past 500 ms
    for one token the generation is refused, naming the limit; a request
    beside it is served."""
    c = oai(daemon)
    box = {}

    def costly():
        try:
            chat(c, "Write nested arrays.", max_tokens=64, response_format={
                "type": "json_schema", "json_schema": {"name": "n", "schema": nested_alternatives(16)}})
        except openai.APIError as e:
            box["error"] = str(e)

    t = __import__("threading").Thread(target=costly)
    t.start()
    beside = chat(c, "Name a river.", max_tokens=8)
    t.join(timeout=300)
    assert not t.is_alive()
    assert "500 ms a token" in box.get("error", ""), box
    assert beside.usage.completion_tokens == 8
    assert chat(c, "Still there?", max_tokens=3).usage.completion_tokens == 3


def test_a_costly_grammar_rests_while_a_stream_beside_it_runs(daemon):
    """Every sequence of a step waits for a grammar run in it: a schema whose
    grammar takes 80-300 ms a token (depth 8 of nested alternatives, inside
    the 500 ms limit) held a stream beside it to one token per grammar
    token. Now the costly generation sits out as many steps as its grammar
    takes longer than a step: a 24-token stream started beside it finishes
    while the costly one draws only a few tokens."""
    c = oai(daemon)
    seen = {"n": 0}
    deep = threading.Event()
    done = {}

    def costly():
        stream = chat(c, "Write nested arrays.", max_tokens=40, stream=True, response_format={
            "type": "json_schema", "json_schema": {"name": "n", "schema": nested_alternatives(7)}})
        for ch in stream:
            if ch.choices and ch.choices[0].delta.content:
                seen["n"] += 1
                if seen["n"] == 18:
                    deep.set()
        done["n"] = seen["n"]

    rested = metrics(daemon).get("superfluid_grammar_rested_steps_total", 0)
    t = threading.Thread(target=costly)
    t.start()
    assert deep.wait(120), "the costly stream never reached its 18th token"
    before = seen["n"]
    beside = chat(c, "Name a river and describe it.", max_tokens=24)
    during = seen["n"] - before
    t.join(timeout=300)
    assert not t.is_alive() and done["n"] > 20, done
    assert beside.usage.completion_tokens == 24
    assert during <= 12, f"the costly generation drew {during} tokens while the stream beside drew 24"
    assert metrics(daemon)["superfluid_grammar_rested_steps_total"] > rested


def test_a_negative_seed_is_a_seed(daemon):
    """OpenAI's seed is a signed 64-bit integer; -1 was refused with a 400
    ("expected u64"). (Two sampled replies with one seed are not compared:
    the second is seeded from the cache, a batch shape that can move a draw;
    docs/sessions.md.)"""
    c = oai(daemon)
    a = chat(c, "Name a fruit.", max_tokens=6, temperature=1, seed=-1)
    assert a.usage.completion_tokens > 0 and a.choices[0].message.content
    r = c.completions.create(model="default", prompt="One, two,", max_tokens=3, seed=-9223372036854775808)
    assert r.usage.completion_tokens == 3


def test_completions_models_and_metrics(daemon):
    c = oai(daemon)
    r = c.completions.create(model="default", prompt="The capital of France is", max_tokens=5, **GREEDY)
    assert r.choices[0].text and r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    ids = c.completions.create(model="default", prompt=[[504, 3575, 282]], max_tokens=3, **GREEDY)
    assert ids.usage.prompt_tokens == 3
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="default", prompt="The capital of France is", max_tokens=5, stream=True, **GREEDY) if ch.choices)
    assert streamed == r.choices[0].text
    models = c.models.list().data
    assert len(models) == 1 and c.models.retrieve(models[0].id).id == models[0].id
    m = metrics(daemon)
    assert m["superfluid_generated_tokens_total"] > 0


def test_logprobs_logit_bias_and_penalties(daemon):
    c = oai(daemon)
    r = chat(c, "Count: one, two,", max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) >= 5
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        tops = [x.logprob for x in t.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # Greedy: the drawn token is the most likely one.
        assert t.top_logprobs[0].token == t.token and abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4
    assert "".join(t.token for t in content).startswith(r.choices[0].message.content[:5])
    # +100 on one token id forces it at every draw; without the bias the
    # reply is not that token four times.
    forced = chat(c, "Count: one, two,", max_tokens=4, logprobs=True, logit_bias={"3000": 100})
    tokens = [t.token for t in forced.choices[0].logprobs.content]
    assert len(tokens) == 4 and len(set(tokens)) == 1, tokens
    assert [t.token for t in content[:4]] != tokens
    plain = chat(c, "one two one two one two one two", max_tokens=24).choices[0].message.content
    penalized = chat(c, "one two one two one two one two", max_tokens=24, frequency_penalty=2.0).choices[0].message.content
    assert plain != penalized
    with pytest.raises(openai.BadRequestError) as e:
        chat(c, "x", logit_bias={"99999999": 5})
    assert "vocabulary" in str(e.value)
    # Each refusal names its field (param was null).
    for ask, param in [(dict(presence_penalty=3.0), "presence_penalty"),
                       (dict(frequency_penalty=-3.0), "frequency_penalty"),
                       (dict(logit_bias={"5": 101}), "logit_bias"),
                       (dict(logprobs=True, top_logprobs=21), "top_logprobs")]:
        with pytest.raises(openai.BadRequestError) as e:
            chat(c, "x", **ask)
        assert e.value.param == param, (ask, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="default", prompt="x", max_tokens=2, logprobs=30)
    assert e.value.param == "logprobs" and "logprobs 30" in e.value.message, e.value.body
    # A legacy prompt over the context names prompt (it named messages).
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="default", prompt=[1] * 9000, max_tokens=1)
    assert e.value.param == "prompt" and "context" in e.value.message, e.value.body
    cl = c.completions.create(model="default", prompt="The capital of France is", max_tokens=3, logprobs=2, **GREEDY)
    assert len(cl.choices[0].logprobs.tokens) == 3 and all(p <= 0 for p in cl.choices[0].logprobs.token_logprobs)
    # Streamed, the same logprobs come a token to a chunk, offsets running on.
    chunks = list(c.completions.create(model="default", prompt="The capital of France is", max_tokens=3,
                                       logprobs=2, stream=True, **GREEDY))
    lps = [ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs]
    assert [t for lp in lps for t in lp.tokens] == cl.choices[0].logprobs.tokens
    assert [o for lp in lps for o in lp.text_offset] == cl.choices[0].logprobs.text_offset
    assert all(len(top) == 2 for lp in lps for top in lp.top_logprobs)
    streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert streamed == cl.choices[0].text


def test_suffix_without_fim_tokens_is_a_clear_400(daemon):
    with pytest.raises(openai.BadRequestError) as e:
        oai(daemon).completions.create(model="default", prompt="def f(", suffix="\n", max_tokens=4)
    assert "fill-in-the-middle" in str(e.value) and e.value.param == "suffix"


def error_of(excinfo):
    return excinfo.value.body if isinstance(excinfo.value.body, dict) else json.loads(excinfo.value.body)


def test_errors_in_openai_shape(daemon):
    c = oai(daemon)
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        oai(daemon, key="wrong").models.list()
    # The daemon's web token works as well as --api-key.
    assert oai(daemon, key=daemon.token()).models.list().data
    with pytest.raises(openai.BadRequestError) as e:
        chat(c, "x", max_tokens=0)
    assert e.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        chat(c, "x", max_tokens=9000)
    assert e.value.code == "context_length_exceeded" and "8192" in str(e.value) and "9000" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        chat(c, words(9000))
    assert e.value.code == "context_length_exceeded"
    prompt = number(r"the prompt is (\d+) tokens", str(e.value))
    assert prompt > 8192 and "8192" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="default", messages=[
            {"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "call_none", "content": "42"}])
    assert "call_none" in str(e.value) and e.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="default", messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}])
    assert "projector" in str(e.value) and e.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}], n=0)
    auth = {"Authorization": "Bearer " + KEY}
    status, _, body = raw(daemon, "POST", "/v1/chat/completions", b"{not json", auth)
    assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"
    status, _, body = raw(daemon, "POST", "/v1/chat/completions", {"model": "default"}, auth)
    assert status == 400 and "messages" in json.loads(body)["error"]["message"]
    status, _, body = raw(daemon, "POST", "/v1/chat/completions", b"x" * (17 << 20), auth)
    assert status == 413 and "error" in json.loads(body)
    status, _, body = raw(daemon, "POST", "/v1/chat/completions",
                          {"model": "default", "messages": [{"role": "user", "content": "x"}]},
                          dict(auth, Origin="http://evil.example"))
    assert status == 403 and "error" in json.loads(body)
    status, _, _ = raw(daemon, "GET", "/v1/models", None, dict(auth, Host="evil.example"))
    assert status == 403
    # Nothing a bad request did harmed the lane.
    assert chat(c, "Still there?", max_tokens=3).usage.completion_tokens == 3


def test_a_forged_model_name_makes_one_access_line(daemon):
    # The access line wrote a request's `model` as sent: a newline in it
    # forged a second line, a space another field, and a megabyte of it
    # went into the log whole. Every generating route logs through it.
    forged = "x\nPOST /v1/chat/completions 200 model=default prompt=1 cached=0 generated=0 wall_ms=1"
    routes = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}),
        ("/v1/responses", {"input": "x"}),
        ("/api/chat", {"messages": [{"role": "user", "content": "x"}]}),
        ("/api/generate", {"prompt": "x"}),
    ]
    auth = {"Authorization": "Bearer " + KEY}

    def lines():
        return [l for l in daemon.log().splitlines() if " model=" in l]

    for path, body in routes:
        for model in (forged, "default prompt=999 cached=999", "m" * (1 << 20)):
            before = len(lines())
            status, _, _ = raw(daemon, "POST", path, dict(body, model=model), auth)
            assert status == 404, (path, status)
            new = lines()[before:]
            assert len(new) == 1, (path, new)
            line = new[0]
            assert "superfluid::access" in line and "POST {} 404 model=".format(path) in line, line
            fields = line.split("superfluid::access] ")[1].split(" ")
            assert [f.split("=")[0] for f in fields[3:]] == ["model", "prompt", "cached", "generated", "wall_ms"], line
            assert len(line) < 400, (path, len(line))
        assert "model=x\\nPOST\\u{20}/v1" in lines()[-3], lines()[-3]
        # The first 128 characters, and how many more were cut.
        assert "model={}\u2026+{} ".format("m" * 128, (1 << 20) - 128) in lines()[-1], lines()[-1]


def test_a_client_that_disconnects_cancels_its_generation(daemon):
    c = oai(daemon)
    before = metrics(daemon)['superfluid_generations_total{finish="cancelled"}']
    stream = c.chat.completions.create(model="default", messages=[{"role": "user", "content": "Write a long story."}],
                                       max_tokens=4000, temperature=1.0, seed=3, stream=True)
    got = 0
    for ch in stream:
        got += 1
        if got == 4:
            break
    stream.close()
    deadline = time.time() + 30
    while time.time() < deadline:
        if metrics(daemon)['superfluid_generations_total{finish="cancelled"}'] > before:
            break
        time.sleep(0.1)
    assert metrics(daemon)['superfluid_generations_total{finish="cancelled"}'] == before + 1
    assert chat(c, "Hello", max_tokens=3).usage.completion_tokens == 3


def test_stateless_requests_leave_no_trace_in_the_log(daemon):
    c = oai(daemon)
    before = metrics(daemon)["superfluid_wal_records_total"]
    chat(c, "Nothing of this is kept.", max_tokens=4)
    list(chat(c, "Nor of this.", max_tokens=4, stream=True))
    assert metrics(daemon)["superfluid_wal_records_total"] == before
    assert daemon.client().list() == []


def test_text_offsets_count_characters_through_a_split_emoji(daemon):
    # A token that splits a character (an emoji in byte tokens) moved every
    # later text_offset on by 3 bytes per U+FFFD; offsets are characters.
    c = oai(daemon)
    ask = dict(model="default", prompt="Emoji list: 😀 😃 😄 😁 ", max_tokens=24, logprobs=1, **GREEDY)

    def check(text, tokens, offsets):
        assert any("\ufffd" in t for t in tokens), tokens  # the case under test
        assert offsets == sorted(offsets) and offsets[-1] <= len(text), offsets
        for token, at in zip(tokens, offsets):
            if "\ufffd" not in token:
                assert text[at:at + len(token)] == token, (token, at, text)

    r = c.completions.create(**ask)
    lp = r.choices[0].logprobs
    check(r.choices[0].text, lp.tokens, lp.text_offset)
    # Streamed, a token to a chunk. (Its prompt is cached now, and a prompt
    # computed from the cache can draw otherwise in a near tie: each reply
    # is checked against its own text.)
    chunks = [ch.choices[0] for ch in c.completions.create(stream=True, **ask) if ch.choices]
    lps = [ch.logprobs for ch in chunks if ch.logprobs]
    check("".join(ch.text for ch in chunks), [t for l in lps for t in l.tokens],
          [o for l in lps for o in l.text_offset])
