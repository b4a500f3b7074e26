"""The client's call table, one test each, and its errors, on the default model."""

import http.client
import json
import threading
import time

import pytest

from superfluid_client import (
    Client, Event, Forbidden, Reply, Sampling, Session, SuperfluidError, Throttled, ToolCall,
    Unauthorized, drop, replace,
)
from superfluid_client.daemon import Daemon

GREEDY = Sampling(temperature=0.0, seed=1)


def asked(sf, question="Name three rivers.", sampling=GREEDY):
    s = sf.session(sampling)
    q = s.user(question)
    return s, q


def test_client_session_creates_with_system_and_tools(sf):
    s = sf.session(Sampling(temperature=0.7, seed=3), system="You are terse.")
    assert isinstance(s, Session) and s.id in sf.list()
    events = s.events()
    assert [e.kind for e in events] == ["Created", "System"]
    assert events[0].data["params"] == {"temperature": 0.7, "top_p": 0.95, "min_p": 0.0, "top_k": 0, "seed": 3}
    assert events[1].data["text"] == "You are terse."
    bare = sf.session()
    assert [e.kind for e in bare.events()] == ["Created"]
    assert bare.inspect()["params"]["seed"] == 0


def test_user_system_assistant_append_messages(sf):
    s = sf.session(GREEDY)
    sys_ev, user_ev, asst_ev = s.system("Be brief."), s.user("Hello"), s.assistant("Hi.")
    assert all(isinstance(e, Event) for e in (sys_ev, user_ev, asst_ev))
    assert (sys_ev.id, user_ev.id, asst_ev.id) == (1, 2, 3)
    assert [(e.kind, e.role, e.text) for e in s.events(1)] == [
        ("Message", 0, "Be brief."), ("Message", 1, "Hello"), ("Message", 2, "Hi.")]
    assert s.events()[2] == user_ev


def test_declare_takes_dicts_and_json_strings(sf):
    tool = {"type": "function", "function": {"name": "now", "description": "The time",
                                             "parameters": {"type": "object", "properties": {}}}}
    s = sf.session(GREEDY)
    e = s.declare(system="Use tools.", tools=[tool, json.dumps(tool)])
    assert e.kind == "System" and e.data["tools"] == [json.dumps(tool)] * 2
    s.user("What time is it?")
    with pytest.raises(SuperfluidError):
        s.declare(system="again")


def test_stream_is_token_by_token_and_adds_up(sf):
    s, _ = asked(sf)
    stream = s.stream(max_tokens=24)
    chunks = list(stream)
    reply = stream.reply
    assert reply.tokens == 24 and reply.finish == 2
    assert all(c.kind == "text" for c in chunks)
    commits = [e for e in stream.committed if e.kind == "Generated"]
    assert len(chunks) > len(commits), "provisional chunks arrive ahead of the commits"
    assert "".join(c.text for c in chunks) == reply.text == "".join(e.text for e in commits)


def test_leaving_a_stream_early_cancels_it(sf):
    """Leaving the loop cancels the generation and returns once the session
    is free: the daemon saw the closed connection only some replies later,
    so a generate() right after the loop was refused SessionBusy."""
    s, _ = asked(sf, "Write a long story about a dragon.")
    for chunk in s.stream(max_tokens=400):
        break
    assert not s.inspect()["generating"]
    last = [e for e in s.events() if e.kind == "Generated"][-1]
    assert last.data["finish"] == 4
    assert s.inspect()["open_turn"]
    assert s.generate(4).tokens == 4


def test_generate_returns_a_reply(sf):
    a, _ = asked(sf)
    b, _ = asked(sf)
    ra, rb = a.generate(16), b.generate(16)
    assert isinstance(ra, Reply)
    assert (ra.finish, ra.tokens, ra.tool_calls, ra.reasoning) == (2, 16, [], "")
    assert ra.text and ra.text == rb.text, "greedy is deterministic"
    assert rb.warm_prefix > 0, "the second session's prompt came from the cache"
    # Continued after the max_tokens cut, the open turn goes on.
    rc = a.generate(8)
    assert rc.tokens == 8
    assert [e.kind for e in a.events()].count("GenerationPrompt") == 1


def warmed_tokens(sf):
    text = sf.call("Metrics")[1]["text"]
    line = [l for l in text.splitlines() if l.startswith("superfluid_turn_warmed_tokens_total ")]
    assert line, "the metric superfluid_turn_warmed_tokens_total is missing"
    return int(line[0].split()[1])


