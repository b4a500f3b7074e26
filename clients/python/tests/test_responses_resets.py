"""A client that resets its connection mid-request (actix then drops the
handler's future where it waits) leaves a conversation whole: an item
delete moved or not moved, a response's input all appended or none, and
the conversation taking later requests. The create and items append cases
are in test_responses.py."""

import json
import time

import openai

from compat import KEY, issued_id, oai
from test_responses import reset_after

EXTRA_ARGS = ["--api-key", KEY]


def msg(text):
    return {"type": "message", "role": "user", "content": text}


def listing(c, conv_id):
    """The conversation's items, oldest first (every page): (id, text) per
    item."""
    out = []
    for i in c.conversations.items.list(conv_id, limit=100, order="asc"):
        text = i.content[0].text if i.type == "message" and i.content else None
        out.append((i.id, text))
    return out


def record(row):
    try:
        return json.loads(row["title"])["openai.conversation"]
    except (TypeError, ValueError, KeyError):
        return None


def branches(daemon, conv_id):
    """The conversation's state from the session API: every session, and
    the conversation's record in each of its branches."""
    rows = {r["session"]: r for r in daemon.client().sessions()}
    mine = {s: record(r) for s, r in rows.items() if (record(r) or {}).get("id") == conv_id}
    return rows, mine


def check_named(daemon, conv_id, when=""):
    """Every branch made from the conversation names it, exactly one is its
    end (no `moved_to`), each `moved_to` names one of its branches, and
    the first session names the end: the id resolves in at most two hops.
    Answers the end."""
    rows, mine = branches(daemon, conv_id)
    first = int(conv_id[len("conv_"):])
    unnamed = sorted(s for s, r in rows.items() if r["parent"] in mine and s not in mine)
    assert not unnamed, "{}branches of {} its record does not name: {}".format(when, conv_id, unnamed)
    ends = sorted(s for s, rec in mine.items() if "moved_to" not in rec)
    assert len(ends) == 1, "{}{} has {} ends: {}".format(when, conv_id, len(ends), {s: mine[s] for s in ends})
    end = ends[0]
    for s, rec in mine.items():
        assert rec.get("moved_to", end) in mine, (when, s, rec)
    assert first == end or mine[first].get("moved_to") == end, (
        "{}{} names {}, its end is {}".format(when, conv_id, mine[first].get("moved_to"), end))
    return end


def settle(probe, done=lambda _: True, timeout=20):
    """Waits until `probe()` answers the same thing three polls in a row,
    one that is `done` (a request the reset left running has finished),
    and answers it."""
    deadline = time.monotonic() + timeout
    seen = []
    while len(seen) < 3 or seen[-1] != seen[-2] or seen[-2] != seen[-3] or not done(seen[-1]):
        assert time.monotonic() < deadline, "never settled: {}".format(seen[-3:])
        seen.append(probe())
        time.sleep(0.05)
    return seen[-1]


def idle(daemon, sessions):
    return not any(daemon.client().get(s).inspect()["generating"] for s in sessions)


