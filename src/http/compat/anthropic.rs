//! Anthropic's routes: `POST /v1/messages` (streamed as the SDK's event
//! types, and not) and `POST /v1/messages/count_tokens`.
//!
//! Content blocks map to superfluid's messages: `text` joins, `tool_use`
//! becomes an assistant call, each `tool_result` its own tool message (before
//! the user's text in the same turn), `thinking` is the model's own and is not
//! put back on the input. A `cache_control` breakpoint pins the prompt up to
//! the end of the message (or the system prompt, or the tools) that carries
//! it, within `--pin-budget-pct`.

use std::time::Instant;

use actix_web::web::{self, Bytes};
use actix_web::{HttpRequest, HttpResponse};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::chat::{Call, Msg, Prompt};
use super::drive::{self, End, Out};
use super::error::{ApiError, Family, Kind};
use super::images::Resolved;
use super::{
    accept, budget, check_lane, check_model, event_stream, logged, markers, new_id, ok_with_warm,
    params, pick, sse, start_all, Access, Prepared,
};
use super::{close_reasoning, forced_grammar, render_prompt};
use crate::http::routes::WebState;
use crate::session::grammar::tool_signature;
use crate::wire::Role;

const F: Family = Family::Anthropic;
/// A breakpoint's time to live when it names none, and the longest one.
pub const PIN_TTL_DEFAULT_MS: u64 = 5 * 60 * 1000;
pub const PIN_TTL_LONG_MS: u64 = 60 * 60 * 1000;

/// The fields of a messages request superfluid reads.
#[derive(Debug, Deserialize)]
pub struct MessagesRequest {
    pub model: String,
    pub max_tokens: u32,
    pub messages: Vec<Value>,
    pub system: Option<Value>,
    #[serde(default)]
    pub stream: bool,
    pub stop_sequences: Option<Vec<String>>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub thinking: Option<Value>,
    /// A breakpoint on the last cacheable block (the last message).
    pub cache_control: Option<Value>,
    /// `format`: `{"type": "json_schema", "schema": ...}`, via grammar.
    pub output_config: Option<Value>,
}

/// A count_tokens request: a messages request without max_tokens.
#[derive(Debug, Deserialize)]
pub struct CountRequest {
    pub model: String,
    pub messages: Vec<Value>,
    pub system: Option<Value>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
}

fn bad(m: impl Into<String>) -> ApiError {
    ApiError::invalid(F, m)
}

/// The longest pin a block's `cache_control` asks for.
fn breakpoint(block: &Value) -> Result<Option<u64>, ApiError> {
    let Some(cc) = block.get("cache_control").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    if cc.get("type").and_then(Value::as_str) != Some("ephemeral") {
        return Err(bad("cache_control.type must be \"ephemeral\""));
    }
    match cc.get("ttl").and_then(Value::as_str) {
        None | Some("5m") => Ok(Some(PIN_TTL_DEFAULT_MS)),
        Some("1h") => Ok(Some(PIN_TTL_LONG_MS)),
        Some(other) => Err(bad(format!(
            "cache_control.ttl {other:?} is not \"5m\" or \"1h\""
        ))),
    }
}

/// An image block's base64 data (`source.type` "base64").
fn image_data(b: &Value) -> Option<&str> {
    let source = b.get("source")?;
    (source.get("type").and_then(Value::as_str) == Some("base64"))
        .then(|| source.get("data").and_then(Value::as_str))
        .flatten()
}

/// The images of a request's messages (`image` blocks with a base64
/// source; a `url` source is refused: the daemon makes no outbound
/// requests), stored and laid out.
async fn resolve_images(state: &WebState, messages: &[Value]) -> Result<Resolved, ApiError> {
    super::chat::check_count(messages.len()).map_err(|e| super::chat_error(F, e))?;
    let mut sources = Vec::new();
    for m in messages {
        for b in m
            .get("content")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if b.get("type").and_then(Value::as_str) != Some("image") {
                continue;
            }
            super::images::next_image(state, F, sources.len())?;
            let source = b.get("source");
            match source.and_then(|s| s.get("type")).and_then(Value::as_str) {
                Some("base64") => {}
                Some("url") => {
                    return Err(bad(
                        "image URLs are not fetched (the daemon makes no outbound requests): \
                         send the image as a base64 source",
                    ))
                }
                other => {
                    return Err(bad(format!(
                        "an image block's source.type must be \"base64\", not {other:?}"
                    )))
                }
            }
            let data = image_data(b).ok_or_else(|| bad("an image source needs a string `data`"))?;
            let mime = source
                .and_then(|s| s.get("media_type"))
                .and_then(Value::as_str)
                .ok_or_else(|| bad("an image source needs a `media_type`"))?;
            let bytes = super::images::decode_base64(F, data)?;
            sources.push((data.to_string(), bytes, mime.to_string()));
        }
    }
    super::images::resolve(state, F, sources).await
}

