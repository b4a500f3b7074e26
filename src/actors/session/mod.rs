//! `SessionActor`: one per session, started on demand by the registry and
//! stopped when idle. It runs its session's requests one at a time, in
//! order, so that an event id is planned, committed and applied before the
//! next request of the session is looked at. Forks, rebases and trims of this
//! session run here too: their parent cannot change under them.
//!
//! The actor receives, calls the book, commits, replies: each request is
//! planned by `SessionBook` (one read of the book, a typed [`Planned`]), then
//! [`commit`]ted. The requests live one family a file:
//!
//! - [`messages`]: appends (text, messages, system, blocks) and reads.
//! - [`tools`]: tool results and outcomes, permissions, the tool choice.
//! - [`branches`]: fork, trim, rebase.
//! - [`meta`]: title and archive, purge, QoS, pin.
//! - [`generation`]: Generate and Cancel.
//!
//! A generation runs as the actor's state, not as a held request: the actor
//! keeps answering Read, Inspect, Fork and Cancel while tokens arrive from
//! the scheduler; it refuses anything that would append to the session
//! (SessionBusy).

mod branches;
mod generation;
mod messages;
mod meta;
mod prepared;
pub use prepared::INLINE_BYTES;
mod schema_cache;
pub(crate) use schema_cache::grammar_of;
mod tools;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use actix::prelude::*;
use tokio::sync::mpsc;

use super::Shared;
use crate::session::{Planned, PlannedEvent, SessionError};
use crate::wire::{Event, Request, Response, SessionId};
use generation::ActiveGeneration;

/// A request about this actor's session.
#[derive(Message)]
#[rtype(result = "Response")]
pub struct SessionRequest(pub Request);

/// A streaming request (Generate): its replies go to `reply`, which closes
/// after the last one.
#[derive(Message)]
#[rtype(result = "()")]
pub struct SessionStream {
    pub request: Request,
    pub reply: mpsc::Sender<Response>,
    /// Also send the text drawn ahead of its commit, as
    /// `SubProvisional { sub: 0, channel, text }` (the browser transport's
    /// `provisional` events).
    pub provisional: bool,
    /// Told the prompt tokens taken from the cache (the scheduler's
    /// `warm_prefix`) when the generation starts: the HTTP routes send it
    /// in a header before the stream. Dropped unsent if it never starts.
    pub started: Option<tokio::sync::oneshot::Sender<u64>>,
}

/// Replies a generation may queue for its client before it is judged gone:
/// more than any generation produces (one per committed chunk or event).
pub const STREAM_REPLY_CAPACITY: usize = 4096;

/// A session actor's work in flight, shared with the registry: an actor with
/// work is never stopped as idle (a second actor for the same session would
/// plan the same event ids). Work is counted by [`BusyGuard`]s, so it cannot
/// be miscounted.
#[derive(Clone, Default)]
pub struct Busy(Arc<AtomicUsize>);

impl Busy {
    /// Marks one piece of work as begun; it ends when the guard drops.
    pub fn begin(&self) -> BusyGuard {
        self.0.fetch_add(1, Ordering::SeqCst);
        BusyGuard(self.0.clone())
    }

    /// True when no guard is alive.
    pub fn is_idle(&self) -> bool {
        self.0.load(Ordering::SeqCst) == 0
    }
}

/// One request in flight, or a generation running: held for as long as it
/// lasts.
pub struct BusyGuard(Arc<AtomicUsize>);

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

pub struct SessionActor {
    id: SessionId,
    shared: Shared,
    /// The generation in flight, holding a `BusyGuard` while it runs.
    generation: Option<ActiveGeneration>,
    busy: Busy,
}

impl SessionActor {
    pub fn new(id: SessionId, shared: Shared, busy: Busy) -> SessionActor {
        SessionActor {
            id,
            shared,
            generation: None,
            busy,
        }
    }
}

impl Actor for SessionActor {
    type Context = Context<Self>;

    fn started(&mut self, _: &mut Context<Self>) {
        log::debug!("session {} actor started", self.id);
    }

    fn stopped(&mut self, _: &mut Context<Self>) {
        log::debug!("session {} actor stopped", self.id);
    }
}

/// Requests that append to the session, refused while it generates.
fn appends(req: &Request) -> bool {
    matches!(
        req,
        Request::Append { .. }
            | Request::AppendMessage { .. }
            | Request::AppendSystem { .. }
            | Request::AppendBlock { .. }
            | Request::AppendImage { .. }
            | Request::AppendToolResult { .. }
            | Request::AppendToolOutcome { .. }
            | Request::RequestToolCancel { .. }
            | Request::RequestPermission { .. }
            | Request::RespondPermission { .. }
            | Request::SetQos { .. }
            | Request::SetToolChoice { .. }
            | Request::SetOutputFormat { .. }
            | Request::Purge { .. }
            | Request::Generate { .. }
            // A rebase keeps the parent's events after its last edit, as many
            // as the parent holds when it is applied; a generation committing
            // meanwhile could make replay see a different count.
            | Request::Rebase { .. }
    )
}

impl Handler<SessionRequest> for SessionActor {
    type Result = AtomicResponse<Self, Response>;

