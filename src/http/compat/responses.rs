//! OpenAI's Responses API on durable sessions: `POST /v1/responses`,
//! `GET`/`DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`
//! (docs/responses.md).
//!
//! A stored response (`store` true, the default) is a committed point of a
//! session: its input items are appended to a session (a new one, a fork of
//! the previous response's session at that response's end, or a
//! conversation's), the session generates, and the response's id,
//! `resp_<session>_<first event>_<tag>`, names where its events begin (the
//! tag: only ids the daemon issued resolve, response_ids.rs). Everything
//! the routes return (output items, input items, the chain) is read back
//! from the log, so it survives a restart. `store: false` runs statelessly
//! on the chat route's machinery and leaves nothing in the log.
//!
//! One [`Emitter`] turns the output, live or read back, into the response
//! object and the streamed semantic events, so both always agree; resume.rs
//! replays and follows a stored response's stream with it.

use std::collections::{HashMap, HashSet};

use actix_web::web::{self, Bytes};
use actix_web::{HttpRequest, HttpResponse};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::chat::{call_text, Call, MAX_MESSAGES, MAX_TOOLS};
use super::drive::{End, Out};
use super::error::{ApiError, Family, Kind};
use super::openai::{prepare_chat, ChatRequest};
pub(crate) use super::response_ids::{owner, parse_response_id, response_id, Resolved};
use super::{
    accept, authorize, check_lane, check_model, event_stream, new_id, now_secs, ok_with_warm,
    params, pick, sse, start_all, Access,
};
use crate::actors::registry::{DispatchStream, Owners};
use crate::actors::session::STREAM_REPLY_CAPACITY;
use crate::frontend::conn::dispatch;
use crate::http::routes::WebState;
use crate::session::grammar::GrammarError;
use crate::session::output::Markers;
use crate::session::{
    input_after, ledger_of, output_schema_of, tool_choice_of, ChatMessage, Owned,
};
use crate::wire::{
    Channel, Event, EventId, Finish, Inspection, LedgerEntry, Params, PurgeMode, Record, Request,
    Response, Role, SessionId,
};

const F: Family = Family::OpenAi;

/// The most items one `input` (or one conversation's `items`) may carry.
pub const MAX_ITEMS: usize = MAX_MESSAGES;
/// The most items a list route returns in one page.
pub const MAX_PAGE: usize = 100;

/// The fields of `POST /v1/responses` superfluid reads; others are ignored.
#[derive(Debug, Deserialize)]
pub struct CreateRequest {
    pub model: String,
    #[serde(default)]
    pub input: Option<Value>,
    pub instructions: Option<String>,
    pub previous_response_id: Option<String>,
    pub conversation: Option<Value>,
    pub store: Option<bool>,
    #[serde(default)]
    pub stream: bool,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub max_output_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub metadata: Option<Value>,
    /// `text.format`: text, json_object or json_schema.
    pub text: Option<Value>,
    /// `disabled` (the default) or `auto`; echoed. Neither drops input: an
    /// input over the context is a 400 either way (docs/responses.md).
    pub truncation: Option<String>,
}

/// One input item, whichever shape it came in.
#[derive(Debug, Clone, PartialEq)]
pub enum Item {
    Message {
        role: Role,
        text: String,
    },
    /// A call the model made, resent by the client.
    Call(Call),
    /// A tool's output answering `call_id`.
    Output {
        call_id: String,
        output: String,
    },
}

fn role_name(r: Role) -> &'static str {
    match r {
        Role::System => "system",
        Role::User => "user",
        Role::Assistant => "assistant",
        Role::Tool => "tool",
    }
}

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::invalid(F, message).with_param("input")
}

pub(crate) fn not_found(what: &str, id: &str) -> ApiError {
    ApiError::new(F, Kind::NotFound, format!("no {what} with id {id:?}"))
}

/// A message's content: a string or a list of text parts.
fn content_text(v: Option<&Value>) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for p in parts {
                match p.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text") => out.push_str(
                        p.get("text")
                            .and_then(Value::as_str)
                            .ok_or_else(|| bad("a text part has no text"))?,
                    ),
                    Some("input_image" | "input_file" | "input_audio") => {
                        return Err(bad(
                            "only text input is served (no vision projector is loaded)",
                        ))
                    }
                    other => return Err(bad(format!("unknown content part type {other:?}"))),
                }
            }
            Ok(out)
        }
        Some(other) => Err(bad(format!(
            "a message's content must be text, not {other}"
        ))),
    }
}

/// `input` (a string or a list of items) as items; capped before any work.
pub fn items(input: Option<&Value>) -> Result<Vec<Item>, ApiError> {
    let list = match input {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => {
            return Ok(vec![Item::Message {
                role: Role::User,
                text: s.clone(),
            }])
        }
        Some(Value::Array(list)) => list,
        Some(other) => {
            return Err(bad(format!(
                "input must be a string or a list, not {other}"
            )))
        }
    };
    if list.len() > MAX_ITEMS {
        return Err(bad(format!(
            "at most {MAX_ITEMS} input items per request ({} given)",
            list.len()
        )));
    }
    let mut out = Vec::new();
    for (i, v) in list.iter().enumerate() {
        let Some(o) = v.as_object() else {
            return Err(bad(format!("input item {i} is not an object")));
        };
        let str_field = |k: &str| -> Result<String, ApiError> {
            o.get(k)
                .and_then(Value::as_str)
                .map(str::to_owned)
                .ok_or_else(|| bad(format!("input item {i} has no {k:?}")))
        };
        let ty = o.get("type").and_then(Value::as_str);
        match ty {
            None | Some("message") => {
                let role = match o.get("role").and_then(Value::as_str) {
                    Some("user") => Role::User,
                    Some("system" | "developer") => Role::System,
                    Some("assistant") => Role::Assistant,
                    other => {
                        return Err(bad(format!(
                            "input item {i}: role {other:?} is not user, system, developer or \
                             assistant"
                        )))
                    }
                };
                let text = content_text(o.get("content"))?;
                out.push(Item::Message { role, text });
            }
            Some("function_call") => out.push(Item::Call(Call {
                id: str_field("call_id")?,
                name: str_field("name")?,
                arguments: str_field("arguments")?,
            })),
            Some("function_call_output") => {
                let output = match o.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(v @ Value::Array(_)) => content_text(Some(v))?,
                    _ => return Err(bad(format!("input item {i} has no \"output\""))),
                };
                out.push(Item::Output {
                    call_id: str_field("call_id")?,
                    output,
                })
            }
            // The model's own reasoning, resent: the session or the template
            // has it already.
            Some("reasoning") => {}
            Some(other) => {
                return Err(bad(format!(
                    "input item {i}: type {other:?} is not served (message, function_call, \
                     function_call_output, reasoning)"
                )))
            }
        }
    }
    Ok(out)
}

/// A Responses function tool (`{"type": "function", "name", ...}`) in the
/// chat form the templates and the session take.
pub fn chat_tool(t: &Value) -> Result<Value, ApiError> {
    let bad = |m: String| ApiError::invalid(F, m).with_param("tools");
    match t.get("type").and_then(Value::as_str) {
        Some("function") => {}
        other => {
            return Err(bad(format!(
                "tool type {other:?} is not served: only function tools"
            )))
        }
    }
    if t.get("function").is_some() {
        return Ok(t.clone());
    }
    let name = t
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("a function tool has no name".into()))?;
    let mut f = json!({"name": name});
    for k in ["description", "parameters"] {
        if let Some(v) = t.get(k).filter(|v| !v.is_null()) {
            f[k] = v.clone();
        }
    }
    Ok(json!({"type": "function", "function": f}))
}

/// `tool_choice` in the chat form: `auto`, `none`, `required`, or a named
/// function.
fn chat_choice(c: &Value) -> Result<Value, ApiError> {
    match c {
        Value::String(s) if matches!(s.as_str(), "auto" | "none" | "required") => Ok(c.clone()),
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o
                .get("name")
                .or_else(|| o.get("function").and_then(|f| f.get("name")))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ApiError::invalid(F, "tool_choice names no function").with_param("tool_choice")
                })?;
            Ok(json!({"type": "function", "function": {"name": name}}))
        }
        other => Err(ApiError::invalid(
            F,
            format!("tool_choice {other} is not auto, none, required or a function"),
        )
        .with_param("tool_choice")),
    }
}

// ---------------------------------------------------------------- ids

fn parse_pair(id: &str, prefix: &str) -> Option<(u64, u64)> {
    let (a, b) = id.strip_prefix(prefix)?.split_once('_')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

/// A call id's parts: `call_<session>_<event>` names the `ToolUse` event by
/// the session that made it and its id there; `call_<event>` (what
/// superfluid named calls before 2026-12) names an event of the session
/// it is sent to.
fn parse_call(call_id: &str) -> Option<(Option<SessionId>, EventId)> {
    if let Some(pair) = parse_pair(call_id, "call_") {
        return Some((Some(pair.0), pair.1));
    }
    Some((None, call_id.strip_prefix("call_")?.parse().ok()?))
}

/// Names a session's tool calls (and items). An event id is unique only
/// within a session, and a fork shares its parent's events under their ids,
/// so a call is named by the session that made it and its id there: two
/// sessions' calls never share a name (agents refuse a reused call id), and
/// a call keeps its name in every fork and rebase that shares it.
#[derive(Debug, Clone)]
pub struct CallNames {
    s: SessionId,
    /// The session's runs by maker (`SessionBook::owners`), in view order
    /// (shared by the clones each turn's decoder takes). Past them, an
    /// event is the session's own.
    runs: std::sync::Arc<[Owned]>,
}

impl CallNames {
    /// For a session's own events only (what it generates from now on).
    pub fn own(s: SessionId) -> CallNames {
        CallNames {
            s,
            runs: std::sync::Arc::new([]),
        }
    }

    pub fn session(&self) -> SessionId {
        self.s
    }

    /// Who made event `e` of the session, and its id there.
    fn maker(&self, e: EventId) -> (SessionId, EventId) {
        let i = self.runs.partition_point(|r| r.at + r.len <= e);
        self.runs
            .get(i)
            .filter(|r| r.at <= e)
            .map_or((self.s, e), |r| (r.owner, r.owner_at + (e - r.at)))
    }

    /// The id of the call event `e` of the session made (a `ToolResult`'s
    /// `call_id` as `Read` gives it: an id in this session).
    pub fn name(&self, e: EventId) -> String {
        self.item("call", e)
    }

    /// `<prefix>_<maker>_<id there>`: the id of the item event `e` opens,
    /// the same in every fork and rebase that shares the event.
    pub fn item(&self, prefix: &str, e: EventId) -> String {
        let (owner, at) = self.maker(e);
        format!("{prefix}_{owner}_{at}")
    }

    /// The session's event a call id names, if the call is one of its own
    /// or one it shares with the session that made it.
    pub fn event(&self, call_id: &str) -> Option<EventId> {
        let (owner, at) = parse_call(call_id)?;
        let Some(owner) = owner else {
            return Some(at);
        };
        let shared = self
            .runs
            .iter()
            .find(|r| r.owner == owner && (r.owner_at..r.owner_at + r.len).contains(&at));
        match shared {
            Some(r) => Some(r.at + (at - r.owner_at)),
            // Made here after the runs were read.
            None if owner == self.s && self.runs.iter().all(|r| r.at + r.len <= at) => Some(at),
            None => None,
        }
    }
}

/// The call names of session `s`.
pub(crate) async fn call_names(state: &WebState, s: SessionId) -> Result<CallNames, ApiError> {
    match state.m().registry.send(Owners(s)).await {
        Ok(Ok(runs)) => Ok(CallNames {
            s,
            runs: runs.into(),
        }),
        Ok(Err(e)) => Err(ApiError::new(F, Kind::NotFound, e.to_string())),
        Err(e) => Err(ApiError::new(
            F,
            Kind::Internal,
            format!("the daemon is shutting down: {e}"),
        )),
    }
}

// ---------------------------------------------------------------- sessions

/// One session request; its `Err` as a 400 (or 404 when it names no
/// session).
pub(crate) async fn call(state: &WebState, request: Request) -> Result<Response, ApiError> {
    match dispatch(&state.m().registry, request).await {
        Response::Err { message } => {
            let kind = if message.contains("no session") || message.contains("purged") {
                Kind::NotFound
            } else {
                Kind::Invalid
            };
            Err(ApiError::new(F, kind, message))
        }
        other => Ok(other),
    }
}

/// Runs `write`, a sequence of session requests that must not stop
/// half-way (a session made and then filled, items appended one by one, a
/// branch made and then named), on a task of its own, and waits for it.
/// actix drops a handler's future where it waits when its client resets
/// the connection: run in the handler, such a sequence would stop between
/// two requests and leave a half-made session or a half-written input
/// behind. The task runs to its end (its own clean-up included) whatever
/// the client does; what it answers is dropped if no one waits for it.
pub(crate) async fn to_the_end<T: 'static>(
    write: impl std::future::Future<Output = Result<T, ApiError>> + 'static,
) -> Result<T, ApiError> {
    actix_rt::spawn(write).await.map_err(|e| {
        ApiError::new(
            F,
            Kind::Internal,
            format!("a request's writes did not finish: {e}"),
        )
    })?
}

