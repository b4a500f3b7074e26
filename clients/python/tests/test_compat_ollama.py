"""Ollama's routes, driven by the official `ollama` Python client on the
default model: chat and generate (NDJSON streamed, and not), format json and a
schema, options (num_predict, stop, num_ctx), the model listing routes
(tags/show/ps/version), the prefix cache across a resent chat, the load
reply, a client that goes away mid-stream, and every error in Ollama's
`{"error": ...}` shape."""

import http.client
import json
import socket
import time

import ollama
import pytest

from compat import KEY, access_lines, metrics, raw, words

EXTRA_ARGS = ["--api-key", KEY]
GREEDY = {"temperature": 0, "seed": 7}


def oll(daemon, key=KEY):
    return ollama.Client(host=daemon.url, headers={"Authorization": "Bearer " + key}, timeout=120)


def model_name(daemon):
    return oll(daemon).list().models[0].model


def user(text):
    return [{"role": "user", "content": text}]


def auth():
    return {"Authorization": "Bearer " + KEY}


def ndjson(body):
    return [json.loads(l) for l in body.decode().splitlines() if l.strip()]


def test_chat_not_streamed_and_streamed_agree(daemon):
    c = oll(daemon)
    name = model_name(daemon)
    r = c.chat(model=name, messages=user("Name a colour."), options={**GREEDY, "num_predict": 24}, stream=False)
    assert r.done and r.done_reason in ("stop", "length")
    assert r.message.role == "assistant" and r.message.content
    assert r.model == name and r.created_at.endswith("Z")
    assert r.eval_count > 0 and r.prompt_eval_count > 10
    for d in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(getattr(r, d), int), d
    assert r.total_duration >= r.eval_duration > 0
    # A first (cold) reply is computed from a prefill, later ones from the
    # cache: their last bits of rounding may differ, so compare warm to warm.
    r = c.chat(model=name, messages=user("Name a colour."), options={**GREEDY, "num_predict": 24}, stream=False)
    parts = list(c.chat(model=name, messages=user("Name a colour."), options={**GREEDY, "num_predict": 24}, stream=True))
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    assert "".join(p.message.content or "" for p in parts) == r.message.content
    assert parts[-1].done_reason == r.done_reason and parts[-1].eval_count == r.eval_count
    line = access_lines(daemon)[-1]
    assert "POST /api/chat 200" in line and "colour" not in line


def test_a_final_assistant_message_is_continued(daemon):
    """Ollama continues a trailing assistant message (its maintainers'
    example: "the sky is blue because it was painted by "); the reply
    began a new turn instead."""
    r = oll(daemon).chat(model="default", messages=[
        {"role": "user", "content": "Count from 1 to 10 separated by commas."},
        {"role": "assistant", "content": "1, 2, 3, 4,"}], options={"num_predict": 6, "temperature": 0})
    assert r.message.content.startswith(" 5"), r.message.content


def test_the_wire_is_ndjson_with_a_final_done_object(daemon):
    body = {"model": "default", "messages": user("Say hi."), "options": {**GREEDY, "num_predict": 8}}
    status, headers, out = raw(daemon, "POST", "/api/chat", body, auth())
    assert status == 200, out
    assert headers["content-type"] == "application/x-ndjson"
    assert "x-superfluid-warm" in headers
    objs = ndjson(out)
    assert all(o["done"] is False for o in objs[:-1]) and objs[-1]["done"] is True
    last = objs[-1]
    for k in ("done_reason", "total_duration", "load_duration", "prompt_eval_count",
              "prompt_eval_duration", "eval_count", "eval_duration"):
        assert k in last, k
    assert last["eval_count"] == 8 and last["done_reason"] == "length"


def test_generate_streamed_and_not_raw_and_system(daemon):
    c = oll(daemon)
    r = c.generate(model="default", prompt="Count: one, two,", options={**GREEDY, "num_predict": 6}, stream=False)
    assert r.done and r.response and r.eval_count == 6 and r.done_reason == "length"
    cold = r
    # Compare warm to warm (a cold reply's rounding may differ).
    r = c.generate(model="default", prompt="Count: one, two,", options={**GREEDY, "num_predict": 6}, stream=False)
    parts = list(c.generate(model="default", prompt="Count: one, two,", options={**GREEDY, "num_predict": 6},
                            stream=True))
    assert "".join(p.response for p in parts) == r.response
    raw_r = c.generate(model="default", prompt="one, two, three,", raw=True, options={**GREEDY, "num_predict": 4},
                       stream=False)
    # Raw: the prompt as text, no template; far fewer tokens than a templated one.
    assert raw_r.prompt_eval_count < cold.prompt_eval_count
    sys_r = c.generate(model="default", prompt="hi", system="You are a pirate.", options={**GREEDY, "num_predict": 4},
                       stream=False, context=[1, 2, 3], keep_alive="5m")
    assert sys_r.done
    assert "POST /api/generate 200" in access_lines(daemon)[-1]