    fn handle(&mut self, msg: SessionRequest, _: &mut Context<Self>) -> Self::Result {
        let ready = |r: Response| AtomicResponse::new(Box::pin(fut::ready(r)));
        if self.generation.is_some() && appends(&msg.0) {
            return ready(err(SessionError::Busy(self.id)));
        }
        if let Request::Cancel { session } = msg.0 {
            return ready(match self.cancel() {
                true => Response::Cancelling,
                false => err(SessionError::NotGenerating(session)),
            });
        }
        let generating = self.generation.is_some();
        let shared = self.shared.clone();
        let work = self.busy.begin();
        AtomicResponse::new(Box::pin(
            async move {
                let mut r = serve(&shared, msg.0).await.unwrap_or_else(err);
                drop(work);
                if let Response::Inspection { inspection } = &mut r {
                    inspection.generating = generating;
                }
                r
            }
            .into_actor(self),
        ))
    }
}

impl Handler<SessionStream> for SessionActor {
    type Result = ();

    fn handle(&mut self, msg: SessionStream, ctx: &mut Context<Self>) {
        match msg.request {
            Request::Generate {
                session,
                max_tokens,
            } => {
                if self.generation.is_some() {
                    let _ = msg.reply.try_send(err(SessionError::Busy(session)));
                    return;
                }
                let asks = generation::Asks {
                    provisional: msg.provisional,
                    started: msg.started,
                };
                self.start_generation(max_tokens, msg.reply, asks, ctx);
            }
            other => {
                let e = SessionError::DoesNotStream(name(&other));
                let _ = msg.reply.try_send(err(e));
            }
        }
    }
}

/// Serves a request that does not stream, one family a file.
async fn serve(shared: &Shared, req: Request) -> Result<Response, SessionError> {
    use Request::*;
    match req {
        Append {
            session,
            text,
            span,
        } => messages::append(shared, session, text, span).await,
        AppendMessage {
            session,
            role,
            text,
        } => messages::message(shared, session, role, text).await,
        AppendSystem {
            session,
            text,
            tools,
        } => messages::system(shared, session, text, tools).await,
        AppendBlock {
            session,
            role,
            kind,
            payload,
        } => messages::block(shared, session, role, kind, payload).await,
        AppendImage {
            session,
            role,
            blob,
            pre_text,
            post_text,
        } => messages::image(shared, session, role, blob, pre_text, post_text).await,
        Read { session, cursor } => messages::read(shared, session, cursor),
        Inspect { session } => messages::inspect(shared, session),
        AppendToolResult {
            session,
            call_id,
            content,
        } => tools::result(shared, session, call_id, content).await,
        AppendToolOutcome {
            session,
            call_id,
            outcome,
            note,
        } => tools::outcome(shared, session, call_id, outcome, note).await,
        RequestToolCancel { session, call_id } => tools::cancel(shared, session, call_id).await,
        OpenToolCalls { session } => tools::open_calls(shared, session),
        Ledger { session } => tools::ledger(shared, session),
        RequestPermission {
            session,
            call_id,
            text,
        } => tools::ask_permission(shared, session, call_id, text).await,
        RespondPermission {
            session,
            request_id,
            granted,
        } => tools::answer_permission(shared, session, request_id, granted).await,
        SetToolChoice { session, choice } => tools::choice(shared, session, choice).await,
        SetOutputFormat { session, schema } => tools::output_format(shared, session, schema).await,
        Fork {
            session,
            at_event,
            params,
        } => branches::fork(shared, session, at_event, params).await,
        Trim { session, to_event } => branches::fork(shared, session, to_event, None).await,
        Rebase {
            session,
            edits,
            params,
        } => branches::rebase(shared, session, edits, params).await,
        SetMeta {
            session,
            expected_version,
            title,
            archived,
        } => meta::set(shared, session, expected_version, title, archived).await,
        Purge {
            session,
            expected_generation,
            mode,
        } => meta::purge(shared, session, expected_generation, mode).await,
        SetQos {
            session,
            class,
            batch_invariant,
        } => meta::qos(shared, session, class, batch_invariant).await,
        Pin { session, ttl_ms } => meta::pin(shared, session, ttl_ms).await,
        // The frontends send Generate as a stream; this says so should one
        // come as a plain request.
        Generate { .. } => Err(SessionError::Streams),
        // The registry answers the requests about no session, and starts a
        // subscription itself; the handler above answers Cancel. None of
        // them reaches this point.
        other => Err(SessionError::NotASessionRequest(name(&other))),
    }
}

/// Commits a plan; the reply it earns once applied.
pub async fn commit(shared: &Shared, planned: Planned) -> Result<Response, SessionError> {
    let reply = match &planned {
        Planned::Event(e) => Response::Committed {
            event: e.event.clone(),
        },
        Planned::Branch { session, .. } => Response::Created { session: *session },
        Planned::Meta { version, .. } => Response::Meta { version: *version },
        Planned::Purge { sessions, .. } => Response::Purged {
            sessions: sessions.clone(),
        },
    };
    shared.commit(planned.into_record()).await?;
    Ok(reply)
}

/// Commits one event a generation produced; the event, for its `Delta`.
async fn commit_event(shared: &Shared, planned: PlannedEvent) -> Result<Event, SessionError> {
    let event = planned.event.clone();
    shared.commit(planned.into_record()).await?;
    Ok(event)
}

fn err(e: SessionError) -> Response {
    Response::err(e.to_string())
}

/// A request's name, as in its JSON form.
pub fn name(req: &Request) -> String {
    match serde_json::to_value(req) {
        Ok(serde_json::Value::String(s)) => s,
        Ok(serde_json::Value::Object(m)) => m.keys().next().cloned().unwrap_or_default(),
        _ => "request".into(),
    }
}
