//! OpenAI's routes: `POST /v1/chat/completions`, `POST /v1/completions`,
//! `GET /v1/models` and `GET /v1/models/{id}`, streamed (server-sent
//! events, ending with `data: [DONE]`) and not.

use std::collections::HashMap;
use std::time::Instant;

use actix_web::web::{self, Bytes};
use actix_web::{HttpRequest, HttpResponse};
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::chat::{Call, Msg, MsgImage, StopMatcher, MAX_STOPS, MAX_STOP_BYTES};
use super::drive::{self, Collected, End, Logprob, Out};
use super::error::{ApiError, Family, Kind};
use super::images::Resolved;
use super::{
    accept, authorize, budget, chat_error, check_lane, check_model, event_stream, json_grammar,
    logged, markers, new_id, now_secs, ok_with_warm, params, pick, start_all, Access, Prepared,
};
use super::{close_reasoning, forced_grammar, render_prompt};
use crate::actors::complete::fim_prompt;
use crate::http::routes::WebState;
use crate::session::grammar::tool_signature;
use crate::session::output::Markers;
use crate::wire::extras::MAX_LOGIT_BIAS;
use crate::wire::{FimMode, Role, SampleExtras, Token};

const F: Family = Family::OpenAi;
/// The most choices one request may ask for (`n`).
pub const MAX_N: u32 = 16;

#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The fields of a chat completion request superfluid reads; others are
/// ignored, as OpenAI-compatible servers do.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<Value>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub min_p: Option<f32>,
    #[serde(default, deserialize_with = "super::any_seed")]
    pub seed: Option<u64>,
    pub stop: Option<Value>,
    pub n: Option<u32>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub response_format: Option<Value>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u8>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub logit_bias: Option<HashMap<String, f32>>,
}

/// A message's content: a string, null, or a list of text and image parts
/// (the text parts joined by newlines, each image at its place between
/// them). Images come resolved (`images::resolve`, by their URI); one not
/// resolved (a route that takes none) is refused.
fn content_text(
    v: Option<&Value>,
    images: &Resolved,
) -> Result<(String, Vec<(usize, MsgImage)>), ApiError> {
    match v {
        None | Some(Value::Null) => Ok((String::new(), vec![])),
        Some(Value::String(s)) => Ok((s.clone(), vec![])),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            let mut placed = Vec::new();
            for p in parts {
                match p.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        let t = p.get("text").and_then(Value::as_str).ok_or_else(|| {
                            ApiError::invalid(F, "a text part needs a string `text`")
                                .with_param("messages")
                        })?;
                        if !text.is_empty() {
                            text.push('\n');
                        }
                        text.push_str(t);
                    }
                    Some("image_url") => {
                        let url = image_url(p).ok_or_else(|| {
                            ApiError::invalid(F, "an image_url part needs `image_url.url`")
                                .with_param("messages")
                        })?;
                        let image = images.get(url).ok_or_else(|| {
                            ApiError::invalid(F, "this route takes no images; send text only")
                                .with_param("messages")
                        })?;
                        // Where the next text starts (after its newline).
                        let at = text.len() + usize::from(!text.is_empty());
                        placed.push((at, image.clone()));
                    }
                    Some(t @ ("input_image" | "input_audio" | "file")) => {
                        return Err(ApiError::invalid(
                            F,
                            format!("a `{t}` part cannot be read here; send text or image_url"),
                        )
                        .with_param("messages"))
                    }
                    other => {
                        return Err(ApiError::invalid(
                            F,
                            format!("unknown content part type {other:?}"),
                        )
                        .with_param("messages"))
                    }
                }
            }
            Ok((text, placed))
        }
        Some(_) => Err(
            ApiError::invalid(F, "content must be a string or a list of parts")
                .with_param("messages"),
        ),
    }
}

/// An image_url part's URL (`{"image_url": {"url": ...}}`, or the string form).
fn image_url(part: &Value) -> Option<&str> {
    let v = part.get("image_url")?;
    v.get("url").and_then(Value::as_str).or_else(|| v.as_str())
}

/// The images of a request's messages, stored and laid out (a data: URI
/// each; an http(s) URL is refused).
pub(crate) async fn resolve_images(
    state: &WebState,
    messages: &[Value],
) -> Result<Resolved, ApiError> {
    super::chat::check_count(messages.len()).map_err(|e| chat_error(F, e))?;
    let mut sources = Vec::new();
    for m in messages {
        for p in m
            .get("content")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if p.get("type").and_then(Value::as_str) != Some("image_url") {
                continue;
            }
            super::images::next_image(state, F, sources.len())
                .map_err(|e| e.with_param("messages"))?;
            let Some(url) = image_url(p) else { continue };
            let (bytes, mime) =
                super::images::data_uri(F, url).map_err(|e| e.with_param("messages"))?;
            sources.push((url.to_string(), bytes, mime));
        }
    }
    super::images::resolve(state, F, sources)
        .await
        .map_err(|e| e.with_param("messages"))
}