def test_the_next_turn_starts_warm_from_what_was_decoded_while_idle():
    # A turn that ends: once the lane has been idle a moment (100 ms), the
    # daemon decodes its end of turn and the chat template's user-turn
    # opening (<|im_start|>user\n, three tokens on this model) ahead, so the
    # next turn computes only the rest of its message. A daemon of its own:
    # the counter is this session's alone.
    with Daemon() as d:
        sf = d.client()
        s, _ = asked(sf, "Hi there.")
        r1 = s.generate(64)
        assert r1.finish == 1, "the reply ends its turn"
        held = sum(len(e.data.get("span") or []) for e in s.events())
        deadline = time.time() + 10
        # The end of turn, the rest of ChatML's closing (a newline) and
        # the user turn's opening (<|im_start|>user\n).
        while warmed_tokens(sf) < 5 and time.time() < deadline:
            time.sleep(0.02)
        assert warmed_tokens(sf) == 5
        s.user("Thanks.")
        r2 = s.generate(4)
        assert r2.warm_prefix == held + 4, (r2.warm_prefix, held)


def test_a_turn_that_follows_at_once_does_not_wait_for_the_opening():
    # A next turn that comes before --turn-warm-ms (here an hour, so it
    # surely does) gets the end of turn and the opening computed in its own
    # step: nothing is decoded ahead, and nothing is waited for.
    with Daemon(extra_args=["--turn-warm-ms", "3600000"]) as d:
        sf = d.client()
        s, _ = asked(sf, "Hi there.")
        r1 = s.generate(64)
        assert r1.finish == 1, "the reply ends its turn"
        held = sum(len(e.data.get("span") or []) for e in s.events())
        s.user("Thanks.")
        r2 = s.generate(4)
        assert r2.warm_prefix == held - 1, (r2.warm_prefix, held)
        assert warmed_tokens(sf) == 0


def test_cancel_stops_the_generation_in_flight(sf):
    s, _ = asked(sf, "Write a long story about a dragon.")
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("reply", s.generate(2000)))
    t.start()
    deadline = time.time() + 20
    while not s.inspect()["generating"] and time.time() < deadline:
        time.sleep(0.02)
    s.cancel()
    t.join(30)
    assert box["reply"].finish == 4 and box["reply"].tokens < 2000
    with pytest.raises(SuperfluidError, match="no generation in flight"):
        s.cancel()


def test_fork(sf):
    s, q = asked(sf)
    s.generate(4)
    n = len(s.events())
    whole = s.fork()
    assert whole.events()[:n] == s.events() and whole.events()[n].kind == "Forked"
    assert whole.inspect()["params"] == s.inspect()["params"]
    part = s.fork(at=q.id + 1, seed=9)
    events = part.events()
    assert events[:q.id + 1] == s.events()[:q.id + 1]
    assert events[q.id + 1].kind == "Forked" and part.inspect()["params"]["seed"] == 9
    assert (part.id, s.id, q.id + 1) in sf.tree()


def test_fork_after(sf):
    s, q = asked(sf)
    s.generate(4)
    f = s.fork_after(q, seed=2)
    assert f.events()[q.id] == q and f.events()[q.id + 1].kind == "Forked"
    f.user("And three mountains?")
    assert f.generate(8).warm_prefix > 0, "the shared history starts warm"


def test_edit_replaces_a_message_and_drops_what_followed(sf):
    s, q = asked(sf)
    s.generate(4)
    e = s.edit(q, "Name three lakes.")
    msgs = e.messages()
    assert [(m.role, m.text) for m in msgs] == [("user", "Name three lakes.")]
    assert e.events()[q.id].kind == "Rebased"
    assert s.messages()[0].text == "Name three rivers.", "the original is untouched"


def test_rebase(sf):
    s = sf.session(GREEDY)
    a, b, c = s.user("one"), s.assistant("two"), s.user("three")
    r = s.rebase([drop(b.id, c.id)])
    assert [m.text for m in r.messages()] == ["one", "three"]
    r2 = s.rebase([replace(a.id, b.id, "user", "uno"), {"Drop": {"from": c.id, "to": c.id + 1}}])
    assert [m.text for m in r2.messages()] == ["uno", "two"]


def test_trim(sf):
    s = sf.session(GREEDY)
    a, b = s.user("one"), s.assistant("two")
    t = s.trim(b)
    assert [m.text for m in t.messages()] == ["one"]
    assert t.events()[b.id].kind == "Forked"


