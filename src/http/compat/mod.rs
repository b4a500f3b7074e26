//! The compatible routes: OpenAI's (`/v1/chat/completions`,
//! `/v1/completions`, `/v1/models`), Anthropic's (`/v1/messages`,
//! `/v1/messages/count_tokens`), Ollama's (`/api/chat`, `/api/generate`,
//! `/api/tags`, …) and `/metrics`, on the `--web` listener.
//! Each request runs as a fresh, stateless generation (never written to the
//! session log) on the lane's shared prefix cache. docs/compat.md is the
//! user's guide.
//!
//! - [`chat`]: sans-IO — a conversation to prompt tokens, stop sequences.
//! - [`drive`]: one generation, decoded into text, reasoning and tool calls.
//! - [`openai`], [`anthropic`], [`ollama`]: each API's request and reply
//!   shapes.
//! - [`gguf`]: the served file's header metadata and identity (Ollama's
//!   `/api/tags` and `/api/show`).
//! - [`error`]: `ApiError`, each family's error shape and status.
//! - [`locks`]: async locks by key (one per conversation, for its changes).
//! - [`values`]: a body's count of JSON values, walked before it is parsed
//!   (sans-IO).
//!
//! Who may call: `auth::Route::Api` (the token or `--api-key`, by
//! `Authorization: Bearer` or `x-api-key`; a listed Origin or none).

pub mod anthropic;
pub mod chat;
pub mod conversations;
pub mod drive;
pub mod error;
pub mod gguf;
pub mod images;
pub mod locks;
pub mod ollama;
pub mod openai;
pub mod response_ids;
pub mod responses;
pub mod resume;
pub mod values;

use std::time::Instant;

use actix_web::web::{self, Bytes};
use actix_web::{HttpRequest, HttpResponse, HttpResponseBuilder};
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::sync::mpsc;

use self::chat::{ChatError, StopMatcher};
use self::drive::{DriveError, Out, Spec};
use self::error::{ApiError, Family, Kind};
use super::auth::Route;
use super::error::WebError;
use super::routes::{check, read_body, WebState};
use crate::actors::lane::LaneState;
use crate::actors::stateless::StatelessError;
use crate::frontend::conn::dispatch;
use crate::scheduler::{PrefixPin, SchedulerError};
use crate::session::grammar::GrammarError;
use crate::session::output::Markers;
use crate::wire::{Params, Request, Response, Token};

/// The header that reports how many prompt tokens came from the cache.
pub const WARM_HEADER: &str = "x-superfluid-warm";

/// The model the routes serve, as `/v1/models` lists it.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// The GGUF's file stem, e.g. `SmolLM2-135M-Instruct.Q4_1`.
    pub id: String,
    /// When the daemon started (Unix seconds).
    pub created: u64,
    /// The GGUF file.
    pub path: std::path::PathBuf,
    /// Its size, digest and header metadata, read on first use.
    pub identity: std::sync::OnceLock<gguf::Identity>,
}

impl ModelInfo {
    pub fn from_path(path: &std::path::Path, created: u64) -> ModelInfo {
        let id = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "default".into());
        ModelInfo {
            id,
            created,
            path: path.to_path_buf(),
            identity: std::sync::OnceLock::new(),
        }
    }

    /// Whether a request's `model` names this model: its id, its file name,
    /// or `default`.
    pub fn answers_to(&self, name: &str) -> bool {
        name == self.id || name == "default" || name == format!("{}.gguf", self.id)
    }
}

pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route(
        "/v1/chat/completions",
        web::post().to(openai::chat_completions),
    )
    .route("/v1/completions", web::post().to(openai::completions))
    .route("/v1/models", web::get().to(openai::models))
    .route("/v1/models/{id}", web::get().to(openai::model))
    .route("/v1/messages", web::post().to(anthropic::messages))
    .route(
        "/v1/messages/count_tokens",
        web::post().to(anthropic::count_tokens),
    )
    .route("/metrics", web::get().to(metrics))
    .configure(responses_routes)
    .route("/api/chat", web::post().to(ollama::chat))
    .route("/api/generate", web::post().to(ollama::generate))
    .route("/api/tags", web::get().to(ollama::tags))
    .route("/api/ps", web::get().to(ollama::ps))
    .route("/api/show", web::post().to(ollama::show))
    .route("/api/version", web::get().to(ollama::version))
    .route("/api/pull", web::post().to(ollama::pull))
    .route("/api/push", web::post().to(ollama::models_later))
    .route("/api/create", web::post().to(ollama::models_later))
    .route("/api/copy", web::post().to(ollama::models_later))
    .route("/api/delete", web::delete().to(ollama::delete))
    .route("/api/embed", web::post().to(ollama::embeddings))
    .route("/api/embeddings", web::post().to(ollama::embeddings));
}

/// OpenAI's Responses and Conversations routes (stored on sessions).
fn responses_routes(cfg: &mut web::ServiceConfig) {
    use self::{conversations as c, responses as r};
    cfg.route("/v1/responses", web::post().to(r::create))
        .route("/v1/responses/{id}", web::get().to(resume::retrieve))
        .route("/v1/responses/{id}/cancel", web::post().to(resume::cancel))
        .route("/v1/responses/{id}", web::delete().to(r::delete))
        .route(
            "/v1/responses/{id}/input_items",
            web::get().to(r::input_items),
        )
        .route("/v1/conversations", web::post().to(c::create))
        .route("/v1/conversations/{id}", web::get().to(c::retrieve))
        .route("/v1/conversations/{id}", web::post().to(c::update))
        .route("/v1/conversations/{id}", web::delete().to(c::delete))
        .route("/v1/conversations/{id}/items", web::get().to(c::list_items))
        .route("/v1/conversations/{id}/items", web::post().to(c::add_items))
        .route(
            "/v1/conversations/{id}/items/{item_id}",
            web::get().to(c::retrieve_item),
        )
        .route(
            "/v1/conversations/{id}/items/{item_id}",
            web::delete().to(c::delete_item),
        );
}

/// A path under `/v1/` or `/api/` that no route serves (or a method its
/// route does not take): after the credential check, a 404 in the API's
/// own error shape naming the method and path (the SDKs show its message).
/// Any other path: a 404 with the browser transport's `{"Err": {message}}`.
pub async fn no_route(req: HttpRequest, state: web::Data<WebState>) -> HttpResponse {
    let path = req.path();
    let family = if path.starts_with("/v1/messages") {
        Family::Anthropic
    } else if path.starts_with("/v1/") {
        Family::OpenAi
    } else if path.starts_with("/api/") {
        Family::Ollama
    } else {
        return HttpResponse::NotFound().json(Response::err(format!(
            "no route serves {} {path}",
            req.method()
        )));
    };
    let e = match authorize(&state, family, &req) {
        Err(e) => e,
        Ok(()) => ApiError::new(
            family,
            Kind::NotFound,
            format!("no route serves {} {path}", req.method()),
        ),
    };
    actix_web::ResponseError::error_response(&e)
}

/// Authorizes a request of the compatible routes and reads its JSON body.
pub(crate) async fn accept<T: DeserializeOwned>(
    state: &WebState,
    family: Family,
    req: &HttpRequest,
    payload: web::Payload,
) -> Result<T, ApiError> {
    authorize(state, family, req)?;
    let body = read_body(req, payload)
        .await
        .map_err(|e| web_error(family, e))?;
    parse(family, &body)
}

pub(crate) fn authorize(
    state: &WebState,
    family: Family,
    req: &HttpRequest,
) -> Result<(), ApiError> {
    check(state, Route::Api, req).map_err(|e| web_error(family, e))
}

fn web_error(family: Family, e: WebError) -> ApiError {
    match e {
        WebError::Denied(d) => ApiError::denied(family, d),
        WebError::TooLarge { .. } => ApiError::new(family, Kind::TooLarge, e.to_string()),
        other => ApiError::invalid(family, other.to_string()),
    }
}

