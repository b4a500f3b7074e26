//! `Pipeline`: the steps a lane has in flight, and their replies.
//!
//! Up to [`PIPELINE_DEPTH`] steps are in flight: as soon as a step is sent,
//! the step that follows it ([`SchedulerState::follow`]) is sent too, so the
//! worker finds its next request waiting when it finishes one, and the
//! daemon's own work on step n's tokens overlaps the worker's decode of step
//! n+1. Replies are taken strictly in the order the steps were sent; after a
//! failed step the steps behind it are dropped unread (they fail in the
//! worker too: a failed request leaves no draw to follow).
//!
//! Plain data: the scheduler actor sends the requests [`Pipeline::kick`]
//! hands it and feeds each reply to [`Pipeline::arrived`]; the tests drive
//! the same code against a fake worker.

use std::collections::VecDeque;

use super::{GenEvent, SchedulerState, Step, StepError};
use crate::wire::worker::{AttentionWork, Drawn, Refused, WorkerRequest, WorkerResponse};

/// The most steps in flight at once (one running, one queued behind it).
pub const PIPELINE_DEPTH: usize = 2;

/// Names a step sent to the worker, in the order steps were sent.
pub type StepId = u64;

/// What a step's worker replies came to: the tokens its decode drew, the
/// tokens decoded (prompt and drawn) and the time its decode calls took.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepOutput {
    pub drawn: Vec<Drawn>,
    pub tokens: u64,
    pub decode_us: u64,
    /// The worker's `Spilled` replies: (key, bytes stored).
    pub spilled: Vec<(u64, u64)>,
    /// Items of the step's `Decode` that failed on their own.
    pub refused: Vec<Refused>,
    /// Sessions whose park artifact the budget deleted.
    pub unparked: Vec<u64>,
    /// The tiled attention's work the reply reported.
    pub attention: AttentionWork,
}

/// A step's outcome.
pub type StepResult = Result<StepOutput, StepError>;

impl StepOutput {
    /// Reads the worker's replies to one step's requests: the `Decoded` one,
    /// or the first failure. The worker runs every request of a step, so a
    /// restore that failed is read with all the others: every sequence left
    /// empty, and whether the decode went through beside them. A failed
    /// restore or a full cache keeps the step's `Spilled` replies (what the
    /// worker exported stands); after any other failure the lane's host
    /// memory is forgotten anyway.
    pub fn from_replies(replies: Vec<WorkerResponse>) -> StepResult {
        let mut out = StepOutput::default();
        let mut not_restored = Vec::new();
        let mut decoded = false;
        let mut failure = None;
        for reply in replies {
            if failure.is_some() && not_restored.is_empty() {
                break;
            }
            match reply {
                WorkerResponse::Done => {}
                WorkerResponse::Decoded {
                    drawn,
                    tokens,
                    decode_us,
                    refused,
                    unparked,
                    attention,
                } => {
                    decoded = true;
                    out.attention = attention;
                    out.drawn = drawn;
                    out.refused = refused;
                    out.unparked = unparked;
                    out.tokens = u64::from(tokens);
                    out.decode_us = decode_us;
                }
                WorkerResponse::Spilled { key, bytes } => out.spilled.push((key, bytes)),
                WorkerResponse::NotRestored { seq } => not_restored.push(seq),
                WorkerResponse::Err { message } => {
                    failure.get_or_insert(StepError::Failed(message));
                }
                WorkerResponse::KvFull { .. } => {
                    failure.get_or_insert(StepError::KvFull { spilled: vec![] });
                }
                other => {
                    failure.get_or_insert(StepError::Failed(format!(
                        "unexpected worker reply {other:?}"
                    )));
                }
            }
        }
        // A request behind a failed restore is refused for it (a decode or
        // a copy on the emptied sequence): the restores are the step's
        // failure, and the scheduler replans.
        if !not_restored.is_empty() {
            return Err(StepError::NotRestored {
                seqs: not_restored,
                decoded,
                spilled: out.spilled,
                unparked: out.unparked,
            });
        }
        match failure {
            // The spills the worker did before the decode found no room
            // stand: the index learns them as after a step that ran.
            Some(StepError::KvFull { .. }) => Err(StepError::KvFull {
                spilled: out.spilled,
            }),
            Some(e) => Err(e),
            None => Ok(out),
        }
    }
}

struct InFlight {
    id: StepId,
    step: Step,
    /// Sent behind a step that failed: its reply is not read.
    dropped: bool,
    result: Option<StepResult>,
}

/// The steps in flight, oldest first.
pub struct Pipeline {
    depth: usize,
    in_flight: VecDeque<InFlight>,
    next_id: StepId,
    /// The worker's cells are gone (a death, an unload) while steps were in
    /// flight: why, until the last of them answers.
    reset_due: Option<String>,
}

impl Pipeline {
    /// At most `depth` steps in flight (1: lockstep).
    pub fn new(depth: usize) -> Pipeline {
        Pipeline {
            depth: depth.max(1),
            in_flight: VecDeque::new(),
            next_id: 0,
            reset_due: None,
        }
    }

    /// No step is in flight.
    pub fn is_empty(&self) -> bool {
        self.in_flight.is_empty()
    }

