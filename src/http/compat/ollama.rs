//! Ollama's routes: `POST /api/chat` and `POST /api/generate` (NDJSON
//! streamed by default, one object with `stream: false`), `GET /api/tags`,
//! `POST /api/show`, `GET /api/ps`, `GET /api/version`, and clear 501s for
//! what is not served yet (pull, delete, embeddings, …). Errors are
//! Ollama's `{"error": "message"}` with the HTTP status.
//!
//! The generations run exactly as the OpenAI routes' do (the same prompt
//! rendering, prefix cache, grammar and tool-call decoding); only the shapes
//! differ. docs/compat.md's "Ollama" section is the user's guide.

use std::time::Instant;

use actix_web::web::{self, Bytes};
use actix_web::{HttpRequest, HttpResponse};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::chat::{Call, Msg};
use super::drive::{self, End, Out};
use super::error::{ApiError, Family, Kind};
use super::gguf::Identity;
use super::images::Resolved;
use super::{
    accept, authorize, check_lane, check_model, json_grammar, logged, markers, ok_with_warm,
    params, pick, start_all, Access, Prepared,
};
use super::{close_reasoning, forced_grammar, off_worker, render_prompt};
use crate::actors::complete::fim_prompt;
use crate::http::routes::WebState;
use crate::session::grammar::tool_signature;
use crate::session::output::Markers;
use crate::wire::{FimMode, Role};

const F: Family = Family::Ollama;

/// Ollama's documented sampling defaults, used where `options` omits them.
pub const DEFAULT_TEMPERATURE: f32 = 0.8;
pub const DEFAULT_TOP_P: f32 = 0.9;
pub const DEFAULT_TOP_K: u32 = 40;

fn bad(m: impl Into<String>) -> ApiError {
    ApiError::invalid(F, m)
}

/// The `options` superfluid reads; others (`num_gpu`, `repeat_penalty`,
/// `mirostat`, …) are accepted and ignored.
#[derive(Debug, Default, Deserialize)]
pub struct Options {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub min_p: Option<f32>,
    pub seed: Option<i64>,
    pub num_predict: Option<i64>,
    pub stop: Option<Value>,
    pub num_ctx: Option<i64>,
    /// superfluid's extension (also at the top level of a chat request):
    /// OpenAI's `tool_choice`, here because the `ollama` client passes
    /// `options` through and has no such parameter.
    pub tool_choice: Option<Value>,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub model: String,
    #[serde(default)]
    pub messages: Vec<Value>,
    pub stream: Option<bool>,
    pub format: Option<Value>,
    pub options: Option<Options>,
    pub tools: Option<Vec<Value>>,
    pub think: Option<Value>,
    pub keep_alive: Option<Value>,
    /// superfluid's extension: OpenAI's `tool_choice` (`auto`, `none`,
    /// `required`, or `{"type": "function", "function": {"name": ...}}`).
    pub tool_choice: Option<Value>,
}

#[derive(Debug, Deserialize)]
pub struct GenerateRequest {
    pub model: String,
    pub prompt: Option<String>,
    pub suffix: Option<String>,
    pub system: Option<String>,
    pub template: Option<String>,
    /// Ollama's token history of an earlier reply: accepted and ignored
    /// (the prefix cache already reuses what a resent prompt shares).
    pub context: Option<Value>,
    #[serde(default)]
    pub raw: bool,
    pub images: Option<Vec<Value>>,
    pub stream: Option<bool>,
    pub format: Option<Value>,
    pub options: Option<Options>,
    pub think: Option<Value>,
    pub keep_alive: Option<Value>,
}

/// A request's `model` without Ollama's default tag `:latest`.
pub fn model_name(name: &str) -> &str {
    name.strip_suffix(":latest").unwrap_or(name)
}

/// The name the routes list the model under (Ollama's `name:tag`).
fn listed_name(state: &WebState) -> String {
    format!("{}:latest", state.m().model.id)
}

/// Ollama's messages as superfluid's. Ollama's calls carry no ids: each gets
/// one, and a tool message answers the earliest unanswered call of its
/// `tool_name` (a 400 when no unanswered call has that name), or, unnamed,
/// the earliest unanswered call. An unnamed tool message with no call to
/// answer is passed on as it is, as Ollama does.
pub fn messages(raw: &[Value], images: &Resolved) -> Result<Vec<Msg>, ApiError> {
    let mut out: Vec<Msg> = Vec::with_capacity(raw.len());
    // (id, name) of calls not yet answered.
    let mut open: Vec<(String, String)> = Vec::new();
    for (i, m) in raw.iter().enumerate() {
        let role = match m.get("role").and_then(Value::as_str) {
            Some("system") => Role::System,
            Some("user") => Role::User,
            Some("assistant") => Role::Assistant,
            Some("tool") => Role::Tool,
            other => {
                return Err(bad(format!(
                    "messages[{i}].role must be system, user, assistant or tool, not {other:?}"
                )))
            }
        };
        let text = match m.get("content") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(_) => return Err(bad(format!("messages[{i}].content must be a string"))),
        };
        let mut msg = Msg::new(role, text);
        // A message's images go before its text, as Ollama places them.
        for data in m
            .get("images")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let image = data
                .as_str()
                .and_then(|d| images.get(d))
                .ok_or_else(no_images)?;
            msg.images.push((0, image.clone()));
        }
        if role == Role::Assistant {
            let calls = m.get("tool_calls").and_then(Value::as_array);
            for (k, c) in calls.into_iter().flatten().enumerate() {
                let f = c.get("function");
                let Some(name) = f.and_then(|f| f.get("name")).and_then(Value::as_str) else {
                    return Err(bad(format!(
                        "messages[{i}].tool_calls[{k}] has no function.name"
                    )));
                };
                let arguments = match f.and_then(|f| f.get("arguments")) {
                    None | Some(Value::Null) => "{}".to_owned(),
                    Some(Value::String(s)) => s.clone(),
                    Some(other) => other.to_string(),
                };
                let id = format!("call_{i}_{k}");
                open.push((id.clone(), name.to_owned()));
                msg.calls.push(Call {
                    id,
                    name: name.to_owned(),
                    arguments,
                });
            }
        }
        if role == Role::Tool {
            let at = match m.get("tool_name").and_then(Value::as_str) {
                Some(n) => match open.iter().position(|(_, name)| name == n) {
                    Some(at) => Some(at),
                    None => {
                        return Err(bad(format!(
                            "messages[{i}].tool_name is {n:?}, but no earlier assistant call \
                             of that name is unanswered"
                        )))
                    }
                },
                None => (!open.is_empty()).then_some(0),
            };
            if let Some(at) = at {
                msg.answers = Some(open.remove(at).0);
            }
        }
        out.push(msg);
    }
    Ok(out)
}

