//! Taking a step's reply: the tokens drawn, handed to their generations in
//! order until one finishes; a full KV cache (evict idle sequences, or end
//! the youngest generation); a failure (every generation fails, the KV is
//! forgotten).

use super::{GenEvent, GenId, SchedulerState, Seq, Step, StepError, NO_SESSION, WARM};
use crate::wire::worker::{Drawn, Refused, WorkerRequest};
use crate::wire::{Finish, Token};

impl SchedulerState {
    /// Counts decode calls that advanced `items` sequences each.
    fn count_calls(&mut self, items: impl IntoIterator<Item = usize>) {
        for n in items.into_iter().filter(|&n| n > 0) {
            self.stats.decode_calls += 1;
            self.stats.seq_steps += n as u64;
            self.stats.max_seqs_per_step = self.stats.max_seqs_per_step.max(n as u64);
        }
    }

    /// The tiled attention's work a step's reply reported.
    pub fn note_attention(&mut self, work: crate::wire::worker::AttentionWork) {
        self.stats.attention.add(work);
    }

    /// What the worker reported of a step: tokens decoded (prompt and
    /// drawn) and the time its llama.cpp decode calls took.
    pub fn note_decode(&mut self, tokens: u64, decode_us: u64) {
        self.stats.decoded_tokens += tokens;
        self.stats.decode_us += decode_us;
        self.last_decode_us = decode_us;
    }

    /// Steps a generation sits out after a draw whose grammar took
    /// `grammar_us`: as many as the grammar took longer than the step's
    /// decode (none when it took less, or the decode time is unknown).
    fn rest_for(&self, grammar_us: u32) -> u32 {
        if self.last_decode_us == 0 {
            return 0;
        }
        (u64::from(grammar_us) / self.last_decode_us).min(u64::from(super::MAX_GRAMMAR_REST)) as u32
    }

    /// Takes a step's result.
    ///
    /// Steps complete in the order they were planned. When a step fails, the
    /// steps sent after it fail in the worker too (a failed request leaves no
    /// draw to follow) and their results must not be passed here.
    pub fn step_done(
        &mut self,
        step: &Step,
        result: Result<Vec<Drawn>, StepError>,
    ) -> Vec<GenEvent> {
        self.step_done_refusing(step, result, &[])
    }

