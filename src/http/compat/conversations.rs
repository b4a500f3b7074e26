//! OpenAI's Conversations API on durable sessions: a conversation is a
//! session each response appends to (docs/responses.md).
//!
//! `conv_<session>` names the session the conversation was created as. Its
//! metadata is the session's title, a JSON object
//! `{"openai.conversation": {"id", "metadata", "moved_to"}}`; deleting an
//! item rebases the session into a new branch (the old one is kept) and
//! `moved_to` on the old one points the id at the new branch.

use actix_web::web;
use actix_web::{HttpRequest, HttpResponse};
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::{ApiError, Family, Kind};
use super::locks::{KeyGuard, KeyedLocks};
use super::responses::{
    append_items, call, call_names, check_fresh_items, create_session, created, input_item,
    inspect, items, not_found, page, read, to_the_end, Decode, Input, Item, ListQuery, Piece,
};
use super::{accept, authorize, params};
use crate::http::routes::WebState;
use crate::wire::{
    Edit, Event, EventId, Inspection, Params, PurgeMode, Record, Request, SessionId,
};

const F: Family = Family::OpenAi;
const KEY: &str = "openai.conversation";
/// The most items `POST /v1/conversations` and `.../items` take at once.
pub const MAX_NEW_ITEMS: usize = 20;
/// OpenAI's metadata caps: 16 pairs, keys of 64 and values of 512 chars.
const MAX_META_PAIRS: usize = 16;
/// How many `moved_to` hops an id may take.
const MAX_HOPS: usize = 64;

fn parse_conv(id: &str) -> Option<SessionId> {
    id.strip_prefix("conv_")?.parse().ok()
}

/// OpenAI's metadata caps (16 pairs, keys of 64 and string values of 512
/// characters), for a conversation's and a response's `metadata`.
pub(crate) fn check_metadata(m: &Value) -> Result<(), ApiError> {
    let bad = |s: String| ApiError::invalid(F, s).with_param("metadata");
    let Some(o) = m.as_object() else {
        return Err(bad("metadata must be an object".into()));
    };
    if o.len() > MAX_META_PAIRS {
        return Err(bad(format!("at most {MAX_META_PAIRS} metadata pairs")));
    }
    for (k, v) in o {
        let ok = k.chars().count() <= 64 && v.as_str().is_some_and(|s| s.chars().count() <= 512);
        if !ok {
            return Err(bad(format!(
                "metadata {k:?}: keys are at most 64 characters and values strings of at most \
                 512"
            )));
        }
    }
    Ok(())
}

/// The conversation record a session's title holds, if it holds one.
fn record(info: &Inspection) -> Option<Value> {
    let title: Value = serde_json::from_str(info.title.as_deref()?).ok()?;
    title.get(KEY).cloned()
}

/// The conversation id of a session, when it is (a branch of) one.
pub fn conversation_of(info: &Inspection) -> Option<String> {
    record(info)?.get("id")?.as_str().map(str::to_owned)
}

/// The session a conversation id names now, following `moved_to`.
pub async fn resolve(state: &WebState, id: &str) -> Result<SessionId, ApiError> {
    let gone = || not_found("conversation", id).with_param("conversation");
    let mut s = parse_conv(id).ok_or_else(gone)?;
    for _ in 0..MAX_HOPS {
        let info = inspect(state, s).await?.ok_or_else(gone)?;
        let rec = record(&info).ok_or_else(gone)?;
        match rec.get("moved_to").and_then(Value::as_u64) {
            Some(next) => s = next,
            None => return Ok(s),
        }
    }
    Err(gone())
}

async fn set_record(state: &WebState, s: SessionId, rec: Value) -> Result<(), ApiError> {
    let info = inspect(state, s)
        .await?
        .ok_or_else(|| not_found("conversation", &format!("conv_{s}")))?;
    call(
        state,
        Request::SetMeta {
            session: s,
            expected_version: info.version,
            title: Some(json!({ KEY: rec }).to_string()),
            archived: None,
        },
    )
    .await?;
    Ok(())
}

