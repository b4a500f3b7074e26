//! `Step`: one step's worker requests, as planned by `SchedulerState::plan`
//! (KV operations, then one decode) or `SchedulerState::follow` (one
//! `DecodeNext`).

use super::GenId;
use crate::wire::worker::{DecodeItem, NextItem, Sample, WorkerRequest};

/// One step's work: the KV operations to run first, then one decode; or,
/// for a following step, one `DecodeNext`.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub ops: Vec<WorkerRequest>,
    pub decode: Vec<DecodeItem>,
    /// A following step ([`SchedulerState::follow`]; `decode` is empty): each
    /// item's first input is the token its sequence drew last, in the step
    /// before, and it runs up to `steps` tokens on its own.
    pub next: Vec<NextItem>,
    /// For each decode item, or each next item: the generation it advances.
    pub gens: Vec<GenId>,
}

impl Step {
    /// The worker requests that run this step, in order.
    pub fn requests(&self) -> Vec<WorkerRequest> {
        let mut out = self.ops.clone();
        if !self.next.is_empty() {
            out.push(WorkerRequest::DecodeNext {
                items: self.next.clone(),
            });
        } else if !self.decode.is_empty() {
            out.push(WorkerRequest::Decode {
                items: self.decode.clone(),
            });
        }
        out
    }

    /// Where each item's sequence ends, and the stream position of its next
    /// draw, once this step has run with no end of turn: (seq, pos, draw_pos,
    /// sample) per sampling item.
    pub(super) fn ends(&self) -> Vec<(u32, u32, u64, &Sample)> {
        if self.next.is_empty() {
            self.decode
                .iter()
                .filter_map(|i| {
                    let s = i.sample.as_ref()?;
                    Some((i.seq, i.pos + i.tokens.len() as u32, s.draw_pos + 1, s))
                })
                .collect()
        } else {
            self.next
                .iter()
                .map(|n| {
                    (
                        n.seq,
                        n.pos + n.steps,
                        n.sample.draw_pos + u64::from(n.steps),
                        &n.sample,
                    )
                })
                .collect()
        }
    }
}