/// OpenAI's messages as superfluid's.
fn messages(raw: &[Value], images: &Resolved) -> Result<Vec<Msg>, ApiError> {
    let bad = |m: String| ApiError::invalid(F, m).with_param("messages");
    raw.iter()
        .enumerate()
        .map(|(i, m)| {
            let role = m
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| bad(format!("messages[{i}] has no role")))?;
            let role = match role {
                "system" | "developer" => Role::System,
                "user" => Role::User,
                "assistant" => Role::Assistant,
                "tool" | "function" => Role::Tool,
                other => return Err(bad(format!("messages[{i}] has an unknown role {other:?}"))),
            };
            let (text, placed) = content_text(m.get("content"), images)?;
            let mut msg = Msg::new(role, text);
            msg.images = placed;
            if role == Role::Assistant {
                for c in m
                    .get("tool_calls")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    let f = c.get("function");
                    let name = f.and_then(|f| f.get("name")).and_then(Value::as_str);
                    let Some(name) = name else {
                        return Err(bad(format!("messages[{i}] has a tool call without a name")));
                    };
                    let arguments = match f.and_then(|f| f.get("arguments")) {
                        Some(Value::String(s)) => s.clone(),
                        Some(other) => other.to_string(),
                        None => "{}".into(),
                    };
                    msg.calls.push(Call {
                        id: c
                            .get("id")
                            .and_then(Value::as_str)
                            .unwrap_or_default()
                            .to_owned(),
                        name: name.to_owned(),
                        arguments,
                    });
                }
            }
            if role == Role::Tool {
                let id = m.get("tool_call_id").and_then(Value::as_str);
                let Some(id) = id else {
                    return Err(bad(format!(
                        "messages[{i}] (a tool result) has no tool_call_id"
                    )));
                };
                msg.answers = Some(id.to_owned());
            }
            Ok(msg)
        })
        .collect()
}

/// `stop`: a string or a list of strings.
fn stops(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let bad =
        || ApiError::invalid(F, "stop must be a string or a list of strings").with_param("stop");
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        // Counted before anything is copied (`StopMatcher` checks the rest).
        Some(Value::Array(a)) if a.len() > MAX_STOPS => Err(ApiError::invalid(
            F,
            format!("at most {MAX_STOPS} stop sequences of at most {MAX_STOP_BYTES} bytes each"),
        )
        .with_param("stop")),
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| s.as_str().map(str::to_owned).ok_or_else(bad))
            .collect(),
        Some(_) => Err(bad()),
    }
}

pub(crate) async fn prepare_chat(
    state: &WebState,
    r: &ChatRequest,
    images: &Resolved,
) -> Result<Prepared, ApiError> {
    check_model(state, F, &r.model)?;
    let msgs = messages(&r.messages, images)?;
    let raw_tools = r.tools.clone().unwrap_or_default();
    let choice = r.tool_choice.clone().unwrap_or(Value::Null);
    // "none": the model is not told of the tools (and no call is parsed).
    let none = choice.as_str() == Some("none");
    let tools: Vec<String> = if none {
        Vec::new()
    } else {
        raw_tools.iter().map(Value::to_string).collect()
    };
    let sigs: Vec<(String, Value)> = tools
        .iter()
        .map(|t| {
            tool_signature(t).ok_or_else(|| {
                ApiError::invalid(F, "each tool needs a function with a name").with_param("tools")
            })
        })
        .collect::<Result<_, _>>()?;
    let (prompt, media) = render_prompt(state, F, &msgs, &tools).await?;
    let (markers, in_reasoning) = markers(state, prompt.header());
    let mut markers = markers.with_tools(!tools.is_empty());
    let prompt = prompt.tokens;
    if none {
        markers.tool_call = None;
    }
    let close = close_reasoning(&markers, in_reasoning);
    let forced: Option<Vec<(String, Value)>> = match &choice {
        Value::Null => None,
        Value::String(s) if s == "auto" || s == "none" => None,
        Value::String(s) if s == "required" => Some(sigs.clone()),
        Value::Object(o) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ApiError::invalid(F, "tool_choice names no function").with_param("tool_choice")
                })?;
            let one: Vec<_> = sigs.iter().filter(|(n, _)| n == name).cloned().collect();
            if one.is_empty() {
                return Err(ApiError::invalid(
                    F,
                    format!("tool_choice names {name:?}, which is not among the tools"),
                )
                .with_param("tool_choice"));
            }
            Some(one)
        }
        other => {
            return Err(ApiError::invalid(
                F,
                format!("tool_choice {other} is not auto, none, required or a function"),
            )
            .with_param("tool_choice"))
        }
    };
    let grammar = match (forced, &r.response_format) {
        (Some(tools), _) => {
            markers = markers.forcing_a_call();
            Some(forced_grammar(F, &tools, close.as_deref())?)
        }
        (None, Some(format)) => response_grammar(format, close.as_deref())?,
        (None, None) => None,
    };
    let asked = r.max_completion_tokens.or(r.max_tokens);
    let param = if r.max_completion_tokens.is_some() {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    let max_tokens = budget(state, F, prompt.len(), asked, param, "messages")?;
    Ok(Prepared {
        media,
        prompt,
        max_tokens,
        grammar,
        markers,
        in_reasoning,
        pin: None,
        extras: None,
    })
}

