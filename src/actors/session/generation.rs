//! Generate and Cancel. `SessionBook::plan_generation` reads the session
//! once; the actor commits the plan's opening record, admits the generation
//! to the scheduler, and turns the tokens it sends back (`GenUpdate`) into
//! records with the plan's `TurnOutput`. The records are committed one after
//! another, and each `Delta` leaves only after its record is durable; the
//! summary (`Generated`) or the error is the last reply.

use std::collections::VecDeque;

use actix::prelude::*;
use tokio::sync::mpsc;

use super::prepared::Answers;
use super::{commit_event, schema_cache, BusyGuard, SessionActor, STREAM_REPLY_CAPACITY};
use crate::actors::now_ms;
use crate::actors::scheduler::{AdmitGen, CancelGen, GenUpdate};
use crate::scheduler::{Admit, GenEvent, GenId};
use crate::session::grammar::GrammarError;
use crate::session::turn::TurnOutput;
use crate::session::{SessionError, TurnState};
use crate::wire::{Channel, Finish, Record, Response};

/// The generation a session actor runs.
pub(super) struct ActiveGeneration {
    /// The scheduler's id for it, once admitted.
    gen: Option<GenId>,
    /// The generating client's replies.
    reply: mpsc::Sender<Response>,
    /// Drawn tokens to records; it knows the finish code once finished.
    output: TurnOutput,
    /// Records ready to commit, in order.
    queue: VecDeque<Record>,
    /// A record's commit is in flight (they are committed one at a time).
    committing: bool,
    /// Events committed, the opening record included.
    events: u64,
    warm_prefix: u64,
    /// Why it failed: the last reply is this error.
    failed: Option<String>,
    /// A Cancel came; sent to the scheduler once its id is known.
    cancel_requested: bool,
    /// The client also wants provisional text.
    provisional: bool,
    /// Told the warm prefix when the scheduler starts it (the first time).
    started: Option<tokio::sync::oneshot::Sender<u64>>,
    /// Keeps the actor from being stopped as idle while it runs.
    _busy: BusyGuard,
}

/// What the generating client asks beside the replies (`SessionStream`).
#[derive(Default)]
pub(crate) struct Asks {
    pub provisional: bool,
    pub started: Option<tokio::sync::oneshot::Sender<u64>>,
}

/// Free places in a generating client's reply queue kept for committed
/// events: provisional text is dropped rather than queued into them.
const PROVISIONAL_RESERVE: usize = STREAM_REPLY_CAPACITY / 2;

impl SessionActor {
    /// Asks the scheduler to stop the generation; false when none runs.
    pub(super) fn cancel(&mut self) -> bool {
        let Some(g) = &mut self.generation else {
            return false;
        };
        g.cancel_requested = true;
        if let Some(gen) = g.gen {
            self.shared.scheduler.do_send(CancelGen(gen));
        }
        true
    }

    /// Sends a reply to the generating client; a client that is gone (or
    /// hopelessly behind) cancels the generation.
    fn tell(&mut self, response: Response) {
        let gone = match &self.generation {
            Some(g) => g.reply.try_send(response).is_err(),
            None => false,
        };
        if gone {
            self.cancel();
        }
    }