/// Serializes the changes to one conversation: what changes which session
/// it names, or adds to it (a response's setup up to its generation
/// starting, items added or dropped, metadata, delete): two at once could
/// fork the same session and one of them drop out of the conversation.
/// Keyed by the model and the conversation's first session, the id its
/// record holds in every branch, so two requests naming it by different
/// ids (a branch's `conv_` id, or the first) take the same lock, and
/// changes to different conversations never wait on each other. Held for
/// the few session requests each takes, never across a generation.
static CHANGES: KeyedLocks<(usize, SessionId)> = KeyedLocks::new();

/// A conversation's lock in [`CHANGES`], held until dropped.
pub(crate) type ChangeGuard = KeyGuard<'static, (usize, SessionId)>;

/// How often [`lock`] takes another lock when the conversation's record,
/// read again under the lock, names another conversation (only a title
/// rewritten through the session API does that).
const MAX_RELOCKS: usize = 4;

/// A conversation locked for a change, and what it holds now.
struct Locked {
    guard: ChangeGuard,
    session: SessionId,
    info: Inspection,
    rec: Value,
}

/// The key in [`CHANGES`] of the conversation record `rec` (read through
/// the id `id`).
fn key_of(state: &WebState, rec: &Value, id: &str) -> Result<(usize, SessionId), ApiError> {
    rec.get("id")
        .and_then(Value::as_str)
        .and_then(parse_conv)
        .map(|first| (state.current, first))
        .ok_or_else(|| not_found("conversation", id))
}

/// Locks conversation `id` for a change and loads it. The id is resolved
/// again under the lock, so the session it names is the one the changes
/// before left it on, and no other change works on it until the guard is
/// dropped; the record read then must name the conversation whose lock was
/// taken.
async fn lock(state: &WebState, id: &str) -> Result<Locked, ApiError> {
    let (_, _, rec) = load(state, id).await?;
    let mut key = key_of(state, &rec, id)?;
    for _ in 0..MAX_RELOCKS {
        let guard = CHANGES.lock(key).await;
        let (session, info, rec) = load(state, id).await?;
        let now = key_of(state, &rec, id)?;
        if now == key {
            return Ok(Locked {
                guard,
                session,
                info,
                rec,
            });
        }
        key = now;
    }
    Err(not_found("conversation", id))
}

fn in_progress(id: &str) -> ApiError {
    ApiError::invalid(
        F,
        format!("conversation {id} has a response in progress; wait for it or cancel it"),
    )
    .with_param("conversation")
}

/// Points conversation `id` at `branch`, a fork or rebase of its session
/// `from` (whose record is `rec`): the branch takes the record, and `from`
/// and the conversation's first session name the branch as `moved_to`, so
/// the id resolves in at most two hops however often it moves.
async fn move_to(
    state: &WebState,
    id: &str,
    from: SessionId,
    branch: SessionId,
    rec: &Value,
) -> Result<(), ApiError> {
    set_record(state, branch, rec.clone()).await?;
    let mut old = rec.clone();
    old["moved_to"] = json!(branch);
    set_record(state, from, old).await?;
    let first = parse_conv(id).ok_or_else(|| not_found("conversation", id))?;
    if first != from {
        if let Some(mut first_rec) = inspect(state, first).await?.as_ref().and_then(record) {
            first_rec["moved_to"] = json!(branch);
            set_record(state, first, first_rec).await?;
        }
    }
    Ok(())
}

/// Where a response on conversation `id` runs, sampling with `p`, the
/// event its input starts at, and the conversation's lock, to hold until
/// the generation is asked for (so the next change to the conversation
/// sees it in progress). A session samples with the settings it was made
/// with, so a response asking for others (a temperature, a top_p) runs on
/// a fork of the conversation at its end, made with them, and the
/// conversation moves to that fork; the seed stays the conversation's.
pub(crate) async fn session_for(
    state: &WebState,
    id: &str,
    p: Params,
    input: &Input<'_>,
) -> Result<(SessionId, EventId, ChangeGuard), ApiError> {
    let Locked {
        guard,
        session: s,
        info,
        rec,
    } = lock(state, id)
        .await
        .map_err(|e| e.with_param("conversation"))?;
    if info.generating {
        return Err(in_progress(id));
    }
    // Before anything is written or the conversation moves.
    input.check(state, Some(s), &read(state, s).await?).await?;
    let wanted = Params {
        seed: info.params.seed,
        ..p
    };
    if wanted == info.params {
        return Ok((s, info.events, guard));
    }
    let branch = created(
        state,
        Request::Fork {
            session: s,
            at_event: info.events,
            params: Some(wanted),
        },
    )
    .await?;
    move_to(state, id, s, branch, &rec).await?;
    Ok((branch, info.events, guard))
}

