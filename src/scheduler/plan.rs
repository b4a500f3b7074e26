//! Planning steps: admission (a sequence for each waiting generation, by
//! class then arrival, with the longest cached prefix and LRU eviction within
//! the KV budget; one that does not fit keeps its claim on the room against
//! those after it), the next step (`plan`), and the step that follows one in
//! flight (`follow`).

use super::{
    spill, GenEvent, GenId, SchedulerState, Seq, Step, FOLLOW_MAX_PREFILL, FOLLOW_STEPS,
    NO_SESSION, WAIT_MIN_SHARED, WARM,
};
use crate::wire::worker::{DecodeItem, MediaSpan, NextItem, Sample, WorkerRequest};
use crate::wire::QosClass;
use crate::wire::Token;

fn lcp(a: &[Token], b: &[Token]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The prompt tokens a sequence can give a generation: none when either
/// holds an image (the spec: requests with images never use the cache).
fn shared(s: &Seq, prompt: &[Token], uncached: bool) -> usize {
    if s.media || uncached {
        0
    } else {
        lcp(&s.resident, prompt)
    }
}

/// How much of `todo` (the prompt from `have` on) a step takes, given it
/// would take `take`: an image is taken whole or not at all, so the take
/// ends before an image it would cut, or covers all of one it starts with.
/// Also the images on what is taken, at offsets from `have`.
fn take_whole_images(
    media: &[MediaSpan],
    have: usize,
    todo: usize,
    take: usize,
) -> (usize, Vec<MediaSpan>) {
    let mut take = take;
    for m in media {
        let (at, end) = (m.at as usize, (m.at + m.len) as usize);
        if at == have {
            take = take.max(end - have).min(todo);
        } else if at > have && at < have + take && end > have + take {
            take = at - have;
        }
    }
    let on = media
        .iter()
        .filter(|m| m.at as usize >= have && (m.at + m.len) as usize <= have + take)
        .map(|m| MediaSpan {
            at: m.at - have as u32,
            len: m.len,
            blob: m.blob.clone(),
        })
        .collect();
    (take, on)
}

impl SchedulerState {
    /// Which sequences pins protect now: session pins (`pin`) and the
    /// prefix pins generations left (`Admit::pin`), the newest first while
    /// they fit the pin budget; older ones yield.
    pub(super) fn protected(&self) -> Vec<bool> {
        let now = self.clock_ms;
        let mut pinned: Vec<(u64, usize, u64)> = self
            .seqs
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let session = s
                    .owner
                    .filter(|&o| o != NO_SESSION)
                    .and_then(|o| self.pins.get(&o))
                    .filter(|(deadline, _)| *deadline > now)
                    .map(|&(_, since)| (since, s.resident.len() as u64));
                let prefix = s
                    .pin
                    .filter(|(deadline, _, _)| *deadline > now)
                    .map(|(_, since, len)| (since, len.min(s.resident.len()) as u64));
                let (since, cost) = match (session, prefix) {
                    (Some(a), Some(b)) => a.max(b),
                    (a, b) => a.or(b)?,
                };
                Some((since, i, cost))
            })
            .collect();
        pinned.sort_by(|a, b| b.cmp(a));
        let budget = self.n_ctx as u64 * self.pin_budget_pct as u64 / 100;
        let mut used = 0u64;
        let mut out = vec![false; self.seqs.len()];
        for (_, i, cost) in pinned {
            // A pin over the whole budget can never hold: it yields alone,
            // without pushing the older pins out of the budget it is not
            // using (one 663-token pin in a 512-token budget unpinned a
            // 105-token one).
            if cost > budget {
                continue;
            }
            used += cost;
            if used <= budget {
                out[i] = true;
            }
        }
        out
    }

    /// The order idle sequences are taken and evicted in, lowest first:
    /// unprotected before protected; within each, cached prefixes of
    /// generations without a session before sessions' sequences; then
    /// least recently used first.
    pub(super) fn eviction_rank(&self, protected: &[bool], i: usize) -> (bool, bool, u64) {
        let s = &self.seqs[i];
        (protected[i], s.owner != Some(NO_SESSION), s.last_used)
    }

    /// Whether a waiting generation should wait for a running one's prefill
    /// rather than compute the same prompt tokens too: a generation whose
    /// prefill is not done (and not cancelled) shares with `prompt` at least
    /// [`WAIT_MIN_SHARED`] more tokens than the other sequences hold now, or
    /// all of `prompt` but its last token. Waiting generations hold no
    /// sequence, so none waits on another, and one whose awaited generation
    /// ends (finished, failed, cancelled) stops waiting.
    fn waits(&self, gen: GenId, prompt: &[Token]) -> bool {
        if !self.gens[&gen].admit.media.is_empty() {
            return false;
        }
        let last = prompt.len() - 1;
        let mut prefilling = vec![false; self.seqs.len()];
        let mut coming = 0;
        for (id, g) in &self.gens {
            let Some(q) = g.seq else { continue };
            let q = q as usize;
            if *id != gen
                && !g.cancelled
                && g.admit.media.is_empty()
                && self.seqs[q].resident.len() < g.admit.prompt.len()
            {
                prefilling[q] = true;
                coming = coming.max(lcp(&g.admit.prompt, prompt).min(last));
            }
        }
        let cached = self
            .seqs
            .iter()
            .zip(&prefilling)
            .filter(|(_, p)| !**p)
            .map(|(s, _)| shared(s, prompt, false))
            .max()
            .unwrap_or(0)
            .min(last);
        coming > cached && (coming - cached >= WAIT_MIN_SHARED || coming == last)
    }

    /// Before sequence `i`'s cells are dropped: export them to the
    /// host-memory tier when the index finds them worth keeping (the
    /// worker first forgets the entries the index drops for them).
    /// Returns whether host memory holds the sequence's tokens after it
    /// (spilled now, or already there).
    pub(super) fn spill_seq(
        &mut self,
        i: usize,
        pinned: bool,
        ops: &mut Vec<WorkerRequest>,
    ) -> bool {
        if self.seqs[i].media {
            // A sequence holding an image is nobody's cache.
            return false;
        }
        let tokens = &self.seqs[i].resident;
        let len = tokens.len() as u32;
        let Some((key, dropped)) = self.spill.insert(tokens, pinned) else {
            return self.spill.in_memory(tokens);
        };
        ops.extend(dropped.into_iter().map(|key| WorkerRequest::KvDrop { key }));
        ops.push(WorkerRequest::KvSpill {
            seq: i as u32,
            key,
            len,
        });
        self.stats.spills += 1;
        true
    }

    /// Whether sequence `i` is one `--idle-spill-ms` moves out once its
    /// period is over: idle, holding tokens, not kept (`stays`),
    /// unprotected, and its session's next turn is not waiting for a
    /// sequence. None while the tier or the period is off, or the worker's
    /// KV is to be cleared anyway (`dirty`).
    fn idle_spillable(&self, protected: &[bool], i: usize) -> bool {
        let s = &self.seqs[i];
        self.idle_spill_ms > 0
            && self.spill.enabled()
            && !self.dirty
            && s.active.is_none()
            && !s.resident.is_empty()
            && !s.stays
            && !protected[i]
            && !self.gens.values().any(|g| {
                g.seq.is_none() && g.admit.session != NO_SESSION && Some(g.admit.session) == s.owner
            })
    }

    /// The sequences due to leave the cells now.
    fn idle_spill_candidates(&self) -> Vec<usize> {
        if self.idle_spill_ms == 0 {
            return vec![];
        }
        let protected = self.protected();
        (0..self.seqs.len())
            .filter(|&i| {
                self.idle_spillable(&protected, i)
                    && self.clock_ms
                        >= self.seqs[i]
                            .idle_since_ms
                            .saturating_add(self.idle_spill_ms)
            })
            .collect()
    }

    /// When the next idle sequence is due to leave the cells (unix ms), if
    /// any: the scheduler actor wakes then.
    pub fn idle_spill_due_at(&self) -> Option<u64> {
        if self.idle_spill_ms == 0 {
            return None;
        }
        let protected = self.protected();
        (0..self.seqs.len())
            .filter(|&i| self.idle_spillable(&protected, i))
            .map(|i| {
                self.seqs[i]
                    .idle_since_ms
                    .saturating_add(self.idle_spill_ms)
            })
            .min()
    }

    /// Moves the idle sequences that are due to the host-memory tier and
    /// frees their cells: llama.cpp attends over every cell up to the
    /// highest one in use, so idle cells slow each decode beside them
    /// (docs/kv-tiers.md, "Idle sequences"). Their next turn restores them.
    ///
    /// Never at another state's expense, and never losing one: a sequence
    /// leaves only when host memory holds it, and is spilled only when it
    /// fits beside what host memory holds (dropping nothing but states it
    /// extends). Until the tier knows a state's size (nothing sized yet),
    /// the sequence is exported first and its cells cleared at the next
    /// plan, once the worker's reply has sized it; if the worker did not
    /// keep it, the sequence stays.
    fn spill_idle(&mut self, ops: &mut Vec<WorkerRequest>) {
        for i in self.idle_spill_candidates() {
            let tokens = &self.seqs[i].resident;
            if self.spill.in_memory(tokens) {
                self.clear_idle(i, ops);
                continue;
            }
            if self.seqs[i].idle_exported {
                // Exported before, and host memory did not keep it.
                self.seqs[i].stays = true;
                continue;
            }
            match self.spill.fits_beside(tokens) {
                Some(true) => {
                    if self.spill_seq(i, false, ops) {
                        self.clear_idle(i, ops);
                    } else {
                        self.seqs[i].stays = true;
                    }
                }
                // Its size is not known yet: export, clear when sized.
                None => {
                    if self.spill_seq(i, false, ops) {
                        self.seqs[i].idle_exported = true;
                    } else {
                        self.seqs[i].stays = true;
                    }
                }
                Some(false) => self.seqs[i].stays = true,
            }
        }
    }

    fn clear_idle(&mut self, i: usize, ops: &mut Vec<WorkerRequest>) {
        ops.push(WorkerRequest::KvClear { seq: i as u32 });
        self.seqs[i] = Seq::default();
        self.stats.idle_spills += 1;
    }

    fn resident_total(&self, except: usize) -> u64 {
        self.seqs
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != except)
            .map(|(_, s)| s.resident.len() as u64)
            .sum()
    }

    /// The cells the running sequences hold or are about to (the rest of
    /// their prompt, and the next draw): what admission leaves them. Idle
    /// sequences do not count; they can be evicted.
    fn busy_cells(&self) -> u64 {
        self.seqs
            .iter()
            .filter_map(|s| {
                let claimed = self.gens.get(&s.active?).map_or(0, |g| g.tokens.len() + 1);
                Some(s.resident.len().max(claimed) as u64)
            })
            .sum()
    }

    /// The cells the running sequences will hold when they finish: their
    /// tokens and the rest of their max_tokens (each at most the context).
    /// A preempted generation is admitted again only beside these, so the
    /// same growth does not preempt it again.
    fn cells_to_finish(&self) -> u64 {
        self.seqs
            .iter()
            .filter_map(|s| {
                let g = self.gens.get(&s.active?)?;
                let left = u64::from(g.admit.max_tokens.saturating_sub(g.produced));
                let full = (g.tokens.len() as u64 + 1 + left).min(self.n_ctx as u64);
                Some(full.max(s.resident.len() as u64))
            })
            .sum()
    }

    /// Gives queued generations a sequence, in class then arrival order.
    /// One that does not fit beside the running sequences keeps its claim
    /// on the room: those after it are admitted only beside it too, so it
    /// starts as soon as the running ones leave it room.
    fn assign(&mut self, ops: &mut Vec<WorkerRequest>, events: &mut Vec<GenEvent>) {
        let mut waiting: Vec<(QosClass, u64, GenId)> = self
            .gens
            .iter()
            .filter(|(_, g)| g.seq.is_none())
            .map(|(id, g)| (g.admit.class, g.arrival, *id))
            .collect();
        waiting.sort();
        // Cells claimed by the generations before this one in that order
        // that did not fit: a later one is admitted only beside them too, so
        // a long prompt is not passed, again and again, by shorter ones
        // that fit beside the running sequences (first come, first served
        // by room). A higher class comes first in the order, so it is never
        // held back by a lower one's claim.
        let mut reserved = 0u64;
        for (_, _, gen) in waiting {
            let session = self.gens[&gen].admit.session;
            let prompt = self.gens[&gen].tokens.clone();
            let uncached = !self.gens[&gen].admit.media.is_empty();
            let idle = |s: &Seq| s.active.is_none();
            // Admit only what fits beside the running sequences (idle ones
            // can be evicted) and the earlier claims; otherwise wait for
            // room, and claim it. (Counted before a sequence is chosen: a
            // generation that waits changes none.)
            // A preempted one waits for room to finish: its prompt and
            // draws so far, and the rest of its max_tokens (at most the
            // whole context: then it waits until nothing else runs).
            let g = &self.gens[&gen];
            let (busy, need) = if g.preempted {
                let left = u64::from(g.admit.max_tokens.saturating_sub(g.produced));
                let need = (prompt.len() as u64 + 1 + left).min(self.n_ctx as u64);
                (self.cells_to_finish(), need)
            } else {
                (self.busy_cells(), prompt.len() as u64 + 1)
            };
            // Nothing went through since it was taken off while others
            // hold sequences: they advance first; its room stays claimed.
            let others_run = self
                .gens
                .iter()
                .any(|(id, o)| *id != gen && o.seq.is_some());
            if g.preempted && others_run && self.stats.decode_calls == g.preempted_at {
                reserved = reserved.saturating_add(need);
                continue;
            }
            if busy + reserved + need > self.n_ctx as u64 {
                reserved = reserved.saturating_add(need);
                continue;
            }
            // One that fits but waits for a running prefill claims no room:
            // it needs none until that prefill is done, and then its
            // admission is judged by room like any other.
            if self.waits(gen, &prompt) {
                continue;
            }
            // Unprotected sequences are taken (and evicted) first.
            let protected = self.protected();
            // The sequence to run on: the session's own (for a generation
            // without a session, the unprotected cached prefix it extends
            // most), else a free one, else the first idle one in eviction
            // order. A protected prefix is copied, not taken.
            // A cached prefix this generation only shares a start with (a
            // chat template's opening, a document with another question) is
            // not its own: it is taken in eviction order like any other, and
            // the shared part copied from it.
            let own = if session == NO_SESSION {
                self.seqs
                    .iter()
                    .enumerate()
                    .filter(|(i, s)| idle(s) && s.owner == Some(NO_SESSION) && !protected[*i])
                    .map(|(i, s)| (shared(s, &prompt, uncached), s.resident.len(), i))
                    .filter(|&(n, len, _)| n > 0 && n == len)
                    .max()
                    .map(|(_, _, i)| i)
            } else {
                self.seqs
                    .iter()
                    .position(|s| idle(s) && s.owner == Some(session))
            };
            let dst = own.or_else(|| {
                self.seqs
                    .iter()
                    .position(|s| idle(s) && s.owner.is_none())
                    .or_else(|| {
                        (0..self.seqs.len())
                            .filter(|&i| idle(&self.seqs[i]))
                            .min_by_key(|&i| self.eviction_rank(&protected, i))
                    })
            });
            let Some(dst) = dst else { break };
            // Tokens decoded ahead on it that this prompt does not start
            // with are dropped below, like any others.
            let d = &mut self.seqs[dst];
            d.warm.clear();
            if d.warmed > 0 {
                let ahead = d.resident.len() - d.warmed;
                let used = shared(d, &prompt, uncached).min(prompt.len() - 1);
                self.stats.turn_warm_missed_tokens +=
                    d.resident.len().saturating_sub(used.max(ahead)) as u64;
                d.warmed = 0;
            }
            // The best source of cells: the longest common prefix.
            let (src, common) = self
                .seqs
                .iter()
                .enumerate()
                .map(|(i, s)| (i, shared(s, &prompt, uncached)))
                .max_by_key(|&(i, n)| (n, i == dst))
                .unwrap_or((dst, 0));
            // The last prompt token is decoded again for its logits.
            let keep = common.min(prompt.len() - 1);
            let own_keep = shared(&self.seqs[dst], &prompt, uncached).min(prompt.len() - 1);
            // The host-memory tier, when it holds more of the prompt than
            // any sequence: the state is imported instead of prefilled.
            let restore = (!uncached)
                .then(|| self.spill.longest(&prompt))
                .flatten()
                .map(|(key, n)| (key, n.min(prompt.len() - 1)))
                .filter(|&(key, n)| self.spill.worth_restoring(key, n, keep));
            let old = self.seqs[dst].resident.clone();
            // What dst held is dropped (past what it keeps): spill it first,
            // unless it is this session's own history being rewritten.
            let kept = if restore.is_some() || (src != dst && keep > own_keep) {
                0
            } else {
                own_keep
            };
            let own_history = session != NO_SESSION && self.seqs[dst].owner == Some(session);
            if !own_history && old.len() > kept {
                self.spill_seq(dst, protected[dst], ops);
            }
            // The restore runs after the evictions below (it needs their
            // room), and briefly holds all of the stored state.
            let mut restore_op = None;
            let mut extra = 0u64;
            if let Some((key, n)) = restore {
                let (stored, source) = self
                    .spill
                    .restore(key, n)
                    .unwrap_or((vec![], spill::Source::Memory { keep: false }));
                let n = n.min(stored.len());
                // A park artifact is imported whole before it is trimmed;
                // from host memory only the prefix's cells are (the worker
                // reads the state's layout; one it cannot read, imported
                // whole, may find no room: the generation then prefills).
                if matches!(source, spill::Source::Disk { .. }) {
                    extra = stored.len().saturating_sub(n) as u64;
                }
                restore_op = Some(match source {
                    spill::Source::Memory { keep } => WorkerRequest::KvRestore {
                        seq: dst as u32,
                        key,
                        len: n as u32,
                        keep,
                    },
                    spill::Source::Disk { session } => WorkerRequest::KvUnpark {
                        seq: dst as u32,
                        session,
                        tokens: stored.clone(),
                        len: n as u32,
                    },
                });
                self.seqs[dst].resident = stored[..n].to_vec();
                self.seqs[dst].restored_from = Some(key);
                self.stats.restored_tokens += n as u64;
                self.stats.restores += 1;
            } else if src != dst && keep > own_keep {
                ops.push(WorkerRequest::KvCopy {
                    src: src as u32,
                    dst: dst as u32,
                    len: keep as u32,
                });
                self.seqs[dst].resident = self.seqs[src].resident[..keep].to_vec();
                // A cache hit keeps the source warm (and in the cells).
                self.seqs[src].last_used = self.steps_planned;
                self.seqs[src].idle_since_ms = self.clock_ms;
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
            // Make room: evict idle sequences, in eviction order.
            let need = prompt.len() as u64 + 1 - warm + extra;
            while self.resident_total(usize::MAX) + need > self.n_ctx as u64 {
                let victim = (0..self.seqs.len())
                    .filter(|&i| {
                        let s = &self.seqs[i];
                        i != dst && idle(s) && !s.resident.is_empty()
                    })
                    .min_by_key(|&i| self.eviction_rank(&protected, i));
                let Some(v) = victim else { break };
                evicted += self.seqs[v].resident.len() as u64;
                self.spill_seq(v, protected[v], ops);
                ops.push(WorkerRequest::KvClear { seq: v as u32 });
                self.seqs[v] = Seq::default();
            }
            ops.extend(restore_op);
            let seq = &mut self.seqs[dst];
            seq.owner = Some(session);
            seq.active = Some(gen);
            seq.media = uncached;
            // Its cells change: a prefix pin left on it no longer holds.
            seq.pin = None;
            seq.last_used = self.steps_planned;
            let g = self.gens.get_mut(&gen).expect("waiting gen");
            g.seq = Some(dst as u32);
            // A preempted generation resumes: its client heard it start
            // (and how much of its prompt was warm) already, and its draws
            // are no prompt tokens of the cache.
            if std::mem::take(&mut g.preempted) {
                continue;
            }
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
            ops.extend(
                self.spill_orphans
                    .drain(..)
                    .map(|key| WorkerRequest::KvDrop { key }),
            );
        }
        ops.append(&mut self.pending_ops);
        let mut events = Vec::new();
        self.assign(&mut ops, &mut events);
        self.spill_idle(&mut ops);
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
        // Generations resting for their grammar's cost sit this step out
        // while any other runs.
        if running.iter().any(|(_, _, id)| self.gens[id].rest == 0) {
            running.retain(|(_, _, id)| {
                let g = self.gens.get_mut(id).expect("running");
                if g.rest == 0 {
                    return true;
                }
                g.rest -= 1;
                self.stats.grammar_rested_steps += 1;
                false
            });
        }
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
                let k = (self.invariant_picks % invariant.len() as u64) as usize;
                self.invariant_picks += 1;
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
            let (take, media) = take_whole_images(&g.admit.media, have, todo.len(), take);
            budget = budget.saturating_sub(take);
            let last = take == todo.len();
            decode.push(DecodeItem {
                media,
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
        if self.gens.is_empty() {
            self.plan_warm(&mut decode, &mut gens);
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

    /// With nothing to run or admit: decodes each idle session sequence's
    /// `warm` tokens (its end of turn and the turn opening) once its turn
    /// ended `--turn-warm-ms` ago, where the cells have room, one item
    /// each, beside [`WARM`] in the step's generations.
    fn plan_warm(&mut self, decode: &mut Vec<DecodeItem>, gens: &mut Vec<GenId>) {
        let mut room = (self.n_ctx as u64).saturating_sub(self.resident_total(usize::MAX));
        for i in 0..self.seqs.len() {
            if self.warm_due_at(&self.seqs[i]) > self.clock_ms {
                continue;
            }
            let s = &mut self.seqs[i];
            let warm = std::mem::take(&mut s.warm);
            let ready = s.active.is_none()
                && !s.resident.is_empty()
                && !s.idle_exported
                && s.pin.is_none()
                && s.owner.is_some_and(|o| o != NO_SESSION);
            if warm.is_empty() || !ready || warm.len() as u64 > room {
                continue;
            }
            room -= warm.len() as u64;
            decode.push(DecodeItem {
                seq: i as u32,
                pos: s.resident.len() as u32,
                tokens: warm,
                sample: None,
                media: vec![],
            });
            gens.push(WARM);
        }
    }

    /// When a sequence's `warm` tokens are due (unix ms): `--turn-warm-ms`
    /// after its turn ended.
    fn warm_due_at(&self, s: &Seq) -> u64 {
        s.idle_since_ms.saturating_add(self.turn_warm_ms)
    }

    /// When the scheduler actor next has to plan with nothing in flight
    /// (unix ms): an idle sequence due to leave the cells, or (with no
    /// generation to run) a session's turn opening due to be decoded ahead.
    pub fn wake_due_at(&self) -> Option<u64> {
        // Warm steps run only with no generation to run.
        let idle = self.gens.is_empty();
        let warm = self
            .seqs
            .iter()
            .filter(|s| idle && !s.warm.is_empty() && s.active.is_none())
            .map(|s| self.warm_due_at(s));
        warm.chain(self.idle_spill_due_at()).min()
    }

    /// Plans the step after `last` while `last` is still in flight: the same
    /// generations, up to [`FOLLOW_STEPS`] tokens each, the first fed what
    /// they draw last in `last` (the worker runs them as one `DecodeNext`).
    /// None when the next step must wait for `last`'s reply and go through
    /// [`plan`](Self::plan): a generation waiting for a sequence, KV
    /// operations to run, a prefill still going, a grammar (its state
    /// follows each committed token), a batch-invariant generation beside
    /// others, a background generation the divisor holds back, or a long
    /// prefill in `last` ([`FOLLOW_MAX_PREFILL`]), or an image in `last`
    /// (the worker may refuse its item alone). A
    /// generation that `last` will finish (max_tokens, a cancel, a full
    /// context) is left out, as `plan` would; one that draws end of turn in
    /// `last` is skipped by the worker.
    pub fn follow(&mut self, last: &Step) -> Option<Step> {
        if self.dirty || self.kv_tight || !self.pending_ops.is_empty() {
            return None;
        }
        // An idle sequence is due to leave the cells: `plan` moves it.
        if !self.idle_spill_candidates().is_empty() {
            return None;
        }
        if last.decode.iter().any(|i| i.sample.is_none()) {
            return None;
        }
        // The worker may refuse an item holding an image on its own (a blob
        // gone from the store, not an image it decodes) and put its sequence
        // back: a step queued behind it would decode past cells that are not
        // there. Its reply decides what comes next.
        if last.decode.iter().any(|i| !i.media.is_empty()) {
            return None;
        }
        // A long prefill (the items of more than one token; a decode item
        // has one): whoever is admitted while it runs joins the next step,
        // which is planned when its reply comes.
        let prefill: usize = last
            .decode
            .iter()
            .map(|i| i.tokens.len())
            .filter(|&n| n > 1)
            .sum();
        if prefill > FOLLOW_MAX_PREFILL {
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

#[cfg(test)]
mod image_tests {
    use super::take_whole_images;
    use crate::wire::worker::MediaSpan;

    fn span(at: u32, len: u32) -> MediaSpan {
        MediaSpan {
            at,
            len,
            blob: "b".into(),
        }
    }

    #[test]
    fn a_step_takes_an_image_whole_or_not_at_all() {
        let media = [span(10, 14), span(30, 5)];
        // A take that would cut the first image stops before it.
        assert_eq!(take_whole_images(&media, 0, 40, 16).0, 10);
        // One that starts on it takes all of it, past the budget if need be.
        let (take, on) = take_whole_images(&media, 10, 30, 4);
        assert_eq!(take, 14);
        assert_eq!(on, vec![span(0, 14)]);
        // Both inside, at offsets from where the take starts.
        let (take, on) = take_whole_images(&media, 5, 35, 35);
        assert_eq!(take, 35);
        assert_eq!(on, vec![span(5, 14), span(25, 5)]);
        // The second one cut: the take ends before it, the first kept.
        let (take, on) = take_whole_images(&media, 5, 35, 27);
        assert_eq!(take, 25);
        assert_eq!(on, vec![span(5, 14)]);
        // No images: the take as asked.
        assert_eq!(take_whole_images(&[], 0, 40, 16), (16, vec![]));
    }
}