/// `response_format`: text (none), `json_object`, or `json_schema`.
fn response_grammar(format: &Value, close: Option<&str>) -> Result<Option<String>, ApiError> {
    let bad = |m: &str| ApiError::invalid(F, m.to_owned()).with_param("response_format");
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => json_grammar(F, &json!({"type": "object"}), close).map(Some),
        Some("json_schema") => {
            let schema = format
                .get("json_schema")
                .and_then(|s| s.get("schema"))
                .ok_or_else(|| bad("json_schema needs a `schema`"))?;
            json_grammar(F, schema, close).map(Some)
        }
        _ => Err(bad(
            "response_format.type must be text, json_object or json_schema",
        )),
    }
}

/// `n`, checked.
fn choices(n: Option<u32>) -> Result<u32, ApiError> {
    match n.unwrap_or(1) {
        0 => Err(ApiError::invalid(F, "n must be at least 1").with_param("n")),
        n if n > MAX_N => {
            Err(ApiError::invalid(F, format!("n must be at most {MAX_N}")).with_param("n"))
        }
        n => Ok(n),
    }
}

/// Penalties, logit bias and log-probabilities as the worker takes them;
/// `None` when the request asks for none.
fn extras(
    presence: Option<f32>,
    frequency: Option<f32>,
    bias: Option<&HashMap<String, f32>>,
    logprobs: Option<u8>,
    logprobs_field: &'static str,
    n_vocab: u32,
) -> Result<Option<SampleExtras>, ApiError> {
    let bias = bias
        .map(|b| b.iter().collect::<Vec<_>>())
        .unwrap_or_default();
    if bias.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::invalid(
            F,
            format!("logit_bias has more than {MAX_LOGIT_BIAS} entries"),
        )
        .with_param("logit_bias"));
    }
    let logit_bias = bias
        .into_iter()
        .map(|(k, v)| {
            k.trim().parse::<Token>().map(|t| (t, *v)).map_err(|_| {
                ApiError::invalid(F, format!("logit_bias key {k:?} is not a token id"))
                    .with_param("logit_bias")
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let e = SampleExtras {
        presence_penalty: presence.unwrap_or(0.0),
        frequency_penalty: frequency.unwrap_or(0.0),
        logit_bias,
        logprobs,
    };
    // Checked here too (the scheduler checks at admission), so a refusal
    // names its field.
    e.check(n_vocab).map_err(|why| {
        let field = match why {
            crate::wire::ExtrasError::TopLogprobs(_) => logprobs_field,
            _ => why.field(),
        };
        let message = match (&why, logprobs_field) {
            (crate::wire::ExtrasError::TopLogprobs(n), "logprobs") => format!(
                "logprobs {n} is out of range (0 to {})",
                crate::wire::extras::MAX_TOP_LOGPROBS
            ),
            _ => why.to_string(),
        };
        ApiError::invalid(F, message).with_param(field)
    })?;
    Ok((e != SampleExtras::default()).then_some(e))
}

/// Chat's `logprobs` and `top_logprobs`: `Some(n)` when asked.
fn chat_logprobs(r: &ChatRequest) -> Result<Option<u8>, ApiError> {
    match (r.logprobs.unwrap_or(false), r.top_logprobs) {
        (true, n) => Ok(Some(n.unwrap_or(0))),
        (false, Some(n)) if n > 0 => {
            Err(ApiError::invalid(F, "top_logprobs needs logprobs: true")
                .with_param("top_logprobs"))
        }
        (false, _) => Ok(None),
    }
}

/// One token's entry of chat's `logprobs.content`.
fn logprob_json(lp: &Logprob) -> Value {
    json!({
        "token": lp.token,
        "logprob": lp.logprob,
        "bytes": lp.bytes,
        "top_logprobs": lp.top.iter().map(|(t, b, l)| json!({"token": t, "logprob": l, "bytes": b})).collect::<Vec<_>>(),
    })
}

/// The legacy completion's `logprobs` object.
fn completion_logprobs(lps: &[Logprob]) -> Value {
    completion_logprobs_at(lps, &mut TextOffsets::default())
}

/// Where each token's text starts in a choice's text, in characters, as
/// OpenAI's `text_offset` counts: the tokens' bytes so far, and the
/// characters of their complete part. A token that begins inside a
/// character another token started (a split emoji) starts at that
/// character.
#[derive(Debug, Default)]
struct TextOffsets {
    bytes: Vec<u8>,
    /// Bytes counted (a character boundary), and the characters in them.
    counted: usize,
    chars: usize,
}

impl TextOffsets {
    /// The offset of a token with `bytes`, which then follows the text:
    /// the index of the first character (or U+FFFD) holding one of its
    /// bytes, or of the character still incomplete after it.
    fn next(&mut self, bytes: &[u8]) -> usize {
        let old = self.bytes.len();
        self.bytes.extend_from_slice(bytes);
        let mut at = None;
        // One character (or invalid sequence) ending at byte `end` is counted.
        let mut unit = |end: usize, chars: &mut usize, counted: &mut usize| {
            if at.is_none() && end > old {
                at = Some(*chars);
            }
            *chars += 1;
            *counted = end;
        };
        loop {
            let rest = &self.bytes[self.counted..];
            let (valid, bad) = match std::str::from_utf8(rest) {
                Ok(s) => (s, None),
                Err(e) => (
                    // Valid by construction: the part before the error.
                    std::str::from_utf8(&rest[..e.valid_up_to()]).unwrap_or_default(),
                    Some(e.error_len()),
                ),
            };
            let mut end = self.counted;
            for c in valid.chars() {
                end += c.len_utf8();
                unit(end, &mut self.chars, &mut self.counted);
            }
            match bad {
                // A sequence that starts no character: one U+FFFD.
                Some(Some(n)) => unit(self.counted + n, &mut self.chars, &mut self.counted),
                // A character not complete yet, or the end.
                Some(None) | None => break,
            }
        }
        at.unwrap_or(self.chars)
    }
}

/// The same for tokens that follow the text `offsets_so_far` has seen (a
/// streamed chunk's), which then follows them too.
fn completion_logprobs_at(lps: &[Logprob], offsets_so_far: &mut TextOffsets) -> Value {
    let offsets: Vec<usize> = lps
        .iter()
        .map(|lp| offsets_so_far.next(&lp.bytes))
        .collect();
    json!({
        "tokens": lps.iter().map(|l| l.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
        "top_logprobs": lps.iter().map(|l| {
            l.top.iter().map(|(t, _, p)| (t.clone(), json!(p))).collect::<serde_json::Map<_, _>>()
        }).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

fn finish_reason(c: &Collected) -> &'static str {
    if !c.calls.is_empty() {
        return "tool_calls";
    }
    match c.end {
        Some(End::MaxTokens) => "length",
        _ => "stop",
    }
}

/// `reasoning` is of `generated`: the tokens of reasoning (its markup
/// included), which OpenAI's `completion_tokens_details` names.
fn usage(prompt: usize, warm: u64, generated: u64, reasoning: u64) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt as u64 + generated,
        "prompt_tokens_details": {"cached_tokens": warm},
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    })
}

fn tool_call_json(index: usize, name: &str, arguments: &str) -> Value {
    json!({
        "index": index,
        "id": new_id("call_"),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    })
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<WebState>,
) -> Result<HttpResponse, ApiError> {
    let mut access = Access::new("/v1/chat/completions", "", Instant::now());
    let r: ChatRequest = accept(&state, F, &req, payload)
        .await
        .map_err(|e| logged(&access, e))?;
    access.set_model(&r.model);
    let state = pick(&state, F, &r.model).map_err(|e| logged(&access, e))?;
    let run = async {
        check_lane(&state, F)?;
        let n = choices(r.n)?;
        check_model(&state, F, &r.model)?;
        // Every cap and setting is checked before the images, the render
        // and the grammar: a request over one does no work.
        let extras = extras(
            r.presence_penalty,
            r.frequency_penalty,
            r.logit_bias.as_ref(),
            chat_logprobs(&r)?,
            "top_logprobs",
            state.m().shared.render.n_vocab(),
        )?;
        let params = params(r.temperature, r.top_p, r.top_k, r.min_p, r.seed, F)?;
        let stop = stops(r.stop.as_ref())?;
        StopMatcher::new(stop.clone()).map_err(|e| super::chat_error(F, e))?;
        let images = resolve_images(&state, &r.messages).await?;
        let mut p = prepare_chat(&state, &r, &images).await?;
        p.extras = extras;
        let (warm, runs) = start_all(&state, F, &p, n, params, &stop, true).await?;
        Ok::<_, ApiError>((p, warm, runs))
    };
    let (p, warm, runs) = run.await.map_err(|e| logged(&access, e))?;
    let include_usage = r.stream_options.as_ref().is_some_and(|o| o.include_usage);
    reply(
        &state,
        Route::Chat,
        r.stream,
        include_usage,
        &p,
        warm,
        runs,
        access,
    )
    .await
}

/// Which of OpenAI's two generating routes a reply is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Chat,
    Completion,
}

impl Route {
    fn id_prefix(self) -> &'static str {
        match self {
            Route::Chat => "chatcmpl-",
            Route::Completion => "cmpl-",
        }
    }

    fn object(self, stream: bool) -> &'static str {
        match (self, stream) {
            (Route::Chat, false) => "chat.completion",
            (Route::Chat, true) => "chat.completion.chunk",
            (Route::Completion, _) => "text_completion",
        }
    }

    /// One choice of a reply that is not streamed.
    fn choice(self, i: usize, c: &Collected, logprobs_asked: bool) -> Value {
        match self {
            Route::Chat => {
                let calls: Vec<Value> = c
                    .calls
                    .iter()
                    .enumerate()
                    .map(|(k, (name, args))| {
                        let mut v = tool_call_json(k, name, args);
                        if let Some(o) = v.as_object_mut() {
                            o.remove("index");
                        }
                        v
                    })
                    .collect();
                let mut message = json!({
                    "role": "assistant",
                    "content": if c.text.is_empty() && !calls.is_empty() { Value::Null } else { Value::String(c.text.clone()) },
                });
                if !c.reasoning.is_empty() {
                    message["reasoning_content"] = Value::String(c.reasoning.clone());
                }
                if !calls.is_empty() {
                    message["tool_calls"] = Value::Array(calls);
                }
                let logprobs = if logprobs_asked {
                    json!({"content": c.logprobs.iter().map(logprob_json).collect::<Vec<_>>(), "refusal": null})
                } else {
                    Value::Null
                };
                json!({
                    "index": i,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason(c),
                })
            }
            Route::Completion => {
                let logprobs = if logprobs_asked {
                    completion_logprobs(&c.logprobs)
                } else {
                    Value::Null
                };
                json!({
                    "index": i,
                    "text": c.text,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason(c),
                })
            }
        }
    }
}