/// The body as `T`; serde's message names the field at fault. A body of
/// more than [`values::MAX_VALUES`] JSON values is a 413 before it is parsed.
pub(crate) fn parse<T: DeserializeOwned>(family: Family, body: &Bytes) -> Result<T, ApiError> {
    if !values::within(body, values::MAX_VALUES) {
        return Err(ApiError::new(
            family,
            Kind::TooLarge,
            format!(
                "the body holds more than {} JSON values",
                values::MAX_VALUES
            ),
        ));
    }
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(family, format!("the body is not JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::invalid(family, "the body must be a JSON object"));
    }
    serde_json::from_value(value).map_err(|e| ApiError::invalid(family, e.to_string()))
}

/// 404 unless `name` is the model `state` looks at (see [`pick`]).
pub(crate) fn check_model(state: &WebState, family: Family, name: &str) -> Result<(), ApiError> {
    if state.m().model.answers_to(name) {
        Ok(())
    } else {
        Err(no_model(state, family, name))
    }
}

/// The state looking at the model a request's `model` names (an id, a file
/// name, or "default"); 404 naming the served models when none.
pub(crate) fn pick(state: &WebState, family: Family, name: &str) -> Result<WebState, ApiError> {
    state
        .pick(name)
        .ok_or_else(|| no_model(state, family, name))
}

fn no_model(state: &WebState, family: Family, name: &str) -> ApiError {
    let ids: Vec<&str> = state.models.iter().map(|v| v.model.id.as_str()).collect();
    let served = if ids.len() == 1 {
        format!("this daemon serves {:?}", ids[0])
    } else {
        format!("this daemon serves {ids:?}")
    };
    ApiError::new(
        family,
        Kind::NoModel,
        format!("the model {name:?} does not exist; {served}"),
    )
    .with_param("model")
}

/// 503 unless the lane's worker is up.
pub(crate) fn check_lane(state: &WebState, family: Family) -> Result<(), ApiError> {
    // A loading lane is waited for, an unloaded one loads; a worker that
    // died is reported.
    match *state.m().lane.borrow() {
        LaneState::Ready | LaneState::Loading | LaneState::Unloaded => Ok(()),
        LaneState::Unreachable => {
            let down: Vec<String> = state
                .m()
                .shared
                .rpc
                .lock()
                .map(|s| s.clone())
                .unwrap_or_default()
                .into_iter()
                .filter_map(|s| s.down.map(|why| format!("{} ({why})", s.server)))
                .collect();
            Err(ApiError::new(
                family,
                Kind::Unavailable,
                format!(
                    "the RPC server{} holding the model's layers cannot be reached: {}; the \
                     model refuses work until it answers again",
                    if down.len() > 1 { "s" } else { "" },
                    down.join(", ")
                ),
            ))
        }
        other => Err(ApiError::new(
            family,
            Kind::Unavailable,
            format!("the model's worker is not ready ({})", other.name()),
        )),
    }
}

/// The prompt must leave room for at least one token, and `max_tokens`
/// (when asked) must be at least 1 and fit beside it. Returns the
/// generation's `max_tokens`: what was asked, or the rest of the context.
pub(crate) fn budget(
    state: &WebState,
    family: Family,
    prompt: usize,
    asked: Option<u32>,
    param: &'static str,
    prompt_param: &'static str,
) -> Result<u32, ApiError> {
    let n_ctx = state.m().shared.n_ctx as usize;
    if prompt >= n_ctx {
        return Err(ApiError::new(
            family,
            Kind::ContextLength,
            format!(
                "the prompt is {prompt} tokens, and this model's context is {n_ctx} tokens \
                 (--ctx-size): it must be shorter to leave room for a reply"
            ),
        )
        .with_param(prompt_param));
    }
    match asked {
        Some(0) => {
            Err(ApiError::invalid(family, format!("{param} must be at least 1")).with_param(param))
        }
        Some(n) if prompt + n as usize > n_ctx => Err(ApiError::new(
            family,
            Kind::ContextLength,
            format!(
                "the prompt ({prompt} tokens) and {param} ({n}) add up to more than this \
                 model's context of {n_ctx} tokens (--ctx-size)"
            ),
        )
        .with_param(param)),
        Some(n) => Ok(n),
        None => Ok((n_ctx - prompt) as u32),
    }
}

/// A conversation's error as the route's error.
pub(crate) fn chat_error(family: Family, e: ChatError) -> ApiError {
    let param = match e {
        ChatError::Stops => "stop",
        ChatError::TooManyTools { .. } => "tools",
        _ => "messages",
    };
    ApiError::invalid(family, e.to_string()).with_param(param)
}

/// Runs `f`, whose inputs are `bytes` long, inline when that is small, on a
/// render thread otherwise (`render_pool::run_sized`), so the HTTP worker
/// serves other requests while a long prompt renders and tokenizes; in the
/// route's error shape.
pub(crate) async fn off_worker<T: Send + 'static>(
    family: Family,
    bytes: usize,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ApiError> {
    crate::actors::render_pool::run_sized(bytes, f)
        .await
        .ok_or_else(|| {
            ApiError::new(
                family,
                Kind::Internal,
                "the prompt could not be rendered (no render thread)",
            )
        })
}

/// A request's prompt (`chat::prompt_with_images` when a message holds
/// images, else `chat::prompt_tokens`), in the route's error shape,
/// rendered [`off_worker`]. On the Anthropic and Ollama routes a final
/// assistant message is continued (`chat::continue_last`): their APIs
/// document it ("prefill"); OpenAI's chat route answers after it.
pub(crate) async fn render_prompt(
    state: &WebState,
    family: Family,
    msgs: &[chat::Msg],
    tools: &[String],
) -> Result<(chat::Prompt, Vec<crate::wire::worker::MediaSpan>), ApiError> {
    // The caps first: they bound what is copied to the render thread.
    chat::check(msgs, tools.len()).map_err(|e| chat_error(family, e))?;
    // Everything the template renders: texts, calls (an agent's history
    // can be all arguments), tools; a message with images renders the
    // conversation twice, so it always goes off the worker.
    let calls = |m: &chat::Msg| -> usize {
        m.calls
            .iter()
            .map(|c| c.id.len() + c.name.len() + c.arguments.len())
            .sum()
    };
    let mut bytes: usize = msgs.iter().map(|m| m.text.len() + calls(m)).sum::<usize>()
        + tools.iter().map(String::len).sum::<usize>();
    if msgs.iter().any(|m| !m.images.is_empty()) {
        bytes = bytes.max(crate::actors::render_pool::INLINE_BYTES);
    }
    let render = state.m().shared.render.clone();
    let (msgs, tools) = (msgs.to_vec(), tools.to_vec());
    let prefill = family != Family::OpenAi && chat::ends_with_prefill(&msgs);
    off_worker(family, bytes, move || {
        let (mut prompt, media) = if msgs.iter().any(|m| !m.images.is_empty()) {
            chat::prompt_with_images(render.as_ref(), &msgs, &tools)?
        } else {
            (chat::prompt_tokens(render.as_ref(), &msgs, &tools)?, vec![])
        };
        if prefill {
            chat::continue_last(render.as_ref(), &msgs, &tools, &mut prompt)?;
        }
        Ok((prompt, media))
    })
    .await?
    .map_err(|e| chat_error(family, e))
}

/// A generation that did not start, as the route's error.
pub(crate) fn drive_error(family: Family, e: DriveError) -> ApiError {
    match e {
        DriveError::Refused(StatelessError::Refused(SchedulerError::DoesNotFit {
            tokens,
            n_ctx,
        })) => ApiError::new(
            family,
            Kind::ContextLength,
            format!("the prompt ({tokens} tokens) does not fit the context ({n_ctx} tokens)"),
        ),
        DriveError::Refused(StatelessError::Refused(other)) => {
            ApiError::invalid(family, other.to_string())
        }
        DriveError::Refused(StatelessError::SchedulerGone(e)) => {
            ApiError::new(family, Kind::Unavailable, e.to_string())
        }
        DriveError::Failed(message) => ApiError::new(family, Kind::Unavailable, message),
        DriveError::Own(message) => ApiError::invalid(family, message),
    }
}

/// The grammar for a JSON schema, after the thinking block is closed when
/// the generation opens inside one.
pub(crate) fn json_grammar(
    family: Family,
    schema: &Value,
    close_reasoning: Option<&str>,
) -> Result<String, ApiError> {
    let bad = |e: GrammarError| {
        ApiError::invalid(family, format!("the JSON schema has no grammar: {e}"))
            .with_param("response_format")
    };
    let convert = |schema: &str| {
        crate::engine::json_schema_grammar(schema).map_err(|e| GrammarError::Convert(e.to_string()))
    };
    crate::session::grammar::json_format(schema, close_reasoning, &convert).map_err(bad)
}

/// The thinking block's closing marker, when the generation prompt opened
/// one (a grammar must close it before what it forces).
pub(crate) fn close_reasoning(markers: &Markers, in_reasoning: bool) -> Option<String> {
    markers
        .think
        .as_ref()
        .filter(|_| in_reasoning)
        .map(|(_, c)| c.clone())
}

/// The grammar forcing one call to one of `tools` (name and parameters
/// schema), after `close` when the turn opened in a thinking block; a 400 of
/// the route's family when it cannot be built.
pub(crate) fn forced_grammar(
    family: Family,
    tools: &[(String, Value)],
    close: Option<&str>,
) -> Result<String, ApiError> {
    let convert = |schema: &str| {
        crate::engine::json_schema_grammar(schema).map_err(|e| GrammarError::Convert(e.to_string()))
    };
    crate::session::grammar::forced_call(tools, close, &convert)
        .map_err(|e| ApiError::invalid(family, e.to_string()).with_param("tool_choice"))
}

/// The markers of the served template, and whether a generation prompt
/// `header` opens a thinking block.
pub(crate) fn markers(state: &WebState, header: &[Token]) -> (Markers, bool) {
    let render = &state.m().shared.render;
    let markers = Markers::from_template(&render.template_source());
    let opens = markers.think.as_ref().is_some_and(|(open, _)| {
        render
            .detokenize(header)
            .trim_end()
            .ends_with(open.as_str())
    });
    (markers, opens)
}

/// A request's `seed`: OpenAI's is a signed 64-bit integer (-1 is common),
/// ours unsigned; a negative one is taken as its two's complement, so each
/// seed still names one stream of draws.
pub(crate) fn any_seed<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Seed {
        Unsigned(u64),
        Signed(i64),
    }
    Ok(
        <Option<Seed> as serde::Deserialize>::deserialize(d)?.map(|s| match s {
            Seed::Unsigned(u) => u,
            Seed::Signed(i) => i as u64,
        }),
    )
}

