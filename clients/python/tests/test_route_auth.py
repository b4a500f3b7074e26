"""Host, credential and Origin checks on every HTTP route of the --web listener.

One row per (method, path) the daemon registers (src/http/routes.rs,
src/http/page.rs, src/http/compat/mod.rs); a new route without a row fails
``test_the_table_covers_every_registered_route``. Each row is sent

- no credential, and a wrong one (every way the route takes one): 401;
- the right credential with a foreign ``Host``: 403 (DNS rebinding);
- the right credential with a foreign ``Origin``: 403, and with the
  listener's own Origin, which only /web/ws accepts unlisted: 403;
- on /web/rpc and /web/stream, the token without ``X-Superfluid-CSRF``: 403;

with the statuses and exceptions of docs/web.md ("Auth") and docs/compat.md
("Who may call"): the page checks only Host and /web/health nothing. Every refusal must
be in its route family's error shape (docs/web.md: ``{"Err": {"message"}}``;
docs/compat.md, "Errors": OpenAI, Anthropic, Ollama). Paths carry real ids (a
conversation, its items, a stored response, a session) and bodies that
would succeed, so a handler that skipped its check would answer, and change
something: the sessions, the conversation, the stored response, wal.log and
the access log must be the same after every refused request. Last, each row
is sent with the right credential, which proves that the path and the ids
were real.
"""

import http.client
import json
import os
import re

from compat import KEY, raw
from superfluid_client import Sampling

EXTRA_ARGS = ["--api-key", KEY]

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "src")
ROUTE_FILES = ["http/routes.rs", "http/page.rs", "http/compat/mod.rs"]

FOREIGN_HOST = "evil.example"
FOREIGN_ORIGIN = "http://evil.example"
WRONG = "0" * 64

MSG = [{"role": "user", "content": "hi"}]

# (method, path as registered, kind, body). kind: "web" (/web/rpc and
# /web/stream: token and CSRF), "ws", "page", "health", or an API family
# ("openai", "anthropic", "ollama"). Bodies are functions of the ids the test
# made, so that a handler that skipped its checks would act on real objects.
ROUTES = [
    # src/http/routes.rs
    ("POST", "/web/rpc", "web", lambda i: {"Create": {"parent": None, "params": i["params"]}}),
    ("POST", "/web/stream", "web", lambda i: {"session": i["session"], "max_tokens": 2, "provisional": False}),
    ("GET", "/web/ws", "ws", None),
    ("GET", "/web/health", "health", None),
    # src/http/page.rs
    ("GET", "/web", "page", None),
    ("GET", "/web/", "page", None),
    ("GET", "/web/app.js", "page", None),
    ("GET", "/web/style.css", "page", None),
    # src/http/compat/mod.rs, configure
    ("POST", "/v1/chat/completions", "openai", lambda i: {"model": "default", "messages": MSG, "max_tokens": 2}),
    ("POST", "/v1/completions", "openai", lambda i: {"model": "default", "prompt": "hi", "max_tokens": 2}),
    ("GET", "/v1/models", "openai", None),
    ("GET", "/v1/models/{id}", "openai", None),
    ("POST", "/v1/messages", "anthropic", lambda i: {"model": "default", "messages": MSG, "max_tokens": 2}),
    ("POST", "/v1/messages/count_tokens", "anthropic", lambda i: {"model": "default", "messages": MSG}),
    ("GET", "/metrics", "openai", None),
    ("POST", "/api/chat", "ollama",
     lambda i: {"model": "default", "messages": MSG, "stream": False, "options": {"num_predict": 2}}),
    ("POST", "/api/generate", "ollama",
     lambda i: {"model": "default", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}),
    ("GET", "/api/tags", "ollama", None),
    ("GET", "/api/ps", "ollama", None),
    ("POST", "/api/show", "ollama", lambda i: {"model": "default"}),
    ("GET", "/api/version", "ollama", None),
    # Not a hub reference: refused before any network access.
    ("POST", "/api/pull", "ollama", lambda i: {"model": "not-a-reference", "stream": False}),
    ("POST", "/api/push", "ollama", lambda i: {"model": "default"}),
    ("POST", "/api/create", "ollama", lambda i: {"model": "default"}),
    ("POST", "/api/copy", "ollama", lambda i: {"source": "default", "destination": "other"}),
    # A reference that is not in the cache: never one that is.
    ("DELETE", "/api/delete", "ollama", lambda i: {"model": "nobody/nothing:Q4_0"}),
    ("POST", "/api/embed", "ollama", lambda i: {"model": "default", "input": "hi"}),
    ("POST", "/api/embeddings", "ollama", lambda i: {"model": "default", "prompt": "hi"}),
    # src/http/compat/mod.rs, responses_routes
    ("POST", "/v1/responses", "openai",
     lambda i: {"model": "default", "input": "hi", "max_output_tokens": 2, "conversation": i["conv"]}),
    ("GET", "/v1/responses/{id}", "openai", None),
    ("POST", "/v1/responses/{id}/cancel", "openai", lambda i: {}),
    ("DELETE", "/v1/responses/{id}", "openai", None),
    ("GET", "/v1/responses/{id}/input_items", "openai", None),
    ("POST", "/v1/conversations", "openai",
     lambda i: {"items": [{"type": "message", "role": "user", "content": "made without a key"}]}),
    ("GET", "/v1/conversations/{id}", "openai", None),
    ("POST", "/v1/conversations/{id}", "openai", lambda i: {"metadata": {"topic": "changed without a key"}}),
    ("DELETE", "/v1/conversations/{id}", "openai", None),
    ("GET", "/v1/conversations/{id}/items", "openai", None),
    ("POST", "/v1/conversations/{id}/items", "openai",
     lambda i: {"items": [{"type": "message", "role": "user", "content": "added without a key"}]}),
    ("GET", "/v1/conversations/{id}/items/{item_id}", "openai", None),
    ("DELETE", "/v1/conversations/{id}/items/{item_id}", "openai", None),
]

