#!/usr/bin/env python3
"""Derive test models from the default model by rewriting GGUF metadata (tensors untouched).

Usage: make-test-models.py [MODEL]   (default: $HOME/.cache/superfluid/models/SmolLM2-135M-Instruct.Q4_1.gguf)

Writes next to MODEL, and prints the paths of:

- SmolLM2-135M-tools-think.gguf: the same tensors and vocabulary, with `tokenizer.chat_template`
  replaced by TOOLS_THINK_TEMPLATE below: ChatML (Qwen2.5 style) that declares tools in the first
  system turn (`# Tools` ... `<tools>` one JSON line per tool `</tools>` ... answer with
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>`), renders each `tool` message as its
  own user turn `<|im_start|>user\n<tool_response>\n...\n</tool_response><|im_end|>\n` (unlike
  Qwen2.5, consecutive tool messages are not merged into one turn, so the rendering stays
  incremental message by message), and opens the assistant turn with
  `<|im_start|>assistant\n<think>\n` (a thinking block) when add_generation_prompt.
- SmolLM2-135M-fim.gguf: the default model (its own chat template kept) with
  `tokenizer.ggml.fim_{pre,suf,mid}_token_id` set to FIM_TOKENS below: three control tokens of
  SmolLM2's vocabulary (StarCoder leftovers) that chat never uses and that llama.cpp does not
  already give a role (unlike `<reponame>`/`<file_sep>`, which it detects as FIM repo/sep).

- SmolLM2-135M-other-vocab.gguf: the default model with the text of one unused control token
  (OTHER_VOCAB_TOKEN below) changed: a file whose vocabulary differs from the default's, for the
  test that a model swapped under the daemon is refused.

- SmolLM2-135M-llama3-style.gguf and SmolLM2-135M-gemma-style.gguf: the default model with the
  chat template of another family, written with SmolLM2's own control tokens: LLAMA3_STYLE_TEMPLATE
  (a header per turn, content `| trim`med, no default system prompt) and GEMMA_STYLE_TEMPLATE (the
  system text folded into the first user turn, `model` for the assistant, content `| trim`med).
  Templates that trim are the ones whose rendering cannot be cut back into content and template
  text, for the tests that client text never becomes a control token on any path.

Needs the `gguf` package (pip install gguf). Idempotent: an output newer than both the input and
this script is left alone.
"""

import os
import sys

import gguf

DEFAULT_MODEL = os.path.join(
    os.path.expanduser("~"), ".cache", "superfluid", "models", "SmolLM2-135M-Instruct.Q4_1.gguf"
)

TOOLS_THINK_NAME = "SmolLM2-135M-tools-think.gguf"
FIM_NAME = "SmolLM2-135M-fim.gguf"
OTHER_VOCAB_NAME = "SmolLM2-135M-other-vocab.gguf"
LLAMA3_STYLE_NAME = "SmolLM2-135M-llama3-style.gguf"
GEMMA_STYLE_NAME = "SmolLM2-135M-gemma-style.gguf"
# (token id, its text in the default model, its text in the other vocabulary)
OTHER_VOCAB_TOKEN = (16, "<empty_output>", "<superfluid_other_vocab>")

# (metadata key, token id, the token's text, checked against the vocabulary)
FIM_TOKENS = [
    (gguf.Keys.Tokenizer.FIM_PRE_ID, 11, "<jupyter_start>"),
    (gguf.Keys.Tokenizer.FIM_SUF_ID, 12, "<jupyter_text>"),
    (gguf.Keys.Tokenizer.FIM_MID_ID, 13, "<jupyter_code>"),
]