    /// Provisional text for the generating client: dropped once its queue
    /// is half full (the commits carry the same text, and keep the other
    /// half: provisional frames a slow reader left queued never push out a
    /// committed `Delta`), a gone client cancels.
    fn tell_provisional(&mut self, channel: Channel, text: String) {
        let gone = match &self.generation {
            Some(g) if g.reply.capacity() <= PROVISIONAL_RESERVE => g.reply.is_closed(),
            Some(g) => matches!(
                g.reply.try_send(Response::SubProvisional {
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
        let Some(g) = &mut self.generation else {
            return;
        };
        if g.committing {
            return;
        }
        if g.failed.is_some() {
            g.queue.clear();
        }
        if let Some(body) = g.queue.pop_front() {
            g.committing = true;
            let planned = self.shared.read().plan_output(self.id, body, now_ms());
            let shared = self.shared.clone();
            let fut = async move { commit_event(&shared, planned?).await };
            ctx.spawn(fut.into_actor(self).map(|result, this, ctx| {
                if let Some(g) = &mut this.generation {
                    g.committing = false;
                }
                match result {
                    Ok(event) => {
                        if let Some(g) = &mut this.generation {
                            g.events += 1;
                        }
                        this.tell(Response::Delta { event });
                    }
                    Err(e) => {
                        if let Some(g) = &mut this.generation {
                            g.failed.get_or_insert(e.to_string());
                        }
                        this.cancel();
                    }
                }
                this.pump(ctx);
            }));
            return;
        }
        if g.failed.is_none() && g.output.finished().is_none() {
            return;
        }
        // Done: the summary (or the error) is the last reply; dropping the
        // generation ends its work.
        let Some(g) = self.generation.take() else {
            return;
        };
        let finish = match g.failed {
            Some(_) => Finish::Error,
            None => g.output.finished().unwrap_or(Finish::Error),
        };
        self.shared.generations.count(finish);
        let last = match g.failed {
            Some(message) => Response::Err { message },
            None => Response::Generated {
                events: g.events,
                tokens_generated: g.output.tokens_generated(),
                finish: g.output.finished().unwrap_or(Finish::Error),
                warm_prefix: g.warm_prefix,
            },
        };
        // The last reply waits for room: it must not be lost to a full queue.
        let reply = g.reply;
        actix_rt::spawn(async move {
            let _ = reply.send(last).await;
        });
    }

    pub(super) fn start_generation(
        &mut self,
        max_tokens: u32,
        reply: mpsc::Sender<Response>,
        asks: Asks,
        ctx: &mut Context<Self>,
    ) {
        crate::logging::stage("sess_generate", &"-");
        self.plan_and_start(max_tokens, reply, asks, 0, Answers::new(), ctx);
    }

    /// Plans the generation with the grammars converted and the renders
    /// computed so far; a schema not converted yet, or a render of a large
    /// conversation (the assistant header of a closed turn renders the
    /// whole history, `prepared`), is computed off the actor thread (the
    /// session's other requests wait, no other session does) and planning
    /// starts again, at most a few times for the schemas.
    fn plan_and_start(
        &mut self,
        max_tokens: u32,
        reply: mpsc::Sender<Response>,
        asks: Asks,
        tries: u8,
        answers: Answers,
        ctx: &mut Context<Self>,
    ) {
        let missing = std::cell::RefCell::new(None);
        let convert = |schema: &str| match schema_cache::cached(schema) {
            Some(result) => result,
            None => {
                *missing.borrow_mut() = Some(schema.to_string());
                Err(GrammarError::Pending)
            }
        };
        let (id, n_ctx) = (self.id, self.shared.n_ctx);
        let planned = answers.plan(&self.shared.read(), self.shared.render.as_ref(), |b, r| {
            b.plan_generation(id, max_tokens, n_ctx, r, &convert, now_ms())
        });
        let plan = match planned {
            Ok(plan) => plan,
            Err(renders) => {
                let compute = answers.compute(self.shared.render.clone(), renders);
                // Busy while it renders: the idle sweep must not stop
                // this actor under a plan in progress.
                let busy = self.busy.begin();
                ctx.wait(compute.into_actor(self).map(move |computed, this, ctx| {
                    match (computed, busy) {
                        (Ok(answers), _busy) => {
                            this.plan_and_start(max_tokens, reply, asks, tries, answers, ctx)
                        }
                        (Err(e), _busy) => {
                            let _ = reply.try_send(Response::err(e.to_string()));
                        }
                    }
                }));
                return;
            }
        };
        let plan = match (plan, missing.into_inner()) {
            (Err(SessionError::Grammar(GrammarError::Pending)), Some(schema)) if tries < 4 => {
                let convert =
                    schema_cache::convert_off_thread(schema, schema_cache::CONVERT_BUDGET);
                let busy = self.busy.begin();
                ctx.wait(convert.into_actor(self).map(move |(), this, ctx| {
                    let _busy = busy;
                    this.plan_and_start(max_tokens, reply, asks, tries + 1, answers, ctx)
                }));
                return;
            }
            (Ok(plan), _) => {
                crate::logging::stage("sess_planned", &"-");
                plan
            }
            (Err(e), _) => {
                let _ = reply.try_send(Response::err(e.to_string()));
                return;
            }
        };
        self.generation = Some(ActiveGeneration {
            gen: None,
            reply,
            output: plan.output(),
            queue: VecDeque::new(),
            committing: false,
            events: 0,
            warm_prefix: 0,
            failed: None,
            cancel_requested: false,
            provisional: asks.provisional,
            started: asks.started,
            _busy: self.busy.begin(),
        });
        if plan.opening.is_some() && matches!(plan.state, TurnState::Open { .. }) {
            log::debug!(
                "session {}: continuing its turn in epoch {}",
                self.id,
                self.shared.read().epoch()
            );
        }
        let admit = Admit {
            session: self.id,
            prompt: plan.prompt,
            params: plan.params,
            max_tokens,
            class: plan.class,
            batch_invariant: plan.batch_invariant,
            grammar: plan.grammar,
            grammar_from: plan.grammar_from,
            pin: None,
            extras: None,
            media: plan.media,
        };
        let opening = plan.opening;
        let shared = self.shared.clone();
        let owner = ctx.address().recipient::<GenUpdate>();
        let fut = async move {
            let opened = match opening {
                Some(planned) => Some(commit_event(&shared, planned).await?),
                None => None,
            };
            crate::logging::stage("sess_opened", &"-");
            let gen = shared
                .scheduler
                .send(AdmitGen { admit, owner })
                .await
                .map_err(|e| SessionError::SchedulerGone(e.to_string()))?
                .map_err(|e| SessionError::Admit(e.to_string()))?;
            Ok::<_, SessionError>((opened, gen))
        };
        ctx.wait(fut.into_actor(self).map(|result, this, ctx| match result {
            Ok((opened, gen)) => {
                crate::logging::stage("sess_admitted", &gen);
                if let Some(g) = &mut this.generation {
                    g.gen = Some(gen);
                    if opened.is_some() {
                        g.events += 1;
                    }
                }
                if let Some(event) = opened {
                    this.tell(Response::Delta { event });
                }
                if this.generation.as_ref().is_some_and(|g| g.cancel_requested) {
                    this.cancel();
                }
            }
            Err(e) => {
                if let Some(g) = &mut this.generation {
                    g.failed = Some(e.to_string());
                }
                this.pump(ctx);
            }
        }));
    }
}

impl Handler<GenUpdate> for SessionActor {
    type Result = ();

    fn handle(&mut self, msg: GenUpdate, ctx: &mut Context<Self>) {
        let render = self.shared.render.clone();
        let Some(g) = &mut self.generation else {
            return;
        };
        let gen = match &msg.0 {
            GenEvent::Started { gen, .. }
            | GenEvent::Token { gen, .. }
            | GenEvent::Finished { gen, .. }
            | GenEvent::Failed { gen, .. } => *gen,
        };
        if g.gen != Some(gen) {
            // A generation this actor no longer runs (ended on an error).
            return;
        }
        crate::logging::stage("sess_update", &gen);
        match msg.0 {
            GenEvent::Started { warm_prefix, .. } => {
                g.warm_prefix = warm_prefix;
                if let Some(tx) = g.started.take() {
                    let _ = tx.send(warm_prefix);
                }
            }
            GenEvent::Token { token, .. } => {
                let eog = render.is_eog(token);
                let piece = if eog { Vec::new() } else { render.piece(token) };
                let records = g.output.push(token, &piece, eog, now_ms());
                g.queue.extend(records);
                // The text this token added, for the generating client if it
                // asked and for subscribers, ahead of its commit.
                let fresh = g.output.take_fresh();
                let wants = g.provisional;
                for (channel, text) in fresh {
                    self.shared.bus.publish_provisional(self.id, channel, &text);
                    if wants {
                        self.tell_provisional(channel, text);
                        crate::logging::stage("sess_told", &gen);
                    }
                }
            }
            GenEvent::Finished { finish, .. } => {
                let records = g.output.finish(finish, now_ms());
                g.queue.extend(records);
            }
            GenEvent::Failed { message, .. } => {
                g.failed = Some(message);
            }
        }
        self.pump(ctx);
    }
}
