//! `SchedulerActor`: runs a lane's decode loop. Each turn of the loop asks
//! `SchedulerState` for the next step, sends its KV operations and its one
//! decode call to the lane, and hands each drawn token to the generation's
//! owner (a session actor, or a stateless caller). Admissions and cancels
//! are handled between steps, while a step is in flight.
//!
//! Up to two steps are in flight: as soon as a step is sent, the step that
//! follows it (`SchedulerState::follow`) is sent too, so the worker finds
//! its next request waiting when it finishes one, and the daemon's own work
//! on step n's tokens overlaps the worker's decode of step n+1. Replies are
//! taken strictly in the order the steps were sent; after a failed step the
//! steps behind it are dropped unread (they fail in the worker too).

use std::collections::{HashMap, VecDeque};

use actix::prelude::*;

use super::lane::{Exec, LaneActor, LaneReset};
use crate::scheduler::{Admit, GenEvent, GenId, SchedulerState, Stats, Step};
use crate::wire::worker::{Drawn, WorkerResponse};

/// Start a generation; its events go to `owner`.
#[derive(Message)]
#[rtype(result = "Result<GenId, String>")]
pub struct AdmitGen {
    pub admit: Admit,
    pub owner: Recipient<GenUpdate>,
}

/// Stop a generation (it finishes with `cancelled`).
#[derive(Message)]
#[rtype(result = "()")]
pub struct CancelGen(pub GenId);

/// `SetBackgroundRate`.
#[derive(Message)]
#[rtype(result = "()")]
pub struct SetBackgroundRate(pub u32);

/// `Pin`: protect a session's cached tokens until `deadline_ms` (unix ms;
/// 0 clears). Replies the deadline in force.
#[derive(Message)]
#[rtype(result = "u64")]
pub struct PinSession {
    pub session: crate::wire::SessionId,
    pub deadline_ms: u64,
}

/// The scheduler's counters.
#[derive(Message)]
#[rtype(result = "Stats")]
pub struct GetStats;

/// What happened to a generation, for its owner. One per event: at most
/// one token per step per generation, so an owner's mailbox holds at most
/// max_tokens of these.
#[derive(Message, Debug, Clone)]
#[rtype(result = "()")]
pub struct GenUpdate(pub GenEvent);

/// The most steps in flight at once (one running, one queued behind it).
const PIPELINE_DEPTH: usize = 2;

type StepResult = Result<(Vec<Drawn>, u64, u64), String>;

struct InFlight {
    id: u64,
    step: Step,
    /// Sent behind a step that failed: its reply is not read.
    dropped: bool,
    result: Option<StepResult>,
}

pub struct SchedulerActor {
    state: SchedulerState,
    lane: Addr<LaneActor>,
    owners: HashMap<GenId, Recipient<GenUpdate>>,
    in_flight: VecDeque<InFlight>,
    next_step: u64,
}

impl SchedulerActor {
    pub fn new(state: SchedulerState, lane: Addr<LaneActor>) -> SchedulerActor {
        SchedulerActor {
            state,
            lane,
            owners: HashMap::new(),
            in_flight: VecDeque::new(),
            next_step: 0,
        }
    }

    fn dispatch(&mut self, events: Vec<GenEvent>) {
        for e in events {
            let gen = match &e {
                GenEvent::Started { gen, .. } | GenEvent::Token { gen, .. } => *gen,
                GenEvent::Finished { gen, .. } | GenEvent::Failed { gen, .. } => *gen,
            };
            let done = matches!(e, GenEvent::Finished { .. } | GenEvent::Failed { .. });
            if let Some(owner) = self.owners.get(&gen) {
                owner.do_send(GenUpdate(e));
            }
            if done {
                self.owners.remove(&gen);
            }
        }
    }

    /// Starts the next step when nothing is in flight, and queues the step
    /// that follows the one in flight when there is one to queue.
    fn kick(&mut self, ctx: &mut Context<Self>) {
        if self.in_flight.is_empty() {
            self.state.set_clock(super::now_ms());
            let (step, events) = self.state.plan();
            self.dispatch(events);
            if let Some(step) = step {
                self.send(step, ctx);
            }
        }
        if let Some(last) = self.in_flight.back() {
            if self.in_flight.len() < PIPELINE_DEPTH && !last.dropped {
                if let Some(next) = self.state.follow(&last.step) {
                    self.send(next, ctx);
                }
            }
        }
    }

