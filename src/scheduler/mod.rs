//! `SchedulerState`: which generations run in a lane's next decode step, on
//! which of its sequences, and what each sequence's KV holds. Plain data, no
//! actix, no model: the scheduler actor drives it, the tests step it by hand.
//!
//! - Admission orders by QoS class (0 first, 3 last), then arrival.
//! - Every active generation of the lane advances in one decode call per
//!   step (continuous batching); a `batch_invariant` one runs alone, so its
//!   batch shape never depends on what else runs.
//! - Class 3 (background) advances only every `background_divisor`-th step.
//! - A session's tokens stay resident in its sequence after its turn, so the
//!   next turn prefills only what is new; a new generation whose prompt
//!   shares a prefix with another sequence (a fork and its parent) starts
//!   from a copy of that sequence's cells instead of a prefill.
//! - The KV budget is `n_ctx` cells; idle sequences are evicted, least
//!   recently used first, to make room.
//! - Steps are pipelined: while a step is in flight, [`SchedulerState::follow`]
//!   plans the next for the same generations, [`FOLLOW_STEPS`] tokens each,
//!   fed by the worker itself with what it draws (`WorkerRequest::DecodeNext`),
//!   so the worker never waits for the daemon between steps and the daemon
//!   hears from it once per few tokens. Anything that changes the batch (an
//!   admission, a KV operation, a prefill, a grammar) waits for the pipeline
//!   to drain and goes through [`SchedulerState::plan`].

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;

use crate::wire::worker::{DecodeItem, Drawn, NextItem, Sample, WorkerRequest, KV_FULL};
use crate::wire::{Finish, Params, QosClass, SessionId, Token};

/// `--pin-budget-pct` default.
pub const DEFAULT_PIN_BUDGET_PCT: u32 = 50;

/// Identifies one generation within a lane.
pub type GenId = u64;

/// Tokens a following step runs per generation on its own, in the worker,
/// before the daemon hears of them: the daemon wakes once per this many
/// tokens of a stream instead of once per token, and a cancel lands within
/// two following steps (the one running and the one queued).
pub const FOLLOW_STEPS: u32 = 4;

/// A generation asking to run.
#[derive(Debug, Clone)]
pub struct Admit {
    pub session: SessionId,
    /// Every token on the session's input, in order.
    pub prompt: Vec<Token>,
    pub params: Params,
    pub max_tokens: u32,
    pub class: QosClass,
    pub batch_invariant: bool,
    pub grammar: Option<String>,
    /// Where the grammar starts to govern, as an offset into `prompt`: the
    /// tokens from there on (the open turn so far, then what this
    /// generation draws) are its prefix. `prompt.len()` for a new turn.
    pub grammar_from: usize,
}

/// What the scheduler tells the generation's owner.
#[derive(Debug, Clone, PartialEq)]
pub enum GenEvent {
    /// It got a sequence; `warm_prefix` prompt tokens came from the KV, and
    /// `evicted` cached tokens were dropped to make way for it (cells that
    /// no longer matched its prompt, and idle sequences cleared for room).
    Started {
        gen: GenId,
        warm_prefix: u64,
        evicted: u64,
    },
    Token {
        gen: GenId,
        token: Token,
    },
    /// It ended; `finish` is a `wire::finish` code (never OPEN).
    Finished {
        gen: GenId,
        finish: Finish,
    },
    /// The lane failed under it (a worker crash, a decode error).
    Failed {
        gen: GenId,
        message: String,
    },
}

#[derive(Debug, Clone, Default)]
struct Seq {
    /// Tokens in this sequence's KV, at positions 0..len.
    resident: Vec<Token>,
    /// The session whose tokens these are.
    owner: Option<SessionId>,
    /// The generation running on it.
    active: Option<GenId>,
    /// The step it was last used in (for LRU eviction).
    last_used: u64,
    /// The token last drawn on it (what a following step feeds).
    last_draw: Option<Drawn>,
}

#[derive(Debug, Clone)]
struct Gen {
    admit: Admit,
    seq: Option<u32>,
    /// Prompt and drawn tokens: what the sequence must hold.
    tokens: Vec<Token>,
    produced: u32,
    /// Draws asked for in steps still in flight.
    inflight: u32,
    cancelled: bool,
    arrival: u64,
}

