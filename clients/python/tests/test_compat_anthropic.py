"""The Anthropic routes, driven by the official `anthropic` SDK on the default
model: messages (streamed and not), count_tokens, a cache_control breakpoint
that pins its prefix against KV pressure, and the error cases. The daemon has
a small KV pool (two sequences of 1024 cells) so that pressure is cheap, and
no host-memory tier (--cache-ram-mb 0): what survives pressure here is what
the cells kept, so the pin is what is tested (docs/kv-tiers.md has the
tier that would bring an evicted prefix back)."""

import json

import anthropic
import pytest

from compat import KEY, ant, metrics, raw, words

EXTRA_ARGS = ["--api-key", KEY, "--ctx-size", "2048", "--parallel", "2", "--cache-ram-mb", "0"]
GREEDY = {"temperature": 0}


def ask(client, content, **kw):
    args = dict(model="default", max_tokens=16, messages=[{"role": "user", "content": content}],
                extra_body=GREEDY)
    args.update(kw)
    return client.messages.create(**args)


def test_message_and_stream_agree(daemon):
    a = ant(daemon)
    m = ask(a, "Name a fruit.")
    assert m.role == "assistant" and m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens > 0
    # The cold reply came from a prefill, later ones from the cache (their
    # rounding may differ): compare warm to warm.
    m = ask(a, "Name a fruit.")
    with a.messages.stream(model="default", max_tokens=16, extra_body=GREEDY,
                           messages=[{"role": "user", "content": "Name a fruit."}]) as s:
        types = [ev.type for ev in s]
        final = s.get_final_message()
    assert final.content[0].text == m.content[0].text and final.stop_reason == m.stop_reason
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert "content_block_start" in types and "content_block_stop" in types and "message_delta" in types
    # Streamed replies reuse the non-streamed one's prefix.
    assert final.usage.cache_read_input_tokens > 0


def test_a_final_assistant_message_is_continued(daemon):
    """Anthropic's "prefill": a final assistant message is the start of the
    reply, which continues it. The turn was closed and a new one opened (a
    count of 8 more tokens for a 2-token message, and a reply that began
    afresh: 'The original sentence is "1')."""
    c = ant(daemon)
    user = [{"role": "user", "content": "Count from 1 to 10 separated by commas."}]
    base = c.messages.count_tokens(model="default", messages=user).input_tokens
    prefill = user + [{"role": "assistant", "content": "1, 2, 3, 4,"}]
    counted = c.messages.count_tokens(model="default", messages=prefill).input_tokens
    m = c.messages.create(model="default", max_tokens=6, messages=prefill, extra_body=GREEDY)
    # Its leading space too: a client joins the prefill and the reply.
    assert m.content[0].text.startswith(" 5"), m.content[0].text
    # The prompt is the conversation up to the prefill's last token: no
    # closing, no new assistant header.
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == counted
    assert counted < base + 8 + 5, (base, counted)


def test_count_tokens_matches_usage(daemon):
    a = ant(daemon)
    msgs = [{"role": "user", "content": "How many tokens is this?"}]
    n = a.messages.count_tokens(model="default", system="Be brief.", messages=msgs).input_tokens
    m = a.messages.create(model="default", max_tokens=4, system="Be brief.", messages=msgs, extra_body=GREEDY)
    u = m.usage
    assert n == u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens


