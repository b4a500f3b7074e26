"""The closing of a generated turn on a template whose assistant header opens
a thinking block (the tools-think test model, Qwen3's shape): the closing is
the template's text after the assistant message's content, not an empty
assistant message less the header (which differ here, by the thinking
block), so a cut turn is closed before the next user turn there too."""

from test_turn_closing import cut_then_user

MODEL = "SmolLM2-135M-tools-think.gguf"


def test_a_cut_turn_on_a_thinking_template_is_closed_by_the_next_message(daemon, sf):
    cut_then_user(sf)