/// Text blocks' text; documents are refused.
fn block_text(b: &Value) -> Result<String, ApiError> {
    match b.get("type").and_then(Value::as_str) {
        Some("text") => b
            .get("text")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| bad("a text block needs a string `text`")),
        Some("image") => Err(bad("an image block goes in a user message")),
        Some("document") => Err(bad("a `document` block cannot be read; send text")),
        other => Err(bad(format!("unexpected content block type {other:?}"))),
    }
}

/// A conversation as superfluid's messages, and the index of the last
/// message a `cache_control` breakpoint covers (with its ttl).
struct Conversation {
    msgs: Vec<Msg>,
    /// (message index, ttl ms) of the last breakpoint.
    pin: Option<(usize, u64)>,
}

fn conversation(
    system: Option<&Value>,
    raw: &[Value],
    tools: &[Value],
    top: Option<&Value>,
    images: &Resolved,
) -> Result<Conversation, ApiError> {
    let mut msgs = Vec::new();
    let mut pin: Option<(usize, u64)> = None;
    let mark = |at: usize, ttl: Option<u64>, pin: &mut Option<(usize, u64)>| {
        if let Some(ttl) = ttl {
            let ttl = pin.map_or(ttl, |(_, t)| t.max(ttl));
            *pin = Some((at, ttl));
        }
    };
    // Tools render inside the first message's span.
    for t in tools {
        mark(0, breakpoint(t)?, &mut pin);
    }
    match system {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => msgs.push(Msg::new(Role::System, s.clone())),
        Some(Value::Array(blocks)) => {
            let mut texts = Vec::new();
            for b in blocks {
                texts.push(block_text(b)?);
                mark(0, breakpoint(b)?, &mut pin);
            }
            msgs.push(Msg::new(Role::System, texts.join("\n")));
        }
        Some(_) => return Err(bad("system must be a string or a list of text blocks")),
    }
    if raw.is_empty() {
        return Err(bad("messages: at least one message is required"));
    }
    for (i, m) in raw.iter().enumerate() {
        let role = match m.get("role") {
            Some(Value::String(r)) if r == "user" => Role::User,
            Some(Value::String(r)) if r == "assistant" => Role::Assistant,
            Some(other) => {
                return Err(bad(format!(
                    "messages[{i}].role must be \"user\" or \"assistant\", not {other}"
                )))
            }
            None => return Err(bad(format!("messages[{i}] has no role"))),
        };
        // Anthropic's rule: only a final assistant message (a prefill) may
        // be empty, and a prefill may not end in whitespace.
        let last_assistant = i + 1 == raw.len() && role == Role::Assistant;
        let empty = match m.get("content") {
            Some(Value::String(s)) => s.is_empty(),
            Some(Value::Array(blocks)) => blocks.is_empty(),
            _ => false,
        };
        if empty && !last_assistant {
            return Err(bad(format!(
                "messages[{i}]: all messages must have non-empty content except for the \
                 optional final assistant message"
            )));
        }
        if last_assistant && prefill_text(m).is_some_and(|t| t.ends_with(char::is_whitespace)) {
            return Err(bad(
                "final assistant content cannot end with trailing whitespace",
            ));
        }
        match m.get("content") {
            Some(Value::String(s)) => msgs.push(Msg::new(role, s.clone())),
            Some(Value::Array(blocks)) => {
                let mut text: Vec<String> = Vec::new();
                let mut placed = Vec::new();
                let mut calls = Vec::new();
                let mut ttl = None;
                for b in blocks {
                    if let Some(t) = breakpoint(b)? {
                        ttl = Some(ttl.map_or(t, |x: u64| x.max(t)));
                    }
                    match b.get("type").and_then(Value::as_str) {
                        Some("tool_use") if role == Role::Assistant => calls.push(Call {
                            id: str_field(b, "id")?,
                            name: str_field(b, "name")?,
                            arguments: b.get("input").cloned().unwrap_or(json!({})).to_string(),
                        }),
                        Some("tool_result") if role == Role::User => {
                            let mut r = Msg::new(Role::Tool, result_text(b)?);
                            r.answers = Some(str_field(b, "tool_use_id")?);
                            msgs.push(r);
                        }
                        Some("thinking" | "redacted_thinking") if role == Role::Assistant => {}
                        Some("image") if role == Role::User => {
                            let image = image_data(b)
                                .and_then(|d| images.get(d))
                                .ok_or_else(|| bad("this route cannot read that image block"))?;
                            // Where the next text starts once the texts are joined.
                            let at = text.iter().map(|t| t.len() + 1).sum::<usize>();
                            placed.push((at, image.clone()));
                        }
                        _ => text.push(block_text(b)?),
                    }
                }
                if !text.is_empty() || !calls.is_empty() || !placed.is_empty() {
                    let mut msg = Msg::new(role, text.join("\n"));
                    msg.calls = calls;
                    msg.images = placed;
                    msgs.push(msg);
                }
                if msgs.is_empty() {
                    return Err(bad(format!("messages[{i}] has no content")));
                }
                mark(msgs.len() - 1, ttl, &mut pin);
            }
            _ => {
                return Err(bad(format!(
                    "messages[{i}].content must be a string or a list of blocks"
                )))
            }
        }
    }
    // A top-level breakpoint marks the last block.
    if let Some(top) = top {
        let ttl = breakpoint(&json!({"cache_control": top}))?;
        mark(msgs.len().saturating_sub(1), ttl, &mut pin);
    }
    Ok(Conversation { msgs, pin })
}

