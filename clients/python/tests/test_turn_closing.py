"""What follows a generated turn opens with the template's closing of that
turn, as far as the model's tokens did not write it, so a session's input
is what the chat template renders for the same conversation (what the HTTP
routes send). On SmolLM2's ChatML template an assistant message renders as
`<|im_start|>assistant\\n...<|im_end|>\\n`: a turn that ended with its
`<|im_end|>` lacked the newline (the next `<|im_start|>` followed it
directly), and a turn cut by max_tokens was never closed at all (the next
user turn followed the cut text)."""

from superfluid_client import Sampling

from compat import KEY, oai

EXTRA_ARGS = ["--api-key", KEY]

# SmolLM2's tokens: <|im_start|>, <|im_end|>, "\n".
IM_START, IM_END, NL = 1, 2, 198
HEADER = 4  # <|im_start|>assistant\n, counted by the chat route


def asked(sf, question, max_tokens):
    """A new session asked `question`, and its reply."""
    s = sf.session()
    s.user(question)
    return s, s.generate(max_tokens=max_tokens)


def chat_prompt_tokens(daemon, *texts):
    """The chat route's prompt tokens for `texts` as user and assistant turns
    in turn."""
    roles = ["user", "assistant"]
    return oai(daemon).chat.completions.create(model="default", max_tokens=1, temperature=0, messages=[
        {"role": roles[i % 2], "content": t} for i, t in enumerate(texts)]).usage.prompt_tokens


def cut_then_user(sf):
    """A turn cut by max_tokens, then a user message: the message closes the
    turn first. The session."""
    s, reply = asked(sf, "Count from one to fifty, in words.", 3)
    assert reply.finish == 2, reply
    m = s.user("Stop there.")
    assert m.data["span"][:3] == [IM_END, NL, IM_START], m.data["span"][:8]
    return s


def test_a_message_after_a_finished_turn_opens_with_the_newline_the_template_puts_there(daemon, sf):
    s, reply = asked(sf, "Name a colour.", 60)
    assert reply.finish == 1 and reply.events[-1].data["span"][-1] == IM_END, reply
    m = s.user("Another one.")
    assert m.data["span"][:2] == [NL, IM_START], m.data["span"][:8]
    # The session holds what the chat route renders for the same messages
    # (the reply's text tokenized again comes to the same count here).
    assert s.inspect()["tokens"] + HEADER == chat_prompt_tokens(daemon, "Name a colour.", reply.text, "Another one.")


def test_a_message_after_a_cut_turn_closes_it_first(daemon, sf):
    s = cut_then_user(sf)
    # The next generation is a new turn, not the cut one continued.
    after = s.generate(max_tokens=4)
    kinds = [e.kind for e in s.events()]
    assert kinds.count("GenerationPrompt") == 2, kinds
    assert after.tokens > 0


def test_a_generate_after_a_finished_turn_closes_it_before_the_next_header(daemon, sf):
    s, first = asked(sf, "Say hi.", 60)
    assert first.finish == 1, first
    s.generate(max_tokens=2)
    headers = [e.data["span"] for e in s.events() if e.kind == "GenerationPrompt"]
    assert len(headers) == 2 and headers[1][:2] == [NL, IM_START], headers
    assert headers[1][1:] == headers[0], "the same header, after the closing"


def test_a_tool_result_after_a_permission_still_closes_the_call_turn(daemon, sf):
    # Records that put nothing on the input (a permission asked and given)
    # between the call and its result do not hide the turn: the result
    # still opens with its closing (the part the turn's tokens did not
    # write).
    # Greedy: with a random seed the forced call's string argument can run
    # past max_tokens before the call closes (CI saw finish 2 at 80 tokens).
    s = sf.session(Sampling(temperature=0.0, seed=1))
    s.declare(system="You answer with tools.", tools=[{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])
    s.set_tool_choice("required")
    s.user("Weather in Paris?")
    reply = s.generate(max_tokens=160)
    assert reply.finish == 3 and reply.tool_calls, reply
    call = reply.tool_calls[0].id
    _, asked = sf.call("RequestPermission", {"session": s.id, "call_id": call, "text": "May I?"})
    sf.call("RespondPermission", {"session": s.id, "request_id": asked["event"]["event_id"], "granted": True})
    result = s.tool_result(call, "sunny")
    last = [t for e in reply.events if e.kind == "Generated" for t in e.data["span"]][-1]
    closing = [NL] if last == IM_END else [IM_END, NL]
    assert result.data["span"][:len(closing) + 1] == closing + [IM_START], (last, result.data["span"][:8])


def test_the_specs_rebase_of_a_turn_into_one_message_keeps_the_template_form(daemon, sf):
    # "To give the model a past turn in the template's form, rebase its
    # Generated events into one assistant message holding the text." The
    # next message kept its span, which opened with the closing of the
    # generated turn (a newline) that the replacing message already ends
    # with: it is rendered again, and the record lists it as a Replace.
    from superfluid_client import replace
    s, reply = asked(sf, "Name a colour.", 60)
    assert reply.finish == 1, reply
    q2 = s.user("Another one.")
    assert q2.data["span"][:2] == [NL, IM_START]
    header = next(e for e in s.events() if e.kind == "GenerationPrompt")
    b = s.rebase([replace(header.id, q2.id, "assistant", reply.text)])
    events = b.events()
    again = [e for e in events if e.kind == "Message" and e.data["text"] == "Another one."]
    assert again and again[0].data["span"][:2] == [IM_START, 4093], again[0].data["span"][:8]
    rebased = next(e for e in events if e.kind == "Rebased")
    assert len(rebased.data["edits"]) == 2, rebased.data["edits"]
    assert b.inspect()["tokens"] + HEADER == chat_prompt_tokens(daemon, "Name a colour.", reply.text, "Another one.")