fn conversation_json(id: &str, created_ms: u64, rec: &Value) -> Value {
    json!({"id": id, "object": "conversation", "created_at": created_ms / 1000,
           "metadata": rec.get("metadata").cloned().unwrap_or_else(|| json!({}))})
}

#[derive(Debug, Deserialize)]
pub struct CreateBody {
    pub items: Option<Value>,
    pub metadata: Option<Value>,
}

fn new_items(v: Option<&Value>) -> Result<Vec<Item>, ApiError> {
    if let Some(Value::Array(list)) = v {
        if list.len() > MAX_NEW_ITEMS {
            return Err(ApiError::invalid(
                F,
                format!(
                    "at most {MAX_NEW_ITEMS} items at once ({} given)",
                    list.len()
                ),
            )
            .with_param("items"));
        }
    }
    items(v).map_err(|e| e.with_param("items"))
}

/// `POST /v1/conversations`: a new session holding `items`, its record
/// set. Every check that needs no session runs before it is made (a new
/// conversation has no open call, so an output must answer a call resent
/// before it in the same items); a refusal once it exists purges it, so a
/// refused create leaves no conversation behind. The session is made and
/// filled on a task of its own ([`to_the_end`]): a client that goes away
/// leaves a whole conversation or none.
pub async fn create(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<WebState>,
) -> Result<HttpResponse, ApiError> {
    let body: CreateBody = accept(&state, F, &req, payload).await?;
    let metadata = body.metadata.unwrap_or_else(|| json!({}));
    check_metadata(&metadata)?;
    let new = new_items(body.items.as_ref())?;
    check_fresh_items(&new).map_err(|e| e.with_param("items"))?;
    let p = params(None, None, None, None, None, F)?;
    to_the_end(async move {
        let s = create_session(&state, p).await?;
        // Taken before the record makes the id resolve: a change naming it
        // (by a guessed id) waits for the items.
        let _changes = CHANGES.lock((state.current, s)).await;
        let id = format!("conv_{s}");
        let rec = json!({"id": id, "metadata": metadata});
        match fill(&state, s, &rec, &new).await {
            Ok(info) => {
                Ok(HttpResponse::Ok().json(conversation_json(&id, info.created_unix_ms, &rec)))
            }
            Err(e) => {
                discard(&state, s).await;
                Err(e)
            }
        }
    })
    .await
}

/// Gives the new session `s` its conversation record `rec` and appends
/// `items`: what it holds after.
async fn fill(
    state: &WebState,
    s: SessionId,
    rec: &Value,
    items: &[Item],
) -> Result<Inspection, ApiError> {
    set_record(state, s, rec.clone()).await?;
    append_items(state, s, items, "items").await?;
    inspect(state, s)
        .await?
        .ok_or_else(|| not_found("conversation", &format!("conv_{s}")))
}

/// Purges session `s`, which a refused create made (nothing names it
/// yet), as `DELETE` purges a conversation's. A failure is only logged:
/// the create's own refusal is what the client is told.
async fn discard(state: &WebState, s: SessionId) {
    let purged = match inspect(state, s).await {
        Ok(Some(info)) => call(
            state,
            Request::Purge {
                session: s,
                expected_generation: info.generation,
                mode: PurgeMode::Reroot,
            },
        )
        .await
        .map(|_| ()),
        Ok(None) => Ok(()),
        Err(e) => Err(e),
    };
    if let Err(e) = purged {
        log::warn!(
            "a refused conversation create left session {s} behind: {}",
            e.message
        );
    }
}

/// The conversation `id`: its session now and what it holds.
async fn load(state: &WebState, id: &str) -> Result<(SessionId, Inspection, Value), ApiError> {
    let s = resolve(state, id).await?;
    let info = inspect(state, s)
        .await?
        .ok_or_else(|| not_found("conversation", id))?;
    let rec = record(&info).ok_or_else(|| not_found("conversation", id))?;
    Ok((s, info, rec))
}