fn no_images() -> ApiError {
    bad("images are read on /api/chat (base64 strings in a message's `images`), not here")
}

/// The images of a chat's messages (base64 strings, their type sniffed),
/// stored and laid out.
async fn resolve_images(state: &WebState, messages: &[Value]) -> Result<Resolved, ApiError> {
    super::chat::check_count(messages.len()).map_err(|e| super::chat_error(F, e))?;
    let mut sources = Vec::new();
    for m in messages {
        for data in m
            .get("images")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            super::images::next_image(state, F, sources.len())?;
            let data = data
                .as_str()
                .ok_or_else(|| bad("each of a message's images is a base64 string"))?;
            let bytes = super::images::decode_base64(F, data)?;
            let mime = crate::media::sniff(&bytes)
                .map(|k| k.mime())
                .ok_or_else(|| bad("an image is not a PNG, JPEG, WebP or GIF"))?;
            sources.push((data.to_string(), bytes, mime.to_string()));
        }
    }
    super::images::resolve(state, F, sources).await
}

/// `tool_choice` (the extension): `None` for the model's own choice (`auto`,
/// `none` or absent), or the tools a grammar forces one call to.
pub fn forced_tools(
    choice: Option<&Value>,
    sigs: &[(String, Value)],
) -> Result<Option<Vec<(String, Value)>>, ApiError> {
    match choice {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s == "auto" || s == "none" => Ok(None),
        Some(Value::String(s)) if s == "required" => {
            if sigs.is_empty() {
                return Err(bad("tool_choice \"required\" needs tools"));
            }
            Ok(Some(sigs.to_vec()))
        }
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| bad("tool_choice names no function"))?;
            let one: Vec<_> = sigs.iter().filter(|(n, _)| n == name).cloned().collect();
            if one.is_empty() {
                return Err(bad(format!(
                    "tool_choice names {name:?}, which is not among the tools"
                )));
            }
            Ok(Some(one))
        }
        Some(other) => Err(bad(format!(
            "tool_choice {other} is not auto, none, required or a function"
        ))),
    }
}

/// `format`: absent or `""` (free text), `"json"`, or a JSON schema.
pub fn format_grammar(
    format: Option<&Value>,
    close: Option<&str>,
) -> Result<Option<String>, ApiError> {
    match format {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Ok(None),
        Some(Value::String(s)) if s == "json" => {
            json_grammar(F, &json!({"type": "object"}), close).map(Some)
        }
        Some(schema @ Value::Object(_)) => json_grammar(F, schema, close).map(Some),
        Some(other) => Err(bad(format!(
            "format must be \"json\" or a JSON schema, not {other}"
        ))),
    }
}

/// `think`: whether reasoning is returned (in `thinking`). Absent: yes, when
/// the model writes any. `true` and Ollama's levels (`"low"`, `"medium"`,
/// `"high"`): yes. `false`: the model's reasoning is left out of the reply.
pub fn think(v: Option<&Value>) -> Result<Option<bool>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(Value::String(s)) if ["low", "medium", "high"].contains(&s.as_str()) => Ok(Some(true)),
        Some(other) => Err(bad(format!(
            "think must be true, false, \"low\", \"medium\" or \"high\", not {other}"
        ))),
    }
}

/// The generation's token budget: `num_ctx` (at most the daemon's context;
/// smaller is honoured as a cap on prompt + reply) and `num_predict` (-1 or
/// -2 or absent: the rest of that context; a larger number is capped by it).
pub fn max_tokens(
    n_ctx: u32,
    num_ctx: Option<i64>,
    prompt: usize,
    num_predict: Option<i64>,
) -> Result<u32, ApiError> {
    let daemon = n_ctx as usize;
    let ctx = match num_ctx {
        None => daemon,
        Some(c) if c < 1 => return Err(bad("options.num_ctx must be at least 1")),
        Some(c) if c as u64 > daemon as u64 => {
            return Err(ApiError::new(
                F,
                Kind::ContextLength,
                format!(
                    "options.num_ctx is {c}, larger than this daemon's context of {daemon} \
                     tokens (--ctx-size): ask for at most {daemon}, or restart the daemon \
                     with a larger --ctx-size"
                ),
            ))
        }
        Some(c) => c as usize,
    };
    if prompt >= ctx {
        return Err(ApiError::new(
            F,
            Kind::ContextLength,
            format!(
                "the prompt is {prompt} tokens, and the context is {ctx} tokens \
                 (options.num_ctx, at most --ctx-size): it must be shorter to leave room \
                 for a reply"
            ),
        ));
    }
    let room = ctx - prompt;
    let n =
        match num_predict {
            None | Some(-1) | Some(-2) => room,
            Some(n) if n < 1 => return Err(bad(
                "options.num_predict must be at least 1, or -1 (no limit) or -2 (fill the context)",
            )),
            Some(n) => (n as u64).min(room as u64) as usize,
        };
    Ok(u32::try_from(n).unwrap_or(u32::MAX))
}

/// `options.stop`: a list of strings (or one string).
fn stops(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let bad = || bad("options.stop must be a list of strings");
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| s.as_str().map(str::to_owned).ok_or_else(bad))
            .collect(),
        Some(_) => Err(bad()),
    }
}

/// RFC 3339 in UTC with nanoseconds, as Ollama writes `created_at`.
pub fn rfc3339(ms: u64) -> String {
    let t = jiff::Timestamp::from_millisecond(i64::try_from(ms).unwrap_or(i64::MAX))
        .unwrap_or(jiff::Timestamp::MAX);
    format!("{t:.9}")
}

fn created_at() -> String {
    rfc3339(crate::actors::now_ms())
}

/// Why the reply ended, in Ollama's words.
pub fn done_reason(end: &End) -> &'static str {
    match end {
        End::MaxTokens => "length",
        End::Turn | End::Stop(_) | End::Cancelled => "stop",
    }
}

/// Which route's shape the objects take.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Shape {
    Chat,
    Generate,
}

/// What every object of one reply repeats, and how to build each.
struct Head {
    shape: Shape,
    model: String,
    show_thinking: bool,
}