# With the right credential (last, in this order, so that the deletes come
# after everything that reads what they delete), what each route answers.
OK = {
    "/web": {308}, "/web/ws": {101},
    "/api/pull": {400}, "/api/delete": {404},
    "/api/push": {501}, "/api/create": {501}, "/api/copy": {501}, "/api/embed": {501}, "/api/embeddings": {501},
    # The stored response is complete, so there is nothing to cancel; the
    # 400 says it found the response (an unknown id is a 404).
    "/v1/responses/{id}/cancel": {400},
}
ORDER = {"GET": 0, "POST": 1, "DELETE": 2}
DELETE_ORDER = ["/api/delete", "/v1/conversations/{id}/items/{item_id}", "/v1/responses/{id}", "/v1/conversations/{id}"]


def registered():
    """Every (method, path) a `.route(...)` call registers in the files that
    configure the listener, and the check that no other file registers one."""
    pattern = re.compile(r'\.route\(\s*"([^"]+)"\s*,\s*web::(\w+)\(\)')
    found = []
    for rel in ROUTE_FILES:
        with open(os.path.join(SRC, rel)) as f:
            found += [(m.group(2).upper(), m.group(1)) for m in pattern.finditer(f.read())]
    elsewhere = []
    for dirpath, _, files in os.walk(SRC):
        for name in files:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, SRC)
            if not name.endswith(".rs") or rel in ROUTE_FILES:
                continue
            with open(path) as f:
                text = f.read()
            if pattern.search(text):
                elsewhere.append(rel)
    for dirpath, _, files in os.walk(SRC):
        for name in files:
            if name.endswith(".rs"):
                with open(os.path.join(dirpath, name)) as f:
                    if re.search(r"web::(resource|scope)\(|\.service\(", f.read()):
                        elsewhere.append(os.path.relpath(os.path.join(dirpath, name), SRC))
    return found, elsewhere


def test_the_table_covers_every_registered_route():
    found, elsewhere = registered()
    assert not elsewhere, "routes registered outside {}: {}".format(ROUTE_FILES, elsewhere)
    assert len(found) == len(set(found)), found
    table = [(m, p) for m, p, _, _ in ROUTES]
    assert len(table) == len(set(table)), table
    missing, extra = set(found) - set(table), set(table) - set(found)
    assert not missing, "registered routes without a row: {}".format(sorted(missing))
    assert not extra, "rows for routes not registered: {}".format(sorted(extra))
    assert len(table) == 41


def send(daemon, method, path, body, headers, host=None):
    """One request; (status, lower-case headers, body bytes). A 101 is not
    read (the socket is a WebSocket then)."""
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=120)
    h = dict(headers)
    h["Host"] = host or "127.0.0.1:{}".format(daemon.port)
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        h["Content-Type"] = "application/json"
    conn.request(method, path, body=data, headers=h)
    r = conn.getresponse()
    out = (r.status, {k.lower(): v for k, v in r.getheaders()}, b"" if r.status == 101 else r.read())
    conn.close()
    return out