/// `GET /v1/conversations/{id}`.
pub async fn retrieve(
    req: HttpRequest,
    path: web::Path<String>,
    state: web::Data<WebState>,
) -> Result<HttpResponse, ApiError> {
    authorize(&state, F, &req)?;
    let (_, info, rec) = load(&state, &path).await?;
    Ok(HttpResponse::Ok().json(conversation_json(&path, info.created_unix_ms, &rec)))
}

#[derive(Debug, Deserialize)]
pub struct UpdateBody {
    pub metadata: Value,
}

/// `POST /v1/conversations/{id}`: replaces its metadata.
pub async fn update(
    req: HttpRequest,
    path: web::Path<String>,
    payload: web::Payload,
    state: web::Data<WebState>,
) -> Result<HttpResponse, ApiError> {
    let body: UpdateBody = accept(&state, F, &req, payload).await?;
    check_metadata(&body.metadata)?;
    let Locked {
        guard: _changes,
        session: s,
        info,
        mut rec,
    } = lock(&state, &path).await?;
    rec["metadata"] = body.metadata;
    set_record(&state, s, rec.clone()).await?;
    Ok(HttpResponse::Ok().json(conversation_json(&path, info.created_unix_ms, &rec)))
}

/// `DELETE /v1/conversations/{id}`: purges its session (responses forked
/// from it keep their history; the bytes stay in the log).
pub async fn delete(
    req: HttpRequest,
    path: web::Path<String>,
    state: web::Data<WebState>,
) -> Result<HttpResponse, ApiError> {
    authorize(&state, F, &req)?;
    let Locked {
        guard: _changes,
        session: s,
        info,
        ..
    } = lock(&state, &path).await?;
    call(
        &state,
        Request::Purge {
            session: s,
            expected_generation: info.generation,
            mode: crate::wire::PurgeMode::Reroot,
        },
    )
    .await?;
    Ok(HttpResponse::Ok()
        .json(json!({"id": path.into_inner(), "object": "conversation.deleted", "deleted": true})))
}