    /// Sends a step's requests to the lane now (so they reach the worker in
    /// the order steps are sent) and takes the reply when it comes.
    fn send(&mut self, step: Step, ctx: &mut Context<Self>) {
        let id = self.next_step;
        self.next_step += 1;
        let reply = self.lane.send(Exec(step.requests()));
        ctx.spawn(
            async move { step_result(reply.await.map_err(|e| e.to_string()).and_then(|r| r)) }
                .into_actor(self)
                .map(move |result, this, ctx| this.arrived(id, result, ctx)),
        );
        self.in_flight.push_back(InFlight {
            id,
            step,
            dropped: false,
            result: None,
        });
    }

    /// A step's reply: completes every step whose reply is in, in order.
    fn arrived(&mut self, id: u64, result: StepResult, ctx: &mut Context<Self>) {
        if let Some(f) = self.in_flight.iter_mut().find(|f| f.id == id) {
            f.result = Some(result);
        }
        while self.in_flight.front().is_some_and(|f| f.result.is_some()) {
            let Some(InFlight {
                step,
                dropped,
                result: Some(result),
                ..
            }) = self.in_flight.pop_front()
            else {
                break;
            };
            if dropped {
                continue;
            }
            let failed = result.is_err();
            let result = result.map(|(drawn, tokens, decode_us)| {
                self.state.note_decode(tokens, decode_us);
                drawn
            });
            let events = self.state.complete(&step, result);
            if failed {
                for behind in &mut self.in_flight {
                    behind.dropped = true;
                }
            }
            self.dispatch(events);
        }
        self.kick(ctx);
    }
}

/// What a step's worker replies come to: the tokens its decode drew (with
/// the tokens decoded and the decode time), or the first error.
fn step_result(replies: Result<Vec<WorkerResponse>, String>) -> StepResult {
    let mut out = (Vec::new(), 0, 0);
    for reply in replies? {
        match reply {
            WorkerResponse::Done => {}
            WorkerResponse::Decoded {
                drawn,
                tokens,
                decode_us,
            } => out = (drawn, u64::from(tokens), decode_us),
            WorkerResponse::Err { message } => return Err(message),
            other => return Err(format!("unexpected worker reply {other:?}")),
        }
    }
    Ok(out)
}

impl Actor for SchedulerActor {
    type Context = Context<Self>;
}

impl Handler<AdmitGen> for SchedulerActor {
    type Result = Result<GenId, String>;

    fn handle(&mut self, msg: AdmitGen, ctx: &mut Context<Self>) -> Self::Result {
        let gen = self.state.admit(msg.admit)?;
        self.owners.insert(gen, msg.owner);
        self.kick(ctx);
        Ok(gen)
    }
}

impl Handler<PinSession> for SchedulerActor {
    type Result = u64;

    fn handle(&mut self, msg: PinSession, _: &mut Context<Self>) -> u64 {
        self.state.set_clock(super::now_ms());
        self.state.pin(msg.session, msg.deadline_ms)
    }
}

impl Handler<GetStats> for SchedulerActor {
    type Result = MessageResult<GetStats>;

    fn handle(&mut self, _: GetStats, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.state.stats())
    }
}

impl Handler<CancelGen> for SchedulerActor {
    type Result = ();

    fn handle(&mut self, msg: CancelGen, ctx: &mut Context<Self>) {
        let events = self.state.cancel(msg.0);
        self.dispatch(events);
        self.kick(ctx);
    }
}

impl Handler<SetBackgroundRate> for SchedulerActor {
    type Result = ();

    fn handle(&mut self, msg: SetBackgroundRate, _: &mut Context<Self>) {
        self.state.set_background_divisor(msg.0);
    }
}

impl Handler<LaneReset> for SchedulerActor {
    type Result = ();

    fn handle(&mut self, msg: LaneReset, ctx: &mut Context<Self>) {
        // A step in flight fails by itself (its Exec errs); idle state is
        // forgotten here so nothing trusts the dead worker's KV.
        if self.in_flight.is_empty() {
            let events = self.state.fail_all(&msg.0);
            self.dispatch(events);
            self.kick(ctx);
        }
    }
}