/// The reply of a started request: streamed from a task, or collected.
#[allow(clippy::too_many_arguments)]
async fn reply(
    state: &WebState,
    route: Route,
    stream: bool,
    include_usage: bool,
    p: &Prepared,
    warm: u64,
    runs: Vec<mpsc::Receiver<Out>>,
    mut access: Access,
) -> Result<HttpResponse, ApiError> {
    access.prompt = p.prompt.len();
    access.cached = warm;
    let head = ChunkHead {
        id: new_id(route.id_prefix()),
        created: now_secs(),
        model: state.m().model.id.clone(),
        object: route.object(stream),
        null_usage: include_usage,
    };
    if stream {
        let (tx, rx) = mpsc::channel(64);
        match route {
            Route::Chat => actix_rt::spawn(stream_chat(runs, tx, head, include_usage, access)),
            Route::Completion => {
                actix_rt::spawn(stream_completion(runs, tx, head, include_usage, access))
            }
        };
        return Ok(event_stream(warm, rx));
    }
    let logprobs_asked = p.extras.as_ref().is_some_and(|e| e.logprobs.is_some());
    let mut out = Vec::new();
    let mut generated = 0u64;
    let mut reasoning = 0u64;
    for (i, rx) in runs.into_iter().enumerate() {
        let c = drive::collect(rx)
            .await
            .map_err(|f| logged(&access, f.api(F)))?;
        generated += u64::from(c.generated);
        reasoning += u64::from(c.reasoning_tokens);
        out.push(route.choice(i, &c, logprobs_asked));
    }
    access.generated = generated;
    access.log(200);
    Ok(ok_with_warm(warm).json(json!({
        "id": head.id,
        "object": head.object,
        "created": head.created,
        "model": head.model,
        "choices": out,
        "usage": usage(access.prompt, warm, generated, reasoning),
        "system_fingerprint": "superfluid",
    })))
}