impl Head {
    /// One object: text, reasoning and calls (any may be empty).
    fn object(&self, text: &str, thinking: &str, calls: &[(String, String)], done: bool) -> Value {
        let mut v = json!({"model": self.model, "created_at": created_at()});
        match self.shape {
            Shape::Chat => {
                let mut m = json!({"role": "assistant", "content": text});
                if self.show_thinking && !thinking.is_empty() {
                    m["thinking"] = json!(thinking);
                }
                if !calls.is_empty() {
                    m["tool_calls"] =
                        Value::Array(calls.iter().map(|(n, a)| call_json(n, a)).collect());
                }
                v["message"] = m;
            }
            Shape::Generate => {
                v["response"] = json!(text);
                if self.show_thinking && !thinking.is_empty() {
                    v["thinking"] = json!(thinking);
                }
            }
        }
        v["done"] = json!(done);
        v
    }
}

/// A call as Ollama returns it: arguments as an object.
pub fn call_json(name: &str, arguments: &str) -> Value {
    let arguments: Value = serde_json::from_str(arguments).unwrap_or_else(|_| json!({}));
    json!({"function": {"name": name, "arguments": arguments}})
}

/// The clock of one request, for the final object's durations.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    pub started: Instant,
    /// The generation was admitted (it has a sequence).
    pub admitted: Instant,
    /// Its first output arrived (the prompt was evaluated).
    pub first: Option<Instant>,
}

/// The final object's counts and durations (nanoseconds).
/// `prompt_eval_count` is the prompt tokens evaluated: the prompt less what
/// came from the prefix cache, as Ollama counts it.
pub fn stats(clock: &Clock, end: Instant, prompt: usize, warm: u64, generated: u32) -> Value {
    let ns = |a: Instant, b: Instant| b.saturating_duration_since(a).as_nanos() as u64;
    let first = clock.first.unwrap_or(end);
    json!({
        "total_duration": ns(clock.started, end),
        "load_duration": ns(clock.started, clock.admitted),
        "prompt_eval_count": (prompt as u64).saturating_sub(warm),
        "prompt_eval_duration": ns(clock.admitted, first),
        "eval_count": generated,
        "eval_duration": ns(first, end),
    })
}

fn ndjson(v: &Value) -> Bytes {
    let mut s = v.to_string();
    s.push('\n');
    Bytes::from(s)
}

fn ndjson_stream(warm: u64, rx: mpsc::Receiver<Bytes>) -> HttpResponse {
    let body = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
    });
    ok_with_warm(warm)
        .insert_header(("content-type", "application/x-ndjson"))
        .streaming(body)
}

/// Whether `keep_alive` asks to unload now: `0`, or a duration of zero
/// (`"0"`, `"0s"`, `"0m"`).
pub fn unloads(k: &Value) -> bool {
    match k {
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s
            .trim_end_matches(|c: char| c.is_ascii_alphabetic())
            .parse::<f64>()
            .is_ok_and(|x| x == 0.0),
        _ => false,
    }
}

/// A request that only loads (no messages, no prompt): loads the model,
/// answered with `done_reason` `load` once it is loading; or, for
/// `keep_alive: 0`, unloads it once idle and answers `unload` (the first
/// model stays loaded: the daemon serves it while it runs).
async fn load_reply(
    state: &WebState,
    shape: Shape,
    keep_alive: Option<&Value>,
) -> Result<HttpResponse, ApiError> {
    let head = Head {
        shape,
        model: listed_name(state),
        show_thinking: false,
    };
    let mut v = head.object("", "", &[], true);
    let zero = keep_alive.is_some_and(unloads);
    apply_keep_alive(state, keep_alive)?;
    if !zero {
        if let Some((gate, slot)) = &state.m().shared.load {
            gate.load(*slot)
                .await
                .map_err(|e| ApiError::new(F, Kind::Unavailable, e))?;
        }
    }
    v["done_reason"] = json!(if zero { "unload" } else { "load" });
    Ok(HttpResponse::Ok().json(v))
}

/// A prepared generation and how to reply to it.
struct Job {
    p: Prepared,
    params: crate::wire::Params,
    stop: Vec<String>,
    trim_leading: bool,
    head: Head,
    stream: bool,
}

fn sampling(o: &Options) -> Result<crate::wire::Params, ApiError> {
    params(
        Some(o.temperature.unwrap_or(DEFAULT_TEMPERATURE)),
        Some(o.top_p.unwrap_or(DEFAULT_TOP_P)),
        Some(o.top_k.unwrap_or(DEFAULT_TOP_K)),
        o.min_p,
        o.seed.map(|s| s as u64),
        F,
    )
}

/// `think: false` on a turn the template opens inside a thinking block:
/// the block is closed empty on the prompt (`\n</think>\n\n`, what Qwen3's
/// template writes with `enable_thinking` off), so the model answers without
/// reasoning. Returns whether the turn is still in reasoning.
fn skip_thinking(
    state: &WebState,
    think_v: Option<&Value>,
    m: &Markers,
    in_reasoning: bool,
    prompt: &mut Vec<crate::wire::Token>,
) -> Result<bool, ApiError> {
    match (think(think_v)?, &m.think) {
        (Some(false), Some((_, close))) if in_reasoning => {
            let render = &state.m().shared.render;
            prompt.extend(render.tokenize(&format!("\n{close}\n\n")));
            Ok(false)
        }
        _ => Ok(in_reasoning),
    }
}

/// Refuses `think: true` on a model whose template has no thinking block,
/// as Ollama does; whether reasoning is shown.
fn show_thinking(state: &WebState, think_v: Option<&Value>, m: &Markers) -> Result<bool, ApiError> {
    match think(think_v)? {
        Some(true) if m.think.is_none() => Err(bad(format!(
            "{:?} does not support thinking (its chat template has no thinking block)",
            listed_name(state)
        ))),
        Some(t) => Ok(t),
        None => Ok(true),
    }
}

