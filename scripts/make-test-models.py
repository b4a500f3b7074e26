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

- SmolLM2-135M-vision.gguf: the default model (same tensors, same chat template) with the text of
  three unused control tokens changed (VISION_TOKENS below) to the tokens llama.cpp's multimodal
  library (mtmd) wraps images with for an `idefics3` (SmolVLM) projector:
  `<fake_token_around_image>`, `<global-img>` and `<row_1_col_1>`. mtmd finds them, and "\n" and
  "\n\n", by their text in the text model's vocabulary, and SmolLM2's vocabulary lacks the first
  three (SmolVLM's text model is SmolLM2 with them added); none of the new texts is one llama.cpp
  gives a role by name (eos/eot/fim...).
- mmproj-SmolLM2-135M-vision.gguf: a vision projector for it: an `idefics3` projector (a SigLIP
  tower, a pixel shuffle and one linear layer, the shape of SmolVLM's; MMPROJ below) with small
  seeded random weights, sized for this text model (its output is the text model's n_embd, 576).
  A tile is MMPROJ_IMAGE_SIZE px (patches of MMPROJ_PATCH_SIZE px, 4x4 of them, shuffled to 2x2:
  4 embeddings a tile) and the longest edge of a preprocessed image is one tile, so mtmd cuts any
  (ordinary) image into a 1x1 grid plus the overview: 14 positions an image, in order
  `<fake_token_around_image><row_1_col_1>` [4 embeddings]
  `\n\n<fake_token_around_image><global-img>` [4 embeddings] `<fake_token_around_image>`.

  The answers the two give about an image are noise: the pair exists to test the mechanics
  (loading a projector, tokenizing, encoding and decoding images, positions, caching).

Needs the `gguf` package (pip install gguf). Idempotent: an output newer than both the input and
this script is left alone.
"""

import os
import sys

import gguf
import numpy as np

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

VISION_NAME = "SmolLM2-135M-vision.gguf"
MMPROJ_NAME = "mmproj-SmolLM2-135M-vision.gguf"
# (token id, its text in the default model, its text in the vision model): StarCoder leftovers
# that chat never uses, the other derivations leave alone and llama.cpp gives no role.
VISION_TOKENS = [
    (8, "<issue_start>", "<fake_token_around_image>"),
    (9, "<issue_comment>", "<global-img>"),
    (10, "<issue_closed>", "<row_1_col_1>"),
]
# The other texts mtmd looks up for idefics3: the first token whose piece they are must exist.
VISION_TEXTS = ["\n", "\n\n"]

# The projector (llama.cpp tools/mtmd/clip.cpp reads these; SmolVLM's converter writes the same
# keys and tensors). A head of 64 (flash attention has kernels for it on every backend; 16 has
# none on CUDA, where clip would warn and fall back).
MMPROJ_IMAGE_SIZE = 32  # a tile, and the longest edge of a preprocessed image
MMPROJ_PATCH_SIZE = 8
MMPROJ_N_EMBD = 128
MMPROJ_N_HEAD = 2
MMPROJ_N_FF = 256
MMPROJ_N_BLOCK = 2
MMPROJ_SCALE_FACTOR = 2  # pixel shuffle: 2x2 patches to one embedding
MMPROJ_SEED = 20240613
MMPROJ_STD = 0.02

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


def gpt2_byte_decoder():
    """GPT-2 byte-level BPE: the character each byte is written as in token texts, reversed."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def first_token_with_piece(tokens, types, piece):
    """The first id whose piece (llama.cpp's token_to_piece with special=true) is `piece`, as
    mtmd's lookup_token finds it; None if none."""
    want = piece.encode()
    decoder = gpt2_byte_decoder()
    for tid, (text, ttype) in enumerate(zip(tokens, types)):
        if ttype in (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED):
            got = text.encode()
        elif ttype == gguf.TokenType.NORMAL and all(c in decoder for c in text):
            got = bytes(decoder[c] for c in text)
        else:
            continue
        if got == want:
            return tid
    return None


def write_mmproj(output, n_embd_text):
    """Write an idefics3 vision projector with seeded random weights whose output is
    `n_embd_text` wide. Shapes are numpy's (row-major), the reverse of ggml's ne."""
    rng = np.random.default_rng(MMPROJ_SEED)
    d, ff = MMPROJ_N_EMBD, MMPROJ_N_FF
    n_patches = (MMPROJ_IMAGE_SIZE // MMPROJ_PATCH_SIZE) ** 2

    def rand(*shape):
        return (rng.standard_normal(shape) * MMPROJ_STD).astype(np.float32)

    def ones(n):
        return np.ones(n, dtype=np.float32)

    def zeros(n):
        return np.zeros(n, dtype=np.float32)

    tensors = [
        # conv2d: ggml ne [kw, kh, in_ch, out_ch]
        ("v.patch_embd.weight", rand(d, 3, MMPROJ_PATCH_SIZE, MMPROJ_PATCH_SIZE)),
        ("v.patch_embd.bias", zeros(d)),
        ("v.position_embd.weight", rand(n_patches, d)),  # ne [n_embd, n_patches]
    ]
    for i in range(MMPROJ_N_BLOCK):
        b = f"v.blk.{i}"
        tensors += [
            (f"{b}.ln1.weight", ones(d)),
            (f"{b}.ln1.bias", zeros(d)),
            (f"{b}.attn_q.weight", rand(d, d)),
            (f"{b}.attn_q.bias", zeros(d)),
            (f"{b}.attn_k.weight", rand(d, d)),
            (f"{b}.attn_k.bias", zeros(d)),
            (f"{b}.attn_v.weight", rand(d, d)),
            (f"{b}.attn_v.bias", zeros(d)),
            (f"{b}.attn_out.weight", rand(d, d)),
            (f"{b}.attn_out.bias", zeros(d)),
            (f"{b}.ln2.weight", ones(d)),
            (f"{b}.ln2.bias", zeros(d)),
            # ffn_up ne [n_embd, n_ff], ffn_down ne [n_ff, n_embd] (a ffn_down whose ne[0] were
            # n_embd would be taken for a legacy swapped pair)
            (f"{b}.ffn_up.weight", rand(ff, d)),
            (f"{b}.ffn_up.bias", zeros(ff)),
            (f"{b}.ffn_down.weight", rand(d, ff)),
            (f"{b}.ffn_down.bias", zeros(d)),
        ]
    tensors += [
        ("v.post_ln.weight", ones(d)),
        ("v.post_ln.bias", zeros(d)),
        # after the pixel shuffle: ne [n_embd * scale^2, n_embd_text], no bias
        ("mm.model.fc.weight", rand(n_embd_text, d * MMPROJ_SCALE_FACTOR**2)),
    ]

    part = output + ".part"
    writer = gguf.GGUFWriter(part, "clip")
    writer.add_name("SmolLM2-135M vision test projector")
    writer.add_description("idefics3 projector with random weights, for tests only")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, gguf.VisionProjectorType.IDEFICS3)
    writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    writer.add_bool(gguf.Keys.ClipVision.USE_GELU, True)
    V = gguf.Keys.ClipVision
    writer.add_uint32(V.IMAGE_SIZE, MMPROJ_IMAGE_SIZE)
    writer.add_uint32(V.PATCH_SIZE, MMPROJ_PATCH_SIZE)
    writer.add_uint32(V.EMBEDDING_LENGTH, d)
    writer.add_uint32(V.FEED_FORWARD_LENGTH, ff)
    writer.add_uint32(V.BLOCK_COUNT, MMPROJ_N_BLOCK)
    writer.add_uint32(V.PROJECTION_DIM, n_embd_text)
    writer.add_uint32(V.Attention.HEAD_COUNT, MMPROJ_N_HEAD)
    writer.add_float32(V.Attention.LAYERNORM_EPS, 1e-6)
    F32 = gguf.GGUFValueType.FLOAT32
    writer.add_key_value(V.IMAGE_MEAN, [0.5, 0.5, 0.5], gguf.GGUFValueType.ARRAY, sub_type=F32)
    writer.add_key_value(V.IMAGE_STD, [0.5, 0.5, 0.5], gguf.GGUFValueType.ARRAY, sub_type=F32)
    writer.add_uint32(V.Projector.SCALE_FACTOR, MMPROJ_SCALE_FACTOR)
    writer.add_uint32(V.PREPROC_IMAGE_SIZE, MMPROJ_IMAGE_SIZE)
    for name, data in tensors:
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
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
    vision = os.path.join(folder, VISION_NAME)
    mmproj = os.path.join(folder, MMPROJ_NAME)
    outputs = (tools_think, fim, other, *styles, vision, mmproj)
    inputs = [model, os.path.abspath(__file__)]
    todo = [p for p in outputs if not up_to_date(p, inputs)]
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
        if vision in todo:
            changed = list(tokens)
            for tid, was, now in VISION_TOKENS:
                if tokens[tid] != was or types[tid] != gguf.TokenType.CONTROL:
                    sys.exit(f"make-test-models: token {tid} of {model} is not the control token {was!r}")
                if now in tokens:
                    sys.exit(f"make-test-models: {model} already has a token {now!r}")
                changed[tid] = now
            for text in VISION_TEXTS:
                if first_token_with_piece(changed, types, text) is None:
                    sys.exit(f"make-test-models: no token of {model} is {text!r}")
            copy_with(reader, vision, {gguf.Keys.Tokenizer.LIST: (gguf.GGUFValueType.ARRAY, changed)})
        if mmproj in todo:
            arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
            n_embd = reader.get_field(gguf.Keys.LLM.EMBEDDING_LENGTH.format(arch=arch)).contents()
            write_mmproj(mmproj, n_embd)
    for path in outputs:
        print(path)


if __name__ == "__main__":
    main()