/// Sampling parameters with the APIs' documented defaults (temperature 1,
/// top_p 1, no top-k or min-p) and a fresh seed when none is given.
pub(crate) fn params(
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<u32>,
    min_p: Option<f32>,
    seed: Option<u64>,
    family: Family,
) -> Result<Params, ApiError> {
    let temperature = temperature.unwrap_or(1.0);
    let top_p = top_p.unwrap_or(1.0);
    let min_p = min_p.unwrap_or(0.0);
    // Each API's own range: OpenAI's 0-2, Anthropic's 0-1; Ollama takes
    // any (llama.cpp's sampler does), finite and not below 0.
    let (max, range) = match family {
        Family::OpenAi => (2.0, "between 0 and 2"),
        Family::Anthropic => (1.0, "between 0 and 1"),
        Family::Ollama => (f32::MAX, "a finite number of at least 0"),
    };
    if !(0.0..=max).contains(&temperature) {
        return Err(
            ApiError::invalid(family, format!("temperature must be {range}"))
                .with_param("temperature"),
        );
    }
    if !(0.0..=1.0).contains(&top_p) {
        return Err(ApiError::invalid(family, "top_p must be between 0 and 1").with_param("top_p"));
    }
    if !(0.0..=1.0).contains(&min_p) {
        return Err(ApiError::invalid(family, "min_p must be between 0 and 1").with_param("min_p"));
    }
    let seed = seed.unwrap_or_else(|| {
        let mut b = [0u8; 8];
        let _ = getrandom::fill(&mut b);
        u64::from_le_bytes(b)
    });
    Ok(Params {
        temperature,
        top_p,
        min_p,
        top_k: top_k.unwrap_or(0),
        seed,
    })
}

