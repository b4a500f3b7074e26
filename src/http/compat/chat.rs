//! The sans-IO half of the compatible routes: a conversation as both APIs
//! send it, turned into the exact prompt tokens the session API would put on
//! the model's input for the same messages, and the stop-sequence matcher.
//! No actix, no model: the daemon hands in a `Render`, the tests a fake.

use serde_json::Value;

use crate::session::output::TOOL_CALL_MARKERS;
use crate::session::{ChatMessage, Render, RenderError, RenderedConversation};
use crate::wire::worker::MediaSpan;
use crate::wire::{Role, Token};

/// The most messages one request may carry (each renders the template once
/// more, so this bounds the work before it starts).
pub const MAX_MESSAGES: usize = 512;
/// The most tools one request may declare.
pub const MAX_TOOLS: usize = 128;
/// The most stop sequences, and the longest one in bytes.
pub const MAX_STOPS: usize = 16;
pub const MAX_STOP_BYTES: usize = 256;

/// A call the assistant made, as a request resends it.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub id: String,
    pub name: String,
    /// The arguments, as JSON text.
    pub arguments: String,
}

/// One message of a request, whichever API it came in.
#[derive(Debug, Clone, PartialEq)]
pub struct Msg {
    pub role: Role,
    pub text: String,
    /// An assistant message's calls.
    pub calls: Vec<Call>,
    /// A tool message: the id of the call it answers.
    pub answers: Option<String>,
    /// Images between its texts: (byte offset into `text`, the image), in
    /// order.
    pub images: Vec<(usize, MsgImage)>,
}

/// An image of a message, stored and laid out by the route
/// (`images::resolve`).
#[derive(Debug, Clone, PartialEq)]
pub struct MsgImage {
    /// Its SHA-256 in the media store.
    pub blob: String,
    /// The projector's layout (`MEDIA_TOKEN` where an embedding goes).
    pub layout: Vec<Token>,
}

impl Msg {
    pub fn new(role: Role, text: impl Into<String>) -> Msg {
        Msg {
            role,
            text: text.into(),
            calls: Vec::new(),
            answers: None,
            images: Vec::new(),
        }
    }
}

/// Why a conversation has no prompt.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ChatError {
    #[error("messages must not be empty")]
    NoMessages,
    #[error("at most {max} messages per request ({got} given)")]
    TooManyMessages { got: usize, max: usize },
    #[error("at most {max} tools per request ({got} given)")]
    TooManyTools { got: usize, max: usize },
    #[error("a tool result answers call {0:?}, which no earlier assistant message made")]
    UnansweredResult(String),
    #[error("the arguments of call {0:?} are not JSON")]
    Arguments(String),
    #[error("at most {MAX_STOPS} stop sequences of at most {MAX_STOP_BYTES} bytes each")]
    Stops,
    #[error("{0}")]
    Render(#[from] RenderError),
}

/// The text a call takes in the model's output: the Hermes form that the
/// output decoder parses and the templates declare.
pub fn call_text(call: &Call) -> Result<String, ChatError> {
    let arguments: Value = if call.arguments.trim().is_empty() {
        Value::Object(Default::default())
    } else {
        serde_json::from_str(&call.arguments).map_err(|_| ChatError::Arguments(call.id.clone()))?
    };
    let body = serde_json::json!({"name": call.name, "arguments": arguments});
    let (open, close) = TOOL_CALL_MARKERS;
    Ok(format!("{open}\n{body}\n{close}"))
}

/// The message cap alone, on a request's messages as sent: the routes
/// check it before any of their images is stored or laid out.
pub fn check_count(n: usize) -> Result<(), ChatError> {
    if n > MAX_MESSAGES {
        return Err(ChatError::TooManyMessages {
            got: n,
            max: MAX_MESSAGES,
        });
    }
    Ok(())
}

/// Checks the shape of a conversation before any rendering: its size, and
/// that each tool result answers a call made before it.
pub fn check(msgs: &[Msg], tools: usize) -> Result<(), ChatError> {
    if msgs.is_empty() {
        return Err(ChatError::NoMessages);
    }
    if msgs.len() > MAX_MESSAGES {
        return Err(ChatError::TooManyMessages {
            got: msgs.len(),
            max: MAX_MESSAGES,
        });
    }
    if tools > MAX_TOOLS {
        return Err(ChatError::TooManyTools {
            got: tools,
            max: MAX_TOOLS,
        });
    }
    let mut made: Vec<&str> = Vec::new();
    for m in msgs {
        made.extend(m.calls.iter().map(|c| c.id.as_str()));
        if let Some(id) = &m.answers {
            if !made.contains(&id.as_str()) {
                return Err(ChatError::UnansweredResult(id.clone()));
            }
        }
    }
    Ok(())
}

