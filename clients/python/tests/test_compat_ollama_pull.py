"""Ollama's /api/pull and /api/delete, driven by the official `ollama`
client, against a fake Hugging Face hub started here (a real HTTP server
serving the hub's API paths and files with Range support): the daemon's
HF_ENDPOINT points at it and HF_HUB_CACHE at a temp dir, so no request leaves
the machine. Pull streams Ollama's status objects with total and completed,
ends with success, and leaves the file in the cache; delete removes it."""

import hashlib
import http.server
import json
import os
import tempfile
import threading

import ollama
import pytest

from compat import KEY
from superfluid_client.daemon import Daemon, default_model

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
FILES = {
    "tiny-Q4_0.gguf": os.urandom(3 << 20),
    "tiny-Q8_0.gguf": os.urandom(1 << 16),
}


class Hub(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        path = self.path
        if path.startswith("/api/models/fake/tiny/revision/main"):
            siblings = [{"rfilename": n, "size": len(b),
                         "lfs": {"sha256": hashlib.sha256(b).hexdigest(), "size": len(b)}}
                        for n, b in FILES.items()]
            body = json.dumps({"id": "fake/tiny", "sha": COMMIT, "siblings": siblings}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        prefix = "/fake/tiny/resolve/main/"
        name = path[len(prefix):] if path.startswith(prefix) else None
        if name not in FILES:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = FILES[name]
        start, end = 0, len(data)
        rng = self.headers.get("Range", "")
        if rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            start = int(a or 0)
            end = min(int(b) + 1, len(data)) if b else len(data)
        sha = hashlib.sha256(data).hexdigest()
        self.send_response(206)
        self.send_header("x-repo-commit", COMMIT)
        self.send_header("x-linked-etag", '"{}"'.format(sha))
        self.send_header("ETag", '"{}"'.format(sha))
        self.send_header("Content-Range", "bytes {}-{}/{}".format(start, end - 1, len(data)))
        self.send_header("Content-Length", str(end - start))
        self.end_headers()
        self.wfile.write(data[start:end])


@pytest.fixture(scope="module")
def hub_daemon():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cache = tempfile.mkdtemp(prefix="sf-hub-")
    d = Daemon(model=default_model(), extra_args=["--api-key", KEY],
               env={"HF_ENDPOINT": "http://127.0.0.1:{}".format(server.server_port),
                    "HF_HUB_CACHE": cache, "HF_HUB_OFFLINE": "0", "HF_TOKEN": ""})
    d.start()
    yield d, cache
    d.cleanup()
    server.shutdown()


def oll(d):
    return ollama.Client(host=d.url, headers={"Authorization": "Bearer " + KEY}, timeout=120)


def cached(cache, name):
    return os.path.join(cache, "models--fake--tiny", "snapshots", COMMIT, name)


def test_pull_streams_progress_then_success_and_delete_removes(hub_daemon):
    d, cache = hub_daemon
    c = oll(d)
    parts = list(c.pull("fake/tiny:q4_0", stream=True))
    statuses = [p.status for p in parts]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success", statuses
    progress = [p for p in parts if p.status == "pulling tiny-Q4_0.gguf"]
    assert progress and progress[-1].total == len(FILES["tiny-Q4_0.gguf"])
    assert progress[-1].completed == progress[-1].total
    digest = hashlib.sha256(FILES["tiny-Q4_0.gguf"]).hexdigest()
    assert progress[-1].digest == "sha256:" + digest
    assert "verifying sha256 digest" in statuses
    with open(cached(cache, "tiny-Q4_0.gguf"), "rb") as f:
        assert f.read() == FILES["tiny-Q4_0.gguf"]
    # Not streamed: one answer.
    assert c.pull("fake/tiny:Q8_0", stream=False).status == "success"
    assert os.path.exists(cached(cache, "tiny-Q8_0.gguf"))
    # A quant the repo lacks: the error names those it has.
    with pytest.raises(ollama.ResponseError) as e:
        c.pull("fake/tiny:Q5_K_M", stream=False)
    assert e.value.status_code == 400 and "quants there: Q4_0, Q8_0" in e.value.error
    # Delete removes it; a second delete is a 404.
    c.delete("fake/tiny:Q4_0")
    assert not os.path.exists(cached(cache, "tiny-Q4_0.gguf"))
    with pytest.raises(ollama.ResponseError) as e:
        c.delete("fake/tiny:Q4_0")
    assert e.value.status_code == 404
    # The daemon still serves the model it started with.
    assert c.list().models