/// What a chat request asks to generate, before it runs.
pub(crate) struct Prepared {
    pub prompt: Vec<Token>,
    pub max_tokens: u32,
    pub grammar: Option<String>,
    pub markers: Markers,
    pub in_reasoning: bool,
    /// An Anthropic breakpoint: the prompt's first `len` tokens are pinned
    /// for `ttl` ms once the request finishes.
    pub pin: Option<(usize, u64)>,
    /// OpenAI's penalties, logit bias and log-probabilities.
    pub extras: Option<crate::wire::SampleExtras>,
    /// The images on `prompt` (offsets into it).
    pub media: Vec<crate::wire::worker::MediaSpan>,
}

/// Starts the `n` generations of one request; the first's warm prefix is
/// the request's. Identical prompts admitted together prefill once: the
/// scheduler seeds the others from the first (its waiter rule).
pub(crate) async fn start_all(
    state: &WebState,
    family: Family,
    p: &Prepared,
    n: u32,
    base: crate::wire::Params,
    stop: &[String],
    trim_leading: bool,
) -> Result<(u64, Vec<mpsc::Receiver<Out>>), ApiError> {
    let stops = StopMatcher::new(stop.to_vec()).map_err(|e| chat_error(family, e))?;
    let mut runs = Vec::new();
    let mut warm = 0;
    let starts = (0..n).map(|i| {
        let mut params = base;
        params.seed = base.seed.wrapping_add(u64::from(i));
        let spec = Spec {
            prompt: p.prompt.clone(),
            params,
            max_tokens: p.max_tokens,
            grammar: p.grammar.clone(),
            stops: stops.clone(),
            markers: p.markers.clone(),
            in_reasoning: p.in_reasoning,
            trim_leading,
            pin: p.pin.map(|(len, ttl_ms)| PrefixPin { len, ttl_ms }),
            extras: p.extras.clone(),
            media: p.media.clone(),
        };
        drive::start(&state.m().shared, spec)
    });
    for (i, run) in futures_util::future::join_all(starts)
        .await
        .into_iter()
        .enumerate()
    {
        let run = run.map_err(|e| drive_error(family, e))?;
        if i == 0 {
            warm = run.warm;
        }
        runs.push(run.out);
    }
    Ok((warm, runs))
}

