//! The test models scripts/make-test-models.py derives from the default model (run by
//! scripts/setup.sh): they load with superfluid's vocabulary, and their rewritten metadata says
//! what it should. The default model is `$SUPERFLUID_TEST_MODEL` or the path
//! scripts/fetch-model.sh writes; the derived ones lie next to it.

use std::path::Path;
use std::sync::Arc;

use superfluid::engine::render::Renderer;
use superfluid::engine::template::{normalize_tool, ChatMessage};
use superfluid::engine::vocab::{FimTokens, Vocab};
use superfluid::session::output::{Markers, OutputDecoder, Segment};
use superfluid::wire::Role;

const TOOLS_THINK: &str = "SmolLM2-135M-tools-think.gguf";
const FIM: &str = "SmolLM2-135M-fim.gguf";
/// The ids make-test-models.py gives the FIM tokens, and the tokens' texts.
const FIM_IDS: [(u32, &str); 3] = [
    (11, "<jupyter_start>"),
    (12, "<jupyter_text>"),
    (13, "<jupyter_code>"),
];

use crate::util::{derived_model as derived, model_path as default_model};

fn load(path: &Path) -> Arc<Vocab> {
    Arc::new(Vocab::load(path).unwrap_or_else(|e| panic!("load {}: {e}", path.display())))
}

fn weather_tool() -> serde_json::Value {
    normalize_tool(
        r#"{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}"#,
    )
    .expect("a valid tool")
}

#[test]
fn derived_models_share_the_default_vocabulary() {
    let base = load(&default_model());
    let text = "Hello <think> world, 日本 <tool_call>{\"a\": 1}</tool_call>";
    for name in [TOOLS_THINK, FIM] {
        let v = load(&derived(name));
        assert_eq!(v.n_vocab(), base.n_vocab(), "{name}");
        assert_eq!(v.bos(), base.bos(), "{name}");
        assert_eq!(v.eos(), base.eos(), "{name}");
        assert_eq!(v.tokenize(text, true), base.tokenize(text, true), "{name}");
    }
}

#[test]
fn tools_think_template_and_generation_prompt() {
    let vocab = load(&derived(TOOLS_THINK));
    let template = vocab.chat_template().expect("a chat template");
    assert!(template.contains("<tool_call>"), "{template}");
    assert!(template.contains("<think>"), "{template}");
    assert_eq!(Markers::from_template(&template), Markers::qwen());

    let renderer = Renderer::new(vocab.clone()).expect("the template compiles");
    let user = ChatMessage::new(Role::User, "Is it raining in Paris?");
    let prompt = renderer
        .generation_prompt_span(std::slice::from_ref(&user), &[])
        .expect("a generation prompt");
    let text = vocab.detokenize(&prompt);
    assert_eq!(text, "<|im_start|>assistant\n<think>\n");
    // With tools too.
    let prompt = renderer
        .generation_prompt_span(&[user], &[weather_tool()])
        .expect("a generation prompt");
    assert!(vocab.detokenize(&prompt).ends_with("<think>\n"));
}

#[test]
fn tools_think_declares_tools_and_renders_results() {
    let vocab = load(&derived(TOOLS_THINK));
    let renderer = Renderer::new(vocab.clone()).expect("the template compiles");
    let tools = [weather_tool()];
    let system = renderer
        .system_span(Some("Answer with the tools."), &tools)
        .expect("a system span");
    let text = vocab.detokenize(&system);
    assert!(
        text.starts_with("<|im_start|>system\nAnswer with the tools.\n\n# Tools\n"),
        "{text}"
    );
    assert!(
        text.contains("<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\""),
        "{text}"
    );
    assert!(text.contains("\n</tools>\n"), "{text}");
    assert!(
        text.ends_with(
            "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
        ),
        "{text}"
    );

    let history = [
        ChatMessage::new(Role::System, "Answer with the tools."),
        ChatMessage::new(Role::User, "Is it raining in Paris?"),
    ];
    let result = ChatMessage::new(Role::Tool, "{\"rain\": true}");
    let span = renderer
        .message_span(&history, &tools, &result, false)
        .expect("a tool result span");
    assert_eq!(
        vocab.detokenize(&span),
        "<|im_start|>user\n<tool_response>\n{\"rain\": true}\n</tool_response><|im_end|>\n"
    );
    // Without tools, the template is SmolLM2's ChatML with its default system prompt.
    let span = renderer
        .message_span(&[], &[], &ChatMessage::new(Role::User, "Hi"), true)
        .expect("a user span");
    assert_eq!(
        vocab.detokenize(&span),
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    );
}

#[test]
fn tools_think_output_decodes_token_by_token() {
    // The model's own tokenization of a reply, fed piece by piece as generation would.
    let vocab = load(&derived(TOOLS_THINK));
    let reply = "The user wants rain.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    let tokens = vocab.tokenize(reply, false);
    let markers = Markers::from_template(&vocab.chat_template().unwrap());
    // The generation prompt opened the thinking block.
    let mut decoder = OutputDecoder::new(markers, true);
    let mut segs = Vec::new();
    for &t in &tokens {
        segs.extend(decoder.push(t, &vocab.piece(t)));
    }
    segs.extend(decoder.finish(true));
    let mut text = String::new();
    let mut attributed = Vec::new();
    let mut calls = Vec::new();
    for s in segs {
        match s {
            Segment::Text {
                text: t, tokens, ..
            } => {
                text.push_str(&t);
                attributed.extend(tokens);
            }
            Segment::ToolCall { name, arguments } => calls.push((name, arguments)),
            Segment::ParseFailure { text, error } => panic!("{text}: {error}"),
        }
    }
    assert_eq!(text, reply);
    assert_eq!(attributed, tokens);
    assert_eq!(
        calls,
        vec![("get_weather".to_owned(), r#"{"city":"Paris"}"#.to_owned())]
    );
}

#[test]
fn fim_model_has_the_chosen_fim_tokens() {
    let vocab = load(&derived(FIM));
    assert_eq!(
        vocab.fim(),
        Some(FimTokens {
            pre: FIM_IDS[0].0,
            suf: FIM_IDS[1].0,
            mid: FIM_IDS[2].0,
        })
    );
    for (id, text) in FIM_IDS {
        assert_eq!(vocab.token_text(id).as_deref(), Some(text));
        assert!(vocab.is_control(id), "{text} is a control token");
        assert!(!vocab.is_eog(id), "{text} does not end generation");
    }
    // Only the FIM ids changed: the chat template is the default model's.
    let base = load(&default_model());
    assert_eq!(vocab.chat_template(), base.chat_template());
}

#[test]
fn default_model_has_no_fim_tokens() {
    assert_eq!(load(&default_model()).fim(), None);
}