fn unexpected(r: Response) -> ApiError {
    ApiError::new(F, Kind::Internal, format!("unexpected reply {r:?}"))
}

pub(crate) async fn inspect(
    state: &WebState,
    s: SessionId,
) -> Result<Option<Inspection>, ApiError> {
    match dispatch(&state.m().registry, Request::Inspect { session: s }).await {
        Response::Inspection { inspection } if !inspection.purged => Ok(Some(inspection)),
        Response::Inspection { .. } | Response::Err { .. } => Ok(None),
        other => Err(unexpected(other)),
    }
}

/// When session `s` was made (its header record's time), purged or not:
/// what its responses' ids are tagged with.
async fn made_ms(state: &WebState, s: SessionId) -> Option<u64> {
    match dispatch(&state.m().registry, Request::Inspect { session: s }).await {
        Response::Inspection { inspection } => Some(inspection.created_unix_ms),
        _ => None,
    }
}

pub(crate) async fn read(state: &WebState, s: SessionId) -> Result<Vec<Event>, ApiError> {
    match call(
        state,
        Request::Read {
            session: s,
            cursor: 0,
        },
    )
    .await?
    {
        Response::Events { events } => Ok(events),
        other => Err(unexpected(other)),
    }
}

/// A request that makes a session (Create, Fork, Rebase, Trim): the new
/// session's id.
pub(crate) async fn created(state: &WebState, request: Request) -> Result<SessionId, ApiError> {
    match call(state, request).await? {
        Response::Created { session } => Ok(session),
        other => Err(unexpected(other)),
    }
}

pub(crate) async fn create_session(state: &WebState, p: Params) -> Result<SessionId, ApiError> {
    created(
        state,
        Request::Create {
            parent: None,
            params: p,
        },
    )
    .await
}

/// `items` as the input of a new session, which has no open call: every
/// output answers a call resent before it in the same items, and every
/// resent call's text can be written (what [`item_requests`] checks,
/// against an empty history). Pure, so a route can refuse such items
/// before it makes the session.
pub(crate) fn check_fresh_items(items: &[Item]) -> Result<(), ApiError> {
    requests_after(items, &CallNames::own(0), &[]).map(|_| ())
}

/// The requests that append `items` after `events`, the history of the
/// session whose calls `names` names (see [`item_requests`]), the calls
/// and resent calls of the history read from `events`: the one check of a
/// stored response's input before its session is made or forked, of a
/// new conversation's items and of a `store: false` continuation's input
/// (which names its outputs' calls by what they answer here).
fn requests_after(
    items: &[Item],
    names: &CallNames,
    events: &[Event],
) -> Result<Vec<(Request, Option<String>)>, ApiError> {
    item_requests(
        names.session(),
        items,
        names,
        &ledger_of(events),
        &Resents::of(events),
    )
}

/// A client's item that the session holds as a message, recorded with
/// what the message does not say: the `kind` of the `Block` it is
/// appended as, as JSON. `AppendBlock` renders exactly as `AppendMessage`
/// would (a message of its role, the payload its content), so the model
/// sees the same tokens; the kind lets the items read back as the client
/// gave them. A resent `function_call` is an assistant block holding the
/// model's own call text, with `{"type": "function_call", "call_id",
/// "name", "arguments"}` (the arguments as given, not re-serialised); the
/// `function_call_output` answering it is a tool block holding the
/// output, with `{"type": "function_call_output", "call_id"}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Resent {
    FunctionCall {
        call_id: String,
        name: String,
        arguments: String,
    },
    FunctionCallOutput {
        call_id: String,
    },
}

impl Resent {
    /// The block's `kind`.
    fn kind(&self) -> String {
        // A plain enum of strings always serialises; the fallback is never
        // taken.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// What a block's `kind` records, if it is a resent item's.
    pub fn of(kind: &str) -> Option<Resent> {
        serde_json::from_str(kind).ok()
    }
}

/// The calls a client resent in a session's history (its [`Resent`]
/// blocks), by call id: whether each has been answered (by a
/// `function_call_output` block for its id after it). An unanswered one is
/// an open call a later request's output may answer, once, as a session's
/// own open call is.
#[derive(Debug, Default)]
pub(crate) struct Resents(HashMap<String, bool>);

impl Resents {
    /// The resent calls of a session with `events`.
    pub(crate) fn of(events: &[Event]) -> Resents {
        let mut calls = HashMap::new();
        for e in events {
            if let Record::Block { kind, .. } = &e.body {
                match Resent::of(kind) {
                    Some(Resent::FunctionCall { call_id, .. }) => {
                        calls.insert(call_id, false);
                    }
                    Some(Resent::FunctionCallOutput { call_id }) => {
                        if let Some(answered) = calls.get_mut(&call_id) {
                            *answered = true;
                        }
                    }
                    None => {}
                }
            }
        }
        Resents(calls)
    }

    /// Whether call `call_id` was resent, and if so whether it has been
    /// answered.
    fn answered(&self, call_id: &str) -> Option<bool> {
        self.0.get(call_id).copied()
    }
}

/// The session requests that append `items` to session `s`, whose calls
/// `names` names and `ledger` says how each stands and whose history
/// resent the calls `history` holds, each with the call id an output
/// answers (for its errors); every output's call checked before anything
/// is written. A resent call goes in as the model's own call text (a
/// [`Resent`] block), its `call_id` used by no call resent before it (in
/// the same items or the history) and naming no call of the model's the
/// session holds; an output answers a call resent in the same items or
/// an unanswered one resent earlier in the history (a tool message, a
/// [`Resent`] block too), or an open call of the session
/// (`AppendToolResult`; it is taken first when a resent call has the name
/// of one), once.
fn item_requests(
    s: SessionId,
    items: &[Item],
    names: &CallNames,
    ledger: &[LedgerEntry],
    history: &Resents,
) -> Result<Vec<(Request, Option<String>)>, ApiError> {
    let mut resent: HashSet<&str> = HashSet::new();
    let mut answered_resent: HashSet<&str> = HashSet::new();
    let mut answered: HashSet<EventId> = HashSet::new();
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        out.push(match item {
            Item::Message { role, text } => (
                Request::AppendMessage {
                    session: s,
                    role: (*role).into(),
                    text: text.clone(),
                },
                None,
            ),
            Item::Call(c) => {
                if own_call(&c.id, names, ledger) {
                    return Err(bad(format!(
                        "function_call call_id {:?} names a call the model made in this \
                         response chain or conversation; call ids must be unique",
                        c.id
                    )));
                }
                if !resent.insert(c.id.as_str()) || history.answered(&c.id).is_some() {
                    return Err(bad(format!(
                        "function_call call_id {:?} is used by an earlier function_call item; \
                         call ids must be unique",
                        c.id
                    )));
                }
                (
                    Request::AppendBlock {
                        session: s,
                        role: Role::Assistant.into(),
                        kind: Resent::FunctionCall {
                            call_id: c.id.clone(),
                            name: c.name.clone(),
                            arguments: c.arguments.clone(),
                        }
                        .kind(),
                        payload: call_text(c).map_err(|e| bad(e.to_string()))?,
                    },
                    None,
                )
            }
            Item::Output { call_id, output }
                if resent.contains(call_id.as_str())
                    || open_resent(call_id, names, ledger, history)? =>
            {
                if !answered_resent.insert(call_id.as_str()) {
                    return Err(answered_twice(call_id));
                }
                (
                    Request::AppendBlock {
                        session: s,
                        role: Role::Tool.into(),
                        kind: Resent::FunctionCallOutput {
                            call_id: call_id.clone(),
                        }
                        .kind(),
                        payload: output.clone(),
                    },
                    None,
                )
            }
            Item::Output { call_id, output } => (
                Request::AppendToolResult {
                    session: s,
                    call_id: open_call(call_id, names, ledger, &mut answered)?,
                    content: output.clone(),
                },
                Some(call_id.clone()),
            ),
        });
    }
    Ok(out)
}

/// Whether `call_id` answers a call resent earlier in the history
/// (`history`) rather than an open call of the session's own: it names no
/// call the session holds, and a resent call has that id. One already
/// answered is refused.
fn open_resent(
    call_id: &str,
    names: &CallNames,
    ledger: &[LedgerEntry],
    history: &Resents,
) -> Result<bool, ApiError> {
    match history.answered(call_id) {
        _ if own_call(call_id, names, ledger) => Ok(false),
        Some(true) => Err(bad(format!(
            "function_call_output answers call {call_id:?}, which was already answered"
        ))),
        Some(false) => Ok(true),
        None => Ok(false),
    }
}

/// Whether `call_id` names a call the model made that the session holds
/// (open or not), in either form.
fn own_call(call_id: &str, names: &CallNames, ledger: &[LedgerEntry]) -> bool {
    names
        .event(call_id)
        .is_some_and(|e| ledger.iter().any(|x| x.call_id == e))
}

/// The event of the open call `call_id` names, not answered before in the
/// same items (`answered`, which takes it): what the session will take a
/// result for. Checked here because the session refuses an output only
/// when it comes to it, after the items before it were written.
fn open_call(
    call_id: &str,
    names: &CallNames,
    ledger: &[LedgerEntry],
    answered: &mut HashSet<EventId>,
) -> Result<EventId, ApiError> {
    let entry = names
        .event(call_id)
        .and_then(|e| ledger.iter().find(|x| x.call_id == e))
        .ok_or_else(|| {
            bad(format!(
                "function_call_output answers call {call_id:?}, which is not a call of this \
                 response chain or conversation"
            ))
        })?;
    if entry.closed_by.is_some() {
        return Err(bad(format!(
            "function_call_output answers call {call_id:?}, which was already answered ({})",
            entry.status
        )));
    }
    if !answered.insert(entry.call_id) {
        return Err(answered_twice(call_id));
    }
    Ok(entry.call_id)
}

/// The refusal of a second output for call `call_id` in the same items.
fn answered_twice(call_id: &str) -> ApiError {
    bad(format!(
        "call {call_id:?} is answered by two function_call_output items"
    ))
}

/// Whether `items` need the calls of the history they follow: an output
/// may answer one of them, and a resent call may not reuse the id of one
/// resent before.
fn need_calls(items: &[Item]) -> bool {
    items
        .iter()
        .any(|i| matches!(i, Item::Output { .. } | Item::Call(_)))
}

/// The call names, the ledger and the resent calls `items` need on session
/// `s` (none unless [`need_calls`]).
async fn calls_of(
    state: &WebState,
    s: SessionId,
    items: &[Item],
) -> Result<(CallNames, Vec<LedgerEntry>, Resents), ApiError> {
    if !need_calls(items) {
        return Ok((CallNames::own(s), Vec::new(), Resents::default()));
    }
    let names = call_names(state, s).await?;
    let ledger = match call(state, Request::Ledger { session: s }).await? {
        Response::Ledger { entries } => entries,
        other => return Err(unexpected(other)),
    };
    Ok((names, ledger, Resents::of(&read(state, s).await?)))
}

/// What a stored response puts on its session's input, checked against
/// the history it will follow before anything is written: a refusal
/// leaves no item, no fork, no new session and no moved conversation.
pub(crate) struct Input<'a> {
    pub items: &'a [Item],
    /// The system turn (instructions, tools) a session opens with when
    /// nothing is on its input yet.
    pub system: Option<(Option<&'a str>, &'a [String])>,
}

