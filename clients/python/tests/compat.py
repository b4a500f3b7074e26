"""Helpers for the tests of the OpenAI and Anthropic routes: SDK clients of a
test daemon, its Prometheus metrics, and raw HTTP for what an SDK will not
send (malformed JSON, a foreign Origin, a huge body)."""

import hashlib
import hmac
import http.client
import json
import os
import re

import anthropic
import openai

KEY = "test-api-key-0123"


def oai(daemon, key=KEY):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key=key, max_retries=0, timeout=120)


def ant(daemon, key=KEY):
    return anthropic.Anthropic(base_url=daemon.url, api_key=key, max_retries=0, timeout=120)


def metrics(daemon, key=KEY):
    """The Prometheus text of GET /metrics, as {series: value}."""
    status, _, body = raw(daemon, "GET", "/metrics", None, {"Authorization": "Bearer " + key})
    assert status == 200, body
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def raw(daemon, method, path, body, headers=None):
    """One HTTP request; (status, headers, body bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=120)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    conn.request(method, path, body=data, headers=h)
    r = conn.getresponse()
    out = (r.status, dict((k.lower(), v) for k, v in r.getheaders()), r.read())
    conn.close()
    return out


def access_lines(daemon):
    return [l for l in daemon.log().splitlines() if "superfluid::access" in l]


def words(n, seed=0):
    """n distinct-ish words, so prompts do not share prefixes by accident."""
    base = ["river", "stone", "maple", "cloud", "ember", "harbor", "quartz", "meadow", "lantern", "falcon"]
    return " ".join("{}{}".format(base[(i * 7 + seed) % len(base)], (i + seed) % 97) for i in range(n))


def cached_field(usage):
    return usage.prompt_tokens_details.cached_tokens


def number(pattern, text):
    m = re.search(pattern, text)
    assert m, (pattern, text)
    return int(m.group(1))


# Two function tools for the Responses tests on the tools-think test model.
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"]}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": CITY}
TIME = {"type": "function", "name": "get_time", "description": "Current time in a city", "parameters": CITY}


def forced_call(c, **kw):
    r = c.responses.create(model="default", tools=[WEATHER, TIME], tool_choice="required",
                           max_output_tokens=160, temperature=0, **kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1, r.output
    return r, calls[0]


def issued_id(daemon, session, start, log="", made_ms=None):
    """The id the daemon issues for the response whose input starts at event
    `start` of `session` (docs/responses.md): the tag is HMAC-SHA256 keyed by
    <sessions>/response-key over the log's name ("" for the default model's),
    the session, when it was made (its `created_unix_ms`, read through the
    session API unless given) and the event, cut to 128 bits. For a test
    that finds a response through the session API, whose client never got
    its id, or that names a point a response could have."""
    if made_ms is None:
        made_ms = daemon.client().get(session).inspect()["created_unix_ms"]
    with open(os.path.join(daemon.sessions, "response-key")) as f:
        key = bytes.fromhex(f.read().strip())
    msg = "{}\0{}\0{}\0{}".format(log, session, made_ms, start).encode()
    return "resp_{}_{}_{}".format(session, start, hmac.new(key, msg, hashlib.sha256).hexdigest()[:32])
