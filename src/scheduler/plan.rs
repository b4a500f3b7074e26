//! Planning steps: admission (a sequence for each waiting generation, by
//! class then arrival, with the longest cached prefix and LRU eviction within
//! the KV budget), the next step (`plan`), and the step that follows one in
//! flight (`follow`).

use super::{GenEvent, GenId, SchedulerState, Seq, Step, FOLLOW_STEPS};
use crate::wire::worker::{DecodeItem, NextItem, Sample, WorkerRequest};
use crate::wire::QosClass;
use crate::wire::Token;

fn lcp(a: &[Token], b: &[Token]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl SchedulerState {
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
            seq.last_used = self.steps_planned;
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
        self.steps_planned += 1;
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
                    || self.steps_planned % self.background_divisor as u64 == 0
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
                let k = (self.steps_planned as usize) % invariant.len();
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
                    extras: g.draw_extras(),
                }),
            });
            if last {
                self.gens.get_mut(&gen).expect("running").inflight += 1;
            }
            gens.push(gen);
            self.seqs[seq].last_used = self.steps_planned;
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
        self.steps_planned += 1;
        for n in &next {
            self.seqs[n.seq as usize].last_used = self.steps_planned;
        }
        Some(Step {
            ops: vec![],
            decode: vec![],
            next,
            gens,
        })
    }
}
