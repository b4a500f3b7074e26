"""Response ids are the daemon's to issue: `resp_<session>_<event>_<tag>`,
the tag a keyed MAC (<sessions>/response-key). A holder of --api-key can
name the responses it was given and nothing else: a session a socket client
made is not reachable by counting through `resp_<n>_<m>`, nor is an id
with its tag changed. The key is kept across a restart, so ids stay valid.
Untagged ids (what the daemon issued before) are taken only by a daemon
started without --api-key."""

import json

import openai
import pytest

from compat import KEY, issued_id, oai, raw

EXTRA_ARGS = ["--api-key", KEY]


def forgeries(session, n_events, tag):
    """Every id a caller could guess for `session`'s points: untagged, and
    with a tag that is valid for another point."""
    for e in range(n_events):
        yield "resp_{}_{}".format(session, e)
        yield "resp_{}_{}_{}".format(session, e, tag)


def refused_everywhere(daemon, id_):
    """Each route that takes a response id answers `id_` with a 404 in
    OpenAI's shape, and nothing is made or purged."""
    key = {"Authorization": "Bearer " + KEY}
    for method, path in (("GET", "/v1/responses/{}"), ("GET", "/v1/responses/{}?stream=true"),
                         ("GET", "/v1/responses/{}/input_items"),
                         ("POST", "/v1/responses/{}/cancel"), ("DELETE", "/v1/responses/{}")):
        status, _, body = raw(daemon, method, path.format(id_), None, key)
        assert status == 404, (method, path, id_, status, body)
        assert json.loads(body)["error"]["message"] == "no response with id {!r}".format(id_).replace("'", '"'), body
    with pytest.raises(openai.NotFoundError):
        oai(daemon).responses.create(model="default", previous_response_id=id_, input="Go on.",
                                     max_output_tokens=2)


def test_a_session_the_socket_made_is_not_reachable_by_a_response_id(daemon, sf):
    c = oai(daemon)
    # Someone else's session, made through the socket: a system prompt, a
    # question and a reply, the shape of a stored response.
    other = sf.session()
    other.system("The code word is heliotrope.")
    other.user("What is the code word?")
    other.generate(max_tokens=6)
    before = other.events()
    mine = c.responses.create(model="default", input="Say hi.", max_output_tokens=4, temperature=0)
    tag = mine.id.rsplit("_", 1)[1]
    assert mine.id.count("_") == 3 and len(tag) == 32, mine.id
    # The tag is what docs/responses.md says it is.
    assert issued_id(daemon, *map(int, mine.id.split("_")[1:3])) == mine.id
    sessions = sorted(daemon.client().list())
    for forged in forgeries(other.id, len(before) + 1, tag):
        refused_everywhere(daemon, forged)
    assert other.events() == before, "a forged id changed another client's session"
    assert sorted(daemon.client().list()) == sessions, "a forged id made or purged a session"
    # The issued id works on every route.
    assert c.responses.retrieve(mine.id).output_text == mine.output_text
    assert c.responses.input_items.list(mine.id).data[0].content[0].text == "Say hi."


def test_an_issued_id_with_any_digit_of_its_tag_changed_is_refused(daemon):
    c = oai(daemon)
    r = c.responses.create(model="default", input="Name a bird.", max_output_tokens=4, temperature=0)
    head, tag = r.id.rsplit("_", 1)
    for i in range(len(tag)):
        flipped = tag[:i] + ("0" if tag[i] != "0" else "1") + tag[i + 1:]
        status, _, body = raw(daemon, "GET", "/v1/responses/{}_{}".format(head, flipped), None,
                              {"Authorization": "Bearer " + KEY})
        assert status == 404, (flipped, body)
    # Another response's numbers under this tag, and this one's numbers
    # without it.
    s, e = head.split("_")[1:]
    for forged in ("resp_{}_{}_{}".format(s, int(e) + 1, tag), head):
        refused_everywhere(daemon, forged)
    assert c.responses.retrieve(r.id).id == r.id


def test_ids_outlive_a_restart_and_untagged_ones_need_a_daemon_without_api_key(daemon):
    c = oai(daemon)
    r = c.responses.create(model="default", input="Name a tree.", max_output_tokens=4, temperature=0)
    s, e = r.id.split("_")[1:3]
    untagged = "resp_{}_{}".format(s, e)
    daemon.restart()  # SIGKILL; the key file is read again
    c = oai(daemon)
    assert c.responses.retrieve(r.id).output_text == r.output_text
    refused_everywhere(daemon, untagged)
    # Without --api-key every caller holds the web token, which opens every
    # session through /web/* anyway: ids issued before tags were added
    # still resolve there.
    daemon.extra_args = []
    try:
        daemon.restart()
        web = oai(daemon, key=daemon.token())
        assert web.responses.retrieve(untagged).output_text == r.output_text
        assert web.responses.retrieve(r.id).output_text == r.output_text
    finally:
        daemon.extra_args = list(EXTRA_ARGS)
        daemon.restart()


def test_an_id_does_not_name_the_session_that_took_its_number_in_a_new_log(daemon, sf):
    # --sessions-cache starts a fresh log at every start: session numbers
    # begin again at 1, so without the making time in the tag an old id
    # named whatever session took its number next, made by anyone.
    c = oai(daemon)
    r = c.responses.create(model="default", input="Name a lake.", max_output_tokens=4, temperature=0)
    number = int(r.id.split("_")[1])
    daemon.extra_args = list(EXTRA_ARGS) + ["--sessions-cache"]
    try:
        daemon.restart()
        client = daemon.client()
        while True:  # someone else's sessions, up to the old id's number
            s = client.session()
            s.user("The code word is heliotrope.")
            if s.id >= number:
                break
        assert s.id == number
        s.generate(max_tokens=4)
        refused_everywhere(daemon, r.id)
        assert len(s.events()) > 2, "the session that took the number is untouched"
    finally:
        daemon.extra_args = list(EXTRA_ARGS)
        daemon.restart()