/// The text a final assistant message ends with (what the reply would
/// continue): its string, or its last block when that is text.
fn prefill_text(m: &Value) -> Option<&str> {
    match m.get("content")? {
        Value::String(s) => Some(s),
        Value::Array(blocks) => {
            let last = blocks.last()?;
            (last.get("type").and_then(Value::as_str) == Some("text"))
                .then(|| last.get("text")?.as_str())?
        }
        _ => None,
    }
}

fn str_field(b: &Value, name: &str) -> Result<String, ApiError> {
    b.get(name)
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| bad(format!("a {} block needs a string `{name}`", b["type"])))
}

/// A tool_result's content: a string or text blocks.
fn result_text(b: &Value) -> Result<String, ApiError> {
    match b.get("content") {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(blocks)) => Ok(blocks
            .iter()
            .map(block_text)
            .collect::<Result<Vec<_>, _>>()?
            .join("\n")),
        Some(_) => Err(bad("tool_result content must be a string or text blocks")),
    }
}

/// What a request renders to: its prompt, tools, and the forced tools.
struct Rendered {
    prompt: Prompt,
    /// The images on `prompt`.
    media: Vec<crate::wire::worker::MediaSpan>,
    /// The prompt's tokens a breakpoint pins, and for how long.
    pin: Option<(usize, u64)>,
    forced: Option<Vec<(String, Value)>>,
    none: bool,
    /// Tools were declared on the prompt.
    tools: bool,
    /// The reply continues a final assistant message: its leading
    /// whitespace is part of the text (" a giant" after "painted by").
    prefill: bool,
}