TOOLS_THINK_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages and messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages and messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}
    {%- elif not (loop.first and message['role'] == 'system') %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n<think>\\n' }}
{%- endif %}
"""

# Llama 3's shape: `<|start_header_id|>role<|end_header_id|>\n\n` + content | trim + `<|eot_id|>`,
# here with <|im_start|>, <empty_output> and <|im_end|>.
LLAMA3_STYLE_TEMPLATE = """\
{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '<empty_output>\\n\\n' + message['content'] | trim + '<|im_end|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant<empty_output>\\n\\n' }}
{%- endif %}
"""

# Gemma's shape: the system text opens the first user turn, the assistant is `model`, content is
# trimmed; `<start_of_turn>`/`<end_of_turn>` are <|im_start|>/<|im_end|> here.
GEMMA_STYLE_TEMPLATE = """\
{%- if messages[0]['role'] == 'system' %}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set first_user_prefix = '' %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message['role'] == 'assistant' %}{%- set role = 'model' %}{%- else %}{%- set role = message['role'] %}{%- endif %}
    {{- '<|im_start|>' + role + '\\n' + (first_user_prefix if loop.first else '') }}
    {{- message['content'] | trim }}
    {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>model\\n' }}
{%- endif %}
"""


def up_to_date(output, inputs):
    if not os.path.exists(output):
        return False
    mtime = os.path.getmtime(output)
    return all(mtime > os.path.getmtime(i) for i in inputs)


def copy_with(reader, output, replace):
    """Write `output`: every KV field of `reader` (values in `replace` substituted, a value of
    None dropping the key; keys not in the reader added), then the tensors unchanged."""
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    part = output + ".part"
    writer = gguf.GGUFWriter(part, arch)
    # Keep the input's alignment (its general.alignment key, if any, is copied below).
    writer.data_alignment = reader.alignment
    replace = dict(replace)
    for field in reader.fields.values():
        # Virtual fields, and the architecture, which GGUFWriter writes itself.
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        if field.name in replace:
            new = replace.pop(field.name)
            if new is not None:
                writer.add_key_value(field.name, new[1], new[0])
            continue
        writer.add_key_value(field.name, field.contents(), val_type, sub_type=sub_type)
    for key, new in replace.items():
        if new is not None:
            writer.add_key_value(key, new[1], new[0])
    for tensor in reader.tensors:
        writer.add_tensor_info(
            tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    os.replace(part, output)


def main():
    model = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL
    folder = os.path.dirname(os.path.abspath(model))
    tools_think = os.path.join(folder, TOOLS_THINK_NAME)
    fim = os.path.join(folder, FIM_NAME)
    other = os.path.join(folder, OTHER_VOCAB_NAME)
    styles = {
        os.path.join(folder, LLAMA3_STYLE_NAME): LLAMA3_STYLE_TEMPLATE,
        os.path.join(folder, GEMMA_STYLE_NAME): GEMMA_STYLE_TEMPLATE,
    }
    inputs = [model, os.path.abspath(__file__)]
    todo = [p for p in (tools_think, fim, other, *styles) if not up_to_date(p, inputs)]
    if todo:
        reader = gguf.GGUFReader(model, "r")
        tokens = reader.get_field(gguf.Keys.Tokenizer.LIST).contents()
        types = reader.get_field(gguf.Keys.Tokenizer.TOKEN_TYPE).contents()
        for key, tid, text in FIM_TOKENS:
            if tid >= len(tokens) or tokens[tid] != text:
                sys.exit(f"make-test-models: token {tid} of {model} is not {text!r}")
            if types[tid] != gguf.TokenType.CONTROL:
                sys.exit(f"make-test-models: token {tid} ({text}) of {model} is not a control token")
        S, U32 = gguf.GGUFValueType.STRING, gguf.GGUFValueType.UINT32
        if tools_think in todo:
            copy_with(reader, tools_think, {gguf.Keys.Tokenizer.CHAT_TEMPLATE: (S, TOOLS_THINK_TEMPLATE)})
        if fim in todo:
            copy_with(reader, fim, {key: (U32, tid) for key, tid, _ in FIM_TOKENS})
        if other in todo:
            tid, was, now = OTHER_VOCAB_TOKEN
            if tokens[tid] != was or types[tid] != gguf.TokenType.CONTROL:
                sys.exit(f"make-test-models: token {tid} of {model} is not the control token {was!r}")
            changed = list(tokens)
            changed[tid] = now
            copy_with(reader, other, {gguf.Keys.Tokenizer.LIST: (gguf.GGUFValueType.ARRAY, changed)})
        for path, template in styles.items():
            if path in todo:
                copy_with(reader, path, {gguf.Keys.Tokenizer.CHAT_TEMPLATE: (S, template)})
    for path in (tools_think, fim, other, *styles):
        print(path)


if __name__ == "__main__":
    main()