/// Counters for metrics and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stats {
    /// Decode calls made.
    pub steps: u64,
    /// Sequences advanced, summed over steps.
    pub seq_steps: u64,
    /// The most sequences one step advanced.
    pub max_seqs_per_step: u64,
    /// Tokens drawn.
    pub drawn: u64,
    /// Prompt tokens taken from the KV instead of a prefill.
    pub warm_tokens: u64,
    /// Tokens the worker decoded (prompt and drawn), and the time its
    /// llama.cpp decode calls took, in microseconds.
    pub decoded_tokens: u64,
    pub decode_us: u64,
}

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
    fn ends(&self) -> Vec<(u32, u32, u64, &Sample)> {
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

/// The scheduler of one lane.
#[derive(Debug)]
pub struct SchedulerState {
    n_ctx: u32,
    n_batch: u32,
    seqs: Vec<Seq>,
    gens: BTreeMap<GenId, Gen>,
    next_gen: GenId,
    step: u64,
    background_divisor: u32,
    /// Alternates batch-invariant generations with the shared batch.
    invariant_turn: bool,
    /// The worker's KV may hold what this state no longer knows of (after a
    /// failed step): clear every sequence before the next step.
    dirty: bool,
    /// KV operations to run before the next step (evictions after the
    /// worker found its cache full).
    pending_ops: Vec<WorkerRequest>,
    /// A following step found the cache full: no following steps until a
    /// generation ends (and its cells can go).
    kv_tight: bool,
    stats: Stats,
    /// `Pin`: session -> (deadline in unix ms, when it was pinned).
    pins: BTreeMap<SessionId, (u64, u64)>,
    /// Pins together protect at most this share of `n_ctx` (percent).
    pin_budget_pct: u32,
    /// The time pins are judged against (unix ms), set by the driver.
    clock_ms: u64,
}

fn lcp(a: &[Token], b: &[Token]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl SchedulerState {
    pub fn new(n_ctx: u32, n_seq: u32, n_batch: u32) -> SchedulerState {
        SchedulerState {
            n_ctx,
            n_batch: n_batch.max(1),
            seqs: vec![Seq::default(); n_seq as usize],
            gens: BTreeMap::new(),
            next_gen: 1,
            step: 0,
            background_divisor: 1,
            invariant_turn: false,
            dirty: false,
            pending_ops: Vec::new(),
            kv_tight: false,
            stats: Stats::default(),
            pins: BTreeMap::new(),
            pin_budget_pct: DEFAULT_PIN_BUDGET_PCT,
            clock_ms: 0,
        }
    }

    /// `--pin-budget-pct`.
    pub fn with_pin_budget_pct(mut self, pct: u32) -> SchedulerState {
        self.pin_budget_pct = pct.min(100);
        self
    }

    /// The current time, for pin deadlines.
    pub fn set_clock(&mut self, now_ms: u64) {
        self.clock_ms = now_ms;
        let now = now_ms;
        self.pins.retain(|_, (deadline, _)| *deadline > now);
    }

    /// `Pin`: protect a session's cached tokens from eviction until
    /// `deadline_ms` (0 clears). Returns the deadline in force.
    pub fn pin(&mut self, session: SessionId, deadline_ms: u64) -> u64 {
        if deadline_ms == 0 || deadline_ms <= self.clock_ms {
            self.pins.remove(&session);
            return 0;
        }
        let since = self.pins.get(&session).map_or(self.clock_ms, |p| p.1);
        self.pins.insert(session, (deadline_ms, since));
        deadline_ms
    }

    /// Which sequences pins protect now: the newest pins first, while they
    /// fit the pin budget; older ones yield.
    fn protected(&self) -> Vec<bool> {
        let mut pinned: Vec<(u64, usize)> = self
            .seqs
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let (deadline, since) = self.pins.get(&s.owner?)?;
                (*deadline > self.clock_ms).then_some((*since, i))
            })
            .collect();
        pinned.sort_by(|a, b| b.cmp(a));
        let budget = self.n_ctx as u64 * self.pin_budget_pct as u64 / 100;
        let mut used = 0u64;
        let mut out = vec![false; self.seqs.len()];
        for (_, i) in pinned {
            used += self.seqs[i].resident.len() as u64;
            if used <= budget {
                out[i] = true;
            }
        }
        out
    }

    pub fn n_ctx(&self) -> u32 {
        self.n_ctx
    }

    /// `SetBackgroundRate`: class 3 advances every `divisor`-th step.
    pub fn set_background_divisor(&mut self, divisor: u32) {
        self.background_divisor = divisor.max(1);
    }

    /// Generations admitted and not finished.
    pub fn running(&self) -> usize {
        self.gens.len()
    }

    /// Queues a generation. Err when it can never fit.
    pub fn admit(&mut self, admit: Admit) -> Result<GenId, String> {
        if admit.prompt.is_empty() {
            return Err("nothing to generate from: the session's input is empty".into());
        }
        if admit.prompt.len() as u64 + 1 > self.n_ctx as u64 {
            return Err(format!(
                "the session's input ({} tokens) does not fit the context ({} cells, --ctx-size)",
                admit.prompt.len(),
                self.n_ctx
            ));
        }
        let gen = self.next_gen;
        self.next_gen += 1;
        let tokens = admit.prompt.clone();
        self.gens.insert(
            gen,
            Gen {
                admit,
                seq: None,
                tokens,
                produced: 0,
                inflight: 0,
                cancelled: false,
                arrival: gen,
            },
        );
        Ok(gen)
    }

    /// Asks a generation to stop; it finishes with `cancelled` at the end of
    /// the step in flight (or at once if it has not started).
    pub fn cancel(&mut self, gen: GenId) -> Vec<GenEvent> {
        let Some(g) = self.gens.get_mut(&gen) else {
            return vec![];
        };
        g.cancelled = true;
        if g.seq.is_none() {
            self.gens.remove(&gen);
            return vec![GenEvent::Finished {
                gen,
                finish: Finish::Cancelled,
            }];
        }
        vec![]
    }

    fn resident_total(&self, except: usize) -> u64 {
        self.seqs
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != except)
            .map(|(_, s)| s.resident.len() as u64)
            .sum()
    }

    /// Gives queued generations a sequence, in class then arrival order.
    fn assign(&mut self, ops: &mut Vec<WorkerRequest>, events: &mut Vec<GenEvent>) {
        let mut waiting: Vec<(QosClass, u64, GenId)> = self
            .gens
            .iter()
            .filter(|(_, g)| g.seq.is_none())
            .map(|(id, g)| (g.admit.class, g.arrival, *id))
            .collect();
        waiting.sort();
        for (_, _, gen) in waiting {
            let session = self.gens[&gen].admit.session;
            let prompt = self.gens[&gen].tokens.clone();
            let idle = |s: &Seq| s.active.is_none();
            // Unprotected sequences are taken (and evicted) first.
            let protected = self.protected();
            // The sequence to run on: the session's own, else a free one,
            // else the least recently used idle one.
            let own = self
                .seqs
                .iter()
                .position(|s| idle(s) && s.owner == Some(session));
            let dst = own.or_else(|| {
                self.seqs
                    .iter()
                    .position(|s| idle(s) && s.owner.is_none())
                    .or_else(|| {
                        self.seqs
                            .iter()
                            .enumerate()
                            .filter(|(_, s)| idle(s))
                            .min_by_key(|(i, s)| (protected[*i], s.last_used))
                            .map(|(i, _)| i)
                    })
            });
            let Some(dst) = dst else { break };
            // The best source of cells: the longest common prefix.
            let (src, common) = self
                .seqs
                .iter()
                .enumerate()
                .map(|(i, s)| (i, lcp(&s.resident, &prompt)))
                .max_by_key(|&(i, n)| (n, i == dst))
                .unwrap_or((dst, 0));
            // The last prompt token is decoded again for its logits.
            let keep = common.min(prompt.len() - 1);
            let own_keep = lcp(&self.seqs[dst].resident, &prompt).min(prompt.len() - 1);
            // Admit only what fits beside the running sequences (idle ones
            // can be evicted); otherwise wait for room.
            // What running sequences hold or are about to (their prefill).
            let busy_cells: u64 = self
                .seqs
                .iter()
                .enumerate()
                .filter(|(i, s)| *i != dst && !idle(s))
                .map(|(_, s)| {
                    let claimed = s
                        .active
                        .and_then(|g| self.gens.get(&g))
                        .map_or(0, |g| g.tokens.len() + 1);
                    s.resident.len().max(claimed) as u64
                })
                .sum();
            if busy_cells + prompt.len() as u64 + 1 > self.n_ctx as u64 {
                continue;
            }
            let old = self.seqs[dst].resident.clone();
            if src != dst && keep > own_keep {
                ops.push(WorkerRequest::KvCopy {
                    src: src as u32,
                    dst: dst as u32,
                    len: keep as u32,
                });
                self.seqs[dst].resident = self.seqs[src].resident[..keep].to_vec();
            } else {
                if self.seqs[dst].resident.len() > own_keep {
                    ops.push(WorkerRequest::KvTrim {
                        seq: dst as u32,
                        from: own_keep as u32,
                    });
                    self.seqs[dst].resident.truncate(own_keep);
                }
            }
            let warm = self.seqs[dst].resident.len() as u64;
            let mut evicted = (old.len() - lcp(&old, &self.seqs[dst].resident)) as u64;
            // Make room: evict idle sequences, least recently used first.
            let need = prompt.len() as u64 + 1 - warm;
            while self.resident_total(usize::MAX) + need > self.n_ctx as u64 {
                let victim = self
                    .seqs
                    .iter()
                    .enumerate()
                    .filter(|(i, s)| *i != dst && idle(s) && !s.resident.is_empty())
                    .min_by_key(|(i, s)| (protected[*i], s.last_used))
                    .map(|(i, _)| i);
                let Some(v) = victim else { break };
                evicted += self.seqs[v].resident.len() as u64;
                ops.push(WorkerRequest::KvClear { seq: v as u32 });
                self.seqs[v] = Seq::default();
            }
            let seq = &mut self.seqs[dst];
            seq.owner = Some(session);
            seq.active = Some(gen);
            seq.last_used = self.step;
            self.gens.get_mut(&gen).expect("waiting gen").seq = Some(dst as u32);
            self.stats.warm_tokens += warm;
            events.push(GenEvent::Started {
                gen,
                warm_prefix: warm,
                evicted,
            });
        }
    }

    /// Plans the next step; None when there is nothing to do. Also returns
    /// events that happen without a decode (admissions).
    pub fn plan(&mut self) -> (Option<Step>, Vec<GenEvent>) {
        let mut ops = Vec::new();
        if std::mem::take(&mut self.dirty) {
            ops.extend((0..self.seqs.len() as u32).map(|seq| WorkerRequest::KvClear { seq }));
        }
        ops.append(&mut self.pending_ops);
        let mut events = Vec::new();
        self.assign(&mut ops, &mut events);
        self.step += 1;
        let foreground = self
            .gens
            .values()
            .any(|g| g.seq.is_some() && g.admit.class != QosClass::Background);
        let mut running: Vec<(QosClass, u64, GenId)> = self
            .gens
            .iter()
            .filter(|(_, g)| g.seq.is_some())
            .filter(|(_, g)| {
                // The divisor slows the background class beside others; alone
                // it runs at full speed (else it would never be stepped).
                g.admit.class != QosClass::Background
                    || !foreground
                    || self.step % self.background_divisor as u64 == 0
            })
            .map(|(id, g)| (g.admit.class, g.arrival, *id))
            .collect();
        running.sort();
        // Batch-invariant generations run alone, taking turns with the rest.
        let invariant: Vec<GenId> = running
            .iter()
            .filter(|(_, _, id)| self.gens[id].admit.batch_invariant)
            .map(|x| x.2)
            .collect();
        let shared: Vec<GenId> = running
            .iter()
            .filter(|(_, _, id)| !self.gens[id].admit.batch_invariant)
            .map(|x| x.2)
            .collect();
        self.invariant_turn = !self.invariant_turn;
        let chosen: Vec<GenId> =
            if !invariant.is_empty() && (self.invariant_turn || shared.is_empty()) {
                let k = (self.step as usize) % invariant.len();
                vec![invariant[k]]
            } else {
                shared
            };
        let mut budget = self.n_batch as usize;
        let mut decode = Vec::new();
        let mut gens = Vec::new();
        for gen in chosen {
            let g = &self.gens[&gen];
            let seq = g.seq.expect("running") as usize;
            let have = self.seqs[seq].resident.len();
            let todo = &g.tokens[have..];
            if todo.is_empty() {
                continue;
            }
            // Every running generation gets at least its one decode token;
            // prefill takes what is left of the batch budget.
            let take = todo.len().min(budget.max(1));
            budget = budget.saturating_sub(take);
            let last = take == todo.len();
            decode.push(DecodeItem {
                seq: seq as u32,
                pos: have as u32,
                tokens: todo[..take].to_vec(),
                sample: last.then(|| Sample {
                    params: g.admit.params,
                    draw_pos: g.tokens.len() as u64,
                    grammar: g.admit.grammar.clone(),
                    grammar_prefix: match g.admit.grammar {
                        Some(_) => g.tokens[g.admit.grammar_from.min(g.tokens.len())..].to_vec(),
                        None => vec![],
                    },
                }),
            });
            if last {
                self.gens.get_mut(&gen).expect("running").inflight += 1;
            }
            gens.push(gen);
            self.seqs[seq].last_used = self.step;
        }
        if decode.is_empty() && ops.is_empty() {
            return (None, events);
        }
        (
            Some(Step {
                ops,
                decode,
                next: vec![],
                gens,
            }),
            events,
        )
    }

    /// Counts decode calls that advanced `items` sequences each.
    fn count_calls(&mut self, items: impl IntoIterator<Item = usize>) {
        for n in items.into_iter().filter(|&n| n > 0) {
            self.stats.steps += 1;
            self.stats.seq_steps += n as u64;
            self.stats.max_seqs_per_step = self.stats.max_seqs_per_step.max(n as u64);
        }
    }

    /// What the worker reported of a step: tokens decoded (prompt and
    /// drawn) and the time its llama.cpp decode calls took.
    pub fn note_decode(&mut self, tokens: u64, decode_us: u64) {
        self.stats.decoded_tokens += tokens;
        self.stats.decode_us += decode_us;
    }

    /// Plans the step after `last` while `last` is still in flight: the same
    /// generations, up to [`FOLLOW_STEPS`] tokens each, the first fed what
    /// they draw last in `last` (the worker runs them as one `DecodeNext`).
    /// None when the next step must wait for `last`'s reply and go through
    /// [`plan`](Self::plan): a generation waiting for a sequence, KV
    /// operations to run, a prefill still going, a grammar (its state
    /// follows each committed token), a batch-invariant generation beside
    /// others, or a background generation the divisor holds back. A
    /// generation that `last` will finish (max_tokens, a cancel, a full
    /// context) is left out, as `plan` would; one that draws end of turn in
    /// `last` is skipped by the worker.
    pub fn follow(&mut self, last: &Step) -> Option<Step> {
        if self.dirty || self.kv_tight || !self.pending_ops.is_empty() {
            return None;
        }
        if last.decode.iter().any(|i| i.sample.is_none()) {
            return None;
        }
        let ends = last.ends();
        if ends.is_empty() {
            return None;
        }
        let mut foreground = false;
        let mut background = false;
        for (id, g) in &self.gens {
            if g.seq.is_none() || !last.gens.contains(id) || g.admit.grammar.is_some() {
                return None;
            }
            foreground |= g.admit.class != QosClass::Background;
            background |= g.admit.class == QosClass::Background;
            if g.admit.batch_invariant && self.gens.len() > 1 {
                return None;
            }
        }
        if foreground && background && self.background_divisor > 1 {
            return None;
        }
        let mut next = Vec::new();
        let mut gens = Vec::new();
        for ((seq, pos, draw_pos, sample), gen) in ends.into_iter().zip(&last.gens) {
            let Some(g) = self.gens.get_mut(gen) else {
                continue;
            };
            // Tokens the generation may still draw, and cells the context
            // has left for them (the last draw needs one more to be fed).
            let left = g.admit.max_tokens.saturating_sub(g.produced + g.inflight);
            let after = g.tokens.len() as u64 + u64::from(g.inflight);
            let room = (self.n_ctx as u64).saturating_sub(after + 1);
            let steps = FOLLOW_STEPS.min(left).min(room.min(u32::MAX as u64) as u32);
            if g.cancelled || steps == 0 {
                continue;
            }
            g.inflight += steps;
            next.push(NextItem {
                seq,
                pos,
                steps,
                sample: Sample {
                    draw_pos,
                    ..sample.clone()
                },
            });
            gens.push(*gen);
        }
        if next.is_empty() {
            return None;
        }
        self.step += 1;
        for n in &next {
            self.seqs[n.seq as usize].last_used = self.step;
        }
        Some(Step {
            ops: vec![],
            decode: vec![],
            next,
            gens,
        })
    }

    /// Takes a step's result.
    ///
    /// Steps complete in the order they were planned. When a step fails, the
    /// steps sent after it fail in the worker too (a failed request leaves no
    /// draw to follow) and their results must not be passed here.
    pub fn complete(&mut self, step: &Step, result: Result<Vec<Drawn>, String>) -> Vec<GenEvent> {
        let drawn = match result {
            Ok(d) => d,
            Err(message) => {
                // Nothing in flight survives a failure.
                for g in self.gens.values_mut() {
                    g.inflight = 0;
                }
                if message.starts_with(KV_FULL) {
                    return self.kv_full(step);
                }
                return self.fail_all(&message);
            }
        };
        let mut events = Vec::new();
        // Decode calls: one for a planned step; for a following one, as
        // many as the most draws a sequence got, each advancing those that
        // had a draw left.
        if step.next.is_empty() {
            self.count_calls([step.decode.len()]);
        } else {
            let per_seq: Vec<usize> = step
                .next
                .iter()
                .map(|n| drawn.iter().filter(|d| d.seq == n.seq).count())
                .collect();
            let calls = per_seq.iter().copied().max().unwrap_or(0);
            self.count_calls((0..calls).map(|j| per_seq.iter().filter(|&&c| c > j).count()));
        }
        for (item, gen) in step.decode.iter().zip(&step.gens) {
            let seq = item.seq as usize;
            self.seqs[seq].resident.extend_from_slice(&item.tokens);
            if item.sample.is_none() {
                continue;
            }
            let d = drawn.iter().find(|d| d.seq == item.seq).copied();
            self.seqs[seq].last_draw = d;
            if let Some(g) = self.gens.get_mut(gen) {
                g.inflight = g.inflight.saturating_sub(1);
            }
            events.extend(self.take_draws(*gen, d.as_slice()));
        }
        for (item, gen) in step.next.iter().zip(&step.gens) {
            let seq = item.seq as usize;
            // The worker fed the last draw, then each of its draws but the
            // last; it skipped the item if the last draw ended the turn.
            let ours: Vec<Drawn> = drawn
                .iter()
                .filter(|d| d.seq == item.seq)
                .copied()
                .collect();
            match self.seqs[seq].last_draw {
                Some(d) if !d.eog => self.seqs[seq].resident.push(d.token),
                _ => continue,
            }
            if let Some((_, fed)) = ours.split_last() {
                let fed: Vec<Token> = fed.iter().map(|d| d.token).collect();
                self.seqs[seq].resident.extend_from_slice(&fed);
            }
            self.seqs[seq].last_draw = ours.last().copied();
            if let Some(g) = self.gens.get_mut(gen) {
                g.inflight = g.inflight.saturating_sub(item.steps);
            }
            events.extend(self.take_draws(*gen, &ours));
        }
        // Cancelled generations still prefilling stop too.
        let cancelled: Vec<GenId> = self
            .gens
            .iter()
            .filter(|(_, g)| g.cancelled && g.seq.is_some())
            .map(|(id, _)| *id)
            .collect();
        for gen in cancelled {
            events.extend(self.finish_gen(gen, Some(Finish::Cancelled), ""));
        }
        events
    }

    /// Hands a generation the tokens drawn for it in a step, in order, until
    /// one finishes it; the rest are dropped (a cancel ends it after the
    /// first). Nothing drawn for a running generation fails it.
    fn take_draws(&mut self, gen: GenId, draws: &[Drawn]) -> Vec<GenEvent> {
        let mut events = Vec::new();
        if draws.is_empty() {
            if self.gens.contains_key(&gen) {
                events.extend(self.finish_gen(gen, None, "the worker drew no token"));
            }
            return events;
        }
        for d in draws {
            // Gone: it finished (a cancel) while this step ran.
            let Some(g) = self.gens.get_mut(&gen) else {
                break;
            };
            g.tokens.push(d.token);
            g.produced += 1;
            self.stats.drawn += 1;
            events.push(GenEvent::Token {
                gen,
                token: d.token,
            });
            let total = g.tokens.len() as u64;
            let finish = if d.eog {
                Some(Finish::EndOfTurn)
            } else if g.produced >= g.admit.max_tokens {
                Some(Finish::MaxTokens)
            } else if g.cancelled {
                Some(Finish::Cancelled)
            } else if total + 1 > self.n_ctx as u64 {
                Some(Finish::Error)
            } else {
                None
            };
            if let Some(f) = finish {
                events.extend(self.finish_gen(gen, Some(f), "the context is full"));
            }
        }
        events
    }

    fn finish_gen(&mut self, gen: GenId, finish: Option<Finish>, why: &str) -> Vec<GenEvent> {
        let Some(g) = self.gens.remove(&gen) else {
            return vec![];
        };
        self.kv_tight = false;
        if let Some(seq) = g.seq {
            self.seqs[seq as usize].active = None;
        }
        match finish {
            Some(finish) => {
                if finish == Finish::Error {
                    log::warn!("generation {gen} ended: {why}");
                }
                vec![GenEvent::Finished { gen, finish }]
            }
            None => vec![GenEvent::Failed {
                gen,
                message: why.to_string(),
            }],
        }
    }

    /// The worker's cache had no room for the step (it rolled the step back,
    /// so every sequence holds what it held before). Our count of cells is
    /// conservative (copied prefixes share cells in llama.cpp), so the worker
    /// is the judge: evict the idle sequences, or if there are none, end the
    /// youngest generation of the step; the rest retry on the next step.
    fn kv_full(&mut self, step: &Step) -> Vec<GenEvent> {
        let idle: Vec<usize> = (0..self.seqs.len())
            .filter(|&i| self.seqs[i].active.is_none() && !self.seqs[i].resident.is_empty())
            .collect();
        if !idle.is_empty() {
            for i in idle {
                self.pending_ops
                    .push(WorkerRequest::KvClear { seq: i as u32 });
                self.seqs[i] = Seq::default();
            }
            return vec![];
        }
        if !step.next.is_empty() {
            // A following step asks several cells per sequence: step one
            // token at a time, through `plan`, until room is freed, and end
            // a generation only if even that does not fit.
            self.kv_tight = true;
            return vec![];
        }
        let youngest = step
            .gens
            .iter()
            .copied()
            .filter(|g| self.gens.contains_key(g))
            .max_by_key(|g| self.gens[g].arrival);
        match youngest {
            Some(gen) => self.finish_gen(gen, Some(Finish::Error), "the KV cache is full"),
            None => vec![],
        }
    }

    /// The lane failed (a decode error or a worker crash): every generation
    /// fails and no sequence's contents can be trusted.
    pub fn fail_all(&mut self, message: &str) -> Vec<GenEvent> {
        let gens: Vec<GenId> = self.gens.keys().copied().collect();
        for s in &mut self.seqs {
            *s = Seq::default();
        }
        self.dirty = true;
        gens.into_iter()
            .filter_map(|gen| {
                self.gens.remove(&gen).map(|_| GenEvent::Failed {
                    gen,
                    message: message.to_string(),
                })
            })
            .collect()
    }

    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// What a sequence holds (for tests and metrics).
    pub fn resident(&self, seq: u32) -> &[Token] {
        &self.seqs[seq as usize].resident
    }
}