async fn prepare_chat(
    state: &WebState,
    r: &ChatRequest,
    images: &Resolved,
) -> Result<Job, ApiError> {
    check_model(state, F, model_name(&r.model))?;
    let msgs = messages(&r.messages, images)?;
    let o = r.options.as_ref();
    let choice = r
        .tool_choice
        .as_ref()
        .or(o.and_then(|o| o.tool_choice.as_ref()));
    // "none": the model is not told of the tools (and no call is parsed).
    let none = choice.and_then(Value::as_str) == Some("none");
    let tools: Vec<String> = if none {
        Vec::new()
    } else {
        r.tools.iter().flatten().map(Value::to_string).collect()
    };
    let sigs: Vec<(String, Value)> = tools
        .iter()
        .map(|t| tool_signature(t).ok_or_else(|| bad("each tool needs a function with a name")))
        .collect::<Result<_, _>>()?;
    let forced = forced_tools(choice, &sigs)?;
    let (prompt, media) = render_prompt(state, F, &msgs, &tools).await?;
    let (markers, in_reasoning) = markers(state, prompt.header());
    let mut markers = markers.with_tools(!tools.is_empty());
    if none {
        markers.tool_call = None;
    }
    let show = show_thinking(state, r.think.as_ref(), &markers)?;
    let mut prompt = prompt.tokens;
    let in_reasoning = skip_thinking(state, r.think.as_ref(), &markers, in_reasoning, &mut prompt)?;
    let close = close_reasoning(&markers, in_reasoning);
    let grammar = match forced {
        Some(tools) => {
            markers = markers.forcing_a_call();
            Some(forced_grammar(F, &tools, close.as_deref())?)
        }
        None => format_grammar(r.format.as_ref(), close.as_deref())?,
    };
    let max = max_tokens(
        state.m().shared.n_ctx,
        o.and_then(|o| o.num_ctx),
        prompt.len(),
        o.and_then(|o| o.num_predict),
    )?;
    let default = Options::default();
    let o = o.unwrap_or(&default);
    Ok(Job {
        p: Prepared {
            media,
            prompt,
            max_tokens: max,
            grammar,
            markers,
            in_reasoning,
            pin: None,
            extras: None,
        },
        params: sampling(o)?,
        stop: stops(o.stop.as_ref())?,
        // A continued assistant message keeps the reply's leading space.
        trim_leading: !super::chat::ends_with_prefill(&msgs),
        head: Head {
            shape: Shape::Chat,
            model: listed_name(state),
            show_thinking: show,
        },
        stream: r.stream.unwrap_or(true),
    })
}

async fn prepare_generate(state: &WebState, r: &GenerateRequest) -> Result<Job, ApiError> {
    check_model(state, F, model_name(&r.model))?;
    if r.images.as_ref().is_some_and(|a| !a.is_empty()) {
        return Err(no_images());
    }
    if r.template.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(bad(
            "template overrides are not served: the model's own chat template renders the \
             prompt (send raw: true to lay the prompt out yourself)",
        ));
    }
    let text = r.prompt.clone().unwrap_or_default();
    let (prompt, markers, in_reasoning, trim_leading) = match (&r.suffix, r.raw) {
        (Some(suffix), _) => {
            let render = state.m().shared.render.clone();
            let fim = render.fim().ok_or_else(|| {
                bad(
                    "this model has no fill-in-the-middle tokens (its GGUF names no \
                     tokenizer.ggml.fim_pre/suf/mid_token_id), so `suffix` cannot be served",
                )
            })?;
            let suffix = suffix.clone();
            let bytes = text.len() + suffix.len();
            let prompt = off_worker(F, bytes, move || {
                let (pre, suf) = (render.tokenize(&text), render.tokenize(&suffix));
                fim_prompt(fim, &pre, &suf, FimMode::Psm)
            })
            .await?;
            (prompt, Markers::none(), false, false)
        }
        (None, true) => {
            let render = state.m().shared.render.clone();
            let bytes = text.len();
            let prompt = off_worker(F, bytes, move || render.tokenize(&text)).await?;
            (prompt, Markers::none(), false, false)
        }
        (None, false) => {
            let mut msgs = Vec::new();
            if let Some(s) = r.system.as_ref().filter(|s| !s.is_empty()) {
                msgs.push(Msg::new(Role::System, s.clone()));
            }
            msgs.push(Msg::new(Role::User, text));
            let (prompt, _) = render_prompt(state, F, &msgs, &[]).await?;
            let (markers, in_reasoning) = markers(state, prompt.header());
            (prompt.tokens, markers, in_reasoning, true)
        }
    };
    let show = show_thinking(state, r.think.as_ref(), &markers)?;
    let mut prompt = prompt;
    let in_reasoning = skip_thinking(state, r.think.as_ref(), &markers, in_reasoning, &mut prompt)?;
    let close = close_reasoning(&markers, in_reasoning);
    let grammar = format_grammar(r.format.as_ref(), close.as_deref())?;
    let o = r.options.as_ref();
    let max = max_tokens(
        state.m().shared.n_ctx,
        o.and_then(|o| o.num_ctx),
        prompt.len(),
        o.and_then(|o| o.num_predict),
    )?;
    let default = Options::default();
    let o = o.unwrap_or(&default);
    Ok(Job {
        p: Prepared {
            media: vec![],
            prompt,
            max_tokens: max,
            grammar,
            markers,
            in_reasoning,
            pin: None,
            extras: None,
        },
        params: sampling(o)?,
        stop: stops(o.stop.as_ref())?,
        trim_leading,
        head: Head {
            shape: Shape::Generate,
            model: listed_name(state),
            show_thinking: show,
        },
        stream: r.stream.unwrap_or(true),
    })
}

/// Runs a prepared job and replies, streamed or whole.
async fn run(
    state: &WebState,
    job: Result<Job, ApiError>,
    mut access: Access,
) -> Result<HttpResponse, ApiError> {
    let started = access.started;
    let job = job
        .and_then(|j| check_lane(state, F).map(|()| j))
        .map_err(|e| logged(&access, e))?;
    let (warm, mut runs) = start_all(state, F, &job.p, 1, job.params, &job.stop, job.trim_leading)
        .await
        .map_err(|e| logged(&access, e))?;
    let out = runs
        .pop()
        .ok_or_else(|| logged(&access, ApiError::new(F, Kind::Internal, "no run")))?;
    access.prompt = job.p.prompt.len();
    access.cached = warm;
    let clock = Clock {
        started,
        admitted: Instant::now(),
        first: None,
    };
    if job.stream {
        let (tx, rx) = mpsc::channel(64);
        actix_rt::spawn(stream(out, tx, job.head, clock, warm, access));
        return Ok(ndjson_stream(warm, rx));
    }
    match whole(out, &job.head, clock, warm, &mut access).await {
        Ok(v) => {
            access.log(200);
            Ok(ok_with_warm(warm).json(v))
        }
        Err(f) => Err(logged(&access, f.api(F))),
    }
}