def ws_headers(daemon):
    return {
        "Connection": "Upgrade",
        "Upgrade": "websocket",
        "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Protocol": "superfluid.v1",
        # The page's own origin: accepted on /web/ws, so only the check
        # under test refuses.
        "Origin": "http://127.0.0.1:{}".format(daemon.port),
    }


def credentials(daemon, kind):
    """(right, [(name, wrong), ...]): the headers that pass, and each way of
    presenting no credential or a wrong one."""
    token = daemon.token()
    if kind == "web":
        right = {"Authorization": "Bearer " + token, "X-Superfluid-CSRF": token}
        wrongs = [
            ("no credential", {"X-Superfluid-CSRF": token}),
            ("a wrong token", {"Authorization": "Bearer " + WRONG, "X-Superfluid-CSRF": token}),
            # docs/compat.md: --api-key is never accepted on /web/*.
            ("the --api-key", {"Authorization": "Bearer " + KEY, "X-Superfluid-CSRF": KEY}),
        ]
        return right, wrongs
    if kind == "ws":
        base = ws_headers(daemon)
        right = dict(base, Authorization="Bearer " + token)
        wrongs = [
            ("no credential", base),
            ("a wrong token", dict(base, Authorization="Bearer " + WRONG)),
            ("a wrong token subprotocol",
             dict(base, **{"Sec-WebSocket-Protocol": "superfluid.v1, superfluid.token." + WRONG})),
            ("the --api-key", dict(base, Authorization="Bearer " + KEY)),
        ]
        return right, wrongs
    if kind in ("page", "health"):
        return {}, [("no credential", {}), ("a wrong token", {"Authorization": "Bearer " + WRONG})]
    right = {"Authorization": "Bearer " + KEY}
    wrongs = [
        ("no credential", {}),
        ("a wrong Bearer key", {"Authorization": "Bearer " + WRONG}),
        ("a wrong x-api-key", {"x-api-key": WRONG}),
    ]
    return right, wrongs


def shape_problem(kind, status, body):
    """Why `body` is not a refusal in the route family's shape (None if it is)."""
    try:
        v = json.loads(body)
    except ValueError:
        return "not JSON: {!r}".format(body[:200])
    if kind in ("web", "ws", "page", "health"):
        ok = isinstance(v, dict) and list(v) == ["Err"] and isinstance(v["Err"].get("message"), str)
    elif kind == "openai":
        e = v.get("error") if isinstance(v, dict) else None
        want = ("authentication_error", "invalid_api_key") if status == 401 else ("permission_error", None)
        ok = (isinstance(e, dict) and set(e) == {"message", "type", "param", "code"}
              and isinstance(e["message"], str) and (e["type"], e["code"]) == want)
    elif kind == "anthropic":
        e = v.get("error") if isinstance(v, dict) else None
        want = "authentication_error" if status == 401 else "permission_error"
        ok = (isinstance(v, dict) and v.get("type") == "error" and isinstance(e, dict)
              and e.get("type") == want and isinstance(e.get("message"), str))
    else:
        ok = isinstance(v, dict) and list(v) == ["error"] and isinstance(v["error"], str)
    return None if ok else "not the {} error shape: {}".format(kind, v)


def cases(daemon, kind):
    """(case, headers, host, expected status) for one row."""
    right, wrongs = credentials(daemon, kind)
    # docs/web.md: no token on the page (it checks only Host), nothing at
    # all on /web/health; everything else answers 401 without one.
    refused = {"page": None, "health": None}.get(kind, 401)
    out = [(name, h, None, refused) for name, h in wrongs]
    out.append(("a foreign Host", right, "{}:{}".format(FOREIGN_HOST, daemon.port), None if kind == "health" else 403))
    out.append(("a foreign Origin", dict(right, Origin=FOREIGN_ORIGIN),
                None, 403 if kind in ("web", "ws", "openai", "anthropic", "ollama") else None))
    if kind in ("web", "openai", "anthropic", "ollama"):
        # Only --web-origin is listed here: the page's own origin is enough
        # on /web/ws alone.
        out.append(("the listener's own Origin", dict(right, Origin="http://127.0.0.1:{}".format(daemon.port)),
                    None, 403))
    if kind == "web":
        out.append(("no X-Superfluid-CSRF", {"Authorization": right["Authorization"]}, None, 403))
    return out


