"""`superfluid session export --endpoint`: OTLP/HTTP JSON pushed to a receiver
this test starts, which parses every body with the official OTLP schema
(opentelemetry-proto's ExportTraceServiceRequest through protobuf's JSON
parser), so a malformed export fails here."""

import base64
import http.server
import json
import subprocess
import threading

import pytest

from superfluid_client import Sampling

json_format = pytest.importorskip("google.protobuf.json_format")
trace_service_pb2 = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

GREEDY = Sampling(temperature=0.0, seed=1)
SECRET = "AKIAIOSFODNN7EXAMPLE"
MARKER = "[REDACTED:aws_access_key_id]"


def parse_otlp(body: bytes):
    """An OTLP/HTTP JSON body as the collector reads it: OTLP/JSON writes
    trace and span ids as hex where proto3's JSON mapping has base64, so
    those are turned into base64 (as the collector's decoder does), then
    protobuf parses the whole with unknown fields refused."""
    doc = json.loads(body)
    for rs in doc.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for span in ss.get("spans", []):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
    msg = trace_service_pb2.ExportTraceServiceRequest()
    json_format.Parse(json.dumps(doc), msg, ignore_unknown_fields=False)
    for rs in msg.resource_spans:
        for ss in rs.scope_spans:
            for span in ss.spans:
                assert len(span.trace_id) == 16 and len(span.span_id) == 8, span
    return msg