impl Input<'_> {
    /// Checks the input against `events`, the history of session `s` it
    /// would follow (a fork of `s` at their end shares them under the same
    /// ids), or against an empty history for a new session (`s` None):
    /// every output answers a call resent with it or an open one of the
    /// history, and the input leaves room in the context for a token of
    /// reply.
    pub(crate) async fn check(
        &self,
        state: &WebState,
        s: Option<SessionId>,
        events: &[Event],
    ) -> Result<(), ApiError> {
        if need_calls(self.items) {
            let names = match s {
                Some(s) => call_names(state, s).await?,
                None => CallNames::own(0),
            };
            requests_after(self.items, &names, events)?;
        }
        self.check_fit(state, events).await
    }

    /// The input rendered after `events` as the session will render it,
    /// with the assistant header a generation opens with, must be shorter
    /// than the context: the session would refuse the generation only
    /// after the input was written (a 503, and the input left in a
    /// conversation for every later response to fail on). The render of
    /// the history runs on a render thread, not the HTTP worker.
    async fn check_fit(&self, state: &WebState, events: &[Event]) -> Result<(), ApiError> {
        let messages = self
            .items
            .iter()
            .map(|item| {
                Ok(match item {
                    Item::Message { role, text } => ChatMessage {
                        role: *role,
                        content: text.clone(),
                    },
                    Item::Call(c) => ChatMessage {
                        role: Role::Assistant,
                        content: call_text(c).map_err(|e| bad(e.to_string()))?,
                    },
                    Item::Output { output, .. } => ChatMessage {
                        role: Role::Tool,
                        content: output.clone(),
                    },
                })
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        let render = state.m().shared.render.clone();
        let events = events.to_vec();
        let system = self
            .system
            .map(|(text, tools)| (text.map(str::to_string), tools.to_vec()));
        let tokens = crate::actors::render_pool::run(move || {
            let system = system
                .as_ref()
                .map(|(text, tools)| (text.as_deref(), tools.as_slice()));
            input_after(&events, system, &messages, render.as_ref())
        })
        .await
        .ok_or_else(|| bad("the input could not be rendered (no render thread)"))?
        .map_err(|e| bad(format!("the input cannot be rendered: {}", e.0)))?;
        super::budget(state, F, tokens, None, "max_output_tokens", "input").map(|_| ())
    }
}

/// Appends `items` to session `s` (see [`item_requests`]): nothing is
/// written unless every output answers an open call. A refusal of the
/// items names `param`, the request field that carried them (`input` on
/// a response, `items` on the conversation routes).
pub(crate) async fn append_items(
    state: &WebState,
    s: SessionId,
    items: &[Item],
    param: &'static str,
) -> Result<(), ApiError> {
    let (names, ledger, history) = calls_of(state, s, items).await?;
    let requests =
        item_requests(s, items, &names, &ledger, &history).map_err(|e| e.with_param(param))?;
    for (request, call_id) in requests {
        call(state, request).await.map_err(|mut e| {
            if e.kind == Kind::NotFound {
                return e;
            }
            if let Some(id) = &call_id {
                e.message = format!("function_call_output for call {id:?}: {}", e.message);
            }
            e.with_param(param)
        })?;
    }
    Ok(())
}

// ---------------------------------------------------------------- output

/// One piece of output, with the id of the item it opens (when it opens
/// one).
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Text {
        id: String,
        text: String,
    },
    Reasoning {
        id: String,
        text: String,
    },
    Call {
        id: String,
        call_id: String,
        name: String,
        arguments: String,
    },
}

/// Turns a session's output events into pieces: drops the text channel's
/// leading whitespace and the thinking block's markers, as the chat route
/// does.
pub struct Decode {
    names: CallNames,
    think: Option<(String, String)>,
    text_started: bool,
}

impl Decode {
    /// For the session's own events (what it generates).
    pub fn new(s: SessionId, markers: &Markers) -> Decode {
        Decode::named(CallNames::own(s), markers)
    }

    /// For any of the session's events, its calls named by `names`.
    pub fn named(names: CallNames, markers: &Markers) -> Decode {
        Decode {
            names,
            think: markers.think.clone(),
            text_started: false,
        }
    }

    pub fn piece(&mut self, e: &Event) -> Option<Piece> {
        let id = e.event_id;
        match &e.body {
            Record::Generated {
                text,
                channel: Channel::Reasoning,
                ..
            } => {
                let text = match &self.think {
                    Some((open, close)) => text.replace(open.as_str(), "").replace(close, ""),
                    None => text.clone(),
                };
                (!text.is_empty()).then(|| Piece::Reasoning {
                    id: self.names.item("rs", id),
                    text,
                })
            }
            Record::Generated {
                text,
                channel: Channel::Text,
                ..
            }
            | Record::ToolParseFailure { text, .. } => {
                let mut text = text.clone();
                if !self.text_started {
                    text = text.trim_start().to_owned();
                    if text.is_empty() {
                        return None;
                    }
                    self.text_started = true;
                }
                Some(Piece::Text {
                    id: self.names.item("msg", id),
                    text,
                })
            }
            Record::ToolUse { name, arguments } => Some(Piece::Call {
                id: self.names.item("fc", id),
                call_id: self.names.name(id),
                name: name.clone(),
                arguments: arguments.clone(),
            }),
            _ => None,
        }
    }
}

/// How a response ended.
#[derive(Debug, Clone, Default)]
pub struct Ending {
    /// `completed`, `incomplete`, `cancelled`, `failed` or `in_progress`.
    pub status: &'static str,
    pub incomplete: Option<&'static str>,
    pub error: Option<String>,
    pub input_tokens: u64,
    pub cached_tokens: u64,
    pub output_tokens: u64,
    /// The output tokens of reasoning (its markup included).
    pub reasoning_tokens: u64,
}

/// A running response's token counts: its input, output, and the output's
/// reasoning.
#[derive(Debug, Clone, Copy, Default)]
struct Totals {
    input: u64,
    output: u64,
    reasoning: u64,
}

impl Totals {
    /// Puts the counts on `ending`.
    fn onto(self, ending: &mut Ending) {
        ending.input_tokens = self.input;
        ending.output_tokens = self.output;
        ending.reasoning_tokens = self.reasoning;
    }
}

impl Ending {
    fn of(finish: Finish) -> Ending {
        let (status, incomplete) = match finish {
            Finish::MaxTokens => ("incomplete", Some("max_output_tokens")),
            Finish::Cancelled => ("cancelled", None),
            Finish::Error => ("failed", None),
            Finish::Open => ("in_progress", None),
            Finish::EndOfTurn | Finish::Grammar => ("completed", None),
        };
        Ending {
            status,
            incomplete,
            ..Ending::default()
        }
    }
}

/// What a response echoes of its request.
#[derive(Debug, Clone)]
pub struct Head {
    pub id: String,
    pub created_at: u64,
    pub model: String,
    pub instructions: Option<String>,
    pub tools: Vec<Value>,
    pub tool_choice: Value,
    pub temperature: f32,
    pub top_p: f32,
    pub max_output_tokens: Option<u32>,
    pub previous_response_id: Option<String>,
    pub conversation: Option<String>,
    pub store: bool,
    pub metadata: Value,
    /// `text.format` as the response echoes it.
    pub text_format: Value,
    /// `truncation` as the request gave it (a stored response read back:
    /// `disabled`).
    pub truncation: &'static str,
}

enum Open {
    Message { id: String, text: String },
    Reasoning { id: String, text: String },
}

/// The response object and its semantic events, built from pieces.
pub struct Emitter {
    head: Head,
    seq: u64,
    output: Vec<Value>,
    open: Option<Open>,
    ending: Option<Ending>,
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({"id": id, "type": "message", "role": "assistant", "status": status,
           "content": if status == "in_progress" && text.is_empty() { json!([]) } else {
               json!([text_part(text)]) }})
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

fn reasoning_item(id: &str, text: &str) -> Value {
    json!({"id": id, "type": "reasoning", "summary": [],
           "content": [{"type": "reasoning_text", "text": text}]})
}

fn call_item(id: &str, call_id: &str, name: &str, arguments: &str, status: &str) -> Value {
    json!({"id": id, "type": "function_call", "status": status, "call_id": call_id,
           "name": name, "arguments": arguments})
}

impl Emitter {
    pub fn new(head: Head) -> Emitter {
        Emitter {
            head,
            seq: 0,
            output: Vec::new(),
            open: None,
            ending: None,
        }
    }

    fn event(&mut self, ty: &str, mut body: Value) -> Value {
        body["type"] = json!(ty);
        body["sequence_number"] = json!(self.seq);
        self.seq += 1;
        body
    }

    /// `response.created` and `response.in_progress`.
    pub fn start(&mut self) -> Vec<Value> {
        let r = self.response();
        vec![
            self.event("response.created", json!({"response": r})),
            self.event("response.in_progress", json!({"response": r})),
        ]
    }

    fn index(&self) -> usize {
        self.output.len()
    }

    fn close(&mut self) -> Vec<Value> {
        let i = self.index();
        match self.open.take() {
            None => Vec::new(),
            Some(Open::Message { id, text }) => {
                let item = message_item(&id, &text, "completed");
                let out = vec![
                    self.event(
                        "response.output_text.done",
                        json!({"item_id": id, "output_index": i, "content_index": 0,
                               "text": text, "logprobs": []}),
                    ),
                    self.event(
                        "response.content_part.done",
                        json!({"item_id": id, "output_index": i, "content_index": 0,
                               "part": text_part(&text)}),
                    ),
                    self.event(
                        "response.output_item.done",
                        json!({"output_index": i, "item": item}),
                    ),
                ];
                self.output.push(item);
                out
            }
            Some(Open::Reasoning { id, text }) => {
                let item = reasoning_item(&id, &text);
                let out = vec![
                    self.event(
                        "response.reasoning_text.done",
                        json!({"item_id": id, "output_index": i, "content_index": 0,
                               "text": text}),
                    ),
                    self.event(
                        "response.output_item.done",
                        json!({"output_index": i, "item": item}),
                    ),
                ];
                self.output.push(item);
                out
            }
        }
    }

    pub fn push(&mut self, piece: Piece) -> Vec<Value> {
        let mut out = Vec::new();
        match piece {
            Piece::Text { id, text } => {
                if !matches!(self.open, Some(Open::Message { .. })) {
                    out.extend(self.close());
                    let i = self.index();
                    out.push(self.event(
                        "response.output_item.added",
                        json!({"output_index": i, "item": message_item(&id, "", "in_progress")}),
                    ));
                    out.push(self.event(
                        "response.content_part.added",
                        json!({"item_id": id, "output_index": i, "content_index": 0,
                               "part": text_part("")}),
                    ));
                    self.open = Some(Open::Message {
                        id,
                        text: String::new(),
                    });
                }
                let i = self.index();
                let Some(Open::Message { id, text: all }) = &mut self.open else {
                    unreachable!("a message was just opened")
                };
                all.push_str(&text);
                let id = id.clone();
                out.push(self.event(
                    "response.output_text.delta",
                    json!({"item_id": id, "output_index": i, "content_index": 0,
                           "delta": text, "logprobs": []}),
                ));
            }
            Piece::Reasoning { id, text } => {
                if !matches!(self.open, Some(Open::Reasoning { .. })) {
                    out.extend(self.close());
                    let i = self.index();
                    out.push(self.event(
                        "response.output_item.added",
                        json!({"output_index": i, "item": reasoning_item(&id, "")}),
                    ));
                    self.open = Some(Open::Reasoning {
                        id,
                        text: String::new(),
                    });
                }
                let i = self.index();
                let Some(Open::Reasoning { id, text: all }) = &mut self.open else {
                    unreachable!("a reasoning item was just opened")
                };
                all.push_str(&text);
                let id = id.clone();
                out.push(self.event(
                    "response.reasoning_text.delta",
                    json!({"item_id": id, "output_index": i, "content_index": 0,
                           "delta": text}),
                ));
            }
            Piece::Call {
                id,
                call_id,
                name,
                arguments,
            } => {
                out.extend(self.close());
                let i = self.index();
                out.push(self.event(
                    "response.output_item.added",
                    json!({"output_index": i,
                           "item": call_item(&id, &call_id, &name, "", "in_progress")}),
                ));
                out.push(self.event(
                    "response.function_call_arguments.delta",
                    json!({"item_id": id, "output_index": i, "delta": arguments}),
                ));
                out.push(self.event(
                    "response.function_call_arguments.done",
                    json!({"item_id": id, "output_index": i, "name": name,
                           "arguments": arguments}),
                ));
                let item = call_item(&id, &call_id, &name, &arguments, "completed");
                out.push(self.event(
                    "response.output_item.done",
                    json!({"output_index": i, "item": item}),
                ));
                self.output.push(item);
            }
        }
        out
    }