    /// The lane's worker is gone with its cells (`LaneReset`): the state
    /// forgets them (`lane_failed`) at once when no step is in flight, else
    /// once the last step in flight has answered (the gone worker's replies,
    /// or refusals of steps planned against it), and no step is sent
    /// meanwhile. A step that came back Ok before the reset was heard must
    /// not leave the state trusting cells the next worker lacks.
    pub fn lane_reset(&mut self, state: &mut SchedulerState, message: &str) -> Vec<GenEvent> {
        if self.in_flight.is_empty() {
            state.lane_failed(&[], message)
        } else {
            self.reset_due = Some(message.to_owned());
            vec![]
        }
    }

    /// The steps to send now, in order, and the events planning raised
    /// (admissions): when nothing is in flight, the next planned step (the
    /// state's clock set to `now_ms` first); then, while there is room and
    /// the last step sent is not dropped, the steps that follow it.
    pub fn kick(
        &mut self,
        state: &mut SchedulerState,
        now_ms: u64,
    ) -> (Vec<(StepId, Vec<WorkerRequest>)>, Vec<GenEvent>) {
        let mut sent = Vec::new();
        let mut events = Vec::new();
        state.set_clock(now_ms);
        if self.reset_due.is_some() {
            return (sent, events);
        }
        if self.in_flight.is_empty() {
            let (step, planned) = state.plan();
            events = planned;
            if let Some(step) = step {
                sent.push(self.push(step));
            }
        }
        while self.in_flight.len() < self.depth {
            let Some(last) = self.in_flight.back().filter(|l| !l.dropped) else {
                break;
            };
            let Some(next) = state.follow(&last.step) else {
                break;
            };
            sent.push(self.push(next));
        }
        (sent, events)
    }

    fn push(&mut self, step: Step) -> (StepId, Vec<WorkerRequest>) {
        let id = self.next_id;
        self.next_id += 1;
        let requests = step.requests();
        self.in_flight.push_back(InFlight {
            id,
            step,
            dropped: false,
            result: None,
        });
        (id, requests)
    }

    /// A step's reply: takes every step whose reply is in, in order, into
    /// the state, and returns the events that raised.
    pub fn arrived(
        &mut self,
        state: &mut SchedulerState,
        id: StepId,
        result: StepResult,
    ) -> Vec<GenEvent> {
        if let Some(f) = self.in_flight.iter_mut().find(|f| f.id == id) {
            f.result = Some(result);
        }
        let mut events = Vec::new();
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
            let mut refused = Vec::new();
            let result = result.map(|out| {
                state.note_decode(out.tokens, out.decode_us);
                state.note_attention(out.attention);
                state.note_spilled(&out.spilled);
                state.forget_parked(&out.unparked);
                refused = out.refused;
                out.drawn
            });
            events.extend(state.step_done_refusing(&step, result, &refused));
            if failed {
                for behind in &mut self.in_flight {
                    behind.dropped = true;
                }
            }
        }
        if self.in_flight.is_empty() {
            if let Some(message) = self.reset_due.take() {
                events.extend(state.lane_failed(&[], &message));
            }
        }
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decoded() -> WorkerResponse {
        WorkerResponse::Decoded {
            drawn: vec![],
            tokens: 3,
            decode_us: 1,
            refused: vec![],
            unparked: vec![],
            attention: Default::default(),
        }
    }

    fn not_restored(r: StepResult) -> (Vec<u32>, bool, Vec<(u64, u64)>) {
        match r {
            Err(StepError::NotRestored {
                seqs,
                decoded,
                spilled,
                ..
            }) => (seqs, decoded, spilled),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn failed_restores_are_read_with_the_whole_step() {
        use WorkerResponse::{Done, NotRestored, Spilled};
        // Every failed restore of the step, not the first only.
        let r = StepOutput::from_replies(vec![
            Done,
            NotRestored { seq: 1 },
            Spilled { key: 7, bytes: 70 },
            NotRestored { seq: 2 },
        ]);
        assert_eq!(not_restored(r), (vec![1, 2], false, vec![(7, 70)]));
        // A decode that went through beside one.
        let r = StepOutput::from_replies(vec![NotRestored { seq: 1 }, decoded()]);
        assert_eq!(not_restored(r), (vec![1], true, vec![]));
        // A decode refused for it (its item on the emptied sequence): the
        // restores are the step's failure, and the scheduler replans.
        let r = StepOutput::from_replies(vec![
            NotRestored { seq: 1 },
            WorkerResponse::Err {
                message: "item 0: sequence 1 holds positions 0..0".into(),
            },
        ]);
        assert_eq!(not_restored(r), (vec![1], false, vec![]));
        // Without a failed restore, the first failure is the step's.
        let r = StepOutput::from_replies(vec![
            WorkerResponse::Err {
                message: "first".into(),
            },
            WorkerResponse::KvFull {
                n_ctx: 1,
                tokens: 2,
            },
        ]);
        assert!(matches!(r, Err(StepError::Failed(m)) if m == "first"));
        // A full cache keeps the spills the step's operations made.
        let r = StepOutput::from_replies(vec![
            Spilled { key: 3, bytes: 30 },
            Done,
            WorkerResponse::KvFull {
                n_ctx: 1,
                tokens: 2,
            },
        ]);
        assert_eq!(
            r,
            Err(StepError::KvFull {
                spilled: vec![(3, 30)]
            })
        );
        let r = StepOutput::from_replies(vec![Spilled { key: 1, bytes: 2 }, decoded()]).unwrap();
        assert_eq!((r.spilled, r.tokens), (vec![(1, 2)], 3));
    }
}