    /// Takes a step's result where the worker refused some items of its
    /// `Decode` on their own (`refused`): each such generation fails with
    /// the worker's reason, its sequence as it was before the step (the
    /// worker put it back), and the rest of the step goes on as usual.
    pub fn step_done_refusing(
        &mut self,
        step: &Step,
        result: Result<Vec<Drawn>, StepError>,
        refused: &[Refused],
    ) -> Vec<GenEvent> {
        let drawn = match result {
            Ok(d) => d,
            Err(e) => {
                // Nothing in flight survives a failure.
                for g in self.gens.values_mut() {
                    g.inflight = 0;
                }
                return match e {
                    StepError::KvFull { spilled } => {
                        self.note_spilled(&spilled);
                        self.kv_full(step)
                    }
                    StepError::Failed(message) => self.lane_failed(&step.gens, &message),
                    StepError::NotDelivered(message) => self.lane_failed(&[], &message),
                    StepError::NotRestored {
                        seqs,
                        decoded,
                        spilled,
                        unparked,
                    } => {
                        self.note_spilled(&spilled);
                        self.forget_parked(&unparked);
                        self.not_restored(step, &seqs, decoded)
                    }
                };
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
            if let Some(r) = refused.iter().find(|r| r.seq == item.seq) {
                self.seqs[seq].last_draw = None;
                if let Some(mut g) = self.gens.remove(gen) {
                    log::info!("generation {gen} failed on its own: {}", r.message);
                    self.stats.refused += 1;
                    g.inflight = 0;
                    if g.seq == Some(item.seq) {
                        self.seqs[seq].active = None;
                        self.seqs[seq].idle_since_ms = self.clock_ms;
                        if self.seqs[seq].media {
                            // An image's KV is nobody's cache.
                            self.seqs[seq] = Seq::default();
                            self.pending_ops
                                .push(WorkerRequest::KvClear { seq: item.seq });
                        }
                    }
                    events.push(GenEvent::Failed {
                        gen: *gen,
                        message: r.message.clone(),
                        own: true,
                    });
                }
                continue;
            }
            self.seqs[seq].resident.extend_from_slice(&item.tokens);
            if *gen == WARM {
                self.seqs[seq].warmed += item.tokens.len();
                self.stats.turn_warmed_tokens += item.tokens.len() as u64;
                continue;
            }
            // Prompt tokens among them were prefill; the rest were draws fed.
            if let Some(g) = self.gens.get(gen) {
                let pos = item.pos as usize;
                let end = (pos + item.tokens.len()).min(g.admit.prompt.len());
                self.stats.prefilled_tokens += end.saturating_sub(pos) as u64;
            }
            if item.sample.is_none() {
                continue;
            }
            let d = drawn.iter().find(|d| d.seq == item.seq).cloned();
            self.seqs[seq].last_draw = d.clone();
            let rest = d.as_ref().map_or(0, |d| self.rest_for(d.grammar_us));
            if let Some(g) = self.gens.get_mut(gen) {
                g.inflight = g.inflight.saturating_sub(1);
                g.rest = rest;
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
                .cloned()
                .collect();
            match self.seqs[seq].last_draw.as_ref().map(|d| (d.token, d.eog)) {
                Some((token, false)) => self.seqs[seq].resident.push(token),
                _ => continue,
            }
            if let Some((_, fed)) = ours.split_last() {
                let fed: Vec<Token> = fed.iter().map(|d| d.token).collect();
                self.seqs[seq].resident.extend_from_slice(&fed);
            }
            self.seqs[seq].last_draw = ours.last().cloned();
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
                logprob: d.logprob.clone(),
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
            let s = &mut self.seqs[seq as usize];
            s.active = None;
            s.idle_since_ms = self.clock_ms;
            s.stays = false;
            s.idle_exported = false;
            if s.media {
                // An image's KV is nobody's cache: cleared, never kept.
                *s = Seq::default();
                self.pending_ops.push(WorkerRequest::KvClear { seq });
            }
            let s = &mut self.seqs[seq as usize];
            // `--park`: a session's turn is sealed (stateless ones never).
            if self.park
                && !s.resident.is_empty()
                && g.admit.session != NO_SESSION
                && !s.resident.is_empty()
                && self.spill.park_is_new(g.admit.session, &s.resident)
            {
                self.pending_ops.push(WorkerRequest::KvPark {
                    seq,
                    session: g.admit.session,
                    tokens: s.resident.clone(),
                });
                self.spill.add_parked(g.admit.session, &s.resident);
                self.stats.parks += 1;
            }
            let s = &mut self.seqs[seq as usize];
            // Its prompt and reply stay cached; a prefix pin protects them
            // (not an image's: its sequence was cleared).
            if let Some(pin) = g.admit.pin.filter(|_| g.admit.media.is_empty()) {
                let deadline = self.clock_ms.saturating_add(pin.ttl_ms);
                s.pin = Some((deadline, self.clock_ms, pin.len));
            }
            // A session's turn that ended: its next turn starts with the end
            // of turn drawn (not fed yet) and, most likely, the turn
            // opening; both are decoded ahead while the lane is idle. Not
            // for a batch-invariant session (its prompt would be computed
            // in a shape that depends on timing), a pinned prefix, or a
            // sequence that does not hold the turn it ran.
            s.warm.clear();
            if finish == Some(Finish::EndOfTurn)
                && g.admit.session != NO_SESSION
                && !g.admit.batch_invariant
                && !s.media
                && s.pin.is_none()
                && g.tokens
                    .split_last()
                    .is_some_and(|(_, fed)| s.resident == fed)
            {
                let eot = g.tokens[g.tokens.len() - 1];
                s.warm = std::iter::once(eot)
                    .chain(self.turn_opening.iter().copied())
                    .collect();
            }
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
                own: false,
            }],
        }
    }

    /// The worker's `Spilled` replies: the host-memory index learns the real
    /// sizes, and the worker drops what no longer fits the budget.
    pub fn note_spilled(&mut self, spilled: &[(u64, u64)]) {
        for &(key, bytes) in spilled {
            let dropped = self.spill.sized(key, bytes);
            self.pending_ops
                .extend(dropped.into_iter().map(|key| WorkerRequest::KvDrop { key }));
        }
    }