    /// Closes the open item and sends `response.completed` (or
    /// `.incomplete`, `.failed`).
    pub fn finish(&mut self, ending: Ending) -> Vec<Value> {
        let mut out = self.close();
        let ty = match ending.status {
            "incomplete" => "response.incomplete",
            "failed" => "response.failed",
            _ => "response.completed",
        };
        self.ending = Some(ending);
        let r = self.response();
        out.push(self.event(ty, json!({"response": r})));
        out
    }

    /// The response object as it stands.
    pub fn response(&self) -> Value {
        let h = &self.head;
        let (status, incomplete, error, usage) = match &self.ending {
            None => ("in_progress", Value::Null, Value::Null, Value::Null),
            Some(e) => (
                e.status,
                e.incomplete.map_or(Value::Null, |r| json!({"reason": r})),
                e.error.as_ref().map_or(
                    Value::Null,
                    |m| json!({"code": "server_error", "message": m}),
                ),
                json!({
                    "input_tokens": e.input_tokens,
                    "input_tokens_details": {"cached_tokens": e.cached_tokens},
                    "output_tokens": e.output_tokens,
                    "output_tokens_details": {"reasoning_tokens": e.reasoning_tokens},
                    "total_tokens": e.input_tokens + e.output_tokens,
                }),
            ),
        };
        json!({
            "id": h.id,
            "object": "response",
            "created_at": h.created_at,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": h.instructions,
            "max_output_tokens": h.max_output_tokens,
            "model": h.model,
            "output": self.output,
            "parallel_tool_calls": true,
            "previous_response_id": h.previous_response_id,
            "conversation": h.conversation.as_ref().map(|c| json!({"id": c})),
            "reasoning": {"effort": null, "summary": null},
            "store": h.store,
            "temperature": h.temperature,
            "text": {"format": h.text_format},
            "tool_choice": h.tool_choice,
            "tools": h.tools,
            "top_p": h.top_p,
            "truncation": h.truncation,
            "usage": usage,
            "metadata": h.metadata,
        })
    }
}

/// A request's function tool as its response echoes it: `strict` as the
/// request gave it (`chat` is its chat form).
fn echoed_tool(given: &Value, chat: &Value) -> Value {
    let mut t = response_tool(chat);
    let strict = given
        .get("strict")
        .or_else(|| given.get("function").and_then(|f| f.get("strict")));
    if let Some(strict) = strict.filter(|v| v.is_boolean()) {
        t["strict"] = strict.clone();
    }
    t
}

/// A Responses function tool as the response echoes it.
fn response_tool(chat: &Value) -> Value {
    let f = chat.get("function").unwrap_or(chat);
    json!({"type": "function", "name": f.get("name"), "description": f.get("description"),
           "parameters": f.get("parameters"), "strict": false})
}

/// `text.format`: what the response echoes, and the JSON schema the output
/// must follow (None for free text).
pub(crate) fn text_format(text: Option<&Value>) -> Result<(Value, Option<Value>), ApiError> {
    let bad = |m: &str| ApiError::invalid(F, m.to_owned()).with_param("text.format");
    let Some(text) = text else {
        return Ok((json!({"type": "text"}), None));
    };
    if !text.is_object() {
        return Err(ApiError::invalid(F, "text must be an object").with_param("text"));
    }
    let Some(format) = text.get("format") else {
        return Ok((json!({"type": "text"}), None));
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok((json!({"type": "text"}), None)),
        Some("json_object") => Ok((
            json!({"type": "json_object"}),
            Some(json!({"type": "object"})),
        )),
        Some("json_schema") => {
            let schema = format
                .get("schema")
                .filter(|s| s.is_object())
                .ok_or_else(|| bad("a json_schema format needs a `schema` object"))?;
            let name = format
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("a json_schema format needs a `name`"))?;
            if name.is_empty()
                || name.len() > 64
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            {
                return Err(bad(
                    "the format's name must be 1 to 64 letters, digits, underscores or dashes",
                ));
            }
            let echo = json!({"type": "json_schema", "name": name, "schema": schema,
                              "description": format.get("description"),
                              "strict": format.get("strict").and_then(Value::as_bool).unwrap_or(false)});
            Ok((echo, Some(schema.clone())))
        }
        _ => Err(bad(
            "text.format.type must be text, json_object or json_schema",
        )),
    }
}

fn response_choice(chat: &Value) -> Value {
    match chat.get("function").and_then(|f| f.get("name")) {
        Some(name) => json!({"type": "function", "name": name}),
        None => chat.clone(),
    }
}

// ---------------------------------------------------------------- create

/// Where a response's pieces come from.
enum Source {
    Session(mpsc::Receiver<Response>, Decode),
    Stateless(mpsc::Receiver<Out>),
}

/// The next piece, or how the response ended.
enum Step {
    Piece(Piece),
    Skip,
    Ended(Ending),
}

impl Source {
    /// The client went away. A stored response runs on to its end: its
    /// events go into the log, where a retrieve or a resumed stream
    /// (`starting_after`) reads them, and `/cancel` stops it. A stateless
    /// one is cancelled by dropping its source.
    async fn run_on(mut self, totals: &mut Totals) {
        if let Source::Session(..) = self {
            while !matches!(self.next(totals).await, Step::Ended(_)) {}
        }
    }

    async fn next(&mut self, totals: &mut Totals) -> Step {
        match self {
            Source::Session(rx, decode) => match rx.recv().await {
                Some(Response::Delta { event }) => {
                    // The assistant header a new turn opens with is input
                    // (as a retrieve and the chat route count it); the
                    // rest is output.
                    let n = event.body.span().len() as u64;
                    match event.body {
                        Record::GenerationPrompt { .. } => totals.input += n,
                        Record::Generated {
                            channel: Channel::Reasoning,
                            ..
                        } => {
                            totals.output += n;
                            totals.reasoning += n;
                        }
                        _ => totals.output += n,
                    }
                    match decode.piece(&event) {
                        Some(p) => Step::Piece(p),
                        None => Step::Skip,
                    }
                }
                Some(Response::Generated {
                    finish,
                    warm_prefix,
                    ..
                }) => Step::Ended(Ending {
                    cached_tokens: warm_prefix,
                    ..Ending::of(finish)
                }),
                Some(Response::Err { message }) => Step::Ended(Ending {
                    status: "failed",
                    error: Some(message),
                    ..Ending::default()
                }),
                Some(_) => Step::Skip,
                None => Step::Ended(Ending {
                    status: "failed",
                    error: Some("the generation ended without a summary".into()),
                    ..Ending::default()
                }),
            },
            Source::Stateless(rx) => match rx.recv().await {
                Some(Out::Text { reasoning, text }) => Step::Piece(if reasoning {
                    Piece::Reasoning {
                        id: new_id("rs_"),
                        text,
                    }
                } else {
                    Piece::Text {
                        id: new_id("msg_"),
                        text,
                    }
                }),
                Some(Out::Call { name, arguments }) => Step::Piece(Piece::Call {
                    id: new_id("fc_"),
                    call_id: new_id("call_"),
                    name,
                    arguments,
                }),
                Some(Out::Logprob(_)) => Step::Skip,
                Some(Out::Ended {
                    end,
                    generated,
                    reasoning,
                }) => {
                    totals.output = u64::from(generated);
                    totals.reasoning = u64::from(reasoning);
                    let finish = match end {
                        End::MaxTokens => Finish::MaxTokens,
                        End::Cancelled => Finish::Cancelled,
                        End::Turn | End::Stop(_) => Finish::EndOfTurn,
                    };
                    Step::Ended(Ending::of(finish))
                }
                Some(Out::Failed(message) | Out::Refused(message)) => Step::Ended(Ending {
                    status: "failed",
                    error: Some(message),
                    ..Ending::default()
                }),
                None => Step::Ended(Ending {
                    status: "failed",
                    error: Some("the generation ended without a reason".into()),
                    ..Ending::default()
                }),
            },
        }
    }
}

/// A response ready to run: what it echoes, its source, the prompt's size
/// and how much of it was cached (stateless), for usage.
struct Running {
    head: Head,
    source: Source,
    input_tokens: u64,
    warm: u64,
    /// A stored response's warm prefix, told when its generation starts
    /// (the session reports it only at its end otherwise).
    started: Option<tokio::sync::oneshot::Receiver<u64>>,
}

/// `POST /v1/responses`.
pub async fn create(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<WebState>,
) -> Result<HttpResponse, ApiError> {
    let started = std::time::Instant::now();
    let r: CreateRequest = accept(&state, F, &req, payload).await?;
    let mut access = Access::new("/v1/responses", &r.model, started);
    let state = pick(&state, F, &r.model).map_err(|e| super::logged(&access, e))?;
    // Its writes (a session or fork made, the input appended, the
    // generation asked for) run to their end if the client goes away.
    let stream_it = r.stream;
    let running = to_the_end(async move { prepare(&state, &r).await })
        .await
        .map_err(|e| super::logged(&access, e))?;
    access.prompt = running.input_tokens as usize;
    if stream_it {
        // The x-superfluid-warm header goes out before the stream: a stored
        // response's is known once its generation starts (not started, it
        // failed, which the stream tells).
        let mut running = running;
        if let Some(started) = running.started.take() {
            running.warm = started.await.unwrap_or(0);
        }
        access.cached = running.warm;
        Ok(stream(running, access))
    } else {
        access.cached = running.warm;
        let Running {
            head,
            mut source,
            input_tokens,
            warm,
            ..
        } = running;
        let mut em = Emitter::new(head);
        let mut totals = Totals {
            input: input_tokens,
            ..Totals::default()
        };
        loop {
            match source.next(&mut totals).await {
                Step::Piece(p) => {
                    em.push(p);
                }
                Step::Skip => {}
                Step::Ended(mut ending) => {
                    totals.onto(&mut ending);
                    ending.cached_tokens = ending.cached_tokens.max(warm);
                    // The assistant header the turn opened with is input too.
                    access.prompt = totals.input as usize;
                    access.generated = totals.output;
                    access.cached = ending.cached_tokens;
                    let failed = ending.status == "failed";
                    em.finish(ending);
                    if failed {
                        access.log(503);
                        let message = em.response()["error"]["message"]
                            .as_str()
                            .unwrap_or("the generation failed")
                            .to_owned();
                        return Err(ApiError::new(F, Kind::Unavailable, message));
                    }
                    access.log(200);
                    return Ok(ok_with_warm(access.cached).json(em.response()));
                }
            }
        }
    }
}

fn stream(running: Running, mut access: Access) -> HttpResponse {
    let Running {
        head,
        mut source,
        input_tokens,
        warm,
        ..
    } = running;
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    actix_rt::spawn(async move {
        let mut em = Emitter::new(head);
        let send = |events: Vec<Value>| {
            let tx = tx.clone();
            async move {
                for e in events {
                    let ty = e["type"].as_str().unwrap_or("").to_owned();
                    if tx.send(sse(Some(&ty), &e)).await.is_err() {
                        return false;
                    }
                }
                true
            }
        };
        let mut totals = Totals {
            input: input_tokens,
            ..Totals::default()
        };
        if !send(em.start()).await {
            access.log(499);
            source.run_on(&mut totals).await;
            return;
        }
        loop {
            match source.next(&mut totals).await {
                Step::Piece(p) => {
                    if !send(em.push(p)).await {
                        access.log(499);
                        source.run_on(&mut totals).await;
                        return;
                    }
                }
                Step::Skip => {}
                Step::Ended(mut ending) => {
                    totals.onto(&mut ending);
                    ending.cached_tokens = ending.cached_tokens.max(warm);
                    // The assistant header the turn opened with is input too.
                    access.prompt = totals.input as usize;
                    access.generated = totals.output;
                    access.cached = ending.cached_tokens;
                    let status = if ending.status == "failed" { 503 } else { 200 };
                    send(em.finish(ending)).await;
                    access.log(status);
                    return;
                }
            }
        }
    });
    event_stream(warm, rx)
}

fn conversation_arg(v: &Value) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Object(o) => o
            .get("id")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| {
                ApiError::invalid(F, "conversation has no id").with_param("conversation")
            }),
        _ => Err(ApiError::invalid(F, "conversation must be an id").with_param("conversation")),
    }
}

