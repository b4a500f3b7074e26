//! `SessionActor`: one per session, started on demand by the registry and
//! stopped when idle. It runs its session's requests one at a time, in
//! order, so that an event id is planned, committed and applied before the
//! next request of the session is looked at. Forks, rebases and trims of this
//! session run here too: their parent cannot change under them.
//!
//! A generation runs as the actor's state, not as a held request: the actor
//! keeps answering Read, Inspect, Fork and Cancel while tokens arrive from
//! the scheduler; it refuses anything that would append to the session
//! (SessionBusy). Drawn tokens become records in `TurnOutput`; they are
//! committed one after another, and each `Delta` leaves only after its
//! record is durable.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use actix::prelude::*;
use tokio::sync::mpsc;

use super::scheduler::{AdmitGen, CancelGen, GenUpdate};
use super::{now_ms, Shared};
use crate::scheduler::{Admit, GenEvent, GenId};
use crate::session::grammar::forced_call;
use crate::session::output::Markers;
use crate::session::turn::TurnOutput;
use crate::session::{Planned, SessionError, TurnState};
use crate::wire::{finish, LogRecord, Record, Request, Response, SessionId};

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
}

/// Replies a generation may queue for its client before it is judged gone:
/// more than any generation produces (one per committed chunk or event).
pub const STREAM_REPLY_CAPACITY: usize = 4096;

/// The state of a generation in flight.
struct Running {
    gen: Option<GenId>,
    reply: mpsc::Sender<Response>,
    output: TurnOutput,
    /// Records ready to commit, in order.
    queue: VecDeque<Record>,
    committing: bool,
    events: u64,
    warm_prefix: u64,
    finish: Option<u8>,
    failed: Option<String>,
    cancel_requested: bool,
    provisional: bool,
    /// A grammar forces a tool call: its end is reported as finish 3.
    forced: bool,
}

pub struct SessionActor {
    id: SessionId,
    shared: Shared,
    running: Option<Running>,
    /// Shared with the registry: requests in flight plus one while a
    /// generation runs. An actor with work is never stopped as idle (a second
    /// actor for the same session would plan the same event ids).
    busy: Arc<AtomicUsize>,
}

impl SessionActor {
    pub fn new(id: SessionId, shared: Shared, busy: Arc<AtomicUsize>) -> SessionActor {
        SessionActor {
            id,
            shared,
            running: None,
            busy,
        }
    }

    fn set_running(&mut self, running: Option<Running>) {
        match (self.running.is_some(), running.is_some()) {
            (false, true) => {
                self.busy.fetch_add(1, Ordering::SeqCst);
            }
            (true, false) => {
                self.busy.fetch_sub(1, Ordering::SeqCst);
            }
            _ => {}
        }
        self.running = running;
    }

    fn cancel(&mut self) -> bool {
        let Some(r) = &mut self.running else {
            return false;
        };
        r.cancel_requested = true;
        if let Some(gen) = r.gen {
            self.shared.scheduler.do_send(CancelGen(gen));
        }
        true
    }

    /// Sends a reply to the generating client; a client that is gone (or
    /// hopelessly behind) cancels the generation.
    fn tell(&mut self, response: Response) {
        let gone = match &self.running {
            Some(r) => r.reply.try_send(response).is_err(),
            None => false,
        };
        if gone {
            self.cancel();
        }
    }

    /// Provisional text for the generating client: dropped when its queue
    /// is full (the commits carry the same text), a gone client cancels.
    fn tell_provisional(&mut self, channel: u8, text: String) {
        let gone = match &self.running {
            Some(r) => matches!(
                r.reply.try_send(Response::SubProvisional {
                    sub: 0,
                    channel,
                    text
                }),
                Err(mpsc::error::TrySendError::Closed(_))
            ),
            None => false,
        };
        if gone {
            self.cancel();
        }
    }

    /// Commits queued records one at a time; ends the generation when all
    /// is committed and the scheduler is done with it.
    fn pump(&mut self, ctx: &mut Context<Self>) {
        let Some(r) = &mut self.running else { return };
        if r.committing {
            return;
        }
        if r.failed.is_some() {
            r.queue.clear();
        }
        if let Some(body) = r.queue.pop_front() {
            r.committing = true;
            let planned = self.shared.read().plan_output(self.id, body, now_ms());
            let shared = self.shared.clone();
            let fut = async move { commit_record(&shared, planned).await };
            ctx.spawn(fut.into_actor(self).map(|result, this, ctx| {
                if let Some(r) = &mut this.running {
                    r.committing = false;
                }
                match result {
                    Ok(event) => {
                        if let Some(r) = &mut this.running {
                            r.events += 1;
                        }
                        this.tell(Response::Delta { event });
                    }
                    Err(e) => {
                        if let Some(r) = &mut this.running {
                            r.failed.get_or_insert(e);
                        }
                        this.cancel();
                    }
                }
                this.pump(ctx);
            }));
            return;
        }
        if r.failed.is_none() && r.finish.is_none() {
            return;
        }
        // Done: the summary (or the error) is the last reply.
        let r = self.running.take().expect("running");
        self.busy.fetch_sub(1, Ordering::SeqCst);
        let last = match r.failed {
            Some(message) => Response::Err { message },
            None => Response::Generated {
                events: r.events,
                tokens_generated: r.output.tokens_generated(),
                finish: r.finish.unwrap_or(finish::ERROR),
                warm_prefix: r.warm_prefix,
            },
        };
        // The last reply waits for room: it must not be lost to a full queue.
        let reply = r.reply;
        actix_rt::spawn(async move {
            let _ = reply.send(last).await;
        });
    }