    /// Restores failed (the worker emptied their sequences): the
    /// generations on them prefill their prompts instead, on the next step.
    /// The step is taken as not run, so what the worker did beside the
    /// failed restores is undone too: a copy into another sequence (from
    /// one that was not restored, it was refused) is cleared, and its
    /// generation told it starts cold; when the decode went through
    /// (`decoded`), the tokens it added are trimmed off each sequence it
    /// decoded on (the state still counts what they held before the step),
    /// so those generations decode the same tokens again, nothing more.
    fn not_restored(&mut self, step: &Step, seqs: &[u32], decoded: bool) -> Vec<GenEvent> {
        let mut events = Vec::new();
        let copied: Vec<u32> = step
            .ops
            .iter()
            .filter_map(|op| match op {
                WorkerRequest::KvCopy { dst, .. } => Some(*dst),
                _ => None,
            })
            .collect();
        for seq in copied {
            if seqs.contains(&seq) {
                continue;
            }
            let Some(s) = self.seqs.get_mut(seq as usize) else {
                continue;
            };
            let n = s.resident.len() as u64;
            s.resident.clear();
            s.last_draw = None;
            self.pending_ops.push(WorkerRequest::KvClear { seq });
            self.stats.warm_tokens = self.stats.warm_tokens.saturating_sub(n);
            if let Some(gen) = s.active {
                events.push(GenEvent::Started {
                    gen,
                    warm_prefix: 0,
                    evicted: 0,
                });
            }
        }
        if decoded {
            let decoded_on = step
                .decode
                .iter()
                .map(|i| i.seq)
                .chain(step.next.iter().map(|n| n.seq));
            for seq in decoded_on {
                if seqs.contains(&seq) {
                    continue;
                }
                if let Some(s) = self.seqs.get(seq as usize) {
                    let from = s.resident.len() as u32;
                    self.pending_ops.push(WorkerRequest::KvTrim { seq, from });
                }
            }
        }
        for &seq in seqs {
            events.extend(self.not_restored_one(seq));
        }
        events
    }

    fn not_restored_one(&mut self, seq: u32) -> Vec<GenEvent> {
        // The worker logged why (one warning); the generation prefills.
        log::debug!("sequence {seq} was not restored; prefilling it");
        let Some(s) = self.seqs.get_mut(seq as usize) else {
            return vec![];
        };
        let n = s.resident.len() as u64;
        s.resident.clear();
        s.last_draw = None;
        if let Some(key) = s.restored_from.take() {
            self.spill.forget(key);
            // A state the restore was to leave in host memory (`keep`)
            // goes from the worker's store too.
            self.pending_ops.push(WorkerRequest::KvDrop { key });
        }
        self.stats.warm_tokens = self.stats.warm_tokens.saturating_sub(n);
        self.stats.restored_tokens = self.stats.restored_tokens.saturating_sub(n);
        // Its owner hears the warm prefix it really got.
        match s.active {
            Some(gen) => vec![GenEvent::Started {
                gen,
                warm_prefix: 0,
                evicted: 0,
            }],
            None => vec![],
        }
    }

    /// The worker's cache had no room for the step (it rolled the step back,
    /// so every sequence holds what it held before). Our count of cells is
    /// conservative (copied prefixes share cells in llama.cpp), so the worker
    /// is the judge: evict the idle sequences, or if there are none, end the
    /// youngest generation of the step; the rest retry on the next step.
    fn kv_full(&mut self, step: &Step) -> Vec<GenEvent> {
        if step.gens.iter().all(|g| *g == WARM) {
            // Only tokens decoded ahead did not fit: they are not worth
            // evicting anything for.
            return vec![];
        }
        let mut idle: Vec<usize> = (0..self.seqs.len())
            .filter(|&i| self.seqs[i].active.is_none() && !self.seqs[i].resident.is_empty())
            .collect();
        if !idle.is_empty() {
            // In eviction order (cached prefixes before sessions, least
            // recently used first, pins last), only as many as the step's
            // new tokens need by the cells they hold; a shared prefix frees
            // less than that, and the next KvFull takes the next one.
            let protected = self.protected();
            idle.sort_by_key(|&i| self.eviction_rank(&protected, i));
            let need: usize = step.decode.iter().map(|d| d.tokens.len()).sum::<usize>()
                + step.next.iter().map(|n| n.steps as usize).sum::<usize>();
            let mut freed = 0;
            let mut ops = Vec::new();
            for i in idle {
                if freed >= need.max(1) {
                    break;
                }
                freed += self.seqs[i].resident.len();
                self.spill_seq(i, protected[i], &mut ops);
                ops.push(WorkerRequest::KvClear { seq: i as u32 });
                self.seqs[i] = Seq::default();
            }
            self.pending_ops.append(&mut ops);
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
            // A cancelled one ends now, as it would have after this step.
            Some(gen) if self.gens[&gen].cancelled => {
                self.finish_gen(gen, Some(Finish::Cancelled), "")
            }
            Some(gen) if self.can_preempt(gen) => self.preempt(gen),
            Some(gen) => self.finish_gen(gen, Some(Finish::Error), "the KV cache is full"),
            None => vec![],
        }
    }