/// Checks a request, resolves where it runs, appends its input and starts
/// its generation.
async fn prepare(state: &WebState, r: &CreateRequest) -> Result<Running, ApiError> {
    check_model(state, F, &r.model)?;
    check_lane(state, F)?;
    if let Some(m) = &r.metadata {
        super::conversations::check_metadata(m)?;
    }
    let items = items(r.input.as_ref())?;
    let tools = r.tools.as_deref().unwrap_or_default();
    if tools.len() > MAX_TOOLS {
        return Err(ApiError::invalid(
            F,
            format!(
                "at most {MAX_TOOLS} tools per request ({} given)",
                tools.len()
            ),
        )
        .with_param("tools"));
    }
    let chat_tools: Vec<Value> = tools.iter().map(chat_tool).collect::<Result<_, _>>()?;
    let choice = r.tool_choice.as_ref().map(chat_choice).transpose()?;
    let truncation = match r.truncation.as_deref() {
        None | Some("disabled") => "disabled",
        Some("auto") => "auto",
        Some(other) => {
            return Err(ApiError::invalid(
                F,
                format!("truncation must be \"auto\" or \"disabled\", not {other:?}"),
            )
            .with_param("truncation"))
        }
    };
    let (format_echo, schema) = text_format(r.text.as_ref())?;
    if let Some(schema) = &schema {
        // Refused here, before any session is touched, when it has no grammar
        // (converted off this thread, into the cache the session plans from).
        let bad = |e: GrammarError| {
            ApiError::invalid(F, format!("the JSON schema has no grammar: {e}"))
                .with_param("text.format")
        };
        if let Some(why) = crate::session::schema_limits::check_schema(schema) {
            return Err(bad(GrammarError::Limit(why)));
        }
        crate::actors::session::grammar_of(&schema.to_string())
            .await
            .map_err(bad)?;
    }
    let p = params(r.temperature, r.top_p, None, None, None, F)?;
    if r.max_output_tokens == Some(0) {
        return Err(ApiError::invalid(F, "max_output_tokens must be at least 1")
            .with_param("max_output_tokens"));
    }
    let conversation = r.conversation.as_ref().map(conversation_arg).transpose()?;
    if conversation.is_some() && r.previous_response_id.is_some() {
        return Err(ApiError::invalid(
            F,
            "previous_response_id and conversation cannot both be given",
        )
        .with_param("conversation"));
    }
    // Conversations are made on the default model's log (POST
    // /v1/conversations names no model), and a session is its model's.
    if let (Some(id), true) = (&conversation, state.current != 0) {
        return Err(ApiError::invalid(
            F,
            format!(
                "conversation {id} is kept by the default model {:?}; a response on it must ask \
                 for that model (or \"default\"), not {:?}",
                state.models[0].model.id,
                state.m().model.id
            ),
        )
        .with_param("model"));
    }
    let store = r.store.unwrap_or(true);
    let head = Head {
        id: String::new(),
        created_at: now_secs(),
        model: state.m().model.id.clone(),
        instructions: r.instructions.clone(),
        tools: tools
            .iter()
            .zip(&chat_tools)
            .map(|(t, c)| echoed_tool(t, c))
            .collect(),
        tool_choice: choice.as_ref().map_or(json!("auto"), response_choice),
        temperature: p.temperature,
        top_p: p.top_p,
        max_output_tokens: r.max_output_tokens,
        previous_response_id: r.previous_response_id.clone(),
        conversation: conversation.clone(),
        store,
        metadata: r.metadata.clone().unwrap_or_else(|| json!({})),
        text_format: format_echo,
        truncation,
    };
    if !store {
        if conversation.is_some() {
            return Err(
                ApiError::invalid(F, "store: false cannot add to a conversation")
                    .with_param("store"),
            );
        }
        return stateless(state, r, head, items, chat_tools, choice, p).await;
    }
    if items.is_empty() {
        return Err(bad("input must hold at least one item"));
    }
    let tool_texts: Vec<String> = chat_tools.iter().map(Value::to_string).collect();
    let system = (r.instructions.is_some() || !chat_tools.is_empty())
        .then_some((r.instructions.as_deref(), tool_texts.as_slice()));
    // Checked against the tools the response's session will declare before
    // any session is made or forked (refused there, it left one behind).
    let wanted_choice = match &choice {
        Some(Value::String(c)) if c != "none" => c.clone(),
        Some(Value::Object(o)) => o
            .get("function")
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
            .unwrap_or("auto")
            .to_owned(),
        _ => "auto".to_owned(),
    };
    // A previous response: forked at its end, unless this request gives
    // other instructions or tools than the chain's system turn (below).
    let mut items = items;
    let mut chain = None;
    let mut replayed_from = None;
    if let Some(prev) = &r.previous_response_id {
        let (ps, events, end) = previous_chain(state, prev).await?;
        let history = &events[..end as usize];
        let wanted = system.map(|(text, tools)| (text.map(str::to_owned), tools.to_vec()));
        let had = system_turn(history);
        if wanted.is_none() || wanted == had {
            // The tools the fork declares: the chain's.
            let (_, declared) = had.unwrap_or_default();
            check_choice(&wanted_choice, &declared)?;
            chain = Some((ps, end, events));
        } else {
            // OpenAI's instructions and tools are each request's own: the
            // chain's history goes on after this request's system turn, in
            // a new session (a template declares them in the first turn
            // only, so the history is rendered again).
            let mut all = replay_items(&call_names(state, ps).await?, history)?;
            for item in &items {
                let Item::Output { call_id, .. } = item else {
                    continue;
                };
                let answered = all
                    .iter()
                    .any(|h| matches!(h, Item::Output { call_id: c, .. } if c == call_id));
                if answered {
                    return Err(bad(format!(
                        "function_call_output answers call {call_id:?}, which was already \
                         answered"
                    ))
                    .with_param("input"));
                }
            }
            all.append(&mut items);
            items = all;
            replayed_from = Some(prev.clone());
        }
    }
    match &conversation {
        // A new session declares this request's tools.
        None if chain.is_none() => check_choice(&wanted_choice, &tool_texts)?,
        None => {}
        // A conversation declares them only while it has no input; after
        // that, its system turn's stand. Checked before anything is
        // appended to it or it moves to a branch.
        Some(conv) => {
            let cs = super::conversations::resolve(state, conv).await?;
            let info = inspect(state, cs)
                .await?
                .ok_or_else(|| not_found("conversation", conv).with_param("conversation"))?;
            if info.tokens == 0 {
                check_choice(&wanted_choice, &tool_texts)?;
            } else {
                let (_, declared) = system_turn(&read(state, cs).await?).unwrap_or_default();
                check_choice(&wanted_choice, &declared)?;
            }
        }
    }
    let input = Input {
        items: &items,
        system,
    };
    // Where the response runs: a fork of the previous response, a
    // conversation's session, or a new session.
    let mut changes = None;
    let (s, start) = match (chain, &conversation) {
        (Some((ps, end, events)), _) => {
            // Before the fork is made.
            input
                .check(state, Some(ps), &events[..end as usize])
                .await?;
            let s = created(
                state,
                Request::Fork {
                    session: ps,
                    at_event: end,
                    params: Some(p),
                },
            )
            .await?;
            (s, end)
        }
        (None, Some(conv)) => {
            // The conversation's lock, held until the generation is asked
            // for (below), so the next change to it sees it in progress.
            let (s, start, guard) =
                super::conversations::session_for(state, conv, p, &input).await?;
            changes = Some(guard);
            (s, start)
        }
        (None, None) => {
            input.check(state, None, &[]).await?;
            let s = create_session(state, p).await?;
            if let Some(prev) = &replayed_from {
                // What a retrieve echoes as its previous_response_id.
                chain_record(state, s, prev).await?;
            }
            (s, 0)
        }
    };
    let fresh = inspect(state, s)
        .await?
        .ok_or_else(|| not_found("session", &s.to_string()))?;
    // Templates declare tools (and the system prompt) in the first turn
    // only: on a session that already has input they were set before.
    if fresh.tokens == 0 && (r.instructions.is_some() || !chat_tools.is_empty()) {
        call(
            state,
            Request::AppendSystem {
                session: s,
                text: r.instructions.clone(),
                tools: tool_texts.clone(),
            },
        )
        .await
        .map_err(|e| e.with_param("tools"))?;
    }
    // The tool choice and output format are settings of the session: each
    // response sets them to what it asks for (defaults included), so one
    // asked for earlier in a chain does not carry over to a later request.
    let wanted_schema = schema.as_ref().map(Value::to_string);
    let events = read(state, s).await?;
    let (had_choice, had_schema) = (tool_choice_of(&events), output_schema_of(&events));
    if wanted_choice != had_choice {
        call(
            state,
            Request::SetToolChoice {
                session: s,
                choice: wanted_choice,
            },
        )
        .await
        .map_err(|e| e.with_param("tool_choice"))?;
    }
    if wanted_schema != had_schema {
        call(
            state,
            Request::SetOutputFormat {
                session: s,
                schema: wanted_schema,
            },
        )
        .await
        .map_err(|e| e.with_param("text.format"))?;
    }
    append_items(state, s, &items, "input").await?;
    let before = inspect(state, s)
        .await?
        .ok_or_else(|| not_found("session", &s.to_string()))?;
    let n_ctx = state.m().shared.n_ctx;
    let max_tokens = r
        .max_output_tokens
        .unwrap_or(n_ctx)
        .min(n_ctx.saturating_sub(before.tokens as u32).max(1));
    let (tx, rx) = mpsc::channel(STREAM_REPLY_CAPACITY);
    let (started, warm) = tokio::sync::oneshot::channel();
    state.m().registry.do_send(DispatchStream {
        request: Request::Generate {
            session: s,
            max_tokens,
        },
        reply: tx,
        provisional: false,
        started: Some(started),
    });
    // The session takes the Generate before any later request: the next
    // change to the conversation finds it generating.
    drop(changes);
    let (markers, _) = super::markers(state, &[]);
    let mut head = head;
    head.id = response_id(state, s, before.created_unix_ms, start);
    // The assistant header the session commits first counts as input
    // (added when its Delta arrives, `Source::next`).
    Ok(Running {
        head,
        source: Source::Session(rx, Decode::new(s, &markers)),
        input_tokens: before.tokens,
        warm: 0,
        started: Some(warm),
    })
}

async fn stateless(
    state: &WebState,
    r: &CreateRequest,
    mut head: Head,
    items: Vec<Item>,
    tools: Vec<Value>,
    choice: Option<Value>,
    p: Params,
) -> Result<Running, ApiError> {
    let (_, schema) = text_format(r.text.as_ref())?;
    let mut messages = Vec::new();
    let mut tools = tools;
    let mut instructions = r.instructions.clone();
    // The chain's history (none without a previous response), and who made
    // its calls. Its system turn holds unless this request gives
    // instructions or tools, as on a stored continuation.
    let (names, events) = match &r.previous_response_id {
        Some(prev) => {
            let (ps, mut events, end) = previous_chain(state, prev).await?;
            events.truncate(end as usize);
            if instructions.is_none() && tools.is_empty() {
                if let Some((text, chain_tools)) = system_turn(&events) {
                    instructions = text;
                    tools = chain_tools
                        .iter()
                        .filter_map(|t| serde_json::from_str(t).ok())
                        .collect();
                }
            }
            events.retain(|e| !matches!(e.body, Record::System { .. }));
            (call_names(state, ps).await?, events)
        }
        None => (CallNames::own(0), Vec::new()),
    };
    if let Some(i) = &instructions {
        messages.push(json!({"role": "system", "content": i}));
    }
    messages.extend(history(&names, &events));
    if items.is_empty() {
        return Err(bad("input must hold at least one item"));
    }
    // Checked as a stored continuation's input is: every output answers an
    // open call of the chain once, every resent call's id is new to it.
    let requests = requests_after(&items, &names, &events)?;
    for (item, (request, _)) in items.iter().zip(&requests) {
        messages.push(match item {
            Item::Message { role, text } => json!({"role": role_name(*role), "content": text}),
            Item::Call(c) => json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}]}),
            Item::Output { call_id, output } => {
                // The call it answers as the history names it: a call of
                // the model's (in any form) by its maker, a resent one by
                // the client's id.
                let id = match request {
                    Request::AppendToolResult { call_id: e, .. } => names.name(*e),
                    _ => call_id.clone(),
                };
                json!({"role": "tool", "tool_call_id": id, "content": output})
            }
        });
    }
    let chat = json!({
        "model": r.model,
        "messages": messages,
        "max_completion_tokens": r.max_output_tokens,
        "tools": if tools.is_empty() { Value::Null } else { json!(tools) },
        "tool_choice": choice,
        "response_format": schema.map(|schema| json!({"type": "json_schema",
                                                      "json_schema": {"schema": schema}})),
    });
    let chat: ChatRequest =
        serde_json::from_value(chat).map_err(|e| ApiError::invalid(F, e.to_string()))?;
    let prepared = prepare_chat(state, &chat, &Default::default())
        .await
        .map_err(|mut e| {
            match e.param {
                Some("messages") => e.param = Some("input"),
                Some("response_format") => e.param = Some("text.format"),
                _ => {}
            }
            e
        })?;
    let (warm, mut runs) = start_all(state, F, &prepared, 1, p, &[], true).await?;
    head.id = new_id("resp_");
    Ok(Running {
        head,
        source: Source::Stateless(runs.remove(0)),
        input_tokens: prepared.prompt.len() as u64,
        warm,
        started: None,
    })
}