def test_stop_sequences(daemon):
    a = ant(daemon)
    # A grammar makes the output exact (see test_compat_openai's EXACT).
    exact = {"format": {"type": "json_schema", "schema": {"enum": ["alpha beta gamma delta"]}}}
    full = ask(a, "Say it.", max_tokens=40, output_config=exact).content[0].text
    assert full.strip() == '"alpha beta gamma delta"'
    m = ask(a, "Say it.", max_tokens=40, output_config=exact, stop_sequences=["ta gam"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "ta gam"
    assert m.content[0].text == '"alpha be'


def test_a_breakpoint_pins_its_prefix_against_pressure(daemon):
    a = ant(daemon)
    system = [{"type": "text", "text": "Reference: " + words(250, seed=21),
               "cache_control": {"type": "ephemeral"}}]
    first = a.messages.create(model="default", max_tokens=4, system=system, extra_body=GREEDY,
                              messages=[{"role": "user", "content": "Question one?"}])
    written = first.usage.cache_creation_input_tokens
    assert written > 250, first.usage
    # Unrelated requests that need the whole pool between them.
    for i in range(4):
        ask(a, words(400, seed=40 + i), max_tokens=4)
    second = a.messages.create(model="default", max_tokens=4, system=system, extra_body=GREEDY,
                               messages=[{"role": "user", "content": "Question two?"}])
    assert second.usage.cache_read_input_tokens >= written, (first.usage, second.usage)
    assert second.usage.cache_creation_input_tokens == 0


def test_unpinned_prefix_is_evicted_by_the_same_pressure(daemon):
    """The control for the test above: without a breakpoint the same
    pressure evicts the prefix, so the pin is what kept it."""
    a = ant(daemon)
    system = "Reference: " + words(250, seed=22)
    a.messages.create(model="default", max_tokens=4, system=system, extra_body=GREEDY,
                      messages=[{"role": "user", "content": "Question one?"}])
    for i in range(4):
        ask(a, words(400, seed=50 + i), max_tokens=4)
    second = a.messages.create(model="default", max_tokens=4, system=system, extra_body=GREEDY,
                               messages=[{"role": "user", "content": "Question two?"}])
    assert second.usage.cache_read_input_tokens < 50, second.usage


def test_errors_in_anthropic_shape(daemon):
    a = ant(daemon)
    with pytest.raises(anthropic.AuthenticationError) as e:
        ask(ant(daemon, key="wrong"), "x")
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError):
        a.messages.create(model="claude-nope", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model="default", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_none", "content": "42"}]}])
    assert "toolu_none" in str(e.value)
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model="default", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert "projector" in str(e.value)
    with pytest.raises(anthropic.BadRequestError) as e:
        ask(a, "x", max_tokens=5000)
    assert "2048" in str(e.value)
    auth = {"x-api-key": KEY}
    status, _, body = raw(daemon, "POST", "/v1/messages",
                          {"model": "default", "messages": [{"role": "user", "content": "x"}]}, auth)
    assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in json.loads(body)["error"]["message"]
    status, _, body = raw(daemon, "POST", "/v1/messages", b"[1,", auth)
    assert status == 400 and json.loads(body)["type"] == "error"
    assert metrics(daemon)["superfluid_generated_tokens_total"] > 0
    assert ask(a, "Still there?", max_tokens=3).usage.output_tokens == 3


def test_requests_anthropic_refuses_are_refused(daemon):
    # What the Messages API answers 400 was served: no messages beside a
    # system prompt, an empty content list, a temperature over 1, a prefill
    # ending in whitespace; a bad role was named as Rust's Some("system").
    a = ant(daemon)
    user = {"role": "user", "content": "Count to five."}
    cases = [
        (dict(system="hi", messages=[]), "at least one message"),
        (dict(system="s", messages=[{"role": "user", "content": []}]), "non-empty content"),
        (dict(messages=[{"role": "user", "content": ""}, {"role": "assistant", "content": "ok"}]),
         "non-empty content"),
        # (this SDK sends temperature only as an extra field)
        (dict(messages=[user], extra_body={"temperature": 1.5}), "between 0 and 1"),
        (dict(messages=[user, {"role": "assistant", "content": "1, 2, "}]), "trailing whitespace"),
        (dict(messages=[{"role": "system", "content": "x"}]), 'not "system"'),
    ]
    for ask_, phrase in cases:
        with pytest.raises(anthropic.BadRequestError) as e:
            a.messages.create(model="default", max_tokens=4, **ask_)
        assert phrase in e.value.body["error"]["message"], (ask_, e.value.body)
    # What it takes still runs: temperature 1, an empty final prefill.
    ok = a.messages.create(model="default", max_tokens=3, extra_body={"temperature": 1.0},
                           messages=[user, {"role": "assistant", "content": ""}])
    assert ok.usage.output_tokens == 3
