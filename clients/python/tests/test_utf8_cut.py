"""A reply cut by max_tokens inside a character (an emoji is several
tokens) leaves that character out instead of ending in U+FFFD: on the
compatible routes the text is the longest whole-character prefix of the
reply's bytes, and on a session the cut turn continued gives exactly the
text of the uncut turn (src/session/output.rs `finish`). With the character
flushed lossily at a cut, the chat reply ended in U+FFFD and the session's
turn held a U+FFFD before the character the continuation wrote whole."""

from superfluid_client import Sampling

from compat import KEY, oai

EXTRA_ARGS = ["--api-key", KEY]

ASK = "Reply with only these emoji: 👨‍👩‍👧🇫🇷🎉"


def whole_prefix(b):
    """The longest prefix of bytes `b` that is whole UTF-8, as text."""
    for end in range(len(b), -1, -1):
        try:
            return b[:end].decode()
        except UnicodeDecodeError:
            continue
    return ""


def token_bytes(daemon):
    """The bytes of each token of the greedy reply (logprobs), 12 tokens."""
    r = oai(daemon).chat.completions.create(
        model="default", messages=[{"role": "user", "content": ASK}], max_tokens=12,
        temperature=0, logprobs=True)
    return [bytes(t.bytes) for t in r.choices[0].logprobs.content]


def cuts_inside_a_character(pieces):
    """The token counts after which the reply's bytes end inside a character."""
    out = []
    for k in range(1, len(pieces)):
        try:
            b"".join(pieces[:k]).decode()
        except UnicodeDecodeError:
            out.append(k)
    return out


def test_the_chat_route_leaves_a_cut_character_out(daemon):
    pieces = token_bytes(daemon)
    cuts = cuts_inside_a_character(pieces)
    assert cuts, "the greedy reply cuts no character: %r" % pieces
    c = oai(daemon)
    for k in cuts[:3]:
        messages = [{"role": "user", "content": ASK}]
        r = c.chat.completions.create(model="default", messages=messages, max_tokens=k, temperature=0)
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "length"
        assert "\ufffd" not in text and text == whole_prefix(b"".join(pieces[:k])), (k, text)
        stream = c.chat.completions.create(model="default", messages=messages, max_tokens=k,
                                           temperature=0, stream=True)
        deltas = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        assert deltas == text, (k, deltas, text)


def test_a_session_turn_cut_inside_a_character_continues_to_the_uncut_text(daemon, sf):
    cuts = cuts_inside_a_character(token_bytes(daemon))
    assert cuts
    k = cuts[0]
    whole = sf.session(Sampling(temperature=0.0, seed=3))
    whole.user(ASK)
    uncut = whole.generate(max_tokens=k + 6)
    s = sf.session(Sampling(temperature=0.0, seed=3))
    s.user(ASK)
    first = s.generate(max_tokens=k)
    assert first.finish == 2 and "\ufffd" not in first.text, first.text
    rest = s.generate(max_tokens=6)
    assert first.text + rest.text == uncut.text, (first.text, rest.text, uncut.text)