    /// Whether `gen` can wait off its sequence and go on later: another
    /// generation runs (alone, it has nothing to wait for), its draws are
    /// not penalized (the worker counts those per sequence), and it is not
    /// batch-invariant (a resume re-prefills its draws in a batch shape
    /// that depends on load).
    fn can_preempt(&self, gen: GenId) -> bool {
        let Some(g) = self.gens.get(&gen) else {
            return false;
        };
        let others = self
            .gens
            .iter()
            .any(|(id, o)| *id != gen && o.seq.is_some());
        let penalized = g.admit.extras.as_ref().is_some_and(|x| x.penalizes());
        g.seq.is_some() && others && !penalized && !g.admit.batch_invariant
    }

    /// Takes `gen` off its sequence: the sequence is left idle (its cells
    /// evictable, an image's cleared) and the generation waits to be
    /// admitted with room to finish (`assign`).
    fn preempt(&mut self, gen: GenId) -> Vec<GenEvent> {
        let Some(g) = self.gens.get_mut(&gen) else {
            return vec![];
        };
        let Some(seq) = g.seq.take() else {
            return vec![];
        };
        g.preempted = true;
        g.preempted_at = self.stats.decode_calls;
        g.inflight = 0;
        g.rest = 0;
        log::info!(
            "generation {gen}: the KV cache is full; it waits for room ({} tokens so far)",
            g.tokens.len()
        );
        self.stats.preempted += 1;
        self.kv_tight = false;
        let s = &mut self.seqs[seq as usize];
        s.active = None;
        s.idle_since_ms = self.clock_ms;
        s.last_used = self.steps_planned;
        s.stays = false;
        s.idle_exported = false;
        s.warm.clear();
        if s.media {
            *s = Seq::default();
            self.pending_ops.push(WorkerRequest::KvClear { seq });
        }
        vec![]
    }

    /// The lane failed: a decode error, or a worker that died. No
    /// sequence's contents can be trusted. What was really in flight fails
    /// with `message`: the generations of `in_step` (a step the worker got)
    /// and every generation that has drawn tokens for its client. The
    /// others, of which nothing was computed for their clients, wait again
    /// and run from their prompts on the next worker; cancelled ones end.
    pub fn lane_failed(&mut self, in_step: &[GenId], message: &str) -> Vec<GenEvent> {
        // A park not sent yet would seal cells that are gone (the worker
        // skips it): the index must not count on its artifact.
        let mut unsealed = Vec::new();
        self.pending_ops.retain(|op| match op {
            WorkerRequest::KvPark { session, .. } => {
                unsealed.push(*session);
                false
            }
            _ => true,
        });
        self.forget_parked(&unsealed);
        for s in &mut self.seqs {
            *s = Seq::default();
        }
        self.dirty = true;
        let keys = self.spill.clear();
        self.spill_orphans.extend(keys);
        for g in self.gens.values_mut() {
            g.seq = None;
            g.inflight = 0;
            // Those that wait again start afresh (nothing of theirs ran).
            g.preempted = false;
        }
        let mut ids: Vec<GenId> = self.gens.keys().copied().collect();
        ids.sort_unstable();
        let mut events = Vec::new();
        for gen in ids {
            let g = &self.gens[&gen];
            if g.cancelled {
                events.extend(self.finish_gen(gen, Some(Finish::Cancelled), ""));
            } else if in_step.contains(&gen) || g.produced > 0 {
                self.gens.remove(&gen);
                events.push(GenEvent::Failed {
                    gen,
                    message: message.to_string(),
                    own: false,
                });
            }
        }
        events
    }
}