/// What every chunk of one streamed reply repeats.
struct ChunkHead {
    id: String,
    created: u64,
    model: String,
    object: &'static str,
    /// `stream_options.include_usage`: every chunk but the last carries
    /// `"usage": null`, as OpenAI's reference says.
    null_usage: bool,
}

impl ChunkHead {
    fn chunk(&self, choices: Value) -> Value {
        let mut c = json!({
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": "superfluid",
            "choices": choices,
        });
        if self.null_usage {
            c["usage"] = Value::Null;
        }
        c
    }
}

/// Merges the choices' outputs into chat completion chunks. A send that
/// fails (the client went away) ends it, which drops every run: their
/// generations are cancelled.
async fn stream_chat(
    runs: Vec<mpsc::Receiver<Out>>,
    tx: mpsc::Sender<Bytes>,
    head: ChunkHead,
    include_usage: bool,
    mut access: Access,
) {
    let data = |v: &Value| super::sse(None, v);
    let n = runs.len();
    for i in 0..n {
        let first = head.chunk(json!([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]));
        if tx.send(data(&first)).await.is_err() {
            access.log(499);
            return;
        }
    }
    let mut merged =
        futures_util::stream::select_all(runs.into_iter().enumerate().map(|(i, rx)| {
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|o| (o, rx)) },
            )
            .map(move |o| (i, o))
            .boxed()
        }));
    let mut calls = vec![0usize; n];
    let mut generated = 0u64;
    let mut reasoning = 0u64;
    let mut failed = None;
    while let Some((i, o)) = merged.next().await {
        let delta = match o {
            Out::Text {
                reasoning: true,
                text,
            } => json!({"reasoning_content": text}),
            Out::Text { text, .. } => json!({"content": text}),
            Out::Logprob(lp) => {
                let c = head.chunk(json!([{"index": i, "delta": {}, "logprobs": {"content": [logprob_json(&lp)]}, "finish_reason": null}]));
                if tx.send(data(&c)).await.is_err() {
                    access.log(499);
                    return;
                }
                continue;
            }
            Out::Call { name, arguments } => {
                calls[i] += 1;
                json!({"tool_calls": [tool_call_json(calls[i] - 1, &name, &arguments)]})
            }
            Out::Ended {
                end,
                generated: g,
                reasoning: r,
            } => {
                generated += u64::from(g);
                reasoning += u64::from(r);
                let reason = if calls[i] > 0 {
                    "tool_calls"
                } else if end == End::MaxTokens {
                    "length"
                } else {
                    "stop"
                };
                let c = head.chunk(
                    json!([{"index": i, "delta": {}, "logprobs": null, "finish_reason": reason}]),
                );
                if tx.send(data(&c)).await.is_err() {
                    access.log(499);
                    return;
                }
                continue;
            }
            Out::Failed(message) | Out::Refused(message) => {
                failed = Some(message);
                break;
            }
        };
        let c = head
            .chunk(json!([{"index": i, "delta": delta, "logprobs": null, "finish_reason": null}]));
        if tx.send(data(&c)).await.is_err() {
            access.log(499);
            return;
        }
    }
    access.generated = generated;
    if let Some(message) = failed {
        let e = ApiError::new(F, Kind::Unavailable, message);
        let _ = tx.send(data(&e.body())).await;
        access.log(503);
        return;
    }
    if include_usage {
        let mut u = head.chunk(json!([]));
        u["usage"] = usage(access.prompt, access.cached, generated, reasoning);
        let _ = tx.send(data(&u)).await;
    }
    let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
    access.log(200);
}

