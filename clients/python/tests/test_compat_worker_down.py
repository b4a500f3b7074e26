"""A model worker that is down answers 503 in each route's error shape
(OpenAI's, Anthropic's, Ollama's), and
the routes serve again once it is back; /metrics passes promtool.

Deterministic: the daemon serves a copy of the model; the test moves that
file away and SIGKILLs the worker, so every respawn fails to load and the
lane stays "respawning" (waited for on /web/health) until the file is back."""

import os
import shutil
import signal
import subprocess
import tempfile
import time

import json

import anthropic
import ollama
import openai
import pytest

from superfluid_client.daemon import Daemon, default_model

from compat import KEY, ant, oai, raw


def children(pid):
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open("/proc/{}/stat".format(entry)) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    out.append(int(entry))
            except OSError:
                pass
    return out


def lane(d):
    status, _, body = raw(d, "GET", "/web/health", None)
    assert status == 200
    return json.loads(body)["lane"]


def wait_lane(d, state, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if lane(d) == state:
            return
        time.sleep(0.05)
    raise AssertionError("lane never became {} (is {})".format(state, lane(d)))


@pytest.fixture(scope="module")
def moved():
    src = default_model()
    if not os.path.exists(src):
        pytest.skip("no model")
    tmp = tempfile.mkdtemp(prefix="sf-model-")
    model = os.path.join(tmp, "model.gguf")
    shutil.copy(src, model)
    d = Daemon(model=model, extra_args=["--api-key", KEY])
    d.start()
    yield d, model
    d.cleanup()
    shutil.rmtree(tmp, ignore_errors=True)


def test_worker_down_is_503_then_served_again(moved):
    d, model = moved
    wait_lane(d, "ready")
    assert oai(d).chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2).usage.completion_tokens == 2
    os.rename(model, model + ".away")
    try:
        workers = children(d.proc.pid)
        assert workers, "the daemon has no worker process"
        for w in workers:
            os.kill(w, signal.SIGKILL)
        wait_lane(d, "respawning")
        time.sleep(0.5)  # a failed respawn or two: still respawning
        assert lane(d) == "respawning"
        with pytest.raises(openai.InternalServerError) as e:
            oai(d).chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["type"] == "server_error"
        # Anthropic's overloaded_error is a 529: its SDK's OverloadedError.
        with pytest.raises(anthropic.OverloadedError) as e:
            ant(d).messages.create(model="default", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 529 and e.value.body["error"]["type"] == "overloaded_error"
        with pytest.raises(ollama.ResponseError) as e:
            ollama.Client(host=d.url, headers={"Authorization": "Bearer " + KEY}).chat(
                model="default", messages=[{"role": "user", "content": "hi"}], stream=False)
        assert e.value.status_code == 503 and "not ready" in e.value.error
        status, _, body = raw(d, "POST", "/api/generate", {"model": "default", "prompt": "hi"},
                              {"Authorization": "Bearer " + KEY})
        assert status == 503 and set(json.loads(body)) == {"error"}
    finally:
        os.rename(model + ".away", model)
    wait_lane(d, "ready")
    assert ant(d).messages.create(model="default", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                                  extra_body={"temperature": 0}).usage.output_tokens == 2


def route_count(body, route, status):
    line = 'superfluid_http_request_duration_seconds_count{route="%s",status="%d"} ' % (route, status)
    for l in body.decode().splitlines():
        if l.startswith(line):
            return int(float(l[len(line):]))
    return 0


def test_metrics_route_passes_promtool(moved):
    d, _ = moved
    wait_lane(d, "ready")
    _, _, before = raw(d, "GET", "/metrics", None, {"Authorization": "Bearer " + KEY})
    oai(d).chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        oai(d).chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=0)
    status, headers, body = raw(d, "GET", "/metrics", None, {"Authorization": "Bearer " + KEY})
    # The request latency histogram counted both, by route and status.
    assert route_count(body, "/v1/chat/completions", 200) == route_count(before, "/v1/chat/completions", 200) + 1
    assert route_count(body, "/v1/chat/completions", 400) == route_count(before, "/v1/chat/completions", 400) + 1
    assert b'superfluid_wal_commit_seconds_bucket{le="+Inf"}' in body
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert b"superfluid_prefill_tokens_total" in body and b"superfluid_warm_prefix_tokens_total" in body
    check = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True)
    assert check.returncode == 0, check.stdout + check.stderr
    status, _, _ = raw(d, "GET", "/metrics", None)
    assert status == 401