/// The messages as the chat template sees them: an assistant message's
/// calls follow its text in the model's own call form.
pub fn template_messages(msgs: &[Msg]) -> Result<Vec<ChatMessage>, ChatError> {
    msgs.iter()
        .map(|m| {
            let mut content = m.text.clone();
            for c in &m.calls {
                if !content.is_empty() {
                    content.push('\n');
                }
                content.push_str(&call_text(c)?);
            }
            Ok(ChatMessage::new(m.role, content))
        })
        .collect()
}

/// A conversation's prompt.
pub type Prompt = RenderedConversation;

/// The prompt of a conversation: the tokens the session API's spans would
/// put on the input for the same messages (content never parsed for control
/// tokens), then the assistant header; rendered in one pass
/// (`Render::conversation`).
pub fn prompt_tokens(
    render: &dyn Render,
    msgs: &[Msg],
    tools: &[String],
) -> Result<Prompt, ChatError> {
    check(msgs, tools.len())?;
    let chat = template_messages(msgs)?;
    Ok(render.conversation(&chat, tools)?)
}

/// Whether a conversation ends with an assistant message a reply should
/// continue (Anthropic's "prefill", Ollama's trailing assistant message):
/// text only, no calls, no images.
pub fn ends_with_prefill(msgs: &[Msg]) -> bool {
    msgs.last().is_some_and(|m| {
        m.role == Role::Assistant && m.calls.is_empty() && m.images.is_empty() && !m.text.is_empty()
    })
}

/// Makes `prompt` (of `msgs`, ending with an assistant message) continue
/// that message: its closing (`Render::turn_tail`, ChatML's
/// `<|im_end|>\n`) and the assistant header after it are cut off, so the
/// reply goes on from its last token. Err when the template does not keep
/// that message's text as given.
pub fn continue_last(
    render: &dyn Render,
    msgs: &[Msg],
    tools: &[String],
    prompt: &mut Prompt,
) -> Result<(), ChatError> {
    let chat = template_messages(msgs)?;
    let tail = render.turn_tail(&chat, tools)?;
    let body = prompt.tokens.len() - prompt.header;
    if tail.is_empty() || !prompt.tokens[..body].ends_with(&tail) {
        return Err(ChatError::Render(RenderError(
            "this model's chat template does not keep a final assistant message as given, so a \
             reply cannot continue it"
                .into(),
        )));
    }
    prompt.tokens.truncate(body - tail.len());
    prompt.header = 0;
    let end = prompt.tokens.len();
    if let Some(last) = prompt.ends.last_mut() {
        *last = (*last).min(end);
    }
    Ok(())
}

/// The prompt of a conversation with images, and the images on it: each
/// message rendered as its span (`Render::image_span` for one with images,
/// its texts split at the images' offsets), then the assistant header.
pub fn prompt_with_images(
    render: &dyn Render,
    msgs: &[Msg],
    tools: &[String],
) -> Result<(Prompt, Vec<MediaSpan>), ChatError> {
    check(msgs, tools.len())?;
    let chat = template_messages(msgs)?;
    let mut tokens = Vec::new();
    let mut ends = Vec::with_capacity(chat.len());
    let mut media = Vec::new();
    for (i, (m, c)) in msgs.iter().zip(&chat).enumerate() {
        let first = i == 0;
        if m.images.is_empty() {
            tokens.extend(render.message_span(&chat[..i], tools, c, first)?);
        } else {
            if !m.calls.is_empty() {
                return Err(ChatError::Render(RenderError(
                    "a message with images cannot also carry tool calls".into(),
                )));
            }
            let mut texts = Vec::new();
            let mut from = 0;
            for (at, _) in &m.images {
                let at = (*at).clamp(from, m.text.len());
                texts.push(m.text.get(from..at).unwrap_or_default().to_string());
                from = at;
            }
            texts.push(m.text.get(from..).unwrap_or_default().to_string());
            let layouts: Vec<Vec<Token>> = m.images.iter().map(|(_, x)| x.layout.clone()).collect();
            let span = render.image_span(&chat[..i], tools, m.role, &texts, &layouts, first)?;
            let at = crate::session::locate_images(&span, &layouts)?;
            for ((_, x), at) in m.images.iter().zip(at) {
                media.push(MediaSpan {
                    at: (tokens.len() + at) as u32,
                    len: x.layout.len() as u32,
                    blob: x.blob.clone(),
                });
            }
            tokens.extend(span);
        }
        ends.push(tokens.len());
    }
    let header = render.generation_prompt_span(&chat, tools)?;
    let n = header.len();
    tokens.extend(header);
    Ok((
        Prompt {
            tokens,
            ends,
            header: n,
        },
        media,
    ))
}

/// Holds back generated text that might be the start of a stop sequence,
/// and finds a stop sequence split across any number of tokens.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

/// What one push gives: text safe to emit, and the stop sequence that ended
/// the output, if one did (the text before it is in `emit`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Matched {
    pub emit: String,
    pub stopped: Option<String>,
}