    fn start_generation(
        &mut self,
        max_tokens: u32,
        reply: mpsc::Sender<Response>,
        provisional: bool,
        ctx: &mut Context<Self>,
    ) {
        let n_ctx = self.shared.n_ctx;
        if max_tokens == 0 || max_tokens > n_ctx {
            let _ = reply.try_send(Response::err(format!(
                "max_tokens must be between 1 and the context size ({n_ctx})"
            )));
            return;
        }
        if let Err(e) = self.shared.read().check_live(self.id) {
            let _ = reply.try_send(Response::err(e.to_string()));
            return;
        }
        let markers = Markers::from_template(&self.shared.render.template_source());
        self.set_running(Some(Running {
            gen: None,
            reply,
            output: TurnOutput::new(markers.clone(), false),
            queue: VecDeque::new(),
            committing: false,
            events: 0,
            warm_prefix: 0,
            finish: None,
            failed: None,
            cancel_requested: false,
            provisional,
            forced: false,
        }));
        let shared = self.shared.clone();
        let id = self.id;
        let owner = ctx.address().recipient::<GenUpdate>();
        let think_close = markers.think.as_ref().map(|m| m.1.clone());
        let think_open = markers.think.as_ref().map(|m| m.0.clone());
        let fut = async move {
            let state = shared
                .read()
                .turn_state(id, think_close.as_deref())
                .map_err(|e| e.to_string())?;
            let prompt_event = match state {
                TurnState::Open { .. } => {
                    // Continuing a turn from an earlier daemon start: its KV
                    // is rebuilt by prefill, which can differ in the last
                    // bits from the original decode. Say so in the log.
                    let (stale, epoch) = {
                        let book = shared.read();
                        let last = book.last_event(id).map(|e| e.epoch).unwrap_or(0);
                        (last < book.epoch(), book.epoch())
                    };
                    let bump = if stale {
                        let planned = shared.read().plan_output(id, Record::EpochBump, now_ms());
                        log::debug!("session {id}: continuing its turn in epoch {epoch}");
                        Some(commit_record(&shared, planned).await?)
                    } else {
                        None
                    };
                    bump
                }
                TurnState::Closed => {
                    let planned =
                        shared
                            .read()
                            .plan_generation_prompt(id, shared.render.as_ref(), now_ms());
                    Some(commit_record(&shared, planned).await?)
                }
            };
            let (prompt, qos, params, forced, turn) = {
                let book = shared.read();
                let e = |e: SessionError| e.to_string();
                (
                    book.input(id).map_err(e)?,
                    book.qos(id).map_err(e)?,
                    book.params(id).map_err(e)?,
                    // A forced tool call: a grammar over the declared tools.
                    book.forced_tools(id).map_err(e)?,
                    book.last_turn_start(id).map_err(e)?,
                )
            };
            // How the turn opened: inside a thinking block if the
            // template's header ends with its opening marker. The grammar
            // governs the whole turn, from its header on: built
            // as it was when the turn opened (inside a thinking block or
            // not), with what the turn holds so far as its prefix, so a cut
            // forced call continues where it stopped.
            let (grammar_from, header) = turn.unwrap_or((prompt.len(), Vec::new()));
            let turn = prompt[grammar_from.min(prompt.len())..].to_vec();
            let opened_in_reasoning = think_open
                .as_deref()
                .is_some_and(|m| shared.render.detokenize(&header).trim_end().ends_with(m));
            let grammar = match forced {
                Some(tools) => Some(forced_call(
                    &tools,
                    think_close.as_deref().filter(|_| opened_in_reasoning),
                    &crate::engine::json_schema_grammar,
                )?),
                None => None,
            };
            let forced = grammar.is_some();
            let admit = Admit {
                session: id,
                prompt,
                params,
                max_tokens,
                class: qos.0,
                batch_invariant: qos.1,
                grammar,
                grammar_from,
            };
            let gen = shared
                .scheduler
                .send(AdmitGen { admit, owner })
                .await
                .map_err(|e| format!("the scheduler is gone: {e}"))?
                .map_err(|e| e.to_string())?;
            Ok::<_, String>((prompt_event, opened_in_reasoning, turn, gen, forced))
        };
        ctx.wait(
            fut.into_actor(self)
                .map(move |result, this, ctx| match result {
                    Ok((prompt_event, opened_in_reasoning, turn, gen, forced)) => {
                        if let Some(r) = &mut this.running {
                            r.gen = Some(gen);
                            r.forced = forced;
                            // A continued turn's decoder picks up where the
                            // cut left it (a marker or tool call split
                            // across the cut).
                            let render = &this.shared.render;
                            let turn = turn
                                .into_iter()
                                .filter(|&t| !render.is_eog(t))
                                .map(|t| (t, render.piece(t)))
                                .collect::<Vec<_>>();
                            r.output = TurnOutput::resume(markers, opened_in_reasoning, &turn);
                            if prompt_event.is_some() {
                                r.events += 1;
                            }
                        }
                        if let Some(event) = prompt_event {
                            this.tell(Response::Delta { event });
                        }
                        if this.running.as_ref().is_some_and(|r| r.cancel_requested) {
                            this.cancel();
                        }
                    }
                    Err(message) => {
                        if let Some(r) = &mut this.running {
                            r.failed = Some(message);
                        }
                        this.pump(ctx);
                    }
                }),
        );
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
        if self.running.is_some() && appends(&msg.0) {
            return ready(Response::err(format!(
                "SessionBusy: session {} has a generation in flight",
                self.id
            )));
        }
        if let Request::Cancel { session } = msg.0 {
            return ready(if self.cancel() {
                Response::Cancelling
            } else {
                Response::err(format!("session {session} has no generation in flight"))
            });
        }
        let generating = self.running.is_some();
        let shared = self.shared.clone();
        let busy = self.busy.clone();
        busy.fetch_add(1, Ordering::SeqCst);
        AtomicResponse::new(Box::pin(
            async move {
                let mut r = handle(&shared, msg.0).await;
                busy.fetch_sub(1, Ordering::SeqCst);
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
                if self.running.is_some() {
                    let _ = msg.reply.try_send(Response::err(format!(
                        "SessionBusy: session {session} has a generation in flight"
                    )));
                    return;
                }
                self.start_generation(max_tokens, msg.reply, msg.provisional, ctx);
            }
            other => {
                let _ = msg
                    .reply
                    .try_send(Response::err(format!("{} does not stream", name(&other))));
            }
        }
    }
}

impl Handler<GenUpdate> for SessionActor {
    type Result = ();