async fn render(
    state: &WebState,
    system: Option<&Value>,
    messages: &[Value],
    tools: Option<&Vec<Value>>,
    tool_choice: Option<&Value>,
    cache_control: Option<&Value>,
    images: &Resolved,
) -> Result<Rendered, ApiError> {
    let raw_tools = tools.cloned().unwrap_or_default();
    let conv = conversation(system, messages, &raw_tools, cache_control, images)?;
    let kind = tool_choice
        .and_then(|c| c.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("auto");
    let none = kind == "none";
    let tools: Vec<String> = if none {
        Vec::new()
    } else {
        raw_tools
            .iter()
            .map(|t| {
                // cache_control is ours, not the template's.
                let mut t = t.clone();
                if let Some(o) = t.as_object_mut() {
                    o.remove("cache_control");
                }
                t.to_string()
            })
            .collect()
    };
    let sigs: Vec<(String, Value)> = tools
        .iter()
        .map(|t| tool_signature(t).ok_or_else(|| bad("each tool needs a name")))
        .collect::<Result<_, _>>()?;
    let forced = match kind {
        "auto" | "none" => None,
        "any" => Some(sigs.clone()),
        "tool" => {
            let name = tool_choice
                .and_then(|c| c.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| bad("tool_choice of type tool needs a name"))?;
            let one: Vec<_> = sigs.iter().filter(|(n, _)| n == name).cloned().collect();
            if one.is_empty() {
                return Err(bad(format!(
                    "tool_choice names {name:?}, which is not among the tools"
                )));
            }
            Some(one)
        }
        other => {
            return Err(bad(format!(
                "tool_choice.type {other:?} is not auto, any, tool or none"
            )))
        }
    };
    let (prompt, media) = render_prompt(state, F, &conv.msgs, &tools).await?;
    let pin = conv
        .pin
        .and_then(|(at, ttl)| prompt.ends.get(at).map(|&end| (end, ttl)));
    Ok(Rendered {
        prompt,
        media,
        pin,
        forced,
        none,
        tools: !tools.is_empty(),
        prefill: super::chat::ends_with_prefill(&conv.msgs),
    })
}

/// `POST /v1/messages/count_tokens`.
pub async fn count_tokens(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<WebState>,
) -> Result<HttpResponse, ApiError> {
    let r: CountRequest = accept(&state, F, &req, payload).await?;
    let state = pick(&state, F, &r.model)?;
    let images = resolve_images(&state, &r.messages).await?;
    let rendered = render(
        &state,
        r.system.as_ref(),
        &r.messages,
        r.tools.as_ref(),
        r.tool_choice.as_ref(),
        None,
        &images,
    )
    .await?;
    // The assistant header is what a reply would start after; it counts.
    Ok(HttpResponse::Ok().json(json!({"input_tokens": rendered.prompt.tokens.len()})))
}

fn stop_reason(end: &End, calls: bool) -> (&'static str, Value) {
    match end {
        _ if calls => ("tool_use", Value::Null),
        End::MaxTokens => ("max_tokens", Value::Null),
        End::Stop(s) => ("stop_sequence", Value::String(s.clone())),
        End::Turn | End::Cancelled => ("end_turn", Value::Null),
    }
}

/// Anthropic's usage: `input_tokens` excludes what was read from the cache
/// and what a breakpoint wrote.
fn usage(prompt: usize, warm: u64, created: u64, output: u64) -> Value {
    json!({
        "input_tokens": (prompt as u64).saturating_sub(warm + created),
        "output_tokens": output,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": warm,
    })
}

/// A tool_use block's input: the call's arguments as a JSON object.
fn input_of(arguments: &str) -> Value {
    serde_json::from_str(arguments).unwrap_or_else(|_| json!({}))
}

/// `POST /v1/messages`.
pub async fn messages(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<WebState>,
) -> Result<HttpResponse, ApiError> {
    let mut access = Access::new("/v1/messages", "", Instant::now());
    let r: MessagesRequest = accept(&state, F, &req, payload)
        .await
        .map_err(|e| logged(&access, e))?;
    access.set_model(&r.model);
    let state = pick(&state, F, &r.model).map_err(|e| logged(&access, e))?;
    let run = async {
        check_lane(&state, F)?;
        check_model(&state, F, &r.model)?;
        let images = resolve_images(&state, &r.messages).await?;
        let rendered = render(
            &state,
            r.system.as_ref(),
            &r.messages,
            r.tools.as_ref(),
            r.tool_choice.as_ref(),
            r.cache_control.as_ref(),
            &images,
        )
        .await?;
        let (markers, in_reasoning) = markers(&state, rendered.prompt.header());
        let mut markers = markers.with_tools(rendered.tools);
        if rendered.none {
            markers.tool_call = None;
        }
        if rendered.forced.is_some() {
            markers = markers.forcing_a_call();
        }
        let close = close_reasoning(&markers, in_reasoning);
        let grammar = match &rendered.forced {
            Some(tools) => Some(forced_grammar(F, tools, close.as_deref())?),
            None => match r
                .output_config
                .as_ref()
                .and_then(|c| c.get("format"))
                .filter(|f| !f.is_null())
            {
                Some(format) => {
                    if format.get("type").and_then(Value::as_str) != Some("json_schema") {
                        return Err(bad("output_config.format.type must be \"json_schema\""));
                    }
                    let schema = format
                        .get("schema")
                        .ok_or_else(|| bad("output_config.format needs a schema"))?;
                    Some(super::json_grammar(F, schema, close.as_deref())?)
                }
                None => None,
            },
        };
        let prompt = rendered.prompt.tokens;
        let max_tokens = budget(
            &state,
            F,
            prompt.len(),
            Some(r.max_tokens),
            "max_tokens",
            "messages",
        )?;
        let params = params(r.temperature, r.top_p, r.top_k, None, None, F)?;
        let p = Prepared {
            media: rendered.media,
            prompt,
            max_tokens,
            grammar,
            markers,
            in_reasoning,
            pin: rendered.pin,
            extras: None,
        };
        let stop = r.stop_sequences.clone().unwrap_or_default();
        let trim_leading = !rendered.prefill;
        let (warm, mut runs) = start_all(&state, F, &p, 1, params, &stop, trim_leading).await?;
        let out = runs
            .pop()
            .ok_or_else(|| ApiError::new(F, Kind::Internal, "no run"))?;
        let created = rendered
            .pin
            .map_or(0, |(len, _)| (len as u64).saturating_sub(warm));
        Ok::<_, ApiError>((p.prompt.len(), warm, created, out))
    };
    let (prompt, warm, created, out) = run.await.map_err(|e| logged(&access, e))?;
    access.prompt = prompt;
    access.cached = warm;
    let id = new_id("msg_");
    let model = state.m().model.id.clone();
    if r.stream {
        let (tx, rx) = mpsc::channel(64);
        let head = json!({
            "id": id, "type": "message", "role": "assistant", "content": [], "model": model,
            "stop_reason": null, "stop_sequence": null,
            "usage": usage(prompt, warm, created, 0),
        });
        actix_rt::spawn(stream_message(
            out,
            tx,
            head,
            (prompt, warm, created),
            access,
        ));
        return Ok(event_stream(warm, rx));
    }
    let c = drive::collect(out)
        .await
        .map_err(|f| logged(&access, f.api(F)))?;
    let mut content = Vec::new();
    if !c.reasoning.is_empty() {
        content.push(json!({"type": "thinking", "thinking": c.reasoning, "signature": ""}));
    }
    if !c.text.is_empty() {
        content.push(json!({"type": "text", "text": c.text}));
    }
    for (name, arguments) in &c.calls {
        content.push(json!({"type": "tool_use", "id": new_id("toolu_"), "name": name, "input": input_of(arguments)}));
    }
    let (reason, sequence) = stop_reason(c.end.as_ref().unwrap_or(&End::Turn), !c.calls.is_empty());
    access.generated = u64::from(c.generated);
    access.log(200);
    Ok(ok_with_warm(warm).json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(prompt, warm, created, u64::from(c.generated)),
    })))
}

