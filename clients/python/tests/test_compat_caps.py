"""The caps of the compatible routes (docs/compat.md): one request over each
is a 400 in the route's own error shape naming the cap (and, on OpenAI's
routes, the field), checked before any work, so nothing reaches the log.
Removing any of the checks (src/http/compat/chat.rs `check`, openai.rs
`choices`, the Responses route's tool count and metadata) fails this
test."""

import json
import os

import pytest

from compat import KEY, raw

EXTRA_ARGS = ["--api-key", KEY]
AUTH = {"Authorization": "Bearer " + KEY}


def turns(n):
    """n messages, user and assistant in turn, ending with the user's."""
    roles = ["user", "assistant"]
    return [{"role": roles[(n - 1 - i) % 2], "content": "x"} for i in range(n)]


def oai_tool(i):
    return {"type": "function", "function": {"name": "t%d" % i, "parameters": {"type": "object"}}}


CASES = [
    # (id, path, body, family, OpenAI param, what the message names)
    ("chat 513 messages", "/v1/chat/completions",
     {"model": "default", "messages": turns(513), "max_tokens": 4}, "openai", "messages", "512"),
    ("chat 129 tools", "/v1/chat/completions",
     {"model": "default", "messages": turns(1), "max_tokens": 4,
      "tools": [oai_tool(i) for i in range(129)]}, "openai", "tools", "128"),
    ("chat n 17", "/v1/chat/completions",
     {"model": "default", "messages": turns(1), "max_tokens": 4, "n": 17}, "openai", "n", "16"),
    ("messages 513", "/v1/messages",
     {"model": "default", "max_tokens": 4, "messages": turns(513)}, "anthropic", None, "512"),
    ("messages 129 tools", "/v1/messages",
     {"model": "default", "max_tokens": 4, "messages": turns(1),
      "tools": [{"name": "t%d" % i, "input_schema": {"type": "object"}} for i in range(129)]},
     "anthropic", None, "128"),
    ("ollama chat 513", "/api/chat",
     {"model": "default", "messages": turns(513), "stream": False}, "ollama", None, "512"),
    ("ollama chat 129 tools", "/api/chat",
     {"model": "default", "messages": turns(1), "stream": False,
      "tools": [oai_tool(i) for i in range(129)]}, "ollama", None, "128"),
    ("responses 129 tools", "/v1/responses",
     {"model": "default", "input": "x", "max_output_tokens": 16,
      "tools": [{"type": "function", "name": "t%d" % i, "parameters": {"type": "object"}}
                for i in range(129)]}, "openai", "tools", "128"),
    ("responses metadata 17 pairs", "/v1/responses",
     {"model": "default", "input": "x", "max_output_tokens": 16,
      "metadata": {"k%d" % i: "v" for i in range(17)}}, "openai", "metadata", "16"),
    ("responses metadata value 513", "/v1/responses",
     {"model": "default", "input": "x", "max_output_tokens": 16,
      "metadata": {"k": "v" * 513}}, "openai", "metadata", "512"),
]