/// Reads a run to its end into one object.
async fn whole(
    mut out: mpsc::Receiver<Out>,
    head: &Head,
    mut clock: Clock,
    warm: u64,
    access: &mut Access,
) -> Result<Value, drive::Failure> {
    let (mut text, mut thinking, mut calls) = (String::new(), String::new(), Vec::new());
    while let Some(o) = out.recv().await {
        clock.first.get_or_insert_with(Instant::now);
        match o {
            Out::Text {
                reasoning: true,
                text: t,
            } => thinking.push_str(&t),
            Out::Text { text: t, .. } => text.push_str(&t),
            Out::Call { name, arguments } => calls.push((name, arguments)),
            Out::Logprob(_) => {}
            Out::Ended { end, generated, .. } => {
                access.generated = u64::from(generated);
                let mut v = head.object(&text, &thinking, &calls, true);
                v["done_reason"] = json!(done_reason(&end));
                merge(
                    &mut v,
                    stats(&clock, Instant::now(), access.prompt, warm, generated),
                );
                return Ok(v);
            }
            Out::Failed(message) => {
                return Err(drive::Failure {
                    message,
                    own: false,
                })
            }
            Out::Refused(message) => return Err(drive::Failure { message, own: true }),
        }
    }
    Err(drive::Failure {
        message: "the generation ended without a reason".into(),
        own: false,
    })
}

fn merge(v: &mut Value, more: Value) {
    if let (Some(o), Value::Object(m)) = (v.as_object_mut(), more) {
        o.extend(m);
    }
}

/// Streams a run as NDJSON objects. A failed send (the client went away)
/// ends it, which drops the run: its generation is cancelled.
async fn stream(
    mut out: mpsc::Receiver<Out>,
    tx: mpsc::Sender<Bytes>,
    head: Head,
    mut clock: Clock,
    warm: u64,
    mut access: Access,
) {
    while let Some(o) = out.recv().await {
        clock.first.get_or_insert_with(Instant::now);
        let v = match o {
            Out::Text {
                reasoning: true,
                text,
            } => {
                if !head.show_thinking {
                    continue;
                }
                head.object("", &text, &[], false)
            }
            Out::Text { text, .. } => head.object(&text, "", &[], false),
            Out::Call { name, arguments } if head.shape == Shape::Chat => {
                head.object("", "", &[(name, arguments)], false)
            }
            Out::Call { .. } | Out::Logprob(_) => continue,
            Out::Ended { end, generated, .. } => {
                access.generated = u64::from(generated);
                let mut v = head.object("", "", &[], true);
                v["done_reason"] = json!(done_reason(&end));
                merge(
                    &mut v,
                    stats(&clock, Instant::now(), access.prompt, warm, generated),
                );
                let _ = tx.send(ndjson(&v)).await;
                access.log(200);
                return;
            }
            Out::Failed(message) | Out::Refused(message) => {
                let _ = tx.send(ndjson(&json!({"error": message}))).await;
                access.log(503);
                return;
            }
        };
        if tx.send(ndjson(&v)).await.is_err() {
            access.log(499);
            return;
        }
    }
    let _ = tx
        .send(ndjson(
            &json!({"error": "the generation ended without a reason"}),
        ))
        .await;
    access.log(503);
}

/// `POST /api/chat`.
pub async fn chat(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<WebState>,
) -> Result<HttpResponse, ApiError> {
    let mut access = Access::new("/api/chat", "", Instant::now());
    let r: ChatRequest = accept(&state, F, &req, payload)
        .await
        .map_err(|e| logged(&access, e))?;
    access.set_model(&r.model);
    let state = pick(&state, F, model_name(&r.model)).map_err(|e| logged(&access, e))?;
    if r.messages.is_empty() {
        check_model(&state, F, model_name(&r.model)).map_err(|e| logged(&access, e))?;
        let reply = load_reply(&state, Shape::Chat, r.keep_alive.as_ref())
            .await
            .map_err(|e| logged(&access, e))?;
        access.log(200);
        return Ok(reply);
    }
    apply_keep_alive(&state, r.keep_alive.as_ref()).map_err(|e| logged(&access, e))?;
    let job = match check_model(&state, F, model_name(&r.model)) {
        Ok(()) => resolve_images(&state, &r.messages).await,
        Err(e) => Err(e),
    };
    let job = match job {
        Ok(images) => prepare_chat(&state, &r, &images).await,
        Err(e) => Err(e),
    };
    run(&state, job, access).await
}

/// `POST /api/generate`.
pub async fn generate(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<WebState>,
) -> Result<HttpResponse, ApiError> {
    let mut access = Access::new("/api/generate", "", Instant::now());
    let r: GenerateRequest = accept(&state, F, &req, payload)
        .await
        .map_err(|e| logged(&access, e))?;
    access.set_model(&r.model);
    let state = pick(&state, F, model_name(&r.model)).map_err(|e| logged(&access, e))?;
    if r.prompt.as_deref().unwrap_or_default().is_empty() && r.suffix.is_none() {
        check_model(&state, F, model_name(&r.model)).map_err(|e| logged(&access, e))?;
        let reply = load_reply(&state, Shape::Generate, r.keep_alive.as_ref())
            .await
            .map_err(|e| logged(&access, e))?;
        access.log(200);
        return Ok(reply);
    }
    apply_keep_alive(&state, r.keep_alive.as_ref()).map_err(|e| logged(&access, e))?;
    let job = prepare_generate(&state, &r).await;
    run(&state, job, access).await
}

/// The file's identity, read once (off the actix threads) and kept.
async fn identity(state: &WebState) -> Result<Identity, ApiError> {
    if let Some(i) = state.m().model.identity.get() {
        return Ok(i.clone());
    }
    let path = state.m().model.path.clone();
    let i = web::block(move || super::gguf::identify(&path))
        .await
        .map_err(|e| ApiError::new(F, Kind::Internal, e.to_string()))?
        .map_err(|e| {
            ApiError::new(
                F,
                Kind::Internal,
                format!("cannot read the model file: {e}"),
            )
        })?;
    Ok(state.m().model.identity.get_or_init(|| i).clone())
}

fn details_json(i: &Identity) -> Value {
    json!({
        "parent_model": "",
        "format": "gguf",
        "family": i.details.family,
        "families": if i.details.family.is_empty() { Value::Null } else { json!([i.details.family]) },
        "parameter_size": i.details.parameter_size,
        "quantization_level": i.details.quantization_level,
    })
}

