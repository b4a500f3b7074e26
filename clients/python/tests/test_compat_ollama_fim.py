"""Ollama's /api/generate `suffix` (fill-in-the-middle) through the official
`ollama` client, on the FIM test model (the default model's GGUF with
fill-in-the-middle token ids): the prompt is laid out with the model's FIM
tokens, and /api/show reports the `insert` capability."""

import ollama

from compat import KEY, access_lines

MODEL = "SmolLM2-135M-fim.gguf"
EXTRA_ARGS = ["--api-key", KEY]


def oll(daemon):
    return ollama.Client(host=daemon.url, headers={"Authorization": "Bearer " + KEY}, timeout=120)


def test_suffix_runs_fill_in_the_middle(daemon):
    c = oll(daemon)
    r = c.generate(model="default", prompt="def add(a, b):\n    return ", suffix="\n\nprint(add(1, 2))\n",
                   options={"temperature": 0, "num_predict": 8}, stream=False)
    assert r.done and r.eval_count > 0
    prefix_only = c.generate(model="default", prompt="def add(a, b):\n    return ", raw=True,
                             options={"temperature": 0, "num_predict": 1}, stream=False)
    # The FIM layout holds the prefix, the suffix and three FIM tokens.
    line = access_lines(daemon)[-2]
    assert "POST /api/generate 200" in line
    fim_prompt = int(line.split("prompt=")[1].split()[0])
    assert fim_prompt >= prefix_only.prompt_eval_count + 3 + 5
    assert "insert" in c.show("default").capabilities


def test_openai_completions_suffix_runs_fill_in_the_middle(daemon):
    """The same layout through OpenAI's /v1/completions `suffix`."""
    from compat import oai
    c = oai(daemon)
    prefix = "def add(a, b):\n    return "
    plain = c.completions.create(model="default", prompt=prefix, max_tokens=4, temperature=0)
    fim = c.completions.create(model="default", prompt=prefix, suffix="\n\nprint(add(1, 2))\n",
                               max_tokens=8, temperature=0)
    # The prefix, the suffix (6+ tokens) and the three FIM tokens.
    assert fim.usage.prompt_tokens >= plain.usage.prompt_tokens + 3 + 5
    assert fim.usage.completion_tokens > 0 and fim.choices[0].finish_reason in ("stop", "length")