def wal_size(daemon):
    return os.path.getsize(os.path.join(daemon.sessions, "wal.log"))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_one_over_each_cap_is_a_400_before_any_work(daemon, case):
    _, path, body, family, param, cap = case
    before = wal_size(daemon)
    status, _, raw_body = raw(daemon, "POST", path, body, AUTH)
    assert status == 400, (status, raw_body[:300])
    reply = json.loads(raw_body)
    if family == "openai":
        err = reply["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, err
        message = err["message"]
    elif family == "anthropic":
        assert reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error", reply
        message = reply["error"]["message"]
    else:
        message = reply["error"]
        assert isinstance(message, str)
    assert cap in message, message
    assert wal_size(daemon) == before, "a refused request reached the log"


def test_at_the_caps_the_requests_are_taken(daemon):
    """The control: exactly at each cap the same requests are served."""
    status, _, body = raw(daemon, "POST", "/v1/chat/completions",
                          {"model": "default", "messages": turns(512), "max_tokens": 1}, AUTH)
    assert status == 200, body[:300]
    status, _, body = raw(daemon, "POST", "/v1/chat/completions",
                          {"model": "default", "messages": turns(1), "max_tokens": 1, "n": 16}, AUTH)
    assert status == 200 and len(json.loads(body)["choices"]) == 16, body[:300]
    status, _, body = raw(daemon, "POST", "/v1/chat/completions",
                          {"model": "default", "messages": turns(1), "max_tokens": 1,
                           "tools": [oai_tool(i) for i in range(128)]}, AUTH)
    assert status == 200, body[:300]


def test_a_refused_response_leaves_its_conversation_as_it_was(daemon):
    """A response on a conversation refused for its text.format (over a
    schema's 64 KiB) or its tools (a schema past the caps) commits nothing:
    its instructions, tools and tool choice were set on the conversation's
    session before the format was refused, for good."""
    status, _, body = raw(daemon, "POST", "/v1/conversations", {}, AUTH)
    assert status == 200, body[:300]
    conv = json.loads(body)["id"]
    tool = {"type": "function", "name": "t", "parameters": {"type": "object"}}
    big = {"type": "json_schema", "name": "x",
           "schema": {"type": "object", "description": "d" * (70 << 10)}}
    long_name = {"type": "function", "name": "u",
                 "parameters": {"type": "object", "properties": {"p" * 300: {}}}}
    for extra, param in [({"tools": [tool], "tool_choice": "required", "text": {"format": big}},
                          "text.format"),
                         ({"tools": [tool, long_name]}, "tools")]:
        before = wal_size(daemon)
        status, _, raw_body = raw(daemon, "POST", "/v1/responses", dict(
            {"model": "default", "conversation": conv, "instructions": "X", "input": "hi",
             "max_output_tokens": 4}, **extra), AUTH)
        assert status == 400, (status, raw_body[:300])
        err = json.loads(raw_body)["error"]
        assert err["param"] == param and "bytes" in err["message"], err
        assert wal_size(daemon) == before, "a refused response changed its conversation"


def test_chat_caps_come_before_the_images_and_the_render(daemon):
    """On /v1/chat/completions the stop and logit_bias caps are checked
    before any work: a request that would also fail in its render (an image
    for a model without a projector) is refused for the cap, not after the
    render for the image."""
    image = [{"type": "text", "text": "what is this?"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]
    base = {"model": "default", "messages": [{"role": "user", "content": image}], "max_tokens": 2}
    status, _, body = raw(daemon, "POST", "/v1/chat/completions", base, AUTH)
    assert status == 400 and "projector" in json.loads(body)["error"]["message"], body[:300]
    for extra, param, said in [
        ({"stop": ["s%d" % i for i in range(17)]}, "stop", "16 stop sequences"),
        ({"stop": ["x" * 257]}, "stop", "256 bytes"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "logit_bias has more than"),
    ]:
        status, _, body = raw(daemon, "POST", "/v1/chat/completions", dict(base, **extra), AUTH)
        err = json.loads(body)["error"]
        assert status == 400 and err["param"] == param and said in err["message"], err


def peak_rss_mib(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM for %d" % pid)


@pytest.mark.parametrize("path,family", [("/v1/chat/completions", "openai"),
                                         ("/v1/messages", "anthropic"),
                                         ("/api/chat", "ollama")])
def test_a_body_of_millions_of_values_is_a_413_before_it_is_parsed(daemon, path, family):
    """A 16 MiB body is within the byte cap, but as eight million JSON
    values it took about 700 MB to parse into a tree; it is refused by its
    count of values first (src/http/compat/values.rs), in the route's own
    error shape, and the daemon's peak memory stays near its size."""
    pid = daemon.proc.pid
    with open("/proc/%d/clear_refs" % pid, "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = peak_rss_mib(pid)
    body = b'{"model": "default", "max_tokens": 4, "messages": [], "junk": ['
    body += b"0," * (((16 << 20) - len(body) - 8) // 2) + b"0]}"
    status, _, raw_body = raw(daemon, "POST", path, body, AUTH)
    assert status == 413, (status, raw_body[:300])
    reply = json.loads(raw_body)
    if family == "openai":
        message = reply["error"]["message"]
        assert reply["error"]["type"] == "invalid_request_error", reply
    elif family == "anthropic":
        assert reply["error"]["type"] == "request_too_large", reply
        message = reply["error"]["message"]
    else:
        message = reply["error"]
    assert "more than 1048576 JSON values" in message, message
    grown = peak_rss_mib(pid) - before
    assert grown < 150, "the daemon's peak memory grew %d MiB for a 16 MiB body" % grown
    # The same keys with a small junk list are served as before.
    # max_tokens for OpenAI and Anthropic, options.num_predict for Ollama
    # (which ignores max_tokens: without it the reply may run to the end of
    # the context, past the client's timeout on a loaded machine).
    small = (b'{"model": "default", "max_tokens": 1, "options": {"num_predict": 1}, "stream": false,'
             b' "messages": [{"role": "user", "content": "hi"}], "junk": [0, 0]}')
    status, _, raw_body = raw(daemon, "POST", path, small, AUTH)
    assert status == 200, (status, raw_body[:300])
