"""The Responses API on a small context (--ctx-size 512), with the official
SDK: a stored response whose input cannot fit is refused with OpenAI's
context_length_exceeded before anything is written, on a conversation, down a
previous_response_id chain and on a new session alike."""

import os

import openai
import pytest

from compat import KEY, oai, words

EXTRA_ARGS = ["--api-key", KEY, "--ctx-size", "512"]


def wal_size(daemon):
    return os.path.getsize(os.path.join(daemon.sessions, "wal.log"))


def test_input_past_the_context_is_refused_before_anything_is_written(daemon):
    # It used to append the input, then fail the generation: a 503
    # server_error, with the input left in the conversation, so every later
    # response on it failed the same way.
    c = oai(daemon)
    conv = c.conversations.create(items=[{"role": "user", "content": "Hello."}])
    first = c.responses.create(model="default", input="Name a river.", max_output_tokens=4)
    items = [i.id for i in c.conversations.items.list(conv.id).data]
    sessions = len(daemon.client().list())
    wal = wal_size(daemon)
    long = words(600)
    cases = [
        dict(conversation=conv.id, input=long),
        dict(conversation=conv.id, input=[{"role": "user", "content": "Hi."},
                                          {"role": "user", "content": long}]),
        dict(previous_response_id=first.id, input=long),
        dict(input=long),
        # The instructions count too, on a new session.
        dict(instructions=long, input="Hi."),
    ]
    for kwargs in cases:
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model="default", max_output_tokens=4, **kwargs)
        assert e.value.code == "context_length_exceeded", (list(kwargs), e.value.body)
        assert e.value.body["type"] == "invalid_request_error"
        assert e.value.body["param"] == "input"
        assert "512" in e.value.body["message"], e.value.body
    # Nothing was written: no item, no session, not a byte of log.
    assert [i.id for i in c.conversations.items.list(conv.id).data] == items
    assert len(daemon.client().list()) == sessions
    assert wal_size(daemon) == wal
    # The conversation and the chain still take a request that fits.
    r = c.responses.create(model="default", conversation=conv.id, input="Hi.", max_output_tokens=4)
    assert r.status in ("completed", "incomplete"), r
    r = c.responses.create(model="default", previous_response_id=first.id, input="Another.",
                           max_output_tokens=4)
    assert r.status in ("completed", "incomplete"), r