/// `GET /api/tags`: every served model, the first first.
pub async fn tags(req: HttpRequest, state: web::Data<WebState>) -> Result<HttpResponse, ApiError> {
    authorize(&state, F, &req)?;
    let mut models = Vec::new();
    for k in 0..state.models.len() {
        let state = state.at(k);
        let i = identity(&state).await?;
        let name = listed_name(&state);
        models.push(json!({
            "name": name,
            "model": name,
            "modified_at": rfc3339(i.modified_ms),
            "size": i.size,
            "digest": i.digest.trim_start_matches("sha256:"),
            "details": details_json(&i),
        }));
    }
    Ok(HttpResponse::Ok().json(json!({ "models": models })))
}

/// `GET /api/ps`: the loaded models, with when each unloads (the first
/// never does: a date far ahead, as Ollama shows `keep_alive: -1`).
pub async fn ps(req: HttpRequest, state: web::Data<WebState>) -> Result<HttpResponse, ApiError> {
    authorize(&state, F, &req)?;
    let forever = crate::actors::now_ms() + 100 * 365 * 86_400_000;
    let mut models = Vec::new();
    for k in 0..state.models.len() {
        let state = state.at(k);
        if *state.m().lane.borrow() == crate::actors::lane::LaneState::Unloaded {
            continue;
        }
        let expires = state
            .m()
            .shared
            .load
            .as_ref()
            .and_then(|(gate, slot)| gate.entry(*slot).expires_ms())
            .unwrap_or(forever);
        let i = identity(&state).await?;
        let name = listed_name(&state);
        models.push(json!({
            "name": name,
            "model": name,
            "size": i.size,
            "digest": i.digest.trim_start_matches("sha256:"),
            "details": details_json(&i),
            "expires_at": rfc3339(expires),
            "size_vram": 0,
            "context_length": state.m().shared.n_ctx,
        }));
    }
    Ok(HttpResponse::Ok().json(json!({ "models": models })))
}

/// A request's `keep_alive` (seconds, or a duration like "5m"; negative:
/// for ever) becomes its model's: how long it stays loaded after this
/// request. The first model stays loaded whatever it says.
fn apply_keep_alive(state: &WebState, keep_alive: Option<&Value>) -> Result<(), ApiError> {
    let Some(k) = keep_alive else {
        return Ok(());
    };
    let text = match k {
        Value::Number(n) => n.to_string(),
        Value::String(s) => s.clone(),
        Value::Null => return Ok(()),
        _ => {
            return Err(bad(
                "keep_alive must be a number of seconds or a duration like \"5m\"",
            ))
        }
    };
    let ms = crate::actors::load_gate::parse_keep_alive(&text).map_err(bad)?;
    if let Some((gate, slot)) = &state.m().shared.load {
        gate.set_keep_alive(*slot, ms);
    }
    Ok(())
}

#[derive(Debug, Deserialize)]
pub struct ShowRequest {
    pub model: Option<String>,
    /// The older spelling of `model`.
    pub name: Option<String>,
}

/// A request's `model`, or its older spelling `name`.
fn model_field(model: Option<String>, name: Option<String>) -> Result<String, ApiError> {
    model.or(name).ok_or_else(|| bad("model is required"))
}

/// What the template lets the model do, as Ollama's `capabilities`.
fn capabilities(state: &WebState) -> Vec<&'static str> {
    let m = Markers::from_template(&state.m().shared.render.template_source());
    // Tools: the template declares them, or the daemon does for it.
    let mut c = vec!["completion", "tools"];
    if m.think.is_some() {
        c.push("thinking");
    }
    if state.m().shared.render.fim().is_some() {
        c.push("insert");
    }
    c
}

/// `POST /api/show`.
pub async fn show(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<WebState>,
) -> Result<HttpResponse, ApiError> {
    let r: ShowRequest = accept(&state, F, &req, payload).await?;
    let name = model_field(r.model, r.name)?;
    let state = pick(&state, F, model_name(&name))?;
    let i = identity(&state).await?;
    let template = state.m().shared.render.template_source();
    let file = state
        .m()
        .model
        .path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    let parameters = format!("num_ctx {}", state.m().shared.n_ctx);
    let modelfile = format!(
        "# Modelfile generated by superfluid\nFROM {file}\nTEMPLATE \"\"\"{template}\"\"\"\nPARAMETER {parameters}\n"
    );
    let mut info = serde_json::Map::new();
    for (k, v) in &i.meta {
        info.insert(k.clone(), v.clone());
    }
    Ok(HttpResponse::Ok().json(json!({
        "modelfile": modelfile,
        "parameters": parameters,
        "template": template,
        "details": details_json(&i),
        "model_info": info,
        "capabilities": capabilities(&state),
        "modified_at": rfc3339(i.modified_ms),
    })))
}

/// `GET /api/version`: superfluid's version.
pub async fn version(
    req: HttpRequest,
    state: web::Data<WebState>,
) -> Result<HttpResponse, ApiError> {
    authorize(&state, F, &req)?;
    Ok(HttpResponse::Ok().json(json!({"version": env!("CARGO_PKG_VERSION")})))
}

fn not_yet(state: &WebState, req: &HttpRequest, message: &str) -> Result<HttpResponse, ApiError> {
    authorize(state, F, req)?;
    Err(ApiError::new(F, Kind::NotImplemented, message))
}

/// The body of `POST /api/pull`.
#[derive(Debug, Deserialize)]
pub struct PullRequest {
    pub model: Option<String>,
    /// The older spelling of `model`.
    pub name: Option<String>,
    /// Stream status objects (the default) or answer once at the end.
    pub stream: Option<bool>,
    /// Accepted and ignored (the hub is always HTTPS unless `HF_ENDPOINT`
    /// says otherwise).
    #[serde(default)]
    pub insecure: bool,
}

/// Progress of one file as Ollama's status objects, at most every 200 ms.
struct OllamaProgress {
    tx: mpsc::Sender<Bytes>,
    status: String,
    digest: Option<String>,
    total: u64,
    completed: u64,
    last: Option<Instant>,
}

impl OllamaProgress {
    fn send(&mut self, force: bool) {
        let now = Instant::now();
        if !force
            && self
                .last
                .is_some_and(|t| now - t < std::time::Duration::from_millis(200))
        {
            return;
        }
        self.last = Some(now);
        let mut v =
            json!({"status": self.status, "total": self.total, "completed": self.completed});
        if let Some(d) = &self.digest {
            v["digest"] = json!(format!("sha256:{d}"));
        }
        // A client that left stops getting them; the download goes on.
        let _ = self.tx.blocking_send(ndjson(&v));
    }
}