/// The fields of a (legacy) completion request.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: Value,
    pub suffix: Option<String>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub min_p: Option<f32>,
    #[serde(default, deserialize_with = "super::any_seed")]
    pub seed: Option<u64>,
    pub stop: Option<Value>,
    pub n: Option<u32>,
    #[serde(default)]
    pub echo: bool,
    pub logprobs: Option<u8>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub logit_bias: Option<HashMap<String, f32>>,
}

/// The prompt of a completion: a string, or token ids (one prompt only);
/// with a suffix, the fill-in-the-middle prompt. Text is tokenized
/// [`off_worker`](super::off_worker).
async fn completion_prompt(
    state: &WebState,
    r: &CompletionRequest,
) -> Result<Vec<Token>, ApiError> {
    let render = state.m().shared.render.clone();
    let bad = |m: &str| ApiError::invalid(F, m.to_owned()).with_param("prompt");
    let ids = |a: &[Value]| -> Option<Vec<Token>> {
        a.iter()
            .map(|t| t.as_u64().and_then(|t| Token::try_from(t).ok()))
            .collect()
    };
    // Token ids as given, or the text to tokenize.
    let prompt: Result<Vec<Token>, String> = match &r.prompt {
        Value::String(s) => Err(s.clone()),
        Value::Array(a) if a.len() == 1 && a[0].is_string() => {
            Err(a[0].as_str().unwrap_or_default().to_owned())
        }
        Value::Array(a) if a.len() == 1 && a[0].is_array() => {
            Ok(ids(a[0].as_array().map(Vec::as_slice).unwrap_or_default())
                .ok_or_else(|| bad("a prompt of token ids must be a list of integers"))?)
        }
        Value::Array(a) if a.iter().all(Value::is_number) && !a.is_empty() => {
            Ok(ids(a).ok_or_else(|| bad("a prompt of token ids must be a list of integers"))?)
        }
        Value::Array(_) => {
            return Err(bad(
                "one prompt per request: a string or a list of token ids",
            ))
        }
        _ => return Err(bad("prompt must be a string or a list of token ids")),
    };
    // The prompt's own errors before the suffix's.
    let n_vocab = render.n_vocab();
    if let Ok(ids) = &prompt {
        if let Some(t) = ids.iter().find(|&&t| t >= n_vocab) {
            return Err(bad(&format!(
                "token id {t} is not below the vocabulary's size {n_vocab}"
            )));
        }
    }
    if prompt.as_ref().map_or_else(String::is_empty, Vec::is_empty) {
        return Err(bad("the prompt is empty"));
    }
    let fim = match &r.suffix {
        None => None,
        Some(suffix) => Some((
            render.fim().ok_or_else(|| {
                ApiError::invalid(
                    F,
                    "this model has no fill-in-the-middle tokens (its GGUF names no \
                     tokenizer.ggml.fim_pre/suf/mid_token_id), so `suffix` cannot be served",
                )
                .with_param("suffix")
            })?,
            suffix.clone(),
        )),
    };
    let bytes =
        prompt.as_ref().err().map_or(0, String::len) + fim.as_ref().map_or(0, |(_, s)| s.len());
    let (prompt, suffix) = super::off_worker(F, bytes, move || {
        let prompt = prompt.unwrap_or_else(|text| render.tokenize(&text));
        let suffix = fim.map(|(fim, s)| (fim, render.tokenize(&s)));
        (prompt, suffix)
    })
    .await?;
    if prompt.is_empty() {
        return Err(bad("the prompt is empty"));
    }
    Ok(match suffix {
        None => prompt,
        Some((fim, suffix)) => fim_prompt(fim, &prompt, &suffix, FimMode::Psm),
    })
}