/// Refuses a tool choice the response's session could not take beside
/// `tools` (their JSON texts), as `SetToolChoice` would.
fn check_choice(choice: &str, tools: &[String]) -> Result<(), ApiError> {
    use crate::session::{check_tool_choice, ChoiceRefusal};
    let why = match check_tool_choice(choice, tools) {
        Ok(()) => return Ok(()),
        Err(ChoiceRefusal::NoTools) => {
            format!("tool_choice {choice:?} forces a call, and the response declares no tools")
        }
        Err(ChoiceRefusal::NotDeclared(names)) => format!(
            "tool_choice names {choice:?}, which is none of the response's tools ({})",
            names.join(", ")
        ),
    };
    Err(ApiError::invalid(F, why).with_param("tool_choice"))
}

/// The system turn (instructions, tools) in effect after `events`: the
/// last `System` record's.
fn system_turn(events: &[Event]) -> Option<(Option<String>, Vec<String>)> {
    events.iter().rev().find_map(|e| match &e.body {
        Record::System { text, tools, .. } => Some((text.clone(), tools.clone())),
        _ => None,
    })
}

/// The key of a session title's record saying which response a chain
/// continued in a new session (its history rendered again after other
/// instructions or tools) followed.
const CHAIN_KEY: &str = "openai.response_chain";

/// Notes in session `s`'s title that its response follows `previous`.
async fn chain_record(state: &WebState, s: SessionId, previous: &str) -> Result<(), ApiError> {
    let info = inspect(state, s)
        .await?
        .ok_or_else(|| not_found("session", &s.to_string()))?;
    call(
        state,
        Request::SetMeta {
            session: s,
            expected_version: info.version,
            title: Some(json!({ CHAIN_KEY: {"previous_response_id": previous} }).to_string()),
            archived: None,
        },
    )
    .await?;
    Ok(())
}

/// A `previous_response_id`'s session, its events, and where the response
/// ends (where a continuation forks); a 404 naming it when it was not
/// issued here, its session is gone, or it holds no such response.
async fn previous_chain(
    state: &WebState,
    id: &str,
) -> Result<(SessionId, Vec<Event>, EventId), ApiError> {
    let gone = || not_found("response", id).with_param("previous_response_id");
    let (s, start) = parse_response_id(state, id).await.ok_or_else(gone)?;
    let events = read_live(state, s, id).await?;
    let end = Stored::locate(&events, start).ok_or_else(gone)?.end;
    Ok((s, events, end))
}

/// Whether response `id` can be read (issued here, its session live).
async fn resolves(state: &WebState, id: &str) -> bool {
    previous_chain(state, id).await.is_ok()
}

/// The previous response a session's title records (see [`chain_record`]).
fn chained_from(info: &Inspection) -> Option<String> {
    let title: Value = serde_json::from_str(info.title.as_deref()?).ok()?;
    title
        .get(CHAIN_KEY)?
        .get("previous_response_id")?
        .as_str()
        .map(str::to_owned)
}

/// A chain's history (`events`, up to the end of its last response) as the
/// input items that say it again, without its system turn: messages, the
/// model's calls and their outputs as resent `function_call` and
/// `function_call_output` items (named as the chain named them, so an
/// output in the request still answers its call), its replies as assistant
/// messages. The reasoning is left out, as a chat template leaves it out of
/// earlier turns.
fn replay_items(names: &CallNames, events: &[Event]) -> Result<Vec<Item>, ApiError> {
    if events
        .iter()
        .any(|e| matches!(e.body, Record::Image { .. }))
    {
        return Err(bad(
            "the previous response's chain holds an image, which cannot be carried into a \
             chain with other instructions or tools; send the chain's own",
        )
        .with_param("previous_response_id"));
    }
    let rest: Vec<Event> = events
        .iter()
        .filter(|e| !matches!(e.body, Record::System { .. }))
        .cloned()
        .collect();
    let text = |m: &Value, k: &str| m.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
    let mut out = Vec::new();
    for m in history(names, &rest) {
        let content = text(&m, "content");
        match m.get("role").and_then(Value::as_str) {
            Some("assistant") => {
                if !content.is_empty() {
                    out.push(Item::Message {
                        role: Role::Assistant,
                        text: content,
                    });
                }
                for c in m
                    .get("tool_calls")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    let f = c.get("function").cloned().unwrap_or_default();
                    out.push(Item::Call(Call {
                        id: text(c, "id"),
                        name: text(&f, "name"),
                        arguments: text(&f, "arguments"),
                    }));
                }
            }
            Some("tool") => out.push(Item::Output {
                call_id: text(&m, "tool_call_id"),
                output: content,
            }),
            Some("system") => out.push(Item::Message {
                role: Role::System,
                text: content,
            }),
            _ => out.push(Item::Message {
                role: Role::User,
                text: content,
            }),
        }
    }
    Ok(out)
}

/// A stored session's events folded into chat messages (for a stateless
/// continuation of a stored response, and a chain said again).
fn history(names: &CallNames, events: &[Event]) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::new();
    let mut text = String::new();
    let mut calls: Vec<Value> = Vec::new();
    let flush = |out: &mut Vec<Value>, text: &mut String, calls: &mut Vec<Value>| {
        if !text.is_empty() || !calls.is_empty() {
            let mut m = json!({"role": "assistant", "content": text.trim().to_owned()});
            if !calls.is_empty() {
                m["tool_calls"] = json!(calls);
            }
            out.push(m);
            text.clear();
            calls.clear();
        }
    };
    for e in events {
        match &e.body {
            Record::System { text: Some(t), .. } => {
                out.push(json!({"role": "system", "content": t}))
            }
            Record::Message { role, text: t, .. } => {
                flush(&mut out, &mut text, &mut calls);
                out.push(json!({"role": role_name(*role), "content": t}));
            }
            Record::Generated {
                text: t,
                channel: Channel::Text,
                ..
            } => text.push_str(t),
            Record::ToolUse { name, arguments } => calls.push(json!({
                "id": names.name(e.event_id), "type": "function",
                "function": {"name": name, "arguments": arguments}})),
            Record::ToolResult {
                call_id, content, ..
            } => {
                flush(&mut out, &mut text, &mut calls);
                out.push(json!({"role": "tool", "tool_call_id": names.name(*call_id),
                                "content": content}));
            }
            Record::Block { kind, payload, .. } => match Resent::of(kind) {
                // A resent call opens an assistant message of its own, as
                // its block did in the session.
                Some(Resent::FunctionCall {
                    call_id,
                    name,
                    arguments,
                }) => {
                    flush(&mut out, &mut text, &mut calls);
                    calls.push(json!({"id": call_id, "type": "function",
                                      "function": {"name": name, "arguments": arguments}}));
                }
                Some(Resent::FunctionCallOutput { call_id }) => {
                    flush(&mut out, &mut text, &mut calls);
                    out.push(json!({"role": "tool", "tool_call_id": call_id,
                                    "content": payload}));
                }
                None => {}
            },
            _ => {}
        }
    }
    flush(&mut out, &mut text, &mut calls);
    out
}

// ---------------------------------------------------------------- stored

/// A stored response located in its session's events.
pub struct Stored {
    /// Index of its `GenerationPrompt`.
    pub prompt: usize,
    /// One past its last output event: where a continuation forks.
    pub end: EventId,
}

pub(crate) fn is_output(r: &Record) -> bool {
    matches!(
        r,
        Record::Generated { .. }
            | Record::ToolUse { .. }
            | Record::ToolParseFailure { .. }
            | Record::EpochBump
    )
}

impl Stored {
    /// The response whose input begins at event `start`: its first
    /// `GenerationPrompt` at or after `start`, before any other output.
    pub fn locate(events: &[Event], start: EventId) -> Option<Stored> {
        let start = usize::try_from(start).ok()?;
        if start >= events.len() {
            return None;
        }
        let prompt = (start..events.len()).find(|&i| {
            matches!(events[i].body, Record::GenerationPrompt { .. }) || is_output(&events[i].body)
        })?;
        if !matches!(events[prompt].body, Record::GenerationPrompt { .. }) {
            return None;
        }
        let end = (prompt + 1..events.len())
            .find(|&i| !is_output(&events[i].body))
            .unwrap_or(events.len());
        Some(Stored {
            prompt,
            end: end as EventId,
        })
    }
}

/// The events of a `previous_response_id`'s session, or a 404 naming it
/// when it is gone.
async fn read_live(state: &WebState, s: SessionId, id: &str) -> Result<Vec<Event>, ApiError> {
    let gone = || not_found("response", id).with_param("previous_response_id");
    if inspect(state, s).await?.is_none() {
        return Err(gone());
    }
    read(state, s).await.map_err(|_| gone())
}

/// Where a response whose `GenerationPrompt` is at `prompt` began: after
/// the previous output, or at the session's first event.
fn start_of(events: &[Event], prompt: usize) -> usize {
    let mut i = prompt;
    while i > 0 {
        let b = &events[i - 1].body;
        if is_output(b) {
            return i;
        }
        if matches!(b, Record::Created { .. } | Record::Forked { .. }) {
            return i - 1;
        }
        i -= 1;
    }
    0
}

/// A stored response as its session's log holds it.
pub(crate) struct StoredResponse {
    pub session: SessionId,
    pub head: Head,
    pub events: Vec<Event>,
    pub st: Stored,
    /// The session is generating and this response is its last: the
    /// generation is this response's.
    pub in_flight: bool,
}

/// The stored response `id`, read from the log: what it echoes and where
/// its output lies.
pub(crate) async fn open_stored(r: &Resolved, id: &str) -> Result<StoredResponse, ApiError> {
    let (state, s, start, info) = (&r.state, r.session, r.start, &r.info);
    let events = read(state, s)
        .await
        .map_err(|_| not_found("response", id))?;
    let st = Stored::locate(&events, start).ok_or_else(|| not_found("response", id))?;
    let system = events[..st.prompt]
        .iter()
        .rev()
        .find_map(|e| match &e.body {
            Record::System { text, tools, .. } => Some((text.clone(), tools.clone())),
            _ => None,
        });
    let (instructions, tools) = system.unwrap_or_default();
    let tools: Vec<Value> = tools
        .iter()
        .filter_map(|t| serde_json::from_str::<Value>(t).ok())
        .map(|t| response_tool(&t))
        .collect();
    let choice = match tool_choice_of(&events[..st.prompt]).as_str() {
        c @ ("auto" | "required") => json!(c),
        name => json!({"type": "function", "name": name}),
    };
    let schema = output_schema_of(&events[..st.prompt]);
    let text_format = match schema.and_then(|s| serde_json::from_str::<Value>(&s).ok()) {
        Some(schema) => json!({"type": "json_schema", "name": "response", "schema": schema,
                               "description": null, "strict": false}),
        None => json!({"type": "text"}),
    };
    let conversation = super::conversations::conversation_of(info);
    // A conversation's branch forks for a response's sampling settings, not
    // for a previous_response_id.
    let previous = match &events[start as usize].body {
        Record::Forked {
            parent, fork_at, ..
        } if conversation.is_none() => {
            match (read(state, *parent).await, made_ms(state, *parent).await) {
                (Ok(pe), Some(made)) if (*fork_at as usize) <= pe.len() => {
                    let pe = &pe[..*fork_at as usize];
                    pe.iter()
                        .rposition(|e| matches!(e.body, Record::GenerationPrompt { .. }))
                        .map(|gp| response_id(state, *parent, made, start_of(pe, gp) as EventId))
                }
                _ => None,
            }
        }
        // A chain continued in a new session: the title says which, while
        // it resolves (as a fork's parent response, gone once deleted).
        _ => match chained_from(info) {
            Some(prev) if resolves(state, &prev).await => Some(prev),
            _ => None,
        },
    };
    let head = Head {
        id: id.to_owned(),
        created_at: events[start as usize].ts_unix_ms / 1000,
        model: state.m().model.id.clone(),
        instructions,
        tools,
        tool_choice: choice,
        temperature: info.params.temperature,
        top_p: info.params.top_p,
        max_output_tokens: None,
        previous_response_id: previous,
        conversation,
        store: true,
        metadata: json!({}),
        text_format,
        truncation: "disabled",
    };
    let in_flight = info.generating && st.end as usize == events.len();
    Ok(StoredResponse {
        session: s,
        head,
        events,
        st,
        in_flight,
    })
}