def test_options_stop_and_num_ctx(daemon):
    c = oll(daemon)
    n_ctx = c.ps().models[0].context_length
    assert n_ctx > 100
    r = c.generate(model="default", prompt="1, 2, 3, 4, 5,", raw=True,
                   options={**GREEDY, "num_predict": 30, "stop": [","]}, stream=False)
    assert "," not in r.response and r.done_reason == "stop"
    # A smaller num_ctx caps prompt + reply.
    r = c.generate(model="default", prompt="1, 2, 3, 4, 5,", raw=True, options={**GREEDY, "num_ctx": 20},
                   stream=False)
    assert r.prompt_eval_count + r.eval_count <= 20 and r.done_reason == "length"
    with pytest.raises(ollama.ResponseError) as e:
        c.generate(model="default", prompt="hi", options={"num_ctx": n_ctx + 1}, stream=False)
    assert e.value.status_code == 400 and str(n_ctx) in e.value.error and "num_ctx" in e.value.error


def test_format_json_and_schema_parse(daemon):
    c = oll(daemon)
    r = c.chat(model="default", messages=user('Reply with {"ok": true}.'), format="json",
               options={**GREEDY, "num_predict": 300}, stream=False)
    assert r.done_reason == "stop", r
    assert isinstance(json.loads(r.message.content), dict)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = c.generate(model="default", prompt="Describe a person as JSON.", format=schema,
                   options={**GREEDY, "num_predict": 80}, stream=False)
    v = json.loads(r.response)
    assert set(v) == {"name", "age"} and isinstance(v["age"], int)


def test_second_turn_of_a_resent_chat_hits_the_cache(daemon):
    c = oll(daemon)
    history = [{"role": "system", "content": "You are brief. " + words(120, seed=5)},
               {"role": "user", "content": "Tell me about lakes."}]
    r1 = c.chat(model="default", messages=history, options={**GREEDY, "num_predict": 12}, stream=False)
    # prompt_eval_count is the prompt tokens evaluated: nearly all of them.
    assert r1.prompt_eval_count > 120
    history += [{"role": "assistant", "content": r1.message.content}, {"role": "user", "content": "And seas?"}]
    body = {"model": "default", "messages": history, "options": {**GREEDY, "num_predict": 8}, "stream": False}
    status, headers, out = raw(daemon, "POST", "/api/chat", body, auth())
    assert status == 200, out
    r2 = json.loads(out)
    warm = int(headers["x-superfluid-warm"])
    # Everything the first request's prompt held is reused...
    assert warm >= r1.prompt_eval_count - 1
    # ...and only the rest is evaluated.
    line = access_lines(daemon)[-1]
    assert "cached={}".format(warm) in line
    prompt = int(line.split("prompt=")[1].split()[0])
    assert r2["prompt_eval_count"] == prompt - warm < 40


def test_tags_show_ps_version(daemon):
    c = oll(daemon)
    tags = c.list().models
    assert len(tags) == 1
    m = tags[0]
    assert m.model.endswith(":latest") and m.size > 1000 and len(m.digest) == 64
    assert m.details.format == "gguf" and m.details.family == "llama"
    assert m.details.quantization_level and m.details.parameter_size
    # The listed name, its bare form and "default" all work.
    c.chat(model=m.model, messages=user("hi"), options={"num_predict": 1}, stream=False)
    s = c.show(m.model)
    assert s.details.family == "llama" and s.template and "{%" in s.template
    assert s.modelinfo["general.architecture"] == "llama"
    assert "completion" in s.capabilities and s.modelfile.startswith("# Modelfile")
    ps = c.ps().models
    assert ps[0].model == m.model and ps[0].digest == m.digest and ps[0].expires_at
    status, _, out = raw(daemon, "GET", "/api/version", None, auth())
    assert status == 200 and json.loads(out)["version"]
    # Asked again: the same cached identity.
    assert c.list().models[0].digest == m.digest