impl hf_hub::api::Progress for OllamaProgress {
    fn init(&mut self, size: usize, _filename: &str) {
        self.total = size as u64;
        self.completed = 0;
        self.send(true);
    }
    fn update(&mut self, size: usize) {
        self.completed += size as u64;
        self.send(false);
    }
    fn finish(&mut self) {
        self.send(true);
    }
}

/// `POST /api/pull`: fetches a model reference (`owner/repo:QUANT`,
/// `owner/repo/FILE.gguf`) into the Hugging Face cache, as `superfluid pull`
/// does, streaming Ollama's status objects (`pulling manifest`, one
/// `pulling <file>` per file with `total` and `completed`, `verifying sha256
/// digest`, `success`), or one object at the end with `"stream": false`. The
/// daemon goes on serving the model it was started with.
pub async fn pull(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<WebState>,
) -> Result<HttpResponse, ApiError> {
    let r: PullRequest = accept(&state, F, &req, payload).await?;
    let name = model_field(r.model, r.name)?;
    let reference = match crate::models::ModelRef::parse_hub(&name) {
        Ok(m) => m,
        Err(_) => {
            return Err(bad(format!(
                "{name:?} is not a model reference: pull takes owner/repo:QUANT or owner/repo/FILE.gguf"
            )))
        }
    };
    let (tx, mut rx) = mpsc::channel::<Bytes>(64);
    let streaming = r.stream.unwrap_or(true);
    let worker_tx = tx.clone();
    let spawned = std::thread::Builder::new()
        .name("pull".into())
        .spawn(move || {
            let _ = worker_tx.blocking_send(ndjson(&json!({"status": "pulling manifest"})));
            let sink = worker_tx.clone();
            let factory = move |file: &str, sha: Option<&str>| -> Box<dyn hf_hub::api::Progress> {
                Box::new(OllamaProgress {
                    tx: sink.clone(),
                    status: format!("pulling {file}"),
                    digest: sha.map(str::to_owned),
                    total: 0,
                    completed: 0,
                    last: None,
                })
            };
            let last = match crate::models::hub::resolve_with(&reference, &factory) {
                Ok(_) => {
                    let _ = worker_tx
                        .blocking_send(ndjson(&json!({"status": "verifying sha256 digest"})));
                    json!({"status": "success"})
                }
                Err(e) => json!({"error": e.to_string()}),
            };
            let _ = worker_tx.blocking_send(ndjson(&last));
        });
    if let Err(e) = spawned {
        return Err(ApiError::new(
            F,
            Kind::Internal,
            format!("cannot start the pull: {e}"),
        ));
    }
    drop(tx);
    if streaming {
        return Ok(ndjson_stream(0, rx));
    }
    // One answer: the last object, its error as the status.
    let mut last = Bytes::new();
    while let Some(b) = rx.recv().await {
        last = b;
    }
    let v: Value =
        serde_json::from_slice(&last).unwrap_or(json!({"error": "the pull ended early"}));
    match v.get("error").and_then(Value::as_str) {
        Some(message) => Err(ApiError::new(F, Kind::Invalid, message.to_owned())),
        None => Ok(HttpResponse::Ok().json(v)),
    }
}

/// `DELETE /api/delete`: removes a model reference's files from the
/// Hugging Face cache (`superfluid rm`); 404 when it is not there.
pub async fn delete(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<WebState>,
) -> Result<HttpResponse, ApiError> {
    let r: ShowRequest = accept(&state, F, &req, payload).await?;
    let name = model_field(r.model, r.name)?;
    // Never a path: whether one exists is not the client's to learn (a 404
    // as for any model not in the cache).
    let reference = crate::models::ModelRef::parse_hub(&name)
        .map_err(|e| ApiError::new(F, Kind::NotFound, e.to_string()))?;
    let served: Vec<_> = state
        .models
        .iter()
        .filter_map(|v| std::fs::canonicalize(&v.model.path).ok())
        .collect();
    let removed = actix_web::web::block(move || {
        use crate::models::hub::{in_cache, remove, HubError};
        // The file the daemon serves (its worker may need it again) stays.
        let files = in_cache(&reference)?.files;
        if files.iter().any(|f| {
            std::fs::canonicalize(f)
                .ok()
                .is_some_and(|f| served.contains(&f))
        }) {
            return Err(HubError::Other {
                reference: reference.to_string(),
                reason: "it is a model this daemon serves; stop the daemon first".into(),
            });
        }
        remove(&reference)
    })
    .await
    .map_err(|e| ApiError::new(F, Kind::Internal, e.to_string()))?;
    use crate::models::hub::HubError;
    match removed {
        Ok(paths) if !paths.is_empty() => Ok(HttpResponse::Ok().finish()),
        Ok(_) => Err(ApiError::new(
            F,
            Kind::NotFound,
            format!("model {name:?} not found"),
        )),
        Err(e @ (HubError::NotCached { .. } | HubError::Ref(_))) => {
            Err(ApiError::new(F, Kind::NotFound, e.to_string()))
        }
        Err(e @ HubError::Other { .. }) => Err(ApiError::new(F, Kind::Invalid, e.to_string())),
        Err(e) => Err(ApiError::new(F, Kind::Internal, e.to_string())),
    }
}

/// `POST /api/push`,
/// `POST /api/copy`, `POST /api/create`.
pub async fn models_later(
    req: HttpRequest,
    state: web::Data<WebState>,
) -> Result<HttpResponse, ApiError> {
    not_yet(
        &state,
        &req,
        &format!(
            "{} is not served yet: model references (pulling, removing and creating models) \
             land with the models issue; this daemon serves the one file it was started with",
            req.path()
        ),
    )
}