    fn handle(&mut self, msg: GenUpdate, ctx: &mut Context<Self>) {
        let render = self.shared.render.clone();
        let Some(r) = &mut self.running else { return };
        let gen = match &msg.0 {
            GenEvent::Started { gen, .. }
            | GenEvent::Token { gen, .. }
            | GenEvent::Finished { gen, .. }
            | GenEvent::Failed { gen, .. } => *gen,
        };
        if r.gen != Some(gen) {
            // A generation this actor no longer runs (ended on an error).
            return;
        }
        match msg.0 {
            GenEvent::Started { warm_prefix, .. } => r.warm_prefix = warm_prefix,
            GenEvent::Token { token, .. } => {
                let eog = render.is_eog(token);
                let piece = if eog { Vec::new() } else { render.piece(token) };
                let records = r.output.push(token, &piece, eog, now_ms());
                r.queue.extend(records);
                // The text this token added, for the generating client if it
                // asked and for subscribers, ahead of its commit.
                let fresh = r.output.take_fresh();
                let wants = r.provisional;
                for (channel, text) in fresh {
                    self.shared.bus.publish_provisional(self.id, channel, &text);
                    if wants {
                        self.tell_provisional(channel, text);
                    }
                }
            }
            GenEvent::Finished { finish, .. } => {
                let finish = if r.forced && finish == finish::END_OF_TURN {
                    finish::GRAMMAR
                } else {
                    finish
                };
                let records = r.output.finish(finish, now_ms());
                r.queue.extend(records);
                r.finish = Some(finish);
            }
            GenEvent::Failed { message, .. } => {
                r.failed = Some(message);
            }
        }
        self.pump(ctx);
    }
}

/// Commits one planned single-event record and returns its event.
async fn commit_record(
    shared: &Shared,
    planned: Result<Planned, SessionError>,
) -> Result<crate::wire::Event, String> {
    let record = planned.map_err(|e| e.to_string())?.record;
    let event = match &record {
        LogRecord::Events { events, .. } => events.last().cloned(),
        _ => None,
    }
    .ok_or("internal error: a record without an event")?;
    shared.commit(record).await?;
    Ok(event)
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
        Request::SetToolChoice { session, choice } => {
            let p = shared.read().plan_tool_choice(session, choice, now);
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
        Request::Generate { .. } => {
            err("Generate streams its replies: send it on the socket or /web/ws")
        }
        Request::Cancel { session } => {
            err(format!("session {session} has no generation in flight"))
        }
        Request::Subscribe { .. } => err("Subscribe is not served by this daemon yet"),
        Request::Pin { session, ttl_ms } => {
            if let Err(e) = shared.read().inspect(session) {
                return err(e);
            }
            let deadline_ms = if ttl_ms == 0 {
                0
            } else {
                now.saturating_add(ttl_ms)
            };
            match shared
                .scheduler
                .send(super::scheduler::PinSession {
                    session,
                    deadline_ms,
                })
                .await
            {
                Ok(deadline_unix_ms) => Response::Pinned { deadline_unix_ms },
                Err(e) => err(format!("the scheduler is gone: {e}")),
            }
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