/// A stored response's output events turned into the stream's events, one
/// event at a time: the same events, with the same sequence numbers, as the
/// stream that created the response sent (both decode the same committed
/// events with the same [`Decode`] and [`Emitter`]).
pub(crate) struct Replay {
    pub em: Emitter,
    decode: Decode,
    finish: Finish,
    called: bool,
    totals: Totals,
}

impl Replay {
    pub fn new(state: &WebState, sr: &StoredResponse) -> Replay {
        let (markers, _) = super::markers(state, &[]);
        Replay {
            em: Emitter::new(sr.head.clone()),
            decode: Decode::new(sr.session, &markers),
            finish: Finish::Open,
            called: false,
            totals: Totals {
                // The history and the assistant header: the prompt.
                input: sr.events[..=sr.st.prompt]
                    .iter()
                    .map(|e| e.body.span().len() as u64)
                    .sum(),
                ..Totals::default()
            },
        }
    }

    /// The output events already in the log.
    pub fn logged(sr: &StoredResponse) -> &[Event] {
        &sr.events[sr.st.prompt + 1..sr.st.end as usize]
    }

    /// The stream's events for one output event of the response.
    pub fn take(&mut self, e: &Event) -> Vec<Value> {
        self.totals.output += e.body.span().len() as u64;
        if let Record::Generated {
            channel: Channel::Reasoning,
            span,
            ..
        } = &e.body
        {
            self.totals.reasoning += span.len() as u64;
        }
        match &e.body {
            Record::Generated { finish, .. } => self.finish = *finish,
            Record::ToolUse { .. } => self.called = true,
            _ => {}
        }
        match self.decode.piece(e) {
            Some(p) => self.em.push(p),
            None => Vec::new(),
        }
    }

    /// The generation wrote its last record (a finish code other than open).
    pub fn ended(&self) -> bool {
        self.finish != Finish::Open
    }

    /// The closing events. A response whose last record left the turn open
    /// and whose generation is over was closed by a tool call, or cut (by a
    /// restart, a worker crash); one still in flight stays in progress.
    pub fn end(&mut self, in_flight: bool) -> Vec<Value> {
        let mut finish = self.finish;
        if finish == Finish::Open && !in_flight {
            finish = if self.called {
                Finish::EndOfTurn
            } else {
                Finish::Cancelled
            };
        }
        let mut ending = Ending::of(finish);
        self.totals.onto(&mut ending);
        self.em.finish(ending)
    }
}

/// The stored response `id`, read back from the log.
pub(crate) async fn load(
    r: &Resolved,
    id: &str,
) -> Result<(Emitter, Vec<Event>, Stored), ApiError> {
    let sr = open_stored(r, id).await?;
    let mut replay = Replay::new(&r.state, &sr);
    for e in Replay::logged(&sr) {
        replay.take(e);
    }
    replay.end(sr.in_flight);
    Ok((replay.em, sr.events, sr.st))
}

/// `DELETE /v1/responses/{id}`: purges the response's session (its
/// continuations keep their history; the bytes stay in the log).
pub async fn delete(
    req: HttpRequest,
    path: web::Path<String>,
    state: web::Data<WebState>,
) -> Result<HttpResponse, ApiError> {
    authorize(&state, F, &req)?;
    let id = path.into_inner();
    let r = owner(&state, &id)
        .await
        .ok_or_else(|| not_found("response", &id))?;
    let (_, events, st) = load(&r, &id).await?;
    let (state, s, start, info) = (r.state, r.session, r.start, r.info);
    // A conversation's branch (forked for a response's sampling settings)
    // is the conversation's, not the response's.
    let own = matches!(
        events[start as usize].body,
        Record::Created { .. } | Record::Forked { .. }
    ) && Stored::locate(&events, st.end).is_none()
        && super::conversations::conversation_of(&info).is_none();
    if !own {
        return Err(ApiError::invalid(
            F,
            "this response shares its session with a conversation's other turns: delete the \
             conversation, or its items",
        ));
    }
    call(
        &state,
        Request::Purge {
            session: s,
            expected_generation: info.generation,
            mode: PurgeMode::Reroot,
        },
    )
    .await?;
    Ok(HttpResponse::Ok().json(json!({"id": id, "object": "response.deleted", "deleted": true})))
}

/// An input event as an item (`None` for what is not one): a message, a
/// tool's output, or a resent call or its output ([`Resent`]).
pub fn input_item(names: &CallNames, e: &Event) -> Option<Value> {
    let id = e.event_id;
    match &e.body {
        Record::Message { role, text, .. } => {
            let (role, part) = match role {
                Role::Assistant => ("assistant", "output_text"),
                Role::System => ("system", "input_text"),
                Role::Tool => {
                    return Some(json!({"id": names.item("fco", id),
                        "type": "function_call_output", "call_id": "", "output": text,
                        "status": "completed"}))
                }
                Role::User => ("user", "input_text"),
            };
            Some(
                json!({"id": names.item("msg", id), "type": "message", "role": role,
                        "status": "completed", "content": [{"type": part, "text": text}]}),
            )
        }
        Record::ToolResult {
            call_id, content, ..
        } => Some(
            json!({"id": names.item("fco", id), "type": "function_call_output",
                         "call_id": names.name(*call_id), "output": content,
                         "status": "completed"}),
        ),
        Record::Block { kind, payload, .. } => match Resent::of(kind)? {
            Resent::FunctionCall {
                call_id,
                name,
                arguments,
            } => Some(json!({"id": names.item("fc", id), "type": "function_call",
                             "status": "completed", "call_id": call_id, "name": name,
                             "arguments": arguments})),
            Resent::FunctionCallOutput { call_id } => Some(
                json!({"id": names.item("fco", id), "type": "function_call_output",
                            "call_id": call_id, "output": payload, "status": "completed"}),
            ),
        },
        _ => None,
    }
}

/// `?limit=&order=&after=` of a list route. `limit` is read as text and
/// parsed by [`page`], so that a bad one is a 400 naming it.
#[derive(Debug, Deserialize)]
pub struct ListQuery {
    pub limit: Option<String>,
    pub order: Option<String>,
    pub after: Option<String>,
}

impl ListQuery {
    /// The request's query, read after `authorize` (never as an extractor:
    /// actix would parse it before the caller is checked, and answer a bad
    /// one with its own plain-text 400).
    pub fn of(req: &HttpRequest) -> Result<ListQuery, ApiError> {
        web::Query::<ListQuery>::from_query(req.query_string())
            .map(web::Query::into_inner)
            .map_err(|e| ApiError::invalid(F, format!("the query: {e}")))
    }
}

/// One page of `items` (in log order) as OpenAI's list object.
pub fn page(mut items: Vec<Value>, q: &ListQuery) -> Result<Value, ApiError> {
    let limit = match q.limit.as_deref() {
        None => 20,
        Some(l) => l
            .parse()
            .ok()
            .filter(|n| (1..=MAX_PAGE).contains(n))
            .ok_or_else(|| {
                ApiError::invalid(F, format!("limit must be an integer from 1 to {MAX_PAGE}"))
                    .with_param("limit")
            })?,
    };
    match q.order.as_deref() {
        None | Some("desc") => items.reverse(),
        Some("asc") => {}
        Some(_) => {
            return Err(ApiError::invalid(F, "order must be asc or desc").with_param("order"))
        }
    }
    if let Some(after) = &q.after {
        let at = items
            .iter()
            .position(|i| i["id"].as_str() == Some(after.as_str()))
            .ok_or_else(|| not_found("item", after).with_param("after"))?;
        items.drain(..=at);
    }
    let has_more = items.len() > limit;
    items.truncate(limit);
    Ok(json!({
        "object": "list",
        "first_id": items.first().map(|i| i["id"].clone()),
        "last_id": items.last().map(|i| i["id"].clone()),
        "has_more": has_more,
        "data": items,
    }))
}