/// The open content block of a streamed message.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Open {
    None,
    Thinking,
    Text,
}

/// Streams one message as Anthropic's events. A failed send (the client went
/// away) ends it, which drops the run: its generation is cancelled.
async fn stream_message(
    mut out: mpsc::Receiver<Out>,
    tx: mpsc::Sender<Bytes>,
    head: Value,
    (prompt, warm, created): (usize, u64, u64),
    mut access: Access,
) {
    let mut events = vec![
        sse(
            Some("message_start"),
            &json!({"type": "message_start", "message": head}),
        ),
        sse(Some("ping"), &json!({"type": "ping"})),
    ];
    let mut index = 0usize;
    let mut open = Open::None;
    let mut calls = false;
    let close = |index: &mut usize, open: &mut Open, events: &mut Vec<Bytes>| {
        if *open == Open::Thinking {
            events.push(sse(
                Some("content_block_delta"),
                &json!({"type": "content_block_delta", "index": *index,
                        "delta": {"type": "signature_delta", "signature": ""}}),
            ));
        }
        if *open != Open::None {
            events.push(sse(
                Some("content_block_stop"),
                &json!({"type": "content_block_stop", "index": *index}),
            ));
            *index += 1;
            *open = Open::None;
        }
    };
    while let Some(o) = out.recv().await {
        match o {
            Out::Text { reasoning, text } => {
                let want = if reasoning {
                    Open::Thinking
                } else {
                    Open::Text
                };
                if open != want {
                    close(&mut index, &mut open, &mut events);
                    let block = if reasoning {
                        json!({"type": "thinking", "thinking": "", "signature": ""})
                    } else {
                        json!({"type": "text", "text": ""})
                    };
                    events.push(sse(
                        Some("content_block_start"),
                        &json!({"type": "content_block_start", "index": index, "content_block": block}),
                    ));
                    open = want;
                }
                let delta = if reasoning {
                    json!({"type": "thinking_delta", "thinking": text})
                } else {
                    json!({"type": "text_delta", "text": text})
                };
                events.push(sse(
                    Some("content_block_delta"),
                    &json!({"type": "content_block_delta", "index": index, "delta": delta}),
                ));
            }
            Out::Logprob(_) => continue,
            Out::Call { name, arguments } => {
                close(&mut index, &mut open, &mut events);
                calls = true;
                let block =
                    json!({"type": "tool_use", "id": new_id("toolu_"), "name": name, "input": {}});
                events.push(sse(
                    Some("content_block_start"),
                    &json!({"type": "content_block_start", "index": index, "content_block": block}),
                ));
                events.push(sse(
                    Some("content_block_delta"),
                    &json!({"type": "content_block_delta", "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": input_of(&arguments).to_string()}}),
                ));
                events.push(sse(
                    Some("content_block_stop"),
                    &json!({"type": "content_block_stop", "index": index}),
                ));
                index += 1;
            }
            Out::Ended { end, generated, .. } => {
                close(&mut index, &mut open, &mut events);
                let (reason, sequence) = stop_reason(&end, calls);
                let mut u = usage(prompt, warm, created, u64::from(generated));
                u["output_tokens"] = json!(generated);
                events.push(sse(
                    Some("message_delta"),
                    &json!({"type": "message_delta",
                            "delta": {"stop_reason": reason, "stop_sequence": sequence},
                            "usage": u}),
                ));
                events.push(sse(Some("message_stop"), &json!({"type": "message_stop"})));
                access.generated = u64::from(generated);
            }
            Out::Failed(message) | Out::Refused(message) => {
                let e = ApiError::new(F, Kind::Unavailable, message);
                events.push(sse(Some("error"), &e.body()));
                for b in events.drain(..) {
                    let _ = tx.send(b).await;
                }
                access.log(503);
                return;
            }
        }
        for b in events.drain(..) {
            if tx.send(b).await.is_err() {
                access.log(499);
                return;
            }
        }
    }
    access.log(200);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_map_to_messages_and_the_last_breakpoint_wins() {
        let msgs = vec![
            json!({"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}),
            json!({"role": "assistant", "content": [
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}]}),
            json!({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "42"},
                {"type": "text", "text": "thanks", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}),
        ];
        let c = conversation(
            Some(&json!("be brief")),
            &msgs,
            &[],
            None,
            &Default::default(),
        )
        .unwrap();
        let roles: Vec<Role> = c.msgs.iter().map(|m| m.role).collect();
        assert_eq!(
            roles,
            [
                Role::System,
                Role::User,
                Role::Assistant,
                Role::Tool,
                Role::User
            ]
        );
        assert_eq!(c.msgs[2].calls[0].arguments, r#"{"x":1}"#);
        assert_eq!(c.msgs[3].answers.as_deref(), Some("t1"));
        assert_eq!(c.pin, Some((4, PIN_TTL_LONG_MS)));
    }

    #[test]
    fn images_and_bad_breakpoints_are_refused() {
        let img = vec![json!({"role": "user", "content": [{"type": "image", "source": {}}]})];
        let e = conversation(None, &img, &[], None, &Default::default())
            .err()
            .unwrap();
        assert!(e.message.contains("cannot read"), "{}", e.message);
        let ttl = vec![json!({"role": "user", "content": [
            {"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2d"}}]})];
        assert!(conversation(None, &ttl, &[], None, &Default::default()).is_err());
    }
}
