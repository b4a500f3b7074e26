"""The closing of a generated turn on a template whose assistant header opens
a thinking block (the tools-think test model, Qwen3's shape): the closing is
the template's text after the assistant message's content, not an empty
assistant message less the header (which differ here, by the thinking
block), so a cut turn is closed before the next user turn there too."""

MODEL = "SmolLM2-135M-tools-think.gguf"

# SmolLM2's tokens: <|im_start|>, <|im_end|>, "\n".
IM_START, IM_END, NL = 1, 2, 198


def test_a_cut_turn_on_a_thinking_template_is_closed_by_the_next_message(daemon, sf):
    s = sf.session()
    s.user("Count from one to fifty, in words.")
    reply = s.generate(max_tokens=3)
    assert reply.finish == 2, reply
    m = s.user("Stop there.")
    assert m.data["span"][:3] == [IM_END, NL, IM_START], m.data["span"][:8]