/// The most characters of a request's `model` its access line shows.
const ACCESS_MODEL_MAX_CHARS: usize = 128;

/// One line per request of the compatible routes, never its content.
pub(crate) struct Access {
    pub method: &'static str,
    pub path: &'static str,
    /// The request's `model` as the line shows it: the client's text,
    /// escaped and cut ([`crate::logging::log_field`]), set before it is
    /// checked (an unknown model's 404 is logged too).
    model: String,
    pub prompt: usize,
    pub cached: u64,
    pub generated: u64,
    pub started: Instant,
}

impl Access {
    pub fn new(path: &'static str, model: &str, started: Instant) -> Access {
        Access {
            method: "POST",
            path,
            model: crate::logging::log_field(model, ACCESS_MODEL_MAX_CHARS),
            prompt: 0,
            cached: 0,
            generated: 0,
            started,
        }
    }

    /// The request's `model`, once its body is read.
    pub fn set_model(&mut self, model: &str) {
        self.model = crate::logging::log_field(model, ACCESS_MODEL_MAX_CHARS);
    }

    pub fn log(&self, status: u16) {
        crate::histogram::HTTP_REQUESTS.observe(self.path, status, self.started.elapsed());
        log::info!(
            target: "superfluid::access",
            "{} {} {} model={} prompt={} cached={} generated={} wall_ms={}",
            self.method,
            self.path,
            status,
            self.model,
            self.prompt,
            self.cached,
            self.generated,
            self.started.elapsed().as_millis()
        );
    }
}