def concrete(path, ids):
    if path.startswith("/v1/models/"):
        return path.replace("{id}", ids["model"])
    if path.startswith("/v1/responses/"):
        return path.replace("{id}", ids["resp"])
    return path.replace("{id}", ids["conv"]).replace("{item_id}", ids.get("item", ""))


def made(daemon, sf):
    """The objects the rows act on."""
    key = {"Authorization": "Bearer " + KEY}
    status, _, body = raw(daemon, "GET", "/v1/models", None, key)
    assert status == 200, body
    model = json.loads(body)["data"][0]["id"]
    status, _, body = raw(daemon, "POST", "/v1/conversations", {
        "items": [{"type": "message", "role": "user", "content": "keep me"},
                  {"type": "message", "role": "user", "content": "and me"}]}, key)
    assert status == 200, body
    conv = json.loads(body)["id"]
    status, _, body = raw(daemon, "GET", "/v1/conversations/{}/items?order=asc".format(conv), None, key)
    assert status == 200, body
    item = json.loads(body)["data"][-1]["id"]
    status, _, body = raw(daemon, "POST", "/v1/responses",
                          {"model": "default", "input": "Say one word.", "max_output_tokens": 4, "store": True}, key)
    assert status == 200, body
    resp = json.loads(body)["id"]
    s = sf.session()
    s.user("Hello.")
    return {"model": model, "conv": conv, "item": item, "resp": resp, "session": s.id,
            "params": Sampling().to_wire()}


def fingerprint(daemon, sf, ids):
    """What a request that skipped its checks would have changed."""
    key = {"Authorization": "Bearer " + KEY}
    out = {"sessions": sf.sessions(include_archived=True)}
    out["wal.log"] = os.path.getsize(os.path.join(daemon.sessions, "wal.log"))
    for path in ("/v1/conversations/{}".format(ids["conv"]),
                 "/v1/conversations/{}/items?order=asc&limit=100".format(ids["conv"]),
                 "/v1/responses/{}".format(ids["resp"]),
                 "/v1/responses/{}/input_items".format(ids["resp"])):
        status, _, body = raw(daemon, "GET", path, None, key)
        out[path] = (status, json.loads(body))
    # Refusals are logged too (with their 401 or 403): count what was served.
    served = re.compile(r"superfluid::access.* (?:GET|POST|DELETE) \S+ ([0-9]{3}) ")
    out["served requests in the access log"] = sum(
        1 for l in daemon.log().splitlines() if (m := served.search(l)) and int(m.group(1)) < 400)
    return out


def test_every_route_checks_host_credential_and_origin(daemon, sf):
    ids = made(daemon, sf)
    before = fingerprint(daemon, sf, ids)
    assert fingerprint(daemon, sf, ids) == before, "reading the fingerprint changed it"

    failures = []
    sent = 0
    for method, path, kind, body in ROUTES:
        url = concrete(path, ids)
        for case, headers, host, want in cases(daemon, kind):
            status, _, got = send(daemon, method, url, body(ids) if body else None, headers, host)
            sent += 1
            row = "{} {} ({}) with {}".format(method, path, url, case)
            if want is None:
                # An exception the docs make: the check does not apply here.
                if status >= 400:
                    failures.append("{}: {} {!r}, the docs say this check does not apply".format(row, status, got[:200]))
                continue
            if status != want:
                failures.append("{}: {} (want {}) {!r}".format(row, status, want, got[:200]))
                continue
            problem = shape_problem(kind, status, got)
            if problem:
                failures.append("{}: {}".format(row, problem))
    after = fingerprint(daemon, sf, ids)
    for k in before:
        if before[k] != after[k]:
            failures.append("the requests changed {}: {} -> {}".format(k, json.dumps(before[k])[:300],
                                                                      json.dumps(after[k])[:300]))
    assert not failures, "{} of {} requests, or what they changed:\n  {}".format(
        len(failures), sent, "\n  ".join(failures))

    # The right credential: the paths and ids were real.
    def order(row):
        method, path = row[0], row[1]
        return (ORDER[method], DELETE_ORDER.index(path) if method == "DELETE" else 0)

    wrong = []
    for method, path, kind, body in sorted(ROUTES, key=order):
        right, _ = credentials(daemon, kind)
        status, _, got = send(daemon, method, concrete(path, ids), body(ids) if body else None, right)
        if status not in OK.get(path, {200}):
            wrong.append("{} {}: {} {!r}".format(method, path, status, got[:200]))
    assert not wrong, "with the right credential:\n  " + "\n  ".join(wrong)