def test_a_request_with_nothing_to_generate_loads(daemon):
    c = oll(daemon)
    r = c.generate(model="default", stream=False)
    assert r.done and r.done_reason == "load" and r.response == ""
    r = c.chat(model="default", messages=[], keep_alive=0, stream=False)
    assert r.done_reason == "unload"


def test_think_true_on_a_model_without_a_thinking_block_is_refused(daemon):
    with pytest.raises(ollama.ResponseError) as e:
        oll(daemon).chat(model="default", messages=user("hi"), think=True, stream=False)
    assert e.value.status_code == 400 and "thinking" in e.value.error


def test_errors(daemon):
    c = oll(daemon)
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model="no-such-model", messages=user("hi"), stream=False)
    assert e.value.status_code == 404 and "no-such-model" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        oll(daemon, key="wrong").chat(model="default", messages=user("hi"), stream=False)
    assert e.value.status_code == 401
    with pytest.raises(ollama.ResponseError) as e:
        oll(daemon, key="wrong").list()
    assert e.value.status_code == 401
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model="default", messages=[{"role": "user", "content": "what is this?", "images": [b"\x89PNG"]}],
               stream=False)
    assert e.value.status_code == 400 and "vision" in e.value.error
    # pull and delete: test_compat_ollama_pull.py (against a fake hub).
    with pytest.raises(ollama.ResponseError) as e:
        c.pull("not a reference", stream=False)
    assert e.value.status_code == 400 and "reference" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        c.embed(model="default", input="hi")
    assert e.value.status_code == 501 and "embedding" in e.value.error
    # Raw bodies: the shape is {"error": "..."} with the status.
    status, headers, out = raw(daemon, "POST", "/api/chat", b"{not json", auth())
    assert status == 400 and set(json.loads(out)) == {"error"}
    status, _, out = raw(daemon, "POST", "/api/generate", {"prompt": "no model"}, auth())
    assert status == 400 and "model" in json.loads(out)["error"]
    status, _, out = raw(daemon, "POST", "/api/generate", {"model": "default", "prompt": "x", "suffix": "y"}, auth())
    assert status == 400 and "fill-in-the-middle" in json.loads(out)["error"]
    status, _, out = raw(daemon, "POST", "/api/chat", {"model": "default", "messages": user("hi"), "format": "xml"},
                         auth())
    assert status == 400 and "format" in json.loads(out)["error"]
    status, _, out = raw(daemon, "GET", "/api/tags", None, {**auth(), "Origin": "http://evil.example"})
    assert status == 403 and "error" in json.loads(out)
    status, _, out = raw(daemon, "POST", "/api/chat", {"model": "default", "messages": user("hi")},
                         {"Authorization": "Bearer wrong"})
    assert status == 401 and set(json.loads(out)) == {"error"}
    assert "POST /api/chat 401" in access_lines(daemon)[-1]


def test_a_client_that_goes_away_cancels_the_generation(daemon):
    before = metrics(daemon)['superfluid_generations_total{finish="cancelled"}']
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=60)
    body = {"model": "default", "messages": user("Write a long story."),
            "options": {"num_predict": 4000, "temperature": 1.0, "seed": 3}}
    conn.request("POST", "/api/chat", body=json.dumps(body), headers={**auth(), "Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    for _ in range(3):
        assert json.loads(r.readline())["done"] is False
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.time() + 30
    while time.time() < deadline:
        if metrics(daemon)['superfluid_generations_total{finish="cancelled"}'] > before:
            break
        time.sleep(0.1)
    assert metrics(daemon)['superfluid_generations_total{finish="cancelled"}'] == before + 1
    deadline = time.time() + 10
    while time.time() < deadline and "POST /api/chat 499" not in access_lines(daemon)[-1]:
        time.sleep(0.1)
    assert "POST /api/chat 499" in access_lines(daemon)[-1]
    r = oll(daemon).chat(model="default", messages=user("Hello"), options={"num_predict": 3}, stream=False)
    assert r.eval_count == 3


def test_any_temperature_ollama_takes_is_taken(daemon):
    # Ollama samples at any temperature; 3.0 was refused as "between 0 and
    # 2" (OpenAI's range). A negative one is still refused.
    c = oll(daemon)
    r = c.chat(model="default", messages=user("Say hi."), stream=False,
               options={"temperature": 3.0, "num_predict": 3, "seed": 1})
    assert r.done and r.eval_count == 3
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model="default", messages=user("Say hi."), stream=False,
               options={"temperature": -1.0, "num_predict": 3})
    assert e.value.status_code == 400 and "temperature" in e.value.error