impl StopMatcher {
    /// Empty strings are ignored.
    pub fn new(stops: Vec<String>) -> Result<StopMatcher, ChatError> {
        let stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
        if stops.len() > MAX_STOPS || stops.iter().any(|s| s.len() > MAX_STOP_BYTES) {
            return Err(ChatError::Stops);
        }
        Ok(StopMatcher {
            stops,
            held: String::new(),
        })
    }

    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// Takes the next piece of output text.
    pub fn push(&mut self, text: &str) -> Matched {
        if self.stops.is_empty() {
            return Matched {
                emit: text.to_owned(),
                stopped: None,
            };
        }
        self.held.push_str(text);
        // The earliest complete match ends the output.
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|(at, s)| (*at, std::cmp::Reverse(s.len())));
        if let Some((at, s)) = first {
            let stopped = Some(s.clone());
            let emit = self.held[..at].to_owned();
            self.held.clear();
            return Matched { emit, stopped };
        }
        // Hold back the longest tail that begins some stop sequence.
        let keep = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.held.len());
        let emit = self.held[..keep].to_owned();
        self.held.drain(..keep);
        Matched {
            emit,
            stopped: None,
        }
    }

    /// The output ended without a match: what was held back is text.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn push_all(m: &mut StopMatcher, pieces: &[&str]) -> (String, Option<String>) {
        let mut out = String::new();
        for p in pieces {
            let r = m.push(p);
            out.push_str(&r.emit);
            if r.stopped.is_some() {
                return (out, r.stopped);
            }
        }
        out.push_str(&m.finish());
        (out, None)
    }

    #[test]
    fn a_stop_split_across_tokens_is_found_and_not_emitted() {
        let mut m = StopMatcher::new(vec!["END".into()]).unwrap();
        let (out, stopped) = push_all(&mut m, &["one E", "N", "D two"]);
        assert_eq!(out, "one ");
        assert_eq!(stopped.as_deref(), Some("END"));
    }

    #[test]
    fn held_text_that_does_not_complete_a_stop_is_emitted() {
        let mut m = StopMatcher::new(vec!["END".into()]).unwrap();
        assert_eq!(m.push("a E").emit, "a ");
        assert_eq!(m.push("Nx").emit, "ENx");
        let (out, stopped) = push_all(&mut m, &["EN"]);
        assert_eq!((out.as_str(), stopped), ("EN", None));
    }

    #[test]
    fn the_earliest_of_several_stops_wins() {
        let mut m = StopMatcher::new(vec!["b c".into(), "a".into()]).unwrap();
        let (out, stopped) = push_all(&mut m, &["xx b ca"]);
        assert_eq!(out, "xx ");
        assert_eq!(stopped.as_deref(), Some("b c"));
    }

    #[test]
    fn multibyte_text_is_held_on_char_boundaries() {
        let mut m = StopMatcher::new(vec!["éé".into()]).unwrap();
        assert_eq!(m.push("aé").emit, "a");
        let r = m.push("é!");
        assert_eq!((r.emit.as_str(), r.stopped.as_deref()), ("", Some("éé")));
    }

    #[test]
    fn without_stops_text_passes_through() {
        let mut m = StopMatcher::new(vec![String::new()]).unwrap();
        assert!(m.is_empty());
        assert_eq!(m.push("abc").emit, "abc");
    }

    #[test]
    fn too_many_or_too_long_stops_are_refused() {
        assert_eq!(
            StopMatcher::new(vec!["x".into(); MAX_STOPS + 1]).unwrap_err(),
            ChatError::Stops
        );
        assert!(StopMatcher::new(vec!["x".repeat(MAX_STOP_BYTES + 1)]).is_err());
    }

    #[test]
    fn a_call_renders_in_the_hermes_form() {
        let c = Call {
            id: "c1".into(),
            name: "get".into(),
            arguments: r#"{"city":"Paris"}"#.into(),
        };
        assert_eq!(
            call_text(&c).unwrap(),
            "<tool_call>\n{\"name\":\"get\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call>"
        );
        let bad = Call {
            arguments: "{".into(),
            ..c
        };
        assert_eq!(
            call_text(&bad).unwrap_err(),
            ChatError::Arguments("c1".into())
        );
    }

    #[test]
    fn a_tool_result_must_answer_an_earlier_call() {
        let mut assistant = Msg::new(Role::Assistant, "");
        assistant.calls.push(Call {
            id: "c1".into(),
            name: "f".into(),
            arguments: "{}".into(),
        });
        let mut result = Msg::new(Role::Tool, "42");
        result.answers = Some("c1".into());
        let ok = [Msg::new(Role::User, "hi"), assistant, result.clone()];
        assert_eq!(check(&ok, 1), Ok(()));
        let mut orphan = result;
        orphan.answers = Some("c9".into());
        assert_eq!(
            check(&[Msg::new(Role::User, "hi"), orphan], 1),
            Err(ChatError::UnansweredResult("c9".into()))
        );
        assert_eq!(check(&[], 0), Err(ChatError::NoMessages));
    }
}