/// A reply builder with the warm header set.
pub(crate) fn ok_with_warm(warm: u64) -> HttpResponseBuilder {
    let mut r = HttpResponse::Ok();
    r.insert_header((WARM_HEADER, warm.to_string()));
    r
}

/// Logs a failed request and passes its error on.
pub(crate) fn logged(access: &Access, e: ApiError) -> ApiError {
    use actix_web::ResponseError;
    access.log(e.status_code().as_u16());
    e
}

/// One server-sent event: `data: <json>` (and `event: <name>` when named).
pub(crate) fn sse(event: Option<&str>, data: &Value) -> Bytes {
    let mut s = String::new();
    if let Some(e) = event {
        s.push_str("event: ");
        s.push_str(e);
        s.push('\n');
    }
    s.push_str("data: ");
    s.push_str(&data.to_string());
    s.push_str("\n\n");
    Bytes::from(s)
}

/// A streamed reply: server-sent events from `rx`, with the warm header.
pub(crate) fn event_stream(warm: u64, rx: tokio::sync::mpsc::Receiver<Bytes>) -> HttpResponse {
    let body = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
    });
    ok_with_warm(warm)
        .insert_header(("content-type", "text/event-stream"))
        .insert_header(("cache-control", "no-cache"))
        .streaming(body)
}

/// `?model=ID` on /metrics.
#[derive(Debug, serde::Deserialize)]
struct MetricsQuery {
    model: Option<String>,
}

/// `GET /metrics`: the Prometheus text of the `Metrics` request, of the
/// first model or of the one `?model=ID` names.
async fn metrics(req: HttpRequest, state: web::Data<WebState>) -> Result<HttpResponse, ApiError> {
    authorize(&state, Family::OpenAi, &req)?;
    let query = web::Query::<MetricsQuery>::from_query(req.query_string())
        .map_err(|e| ApiError::invalid(Family::OpenAi, format!("the query: {e}")))?;
    let state = match query.into_inner().model {
        Some(name) => pick(&state, Family::OpenAi, &name)?,
        None => state.at(0),
    };
    match dispatch(&state.m().registry, Request::Metrics).await {
        Response::Text { text } => Ok(HttpResponse::Ok()
            .insert_header(("content-type", "text/plain; version=0.0.4; charset=utf-8"))
            .body(text)),
        other => Err(ApiError::new(
            Family::OpenAi,
            Kind::Internal,
            format!("unexpected reply to Metrics: {other:?}"),
        )),
    }
}

/// Milliseconds → seconds since the Unix epoch.
pub(crate) fn now_secs() -> u64 {
    crate::actors::now_ms() / 1000
}

/// A random hex id with a prefix (`chatcmpl-…`, `msg_…`, `call_…`).
pub(crate) fn new_id(prefix: &str) -> String {
    let mut b = [0u8; 12];
    let _ = getrandom::fill(&mut b);
    format!("{prefix}{}", hex::encode(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A large prompt renders on a render thread, not the HTTP worker; a
    /// small one inline.
    #[actix_rt::test]
    async fn a_large_prompt_renders_off_the_http_worker() {
        let here = std::thread::current().id();
        let id = || std::thread::current().id();
        let small = crate::actors::render_pool::INLINE_BYTES - 1;
        assert_eq!(off_worker(Family::OpenAi, small, id).await.unwrap(), here);
        let large = crate::actors::render_pool::INLINE_BYTES;
        assert_ne!(off_worker(Family::OpenAi, large, id).await.unwrap(), here);
    }
}