/// `POST /v1/completions`.
pub async fn completions(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<WebState>,
) -> Result<HttpResponse, ApiError> {
    let mut access = Access::new("/v1/completions", "", Instant::now());
    let r: CompletionRequest = accept(&state, F, &req, payload)
        .await
        .map_err(|e| logged(&access, e))?;
    access.set_model(&r.model);
    let state = pick(&state, F, &r.model).map_err(|e| logged(&access, e))?;
    let run = async {
        check_lane(&state, F)?;
        check_model(&state, F, &r.model)?;
        if r.echo {
            return Err(
                ApiError::invalid(F, "echo is not served by this daemon").with_param("echo")
            );
        }
        let n = choices(r.n)?;
        let prompt = completion_prompt(&state, &r).await?;
        let max_tokens = budget(
            &state,
            F,
            prompt.len(),
            Some(r.max_tokens.unwrap_or(16)),
            "max_tokens",
            "prompt",
        )?;
        let p = Prepared {
            media: vec![],
            prompt,
            max_tokens,
            grammar: None,
            markers: Markers::none(),
            in_reasoning: false,
            pin: None,
            extras: extras(
                r.presence_penalty,
                r.frequency_penalty,
                r.logit_bias.as_ref(),
                r.logprobs,
                "logprobs",
                state.m().shared.render.n_vocab(),
            )?,
        };
        let params = params(r.temperature, r.top_p, r.top_k, r.min_p, r.seed, F)?;
        let stop = stops(r.stop.as_ref())?;
        let (warm, runs) = start_all(&state, F, &p, n, params, &stop, false).await?;
        Ok((p, warm, runs))
    };
    let (p, warm, runs) = run.await.map_err(|e| logged(&access, e))?;
    let include_usage = r.stream_options.as_ref().is_some_and(|o| o.include_usage);
    reply(
        &state,
        Route::Completion,
        r.stream,
        include_usage,
        &p,
        warm,
        runs,
        access,
    )
    .await
}