class Receiver:
    """An OTLP/HTTP receiver on a free loopback port: each POST is parsed
    with parse_otlp and answered 200, or 400 with the parse error."""

    def __init__(self):
        self.requests = []
        self.errors = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                try:
                    msg = parse_otlp(body)
                except Exception as e:  # the export was malformed
                    outer.errors.append(repr(e))
                    self.send_response(400)
                    self.end_headers()
                    return
                outer.requests.append((self.path, self.headers["Content-Type"], body, msg))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args):
                pass

        self.server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self.url = "http://127.0.0.1:{}".format(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def export(daemon, *args):
    return subprocess.run(
        [daemon.binary, "session", "export", *args, "--socket", daemon.socket],
        capture_output=True, text=True, timeout=120)


def attrs(span):
    out = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        if kind == "array_value":
            out[kv.key] = [x.string_value for x in v.array_value.values]
        else:
            out[kv.key] = getattr(v, kind)
    return out


@pytest.fixture
def forked(sf):
    """A session with a secret in its prompt and a generation, and a fork of
    it with one more turn."""
    s = sf.session(GREEDY)
    s.user("My key is {}. Say hi.".format(SECRET))
    s.generate(max_tokens=8)
    f = s.fork()
    f.user("And again.")
    f.generate(max_tokens=4)
    return s, f


def test_push_with_content_is_valid_otlp_and_redacted(daemon, receiver, forked):
    s, f = forked
    r = export(daemon, str(s.id), str(f.id), "--endpoint", receiver.url, "--include-content",
               "--allow-content-egress", "--model", "smollm2")
    assert r.returncode == 0, r.stderr
    assert receiver.errors == []
    assert len(receiver.requests) == 2
    for path, ctype, body, _ in receiver.requests:
        assert path == "/v1/traces"
        assert ctype == "application/json"
        assert SECRET.encode() not in body
    _, _, _, msg = receiver.requests[1]
    spans = msg.resource_spans[0].scope_spans[0].spans
    gens = [sp for sp in spans if sp.name == "chat smollm2"]
    assert len(gens) == 2, [sp.name for sp in spans]
    inherited, own = attrs(gens[0]), attrs(gens[1])
    assert inherited["superfluid.inherited_from"] == s.id
    assert "superfluid.inherited_from" not in own
    for a in (inherited, own):
        assert a["gen_ai.conversation.id"] == str(f.id)
        assert a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.request.model"] == "smollm2"
        assert a["gen_ai.usage.input_tokens"] > 0
        assert a["gen_ai.usage.output_tokens"] > 0
        assert a["gen_ai.response.finish_reasons"][0] in ("stop", "length")
    assert own["gen_ai.usage.output_tokens"] <= 4
    assert own["gen_ai.usage.input_tokens"] > inherited["gen_ai.usage.input_tokens"]
    messages = json.loads(own["gen_ai.input.messages"])
    assert messages[0]["role"] == "user"
    assert MARKER in messages[0]["parts"][0]["content"]
    assert messages[-1]["parts"][0]["content"] == "And again."
    out = json.loads(own["gen_ai.output.messages"])
    assert out[0]["role"] == "assistant" and out[0]["finish_reason"] in ("stop", "length")
    assert all(sp.trace_id == spans[0].trace_id for sp in spans)
    assert all(sp.parent_span_id == spans[0].span_id for sp in gens)


def test_a_body_over_the_cap_is_split_into_valid_requests(daemon, receiver, forked):
    _, f = forked
    args = [str(f.id), "--endpoint", receiver.url, "--include-content", "--allow-content-egress"]
    assert export(daemon, *args).returncode == 0
    assert receiver.errors == [] and len(receiver.requests) == 1
    _, _, whole, msg = receiver.requests[0]
    spans = list(msg.resource_spans[0].scope_spans[0].spans)
    assert len(spans) == 3  # the session's root and two generations
    biggest = max(len(sp.SerializeToString()) for sp in spans)
    # A cap under the whole body: the spans arrive over several requests,
    # each within the cap, each valid OTLP, all of them once and in order.
    cap = len(whole) - 1
    receiver.requests.clear()
    r = export(daemon, *args, "--max-request-bytes", str(cap))
    assert r.returncode == 0, r.stderr
    assert receiver.errors == [] and len(receiver.requests) >= 2
    assert all(len(body) <= cap for _, _, body, _ in receiver.requests)
    again = [sp for _, _, _, m in receiver.requests for sp in m.resource_spans[0].scope_spans[0].spans]
    assert again == spans
    assert all(m.resource_spans[0].resource == msg.resource_spans[0].resource
               for _, _, _, m in receiver.requests)
    # A cap no single span fits: refused, nothing sent.
    receiver.requests.clear()
    r = export(daemon, *args, "--max-request-bytes", str(biggest // 2))
    assert r.returncode != 0 and "--max-request-bytes" in r.stderr, r.stderr
    assert receiver.requests == []


def test_push_without_content_carries_none(daemon, receiver, forked):
    s, _ = forked
    r = export(daemon, str(s.id), "--endpoint", receiver.url)
    assert r.returncode == 0, r.stderr
    assert receiver.errors == [] and len(receiver.requests) == 1
    path, _, body, msg = receiver.requests[0]
    assert path == "/v1/traces"
    assert b"Say hi" not in body and b"REDACTED" not in body
    for sp in msg.resource_spans[0].scope_spans[0].spans:
        a = attrs(sp)
        assert "gen_ai.input.messages" not in a and "gen_ai.output.messages" not in a


def test_content_egress_is_refused_before_anything_is_sent(daemon, receiver, forked):
    s, _ = forked
    r = export(daemon, str(s.id), "--endpoint", receiver.url, "--include-content")
    assert r.returncode != 0
    assert "--allow-content-egress" in r.stderr
    assert receiver.requests == [] and receiver.errors == []


def test_the_receiver_refuses_a_malformed_export():
    good = {"resourceSpans": [{"scopeSpans": [{"spans": [{
        "traceId": "00" * 16, "spanId": "11" * 8, "name": "x", "kind": 1,
        "startTimeUnixNano": "1", "endTimeUnixNano": "2",
        "attributes": [{"key": "k", "value": {"intValue": "3"}}]}]}]}]}
    parse_otlp(json.dumps(good).encode())
    for broken in (
        {"key": "k", "value": {"intValue": "three"}},
        {"key": "k", "value": {"integerValue": 3}},
    ):
        bad = json.loads(json.dumps(good))
        bad["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"] = [broken]
        with pytest.raises(json_format.ParseError):
            parse_otlp(json.dumps(bad).encode())
    short = json.loads(json.dumps(good))
    short["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["spanId"] = "11" * 4
    with pytest.raises(AssertionError):
        parse_otlp(json.dumps(short).encode())