/// `GET /v1/responses/{id}/input_items`: the items the response's request
/// added.
pub async fn input_items(
    req: HttpRequest,
    path: web::Path<String>,
    state: web::Data<WebState>,
) -> Result<HttpResponse, ApiError> {
    authorize(&state, F, &req)?;
    let query = ListQuery::of(&req)?;
    let id = path.into_inner();
    let r = owner(&state, &id)
        .await
        .ok_or_else(|| not_found("response", &id))?;
    let (_, events, st) = load(&r, &id).await?;
    let (state, s, start) = (r.state, r.session, r.start);
    let events = &events[start as usize..st.prompt];
    let names = call_names(&state, s).await?;
    let items = events
        .iter()
        .filter_map(|e| input_item(&names, e))
        .collect();
    Ok(HttpResponse::Ok().json(page(items, &query)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::LedgerStatus;

    fn head() -> Head {
        Head {
            id: "resp_1_0".into(),
            created_at: 1,
            model: "m".into(),
            instructions: None,
            tools: vec![],
            tool_choice: json!("auto"),
            temperature: 1.0,
            top_p: 1.0,
            max_output_tokens: None,
            previous_response_id: None,
            conversation: None,
            store: true,
            metadata: json!({}),
            text_format: json!({"type": "text"}),
            truncation: "disabled",
        }
    }

    #[test]
    fn text_formats_and_their_errors() {
        assert_eq!(text_format(None).unwrap(), (json!({"type": "text"}), None));
        let (echo, schema) =
            text_format(Some(&json!({"format": {"type": "json_object"}}))).unwrap();
        assert_eq!(
            (echo["type"].as_str(), schema),
            (Some("json_object"), Some(json!({"type": "object"})))
        );
        let f = json!({"format": {"type": "json_schema", "name": "w", "strict": true,
                                  "schema": {"type": "object"}}});
        let (echo, schema) = text_format(Some(&f)).unwrap();
        assert_eq!(echo["name"], "w");
        assert_eq!(echo["strict"], true);
        assert_eq!(schema, Some(json!({"type": "object"})));
        for bad in [
            json!({"format": {"type": "xml"}}),
            json!({"format": {"type": "json_schema", "name": "w"}}),
            json!({"format": {"type": "json_schema", "schema": {"type": "object"}}}),
            json!({"format": {"type": "json_schema", "name": "a b", "schema": {}}}),
        ] {
            let e = text_format(Some(&bad)).unwrap_err();
            assert_eq!(e.param, Some("text.format"), "{bad}");
        }
    }

    #[test]
    fn events_are_numbered_and_items_close_in_order() {
        let mut em = Emitter::new(head());
        let mut all = em.start();
        all.extend(em.push(Piece::Text {
            id: "msg_a".into(),
            text: "Hel".into(),
        }));
        all.extend(em.push(Piece::Text {
            id: "msg_b".into(),
            text: "lo".into(),
        }));
        all.extend(em.push(Piece::Call {
            id: "fc_1".into(),
            call_id: "call_1".into(),
            name: "f".into(),
            arguments: "{}".into(),
        }));
        all.extend(em.finish(Ending::of(Finish::EndOfTurn)));
        let seqs: Vec<u64> = all
            .iter()
            .map(|e| e["sequence_number"].as_u64().unwrap())
            .collect();
        assert_eq!(seqs, (0..all.len() as u64).collect::<Vec<_>>());
        let types: Vec<&str> = all.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            types,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        let r = em.response();
        assert_eq!(r["output"][0]["id"], "msg_a");
        assert_eq!(r["output"][0]["content"][0]["text"], "Hello");
        assert_eq!(r["output"][1]["call_id"], "call_1");
        assert_eq!(r["status"], "completed");
    }

    #[test]
    fn items_parse_and_refuse() {
        let got = items(Some(&json!([
            {"role": "developer", "content": "be brief"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "ok"},
            {"type": "reasoning", "summary": []},
        ])))
        .unwrap();
        assert_eq!(got.len(), 4);
        assert_eq!(
            got[0],
            Item::Message {
                role: Role::System,
                text: "be brief".into()
            }
        );
        for bad in [
            json!(3),
            json!([{"role": "robot", "content": "x"}]),
            json!([{"type": "function_call_output", "call_id": "c"}]),
            json!([{"type": "web_search_call"}]),
            json!([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
        ] {
            assert!(items(Some(&bad)).is_err(), "{bad}");
        }
        let many = Value::Array(vec![json!("x"); MAX_ITEMS + 1]);
        assert!(items(Some(&many)).is_err());
    }

    #[test]
    fn call_ids_parse() {
        assert_eq!(parse_call("call_3_5"), Some((Some(3), 5)));
        assert_eq!(parse_call("call_5"), Some((None, 5)));
        assert_eq!(parse_call("call_abc"), None);
        assert_eq!(parse_call("call_3_x"), None);
    }

    fn run(at: u64, len: u64, owner: SessionId, owner_at: u64) -> Owned {
        Owned {
            at,
            len,
            owner,
            owner_at,
        }
    }

    #[test]
    fn a_call_is_named_by_the_session_that_made_it() {
        // Runs as a view of session 3 may hold them (not a layout a rebase
        // makes, whose header sits at its fork point): 1's events 0..2 at 0,
        // 1's event 3 at 2, 2's events 4..7 at 3, then its own event 6.
        let names = CallNames {
            s: 3,
            runs: vec![
                run(0, 2, 1, 0),
                run(2, 1, 1, 3),
                run(3, 3, 2, 4),
                run(6, 1, 3, 6),
            ]
            .into(),
        };
        // 1's call at 3 keeps its name in the rebase; 2's call at 5 too.
        assert_eq!(names.name(2), "call_1_3");
        assert_eq!(names.name(4), "call_2_5");
        assert_eq!(names.name(6), "call_3_6");
        assert_eq!(names.item("msg", 4), "msg_2_5");
        // Past the runs: made here since.
        assert_eq!(names.name(9), "call_3_9");
        // Every name reads back to its event here.
        for e in [2, 4, 6, 9] {
            assert_eq!(names.event(&names.name(e)), Some(e), "{e}");
        }
        // A call this view does not share, or another session's.
        assert_eq!(names.event("call_1_4"), None);
        assert_eq!(names.event("call_7_2"), None);
        assert_eq!(names.event("call_3_3"), None);
        // The old form names an event of this session.
        assert_eq!(names.event("call_4"), Some(4));
        // Two sessions' own calls at the same id differ.
        assert_ne!(CallNames::own(5).name(4), CallNames::own(6).name(4));
    }

    #[test]
    fn an_output_answers_an_open_call_once() {
        // Session 3's calls at 4 (open) and 6 (answered at 7).
        let entry = |call_id, closed_by: Option<u64>| LedgerEntry {
            call_id,
            name: "f".into(),
            arguments: "{}".into(),
            status: match closed_by {
                Some(_) => LedgerStatus::Answered,
                None => LedgerStatus::Open,
            },
            closed_by,
            permission: None,
        };
        let ledger = [entry(4, None), entry(6, Some(7))];
        let names = CallNames::own(3);
        let none = Resents::default();
        let hi = Item::Message {
            role: Role::User,
            text: "hi".into(),
        };
        let out = |id: &str| Item::Output {
            call_id: id.into(),
            output: "x".into(),
        };
        let requests =
            item_requests(3, &[hi.clone(), out("call_3_4")], &names, &ledger, &none).unwrap();
        assert!(matches!(
            requests[1],
            (Request::AppendToolResult { call_id: 4, .. }, Some(_))
        ));
        assert_eq!(
            item_requests(3, &[out("call_4")], &names, &ledger, &none)
                .unwrap()
                .len(),
            1
        );
        for (items, why) in [
            (vec![hi.clone(), out("call_3_999")], "not a call"),
            (vec![hi.clone(), out("call_0")], "not a call"),
            (vec![hi.clone(), out("call_5")], "not a call"),
            (vec![hi.clone(), out("call_3_6")], "already answered"),
            (
                vec![out("call_3_4"), out("call_4")],
                "two function_call_output",
            ),
        ] {
            let e = item_requests(3, &items, &names, &ledger, &none).unwrap_err();
            assert!(e.message.contains(why), "{items:?}: {}", e.message);
            assert_eq!(e.param, Some("input"));
        }
        // On a new session only a call resent with its output is answered.
        let call = Item::Call(Call {
            id: "c1".into(),
            name: "f".into(),
            arguments: "{}".into(),
        });
        assert!(item_requests(
            0,
            &[call.clone(), out("c1")],
            &CallNames::own(0),
            &[],
            &none
        )
        .is_ok());
        assert!(item_requests(0, &[out("call_1")], &CallNames::own(0), &[], &none).is_err());
        // Once: a second output for the resent call is refused.
        let e = item_requests(
            0,
            &[call, out("c1"), out("c1")],
            &CallNames::own(0),
            &[],
            &none,
        )
        .unwrap_err();
        assert!(
            e.message.contains("\"c1\" is answered by two"),
            "{}",
            e.message
        );
        // A call resent in an earlier request: open until answered, once.
        let block = |event_id, role, kind: Resent| Event {
            event_id,
            epoch: 1,
            ts_unix_ms: 0,
            body: Record::Block {
                role,
                kind: kind.kind(),
                payload: "p".into(),
                span: Vec::new(),
            },
        };
        let resent = |call_id: &str| Resent::FunctionCall {
            call_id: call_id.into(),
            name: "f".into(),
            arguments: "{}".into(),
        };
        let answer = |call_id: &str| Resent::FunctionCallOutput {
            call_id: call_id.into(),
        };
        let history = Resents::of(&[
            block(1, Role::Assistant, resent("c8")),
            block(2, Role::Tool, answer("c8")),
            block(3, Role::Assistant, resent("c9")),
            // Named as session 3's open call at 4: that call is answered.
            block(5, Role::Assistant, resent("call_3_4")),
        ]);
        assert_eq!(history.answered("c8"), Some(true));
        assert_eq!(history.answered("c9"), Some(false));
        assert_eq!(history.answered("c7"), None);
        let requests =
            item_requests(3, &[out("c9"), out("call_3_4")], &names, &ledger, &history).unwrap();
        assert!(
            matches!(&requests[0].0, Request::AppendBlock { kind, .. } if *kind == answer("c9").kind())
        );
        assert!(matches!(
            requests[1],
            (Request::AppendToolResult { call_id: 4, .. }, Some(_))
        ));
        let again = |id: &str| {
            Item::Call(Call {
                id: id.into(),
                name: "f".into(),
                arguments: "{}".into(),
            })
        };
        for (items, why) in [
            (vec![again("c8")], "\"c8\" is used by an earlier"),
            (vec![again("c9"), out("c9")], "\"c9\" is used by an earlier"),
            (
                vec![again("c1"), out("c1"), again("c1")],
                "\"c1\" is used by an earlier",
            ),
            (vec![out("c8")], "already answered"),
            (vec![out("c9"), out("c9")], "two function_call_output"),
            (vec![out("c7")], "not a call"),
            // The name of one of the model's calls, open or answered, in
            // either form.
            (
                vec![again("call_3_4")],
                "\"call_3_4\" names a call the model made",
            ),
            (
                vec![again("call_4")],
                "\"call_4\" names a call the model made",
            ),
            (
                vec![again("call_3_6")],
                "\"call_3_6\" names a call the model made",
            ),
        ] {
            let e = item_requests(3, &items, &names, &ledger, &history).unwrap_err();
            assert!(e.message.contains(why), "{items:?}: {}", e.message);
            assert_eq!(e.param, Some("input"));
        }
        // An id naming no call the session holds is the client's to use.
        assert!(item_requests(
            3,
            &[again("call_3_5"), again("call_9_4")],
            &names,
            &ledger,
            &history
        )
        .is_ok());
    }

    #[test]
    fn the_history_gives_the_calls_an_input_is_checked_against() {
        // Session 3's history: the model's call at 1, answered at 2, its
        // call at 3, open, and a call the client resent at 4, open.
        let event = |event_id, body| Event {
            event_id,
            epoch: 1,
            ts_unix_ms: 0,
            body,
        };
        let events = [
            event(
                1,
                Record::ToolUse {
                    name: "f".into(),
                    arguments: "{}".into(),
                },
            ),
            event(
                2,
                Record::ToolResult {
                    call_id: 1,
                    content: "x".into(),
                    span: Vec::new(),
                },
            ),
            event(
                3,
                Record::ToolUse {
                    name: "f".into(),
                    arguments: "{}".into(),
                },
            ),
            event(
                4,
                Record::Block {
                    role: Role::Assistant,
                    kind: Resent::FunctionCall {
                        call_id: "c1".into(),
                        name: "f".into(),
                        arguments: "{}".into(),
                    }
                    .kind(),
                    payload: "p".into(),
                    span: Vec::new(),
                },
            ),
        ];
        let names = CallNames::own(3);
        let out = |id: &str| Item::Output {
            call_id: id.into(),
            output: "x".into(),
        };
        let call = |id: &str| {
            Item::Call(Call {
                id: id.into(),
                name: "f".into(),
                arguments: "{}".into(),
            })
        };
        let requests = requests_after(&[out("call_3_3"), out("c1")], &names, &events).unwrap();
        assert!(matches!(
            requests[0].0,
            Request::AppendToolResult { call_id: 3, .. }
        ));
        assert!(matches!(requests[1].0, Request::AppendBlock { .. }));
        for (items, why) in [
            (vec![out("call_3_1")], "already answered"),
            (vec![out("call_3_9")], "not a call"),
            (vec![out("c2")], "not a call"),
            (vec![out("c1"), out("c1")], "two function_call_output"),
            (vec![call("c1")], "used by an earlier"),
            (vec![call("call_3_3")], "names a call the model made"),
            (vec![call("call_1")], "names a call the model made"),
        ] {
            let e = requests_after(&items, &names, &events).unwrap_err();
            assert!(e.message.contains(why), "{items:?}: {}", e.message);
            assert_eq!(e.param, Some("input"));
        }
        // Without a history, every output answers a call resent before it.
        assert!(check_fresh_items(&[call("c1"), out("c1")]).is_ok());
        assert!(check_fresh_items(&[out("c1")]).is_err());
        assert!(check_fresh_items(&[call("c1"), call("c1")]).is_err());
    }

    #[test]
    fn a_resent_call_reads_back_from_its_block() {
        let call = Resent::FunctionCall {
            call_id: "c1".into(),
            name: "f".into(),
            arguments: "{\"a\": 1}".into(),
        };
        assert_eq!(Resent::of(&call.kind()), Some(call.clone()));
        // Any other block is no resent item.
        assert_eq!(Resent::of("note"), None);
        assert_eq!(Resent::of("{\"type\": \"message\"}"), None);
        let block = |role, kind: String, payload: &str| Event {
            event_id: 5,
            epoch: 1,
            ts_unix_ms: 0,
            body: Record::Block {
                role,
                kind,
                payload: payload.into(),
                span: Vec::new(),
            },
        };
        let names = CallNames::own(3);
        assert_eq!(
            input_item(&names, &block(Role::Assistant, call.kind(), "<tool_call>")),
            Some(
                json!({"id": "fc_3_5", "type": "function_call", "status": "completed",
                        "call_id": "c1", "name": "f", "arguments": "{\"a\": 1}"})
            )
        );
        let output = Resent::FunctionCallOutput {
            call_id: "c1".into(),
        };
        assert_eq!(
            input_item(&names, &block(Role::Tool, output.kind(), "sunny")),
            Some(
                json!({"id": "fco_3_5", "type": "function_call_output", "call_id": "c1",
                        "output": "sunny", "status": "completed"})
            )
        );
        assert_eq!(
            input_item(&names, &block(Role::User, "note".into(), "x")),
            None
        );
        // The requests that write them.
        let items = [
            Item::Call(Call {
                id: "c1".into(),
                name: "f".into(),
                arguments: "{\"a\": 1}".into(),
            }),
            Item::Output {
                call_id: "c1".into(),
                output: "sunny".into(),
            },
        ];
        let requests = item_requests(3, &items, &names, &[], &Resents::default()).unwrap();
        assert!(
            matches!(&requests[0].0, Request::AppendBlock { kind, .. } if *kind == call.kind())
        );
        assert!(
            matches!(&requests[1].0, Request::AppendBlock { kind, payload, .. }
                     if *kind == output.kind() && payload == "sunny")
        );
    }

    #[test]
    fn tools_take_the_chat_form() {
        let t =
            chat_tool(&json!({"type": "function", "name": "f", "parameters": {"type": "object"}}))
                .unwrap();
        assert_eq!(t["function"]["name"], "f");
        assert!(chat_tool(&json!({"type": "web_search"})).is_err());
        assert_eq!(
            chat_choice(&json!({"type": "function", "name": "f"})).unwrap(),
            json!({"type": "function", "function": {"name": "f"}})
        );
    }
}