def test_events_from_a_cursor(sf):
    s, q = asked(sf)
    everything = s.events()
    assert [e.id for e in everything] == list(range(len(everything)))
    assert s.events(cursor=q.id) == everything[q.id:]
    assert s.events(cursor=len(everything)) == []


def test_messages_fold_the_log(sf):
    s, q = asked(sf)
    r = s.generate(12)
    s.user("Thanks.")
    msgs = s.messages()
    assert [m.role for m in msgs] == ["user", "assistant", "user"]
    assert msgs[1].text == r.text and msgs[0].events == [q.id]


def test_tool_calls_on_a_session_without_any(sf):
    s, _ = asked(sf)
    assert s.open_tool_calls() == []
    with pytest.raises(SuperfluidError):
        s.tool_result(ToolCall(9999, "nope", "{}"), "x")


def test_pin(sf):
    s, _ = asked(sf)
    deadline = s.pin(30)
    assert time.time() * 1000 < deadline <= (time.time() + 31) * 1000
    assert s.pin(0) == 0, "0 clears the pin"


def test_set_qos(sf):
    s, _ = asked(sf)
    e = s.set_qos(2, batch_invariant=True)
    assert e.kind == "Qos" and e.data == {"class": 2, "batch_invariant": True}
    with pytest.raises(SuperfluidError):
        s.set_qos(9)


def test_client_call_sends_raw_requests(sf):
    s, q = asked(sf)
    variant, payload = sf.call("Read", {"session": s.id, "cursor": q.id})
    assert variant == "Events" and payload["events"][0] == q.raw
    variant, payload = sf.call("Tree")
    assert variant == "Tree" and [s.id, None, None] in payload["nodes"]
    assert sf.call("Metrics")[0] == "Text"


def test_client_get(sf, daemon):
    s, q = asked(sf)
    again = sf.get(s.id)
    assert again.id == s.id and again.events() == s.events()


def test_client_get_after_a_restart():
    with Daemon() as d:
        sf = d.client()
        s, q = asked(sf)
        before = s.events()
        d.kill9()
        d.start()  # a new token: the client reads it again
        again = sf.get(s.id)
        assert again.events()[:len(before)] == before


# ---- errors -----------------------------------------------------------------


def test_unknown_session_raises(sf):
    with pytest.raises(SuperfluidError, match="unknown session"):
        sf.get(987654)
    with pytest.raises(SuperfluidError, match="unknown session"):
        Session(sf, 987654).user("hi")
    with pytest.raises(SuperfluidError):
        Session(sf, 987654).generate(4)


def test_wrong_token_raises(daemon, tmp_path):
    bad = Client(daemon.url, token="0" * 64)
    with pytest.raises(Unauthorized) as e:
        bad.list()
    assert e.value.status == 401
    assert "the token was given to Client()" in str(e.value), e.value
    with pytest.raises(Unauthorized):
        bad.session()
    # A 401 names the token file the client read, or could not read.
    missing = tmp_path / "elsewhere"
    with pytest.raises(Unauthorized) as e:
        Client(daemon.url, sessions_dir=str(missing)).list()
    assert "no token: {} could not be read".format(missing / "web-token") in str(e.value), e.value
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "web-token").write_text("1" * 64)
    with pytest.raises(Unauthorized) as e:
        Client(daemon.url, sessions_dir=str(stale)).list()
    assert "the token was read from {}".format(stale / "web-token") in str(e.value), e.value


def test_wrong_csrf_is_forbidden(daemon):
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=10)
    token = daemon.token()
    conn.request("POST", "/web/rpc", body=b'"List"', headers={
        "authorization": "Bearer " + token, "x-superfluid-csrf": "nope"})
    resp = conn.getresponse()
    assert resp.status == 403
    from superfluid_client import _http_error
    assert isinstance(_http_error(resp, resp.read()), Forbidden)


def test_a_refused_request_carries_the_daemons_message(sf):
    with pytest.raises(SuperfluidError) as e:
        sf.call("Create", {"parent": None, "params": {"temperature": 0.7}})
    assert "missing field" in e.value.message


def test_completions_past_the_bucket_are_throttled(sf):
    # Complete is metered by one bucket for the whole /web/rpc listener
    # (burst 16); the default model has no FIM tokens, so each is an Err.
    with pytest.raises(Throttled) as e:
        for _ in range(40):
            try:
                sf.call("Complete", {"prefix": "a", "suffix": "b", "mode": 0, "max_tokens": 1})
            except Throttled:
                raise
            except SuperfluidError:
                pass
    assert e.value.status == 429 and e.value.retry_after_ms > 0