def answered(c, **kw):
    """A response on a conversation, once the one before has stopped (a
    400 while it still generates)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return c.responses.create(model="default", max_output_tokens=2, **kw)
        except openai.BadRequestError as e:
            assert "in progress" in str(e) and time.monotonic() < deadline, e
            time.sleep(0.1)


# Resets from as soon as the request is sent to after the request's writes
# are done, in steps shorter than one of them.
DELAYS = (0.0, 0.001, 0.002, 0.003, 0.004, 0.006, 0.008, 0.01, 0.013, 0.016, 0.02, 0.025, 0.03, 0.04,
          0.06)
# A response's setup: fewer, as each reset one then generates (about a
# second here) before the next is sent.
SETUP_DELAYS = (0.0, 0.001, 0.002, 0.003, 0.004, 0.006, 0.009, 0.013, 0.02)


def test_an_item_delete_dropped_by_its_client_moves_the_conversation_whole_or_not(daemon):
    # DELETE .../items/{item} makes a branch without the item, names it
    # with the conversation's record, then points the old branch and the
    # first session at it: a reset between two of those left a branch
    # unnamed, two ends, or the first session naming an old branch.
    c = oai(daemon)
    conv = c.conversations.create(items=[msg("item {}".format(i)) for i in range(20)])
    initial = before = listing(c, conv.id)
    targeted = set()
    for n, delay in enumerate(DELAYS):
        gone = before[1 + n % (len(before) - 1)]
        targeted.add(gone)
        reset_after(daemon, "DELETE", "/v1/conversations/{}/items/{}".format(conv.id, gone[0]), None, delay)
        now = settle(lambda: (listing(c, conv.id), branches(daemon, conv.id)[1]))[0]
        # Whatever the deletes sent so far did (one may land after the
        # polls settled): the items none of them named all there, in
        # order, and nothing else.
        assert [i for i in now if i not in targeted] == [i for i in initial if i not in targeted] and (
            set(now) <= set(initial)), "after a reset at {} s: {} from {}".format(delay, now, before)
        check_named(daemon, conv.id, "after a reset at {} s: ".format(delay))
        before = now
    # The conversation takes an append and a response where it ended.
    before = settle(lambda: listing(c, conv.id))
    c.conversations.items.create(conv.id, items=[msg("one more")])
    last = answered(c, conversation=conv.id, input="Say hi.")
    assert last.status in ("completed", "incomplete"), last
    texts = [t for _, t in listing(c, conv.id)]
    assert texts[:len(before) + 2] == [t for _, t in before] + ["one more", "Say hi."], texts
    check_named(daemon, conv.id)


def test_a_response_dropped_during_its_setup_leaves_its_conversation_whole(daemon):
    # A response on a conversation appends its input items one by one and
    # asks for the generation, after (every other time, for another
    # temperature) forking the conversation and moving it to the fork: a
    # reset must leave all of them or none, the fork named or none, and a
    # conversation that takes the next response.
    c = oai(daemon)
    conv = c.conversations.create(items=[msg("hi")])
    n = 20
    for r, delay in enumerate(SETUP_DELAYS):
        body = {"model": "default", "conversation": conv.id, "max_output_tokens": 2,
                "temperature": (0.5, 0.7)[r // 2 % 2],
                "input": [msg("r{} {}".format(r, i)) for i in range(n)]}
        reset_after(daemon, "POST", "/v1/responses", body, delay)

        def probe():
            _, mine = branches(daemon, conv.id)
            return idle(daemon, mine), listing(c, conv.id), mine
        _, items, _ = settle(probe, done=lambda p: p[0])
        texts = [t for _, t in items]
        for k in range(r + 1):
            mine = [t for t in texts if (t or "").startswith("r{} ".format(k))]
            at = texts.index(mine[0]) if mine else 0
            assert mine in ([], texts[at:at + n]) and len(mine) in (0, n), (
                "response {} after a reset at {} s: {} of its {} input items".format(k, delay, len(mine), n))
        check_named(daemon, conv.id, "after a reset at {} s: ".format(delay))
    last = answered(c, conversation=conv.id, input="Say hi.")
    assert last.status in ("completed", "incomplete"), last
    check_named(daemon, conv.id)


def test_a_continuation_dropped_during_its_setup_is_a_whole_response(daemon):
    # previous_response_id forks the previous response's session (here a
    # conversation's) and appends the input there: a reset must leave no
    # fork with part of its input and no generation asked for, and the
    # conversation as it was.
    c = oai(daemon)
    conv = c.conversations.create(items=[msg("hi")])
    prev = c.responses.create(model="default", conversation=conv.id, input="Pick a colour.", max_output_tokens=2)
    ps = int(prev.id.split("_")[1])
    before = listing(c, conv.id)
    n = 20
    for r, delay in enumerate(SETUP_DELAYS):
        body = {"model": "default", "previous_response_id": prev.id, "max_output_tokens": 2,
                "input": [msg("r{} {}".format(r, i)) for i in range(n)]}
        reset_after(daemon, "POST", "/v1/responses", body, delay)

        def probe():
            forks = sorted((s, at) for s, parent, at in daemon.client().tree() if parent == ps)
            return idle(daemon, [s for s, _ in forks]), forks, [
                daemon.client().get(s).inspect()["events"] for s, _ in forks]
        _, forks, counts = settle(probe, done=lambda p: p[0])
        for (s, at), events in zip(forks, counts):
            rid = issued_id(daemon, s, at)
            try:
                status = c.responses.retrieve(rid).status
            except openai.NotFoundError:
                raise AssertionError("after a reset at {} s, fork {} holds {} input items and no response".format(
                    delay, s, events - at - 1))
            assert status != "in_progress", rid
            got = [i.content[0].text for i in c.responses.input_items.list(rid, limit=100, order="asc")]
            assert len(got) == n and got[0].endswith(" 0"), (
                "after a reset at {} s, {} has {} input items: {}".format(delay, rid, len(got), got))
        assert listing(c, conv.id) == before
    last = c.responses.create(model="default", previous_response_id=prev.id, input="Say hi.", max_output_tokens=2)
    assert last.status in ("completed", "incomplete"), last
    assert listing(c, conv.id) == before