async fn stream_completion(
    runs: Vec<mpsc::Receiver<Out>>,
    tx: mpsc::Sender<Bytes>,
    head: ChunkHead,
    include_usage: bool,
    mut access: Access,
) {
    let data = |v: &Value| super::sse(None, v);
    // Each choice's text so far: its next token's text_offset.
    let mut offsets: Vec<TextOffsets> = (0..runs.len()).map(|_| TextOffsets::default()).collect();
    let mut merged =
        futures_util::stream::select_all(runs.into_iter().enumerate().map(|(i, rx)| {
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|o| (o, rx)) },
            )
            .map(move |o| (i, o))
            .boxed()
        }));
    let mut generated = 0u64;
    let mut reasoning = 0u64;
    while let Some((i, o)) = merged.next().await {
        let (text, reason) = match o {
            Out::Text { text, .. } => (text, Value::Null),
            Out::Call { .. } => continue,
            // A token's logprobs in a chunk of their own, before the text
            // they are part of (as the chat route sends them).
            Out::Logprob(lp) => {
                let lps = completion_logprobs_at(std::slice::from_ref(&lp), &mut offsets[i]);
                let c = head.chunk(
                    json!([{"index": i, "text": "", "logprobs": lps, "finish_reason": null}]),
                );
                if tx.send(data(&c)).await.is_err() {
                    access.log(499);
                    return;
                }
                continue;
            }
            Out::Ended {
                end,
                generated: g,
                reasoning: r,
            } => {
                generated += u64::from(g);
                reasoning += u64::from(r);
                let r = if end == End::MaxTokens {
                    "length"
                } else {
                    "stop"
                };
                (String::new(), Value::String(r.into()))
            }
            Out::Failed(message) | Out::Refused(message) => {
                let e = ApiError::new(F, Kind::Unavailable, message);
                let _ = tx.send(data(&e.body())).await;
                access.log(503);
                return;
            }
        };
        let c = head
            .chunk(json!([{"index": i, "text": text, "logprobs": null, "finish_reason": reason}]));
        if tx.send(data(&c)).await.is_err() {
            access.log(499);
            return;
        }
    }
    access.generated = generated;
    if include_usage {
        let mut u = head.chunk(json!([]));
        u["usage"] = usage(access.prompt, access.cached, generated, reasoning);
        let _ = tx.send(data(&u)).await;
    }
    let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
    access.log(200);
}

fn model_json(state: &WebState) -> Value {
    json!({
        "id": state.m().model.id,
        "object": "model",
        "created": state.m().model.created,
        "owned_by": "superfluid",
    })
}

/// `GET /v1/models`.
pub async fn models(
    req: HttpRequest,
    state: web::Data<WebState>,
) -> Result<HttpResponse, ApiError> {
    authorize(&state, F, &req)?;
    let data: Vec<Value> = (0..state.models.len())
        .map(|i| model_json(&state.at(i)))
        .collect();
    Ok(HttpResponse::Ok().json(json!({"object": "list", "data": data})))
}

/// `GET /v1/models/{id}`.
pub async fn model(
    req: HttpRequest,
    path: web::Path<String>,
    state: web::Data<WebState>,
) -> Result<HttpResponse, ApiError> {
    authorize(&state, F, &req)?;
    let state = pick(&state, F, &path)?;
    Ok(HttpResponse::Ok().json(model_json(&state)))
}

#[cfg(test)]
mod tests {
    use super::TextOffsets;

    #[test]
    fn text_offsets_count_characters_and_a_split_one_once() {
        let mut o = TextOffsets::default();
        let smile = "😀".as_bytes();
        // " #", the emoji in three tokens, "\n", "é".
        let tokens: [&[u8]; 6] = [
            b" #",
            &smile[..1],
            &smile[1..3],
            &smile[3..],
            b"\n",
            "é".as_bytes(),
        ];
        let got: Vec<usize> = tokens.iter().map(|t| o.next(t)).collect();
        assert_eq!(got, [0, 2, 2, 2, 3, 4]);
        // A byte that starts no character counts as one (U+FFFD), also
        // when only the next token shows the sequence was cut.
        let mut o = TextOffsets::default();
        assert_eq!([o.next(&[0xff]), o.next(b"a")], [0, 1]);
        let mut o = TextOffsets::default();
        assert_eq!([o.next(&[0xf0]), o.next(b"a"), o.next(b"b")], [0, 1, 2]);
        let mut o = TextOffsets::default();
        assert_eq!([o.next(b"x\xe2\x82"), o.next(b"y")], [0, 2]);
    }
}