/// A session's events as conversation items, each with the range of
/// events it spans (for a delete).
async fn all_items(
    state: &WebState,
    s: SessionId,
    events: &[Event],
) -> Result<Vec<(Value, u64, u64)>, ApiError> {
    let names = call_names(state, s).await?;
    let (markers, _) = super::markers(state, &[]);
    let mut out: Vec<(Value, u64, u64)> = Vec::new();
    let mut decode = Decode::named(names.clone(), &markers);
    // The assistant message being read: (id, text, first, end).
    let mut open: Option<(String, String, u64, u64)> = None;
    let flush = |open: &mut Option<(String, String, u64, u64)>, out: &mut Vec<_>| {
        if let Some((id, text, a, b)) = open.take() {
            out.push((
                json!({"id": id, "type": "message", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": text, "annotations": []}]}),
                a,
                b,
            ));
        }
    };
    for e in events {
        let at = e.event_id;
        if let Record::GenerationPrompt { .. } = e.body {
            flush(&mut open, &mut out);
            decode = Decode::named(names.clone(), &markers);
            continue;
        }
        match decode.piece(e) {
            Some(Piece::Text { id, text }) => match &mut open {
                Some(o) => {
                    o.1.push_str(&text);
                    o.3 = at + 1;
                }
                None => open = Some((id, text, at, at + 1)),
            },
            Some(Piece::Call {
                id,
                call_id,
                name,
                arguments,
            }) => {
                flush(&mut open, &mut out);
                out.push((
                    json!({"id": id, "type": "function_call", "status": "completed",
                           "call_id": call_id, "name": name, "arguments": arguments}),
                    at,
                    at + 1,
                ));
            }
            Some(Piece::Reasoning { .. }) => {}
            None => {
                if let Some(item) = input_item(&names, e) {
                    flush(&mut open, &mut out);
                    out.push((item, at, at + 1));
                } else if matches!(e.body, Record::Generated { .. }) {
                    // Markup of a call, or whitespace: part of the message.
                    if let Some(o) = &mut open {
                        o.3 = at + 1;
                    }
                }
            }
        }
    }
    flush(&mut open, &mut out);
    Ok(out)
}

/// `GET /v1/conversations/{id}/items`.
pub async fn list_items(
    req: HttpRequest,
    path: web::Path<String>,
    state: web::Data<WebState>,
) -> Result<HttpResponse, ApiError> {
    authorize(&state, F, &req)?;
    let query = ListQuery::of(&req)?;
    let (s, _, _) = load(&state, &path).await?;
    let events = read(&state, s).await?;
    let items = all_items(&state, s, &events)
        .await?
        .into_iter()
        .map(|(v, _, _)| v)
        .collect();
    Ok(HttpResponse::Ok().json(page(items, &query)?))
}

/// `GET /v1/conversations/{id}/items/{item_id}`: one item, as the listing
/// shows it.
pub async fn retrieve_item(
    req: HttpRequest,
    path: web::Path<(String, String)>,
    state: web::Data<WebState>,
) -> Result<HttpResponse, ApiError> {
    authorize(&state, F, &req)?;
    let (id, item_id) = path.into_inner();
    let (s, _, _) = load(&state, &id).await?;
    let events = read(&state, s).await?;
    let (item, _, _) = find_item(&state, s, &events, &item_id).await?;
    Ok(HttpResponse::Ok().json(item))
}

/// The item `item_id` of session `s` (of `events`), with where its events
/// start and end; 404 when none has that id.
async fn find_item(
    state: &WebState,
    s: SessionId,
    events: &[Event],
    item_id: &str,
) -> Result<(Value, u64, u64), ApiError> {
    all_items(state, s, events)
        .await?
        .into_iter()
        .find(|(v, _, _)| v["id"].as_str() == Some(item_id))
        .ok_or_else(|| not_found("item", item_id))
}

#[derive(Debug, Deserialize)]
pub struct ItemsBody {
    pub items: Value,
}

/// `POST /v1/conversations/{id}/items`: appends items, all of them
/// whatever the client does ([`to_the_end`]).
pub async fn add_items(
    req: HttpRequest,
    path: web::Path<String>,
    payload: web::Payload,
    state: web::Data<WebState>,
) -> Result<HttpResponse, ApiError> {
    let body: ItemsBody = accept(&state, F, &req, payload).await?;
    let new = new_items(Some(&body.items))?;
    let (s, info) = to_the_end({
        let (state, id) = (state.clone(), path.clone());
        async move {
            let Locked {
                guard: _changes,
                session: s,
                info,
                ..
            } = lock(&state, &id).await?;
            append_items(&state, s, &new, "items").await?;
            Ok((s, info))
        }
    })
    .await?;
    let events = read(&state, s).await?;
    let added: Vec<Value> = all_items(&state, s, &events)
        .await?
        .into_iter()
        .filter(|(_, a, _)| *a >= info.events)
        .map(|(v, _, _)| v)
        .collect();
    Ok(HttpResponse::Ok().json(json!({
        "object": "list",
        "first_id": added.first().map(|i| i["id"].clone()),
        "last_id": added.last().map(|i| i["id"].clone()),
        "has_more": false,
        "data": added,
    })))
}

/// `DELETE /v1/conversations/{id}/items/{item_id}`: a rebase that drops the
/// item's events into a new branch (the old one is kept); the conversation
/// id names the new branch from then on. The branch is made and named on
/// a task of its own ([`to_the_end`]), so a client that goes away leaves
/// no branch unnamed.
pub async fn delete_item(
    req: HttpRequest,
    path: web::Path<(String, String)>,
    state: web::Data<WebState>,
) -> Result<HttpResponse, ApiError> {
    authorize(&state, F, &req)?;
    let (id, item_id) = path.into_inner();
    to_the_end(drop_item(state, id, item_id)).await
}

/// The rebase and moves of [`delete_item`].
async fn drop_item(
    state: web::Data<WebState>,
    id: String,
    item_id: String,
) -> Result<HttpResponse, ApiError> {
    let Locked {
        guard: _changes,
        session: s,
        info,
        rec,
    } = lock(&state, &id).await?;
    let events = read(&state, s).await?;
    let (_, from, to) = find_item(&state, s, &events, &item_id).await?;
    if from == 0 {
        return Err(ApiError::new(
            F,
            Kind::Invalid,
            "the first event cannot be dropped",
        ));
    }
    let branch = created(
        &state,
        Request::Rebase {
            session: s,
            edits: vec![Edit::Drop { from, to }],
            params: None,
        },
    )
    .await?;
    move_to(&state, &id, s, branch, &rec).await?;
    Ok(HttpResponse::Ok().json(conversation_json(&id, info.created_unix_ms, &rec)))
}