/// `POST /api/embed`, `POST /api/embeddings`.
pub async fn embeddings(
    req: HttpRequest,
    state: web::Data<WebState>,
) -> Result<HttpResponse, ApiError> {
    not_yet(
        &state,
        &req,
        &format!(
            "{} is not served: embeddings need an embedding model loaded with pooled output \
             and a worker request that returns vectors, and this daemon has neither yet",
            req.path()
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_get_ids_and_results_answer_them_by_name_then_order() {
        let raw = vec![
            json!({"role": "user", "content": "hi"}),
            json!({"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "a", "arguments": {"x": 1}}},
                {"function": {"name": "b", "arguments": "{\"y\":2}"}}]}),
            json!({"role": "tool", "content": "B", "tool_name": "b"}),
            json!({"role": "tool", "content": "A"}),
            json!({"role": "tool", "content": "stray"}),
        ];
        let m = messages(&raw, &Default::default()).unwrap();
        assert_eq!(m[1].calls[0].arguments, r#"{"x":1}"#);
        assert_eq!(m[1].calls[1].arguments, r#"{"y":2}"#);
        assert_eq!(m[2].answers.as_deref(), Some(m[1].calls[1].id.as_str()));
        assert_eq!(m[3].answers.as_deref(), Some(m[1].calls[0].id.as_str()));
        assert_eq!(m[4].answers, None);
        assert_eq!(super::super::chat::check(&m, 0), Ok(()));
    }

    #[test]
    fn a_tool_name_that_names_no_open_call_is_refused() {
        let call = |name: &str| {
            json!({"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": name, "arguments": {}}}]})
        };
        let result = |name: &str| json!({"role": "tool", "content": "r", "tool_name": name});
        for raw in [
            vec![call("a"), result("b")],
            vec![call("a"), result("a"), result("a")],
            vec![result("a")],
        ] {
            let e = messages(&raw, &Default::default()).unwrap_err();
            assert_eq!(e.kind, Kind::Invalid);
            let at = format!("messages[{}].tool_name is \"", raw.len() - 1);
            assert!(e.message.starts_with(&at), "{}", e.message);
        }
    }

    #[test]
    fn images_and_bad_roles_are_refused() {
        let e = messages(
            &[json!({"role": "user", "content": "x", "images": ["aGk="]})],
            &Default::default(),
        )
        .unwrap_err();
        assert_eq!(e.kind, Kind::Invalid);
        assert!(e.message.contains("/api/chat"), "{}", e.message);
        assert!(messages(
            &[json!({"role": "user", "content": "x", "images": []})],
            &Default::default()
        )
        .is_ok());
        assert!(messages(
            &[json!({"role": "robot", "content": "x"})],
            &Default::default()
        )
        .is_err());
    }

    #[test]
    fn num_ctx_and_num_predict_budget() {
        // No options: the rest of the daemon's context.
        assert_eq!(max_tokens(100, None, 10, None).unwrap(), 90);
        assert_eq!(max_tokens(100, None, 10, Some(-1)).unwrap(), 90);
        assert_eq!(max_tokens(100, None, 10, Some(-2)).unwrap(), 90);
        // A smaller num_ctx caps prompt + reply.
        assert_eq!(max_tokens(100, Some(50), 10, None).unwrap(), 40);
        assert_eq!(max_tokens(100, Some(50), 10, Some(500)).unwrap(), 40);
        assert_eq!(max_tokens(100, Some(50), 10, Some(5)).unwrap(), 5);
        // Larger than the daemon's: a 400 naming both.
        let e = max_tokens(100, Some(101), 10, None).unwrap_err();
        assert_eq!(e.kind, Kind::ContextLength);
        assert!(
            e.message.contains("101") && e.message.contains("100"),
            "{}",
            e.message
        );
        // A prompt that does not fit.
        assert_eq!(
            max_tokens(100, Some(10), 10, None).unwrap_err().kind,
            Kind::ContextLength
        );
        assert!(max_tokens(100, None, 10, Some(0)).is_err());
        assert!(max_tokens(100, Some(0), 10, None).is_err());
    }

    #[test]
    fn tool_choice_forces_the_named_or_any_tool() {
        let sigs = vec![("a".to_owned(), json!({})), ("b".to_owned(), json!({}))];
        assert_eq!(forced_tools(None, &sigs).unwrap(), None);
        assert_eq!(forced_tools(Some(&json!("auto")), &sigs).unwrap(), None);
        assert_eq!(
            forced_tools(Some(&json!("required")), &sigs).unwrap(),
            Some(sigs.clone())
        );
        let one = forced_tools(
            Some(&json!({"type": "function", "function": {"name": "b"}})),
            &sigs,
        );
        assert_eq!(one.unwrap(), Some(vec![sigs[1].clone()]));
        assert!(forced_tools(Some(&json!({"function": {"name": "c"}})), &sigs).is_err());
        assert!(forced_tools(Some(&json!("required")), &[]).is_err());
        assert!(forced_tools(Some(&json!(1)), &sigs).is_err());
    }

    #[test]
    fn think_and_format_values() {
        assert_eq!(think(None).unwrap(), None);
        assert_eq!(think(Some(&json!(false))).unwrap(), Some(false));
        assert_eq!(think(Some(&json!("high"))).unwrap(), Some(true));
        assert!(think(Some(&json!("max"))).is_err());
        assert_eq!(format_grammar(None, None).unwrap(), None);
        assert_eq!(format_grammar(Some(&json!("")), None).unwrap(), None);
        assert!(format_grammar(Some(&json!("xml")), None).is_err());
        assert!(format_grammar(Some(&json!(3)), None).is_err());
    }

    #[test]
    fn shapes_of_dates_calls_and_stats() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000000000Z");
        assert_eq!(rfc3339(1_709_210_096_789), "2024-02-29T12:34:56.789000000Z");
        assert_eq!(
            call_json("f", r#"{"a":1}"#),
            json!({"function": {"name": "f", "arguments": {"a": 1}}})
        );
        assert_eq!(model_name("m:latest"), "m");
        assert!(unloads(&json!(0)) && unloads(&json!("0s")) && unloads(&json!("0")));
        assert!(!unloads(&json!("5m")) && !unloads(&json!(-1)) && !unloads(&json!(null)));
        assert_eq!(model_name("m"), "m");
        assert_eq!(done_reason(&End::MaxTokens), "length");
        assert_eq!(done_reason(&End::Stop("x".into())), "stop");
        let t = Instant::now();
        let clock = Clock {
            started: t,
            admitted: t + std::time::Duration::from_millis(1),
            first: Some(t + std::time::Duration::from_millis(3)),
        };
        let s = stats(&clock, t + std::time::Duration::from_millis(10), 50, 20, 7);
        assert_eq!(s["total_duration"], 10_000_000);
        assert_eq!(s["load_duration"], 1_000_000);
        assert_eq!(s["prompt_eval_count"], 30);
        assert_eq!(s["prompt_eval_duration"], 2_000_000);
        assert_eq!(s["eval_count"], 7);
        assert_eq!(s["eval_duration"], 7_000_000);
    }
}
