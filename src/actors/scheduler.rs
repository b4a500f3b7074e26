//! `SchedulerActor`: runs a lane's decode loop. Each turn of the loop asks
//! `SchedulerState` for the next step, sends its KV operations and its one
//! decode call to the lane, and hands each drawn token to the generation's
//! owner (a session actor, or a stateless caller). Admissions and cancels
//! are handled between steps, while a step is in flight.

use std::collections::HashMap;

use actix::prelude::*;

use super::lane::{Exec, LaneActor, LaneReset};
use crate::scheduler::{Admit, GenEvent, GenId, SchedulerState, Stats, Step};
use crate::wire::worker::{WorkerRequest, WorkerResponse};

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

pub struct SchedulerActor {
    state: SchedulerState,
    lane: Addr<LaneActor>,
    owners: HashMap<GenId, Recipient<GenUpdate>>,
    stepping: bool,
}

impl SchedulerActor {
    pub fn new(state: SchedulerState, lane: Addr<LaneActor>) -> SchedulerActor {
        SchedulerActor {
            state,
            lane,
            owners: HashMap::new(),
            stepping: false,
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

    /// Starts the next step unless one is in flight or nothing is to do.
    fn kick(&mut self, ctx: &mut Context<Self>) {
        if self.stepping {
            return;
        }
        self.state.set_clock(super::now_ms());
        let (step, events) = self.state.plan();
        self.dispatch(events);
        let Some(step) = step else { return };
        self.stepping = true;
        let lane = self.lane.clone();
        let fut = run_step(lane, step.clone());
        ctx.spawn(fut.into_actor(self).map(move |result, this, ctx| {
            this.stepping = false;
            let events = this.state.complete(&step, result);
            this.dispatch(events);
            this.kick(ctx);
        }));
    }
}

/// Sends a step's KV operations, then its decode, to the lane.
async fn run_step(
    lane: Addr<LaneActor>,
    step: Step,
) -> Result<Vec<crate::wire::worker::Drawn>, String> {
    for op in step.ops {
        match lane.send(Exec(op)).await.map_err(|e| e.to_string())?? {
            WorkerResponse::Done => {}
            WorkerResponse::Err { message } => return Err(message),
            other => return Err(format!("unexpected worker reply {other:?}")),
        }
    }
    if step.decode.is_empty() {
        return Ok(vec![]);
    }
    match lane
        .send(Exec(WorkerRequest::Decode { items: step.decode }))
        .await
        .map_err(|e| e.to_string())??
    {
        WorkerResponse::Decoded { drawn, .. } => Ok(drawn),
        WorkerResponse::Err { message } => Err(message),
        other => Err(format!("unexpected worker reply {other:?}")),
    }
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
        if !self.stepping {
            let events = self.state.fail_all(&msg.0);
            self.dispatch(events);
            self.kick(ctx);
        }
    }
}
