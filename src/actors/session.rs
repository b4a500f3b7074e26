//! `SessionActor`: one per session, started on demand by the registry and
//! stopped when idle. It runs its session's requests one at a time, in
//! order, so that an event id is planned, committed and applied before the
//! next request of the session is looked at. Forks, rebases and trims of this
//! session run here too: their parent cannot change under them.

use actix::prelude::*;

use super::{now_ms, Shared};
use crate::session::{Planned, SessionError};
use crate::wire::{LogRecord, Request, Response, SessionId};

/// A request about this actor's session.
#[derive(Message)]
#[rtype(result = "Response")]
pub struct SessionRequest(pub Request);

pub struct SessionActor {
    id: SessionId,
    shared: Shared,
}

impl SessionActor {
    pub fn new(id: SessionId, shared: Shared) -> SessionActor {
        SessionActor { id, shared }
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

impl Handler<SessionRequest> for SessionActor {
    type Result = AtomicResponse<Self, Response>;

    fn handle(&mut self, msg: SessionRequest, _: &mut Context<Self>) -> Self::Result {
        let shared = self.shared.clone();
        AtomicResponse::new(Box::pin(
            async move { handle(&shared, msg.0).await }.into_actor(self),
        ))
    }
}

fn err(e: impl ToString) -> Response {
    Response::err(e.to_string())
}

/// Commits a planned record and replies with its last event.
async fn commit_event(shared: &Shared, planned: Result<Planned, SessionError>) -> Response {
    let record = match planned {
        Ok(p) => p.record,
        Err(e) => return err(e),
    };
    let event = match &record {
        LogRecord::Events { events, .. } => events.last().cloned(),
        _ => None,
    };
    match (shared.commit(record).await, event) {
        (Ok(()), Some(event)) => Response::Committed { event },
        (Ok(()), None) => err("internal error: a committed record without an event"),
        (Err(e), _) => err(e),
    }
}

/// Commits a planned new session (fork, rebase, trim) and replies `Created`.
async fn commit_branch(
    shared: &Shared,
    id: SessionId,
    planned: Result<Planned, SessionError>,
) -> Response {
    match planned {
        Ok(p) => match shared.commit(p.record).await {
            Ok(()) => Response::Created { session: id },
            Err(e) => err(e),
        },
        Err(e) => err(e),
    }
}

const NEEDS_LANE: &str = "needs a model lane to generate, which this daemon does not run yet";

async fn handle(shared: &Shared, req: Request) -> Response {
    let now = now_ms();
    let render = shared.render.as_ref();
    match req {
        Request::Append {
            session,
            text,
            span,
        } => {
            let p = shared.read().plan_append(session, text, span, render, now);
            commit_event(shared, p).await
        }
        Request::AppendMessage {
            session,
            role,
            text,
        } => {
            let p = shared.read().plan_message(session, role, text, render, now);
            commit_event(shared, p).await
        }
        Request::AppendSystem {
            session,
            text,
            tools,
        } => {
            let p = shared.read().plan_system(session, text, tools, render, now);
            commit_event(shared, p).await
        }
        Request::AppendBlock {
            session,
            role,
            kind,
            payload,
        } => {
            let p = shared
                .read()
                .plan_block(session, role, kind, payload, render, now);
            commit_event(shared, p).await
        }
        Request::AppendImage { .. } => err("AppendImage: this model has no vision projector"),
        Request::Read { session, cursor } => match shared.read().read(session, cursor) {
            Ok(events) => Response::Events { events },
            Err(e) => err(e),
        },
        Request::Inspect { session } => match shared.read().inspect(session) {
            Ok(inspection) => Response::Inspection { inspection },
            Err(e) => err(e),
        },
        Request::SetMeta {
            session,
            expected_version,
            title,
            archived,
        } => {
            let p = shared
                .read()
                .plan_meta(session, expected_version, title, archived, now);
            match p {
                Ok(p) => {
                    let version = match &p.record {
                        LogRecord::Meta { version, .. } => *version,
                        _ => 0,
                    };
                    match shared.commit(p.record).await {
                        Ok(()) => Response::Meta { version },
                        Err(e) => err(e),
                    }
                }
                Err(e) => err(e),
            }
        }
        Request::Purge {
            session,
            expected_generation,
            mode,
        } => {
            let p = shared
                .read()
                .plan_purge(session, expected_generation, mode, now);
            match p {
                Ok(p) => {
                    let sessions = match &p.record {
                        LogRecord::Purge { sessions, .. } => sessions.clone(),
                        _ => vec![],
                    };
                    match shared.commit(p.record).await {
                        Ok(()) => Response::Purged { sessions },
                        Err(e) => err(e),
                    }
                }
                Err(e) => err(e),
            }
        }
        Request::Fork {
            session,
            at_event,
            params,
        } => {
            let (id, p) = {
                let mut book = shared.write();
                let id = book.reserve_id();
                (id, book.plan_fork(id, session, at_event, params, now))
            };
            commit_branch(shared, id, p).await
        }
        Request::Trim { session, to_event } => {
            let (id, p) = {
                let mut book = shared.write();
                let id = book.reserve_id();
                (id, book.plan_fork(id, session, to_event, None, now))
            };
            commit_branch(shared, id, p).await
        }
        Request::Rebase {
            session,
            edits,
            params,
        } => {
            let (id, p) = {
                let mut book = shared.write();
                let id = book.reserve_id();
                (
                    id,
                    book.plan_rebase(id, session, edits, params, render, now),
                )
            };
            commit_branch(shared, id, p).await
        }
        Request::AppendToolResult {
            session,
            call_id,
            content,
        } => {
            let p = shared
                .read()
                .plan_tool_result(session, call_id, content, render, now);
            commit_event(shared, p).await
        }
        Request::AppendToolOutcome {
            session,
            call_id,
            outcome,
            note,
        } => {
            let p = shared
                .read()
                .plan_tool_outcome(session, call_id, outcome, note, now);
            commit_event(shared, p).await
        }
        Request::RequestToolCancel { session, call_id } => {
            let p = shared.read().plan_tool_cancel(session, call_id, now);
            commit_event(shared, p).await
        }
        Request::OpenToolCalls { session } => match shared.read().open_tool_calls(session) {
            Ok(calls) => Response::ToolCalls { calls },
            Err(e) => err(e),
        },
        Request::Ledger { session } => match shared.read().ledger(session) {
            Ok(entries) => Response::Ledger { entries },
            Err(e) => err(e),
        },
        Request::RequestPermission {
            session,
            call_id,
            text,
        } => {
            let p = shared
                .read()
                .plan_permission_request(session, call_id, text, now);
            commit_event(shared, p).await
        }
        Request::RespondPermission {
            session,
            request_id,
            granted,
        } => {
            let p = shared
                .read()
                .plan_permission_response(session, request_id, granted, now);
            commit_event(shared, p).await
        }
        Request::SetQos {
            session,
            class,
            batch_invariant,
        } => {
            let p = shared.read().plan_qos(session, class, batch_invariant, now);
            commit_event(shared, p).await
        }
        Request::Generate { .. } => err(format!("Generate {NEEDS_LANE}")),
        Request::Cancel { session } => {
            err(format!("session {session} has no generation in flight"))
        }
        Request::Subscribe { .. } => err("Subscribe is not served by this daemon yet"),
        Request::Pin { .. } => {
            err("Pin holds a prefix in the prefix cache, which this daemon does not have yet")
        }
        other => err(format!(
            "internal error: {} is not a session request",
            name(&other)
        )),
    }
}

/// A request's name, as in its JSON form.
pub fn name(req: &Request) -> String {
    match serde_json::to_value(req) {
        Ok(serde_json::Value::String(s)) => s,
        Ok(serde_json::Value::Object(m)) => m.keys().next().cloned().unwrap_or_default(),
        _ => "request".into(),
    }
}
