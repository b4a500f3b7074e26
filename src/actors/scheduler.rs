//! `SchedulerActor`: runs a lane's decode loop. It keeps the lane's
//! `SchedulerState` and `Pipeline` (src/scheduler): on every admission,
//! cancel and step reply it asks the pipeline which steps to send, sends
//! their requests to the lane at once (so they reach the worker in the order
//! planned), feeds each reply back, and hands each event to the generation's
//! owner (a session actor, or a stateless caller). Up to two steps are in
//! flight (`PIPELINE_DEPTH`); admissions and cancels are handled between
//! replies.

use std::collections::HashMap;

use actix::prelude::*;

use super::lane::{Exec, LaneActor, LaneError, LaneReset, WithdrawHeld};
use crate::scheduler::pipeline::{Pipeline, StepOutput, StepResult, PIPELINE_DEPTH};
use crate::scheduler::{Admit, GenEvent, GenId, SchedulerError, SchedulerState, Stats, StepError};

/// Start a generation; its events go to `owner`.
#[derive(Message)]
#[rtype(result = "Result<GenId, SchedulerError>")]
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

/// Purged sessions: forget their park artifacts.
#[derive(Message)]
#[rtype(result = "()")]
pub struct ForgetParked(pub Vec<crate::wire::SessionId>);

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
    pipeline: Pipeline,
    lane: Addr<LaneActor>,
    owners: HashMap<GenId, Recipient<GenUpdate>>,
    /// The wake-up armed for the next idle sequence due to leave the cells
    /// (`--idle-spill-ms`): when (unix ms), and its handle.
    idle_timer: Option<(u64, SpawnHandle)>,
    /// The lane's resets heard of ([`LaneReset::epoch`]), sent with each
    /// step so the lane refuses one planned against a gone worker's cells.
    lane_epoch: u64,
}

impl SchedulerActor {
    pub fn new(state: SchedulerState, lane: Addr<LaneActor>) -> SchedulerActor {
        SchedulerActor {
            state,
            pipeline: Pipeline::new(PIPELINE_DEPTH),
            lane,
            owners: HashMap::new(),
            idle_timer: None,
            lane_epoch: 0,
        }
    }

    /// While nothing is in flight, wakes the actor when the next idle
    /// sequence is due to leave the cells or a turn opening to be decoded
    /// ahead (`plan` does either). While steps are in flight, `follow`
    /// stops at a due spill and the reply's `kick` plans it.
    fn arm_idle_timer(&mut self, ctx: &mut Context<Self>) {
        if !self.pipeline.is_empty() {
            return;
        }
        let Some(due) = self.state.wake_due_at() else {
            return;
        };
        if self.idle_timer.as_ref().is_some_and(|(at, _)| *at <= due) {
            return;
        }
        if let Some((_, h)) = self.idle_timer.take() {
            ctx.cancel_future(h);
        }
        let wait = due.saturating_sub(super::now_ms()) + 1;
        let h = ctx.run_later(std::time::Duration::from_millis(wait), |this, ctx| {
            this.idle_timer = None;
            this.kick(ctx);
        });
        self.idle_timer = Some((due, h));
    }

    /// Hands each event to its generation's owner, and forgets the owner
    /// of a generation that ended.
    fn notify_owners(&mut self, events: Vec<GenEvent>) {
        for e in events {
            let (gen, done) = (e.gen(), e.ends());
            if let Some(owner) = self.owners.get(&gen) {
                owner.do_send(GenUpdate(e));
            }
            if done {
                self.owners.remove(&gen);
            }
        }
    }

    /// Sends the steps the pipeline has room for, and takes each reply when
    /// it comes.
    fn kick(&mut self, ctx: &mut Context<Self>) {
        let (sent, events) = self.pipeline.kick(&mut self.state, super::now_ms());
        self.notify_owners(events);
        for (id, requests) in sent {
            crate::logging::stage("sch_send", &id);
            let reply = self.lane.send(Exec {
                requests,
                kv_epoch: Some(self.lane_epoch),
            });
            ctx.spawn(
                async move {
                    match reply.await {
                        Ok(Ok(replies)) => StepOutput::from_replies(replies),
                        Ok(Err(LaneError::NotDelivered(why))) => Err(StepError::NotDelivered(why)),
                        Ok(Err(e)) => Err(StepError::Failed(e.to_string())),
                        Err(e) => Err(StepError::Failed(e.to_string())),
                    }
                }
                .into_actor(self)
                .map(move |result: StepResult, this, ctx| {
                    crate::logging::stage("sch_arrived", &id);
                    // Generations that end in this reply end now (what
                    // `--idle-spill-ms` and prefix pins count from).
                    this.state.set_clock(super::now_ms());
                    let events = this.pipeline.arrived(&mut this.state, id, result);
                    this.notify_owners(events);
                    this.kick(ctx);
                }),
            );
        }
        self.arm_idle_timer(ctx);
    }
}

impl Actor for SchedulerActor {
    type Context = Context<Self>;
}

impl Handler<AdmitGen> for SchedulerActor {
    type Result = Result<GenId, SchedulerError>;

    fn handle(&mut self, msg: AdmitGen, ctx: &mut Context<Self>) -> Self::Result {
        crate::logging::stage("sch_admit", &"-");
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
        if self.state.is_running(msg.0) && !self.pipeline.is_empty() {
            // It finishes when its step answers; a worker still loading may
            // hold that step for long: the lane hands such steps back.
            self.lane.do_send(WithdrawHeld);
        }
        self.notify_owners(events);
        self.kick(ctx);
    }
}

impl Handler<ForgetParked> for SchedulerActor {
    type Result = ();

    fn handle(&mut self, msg: ForgetParked, _: &mut Context<Self>) {
        self.state.forget_parked(&msg.0);
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
        // Nothing trusts the gone worker's KV (a generation between two
        // steps fails; one with nothing drawn runs again): at once, or once
        // the steps in flight have answered (see `Pipeline::lane_reset`).
        self.lane_epoch = msg.epoch;
        let events = self
            .pipeline
            .lane_reset(&mut self.state, &msg.error.to_string());
        self.notify_owners(events);
        self.kick(ctx);
    }
}
