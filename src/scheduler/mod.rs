//! `SchedulerState`: which generations run in a lane's next decode step, on
//! which of its sequences, and what each sequence's KV holds. Plain data, no
//! actix, no model: the scheduler actor drives it, the tests step it by hand.
//!
//! - Admission orders by QoS class (0 first, 3 last), then arrival. A
//!   generation is admitted when its prompt fits beside what the running
//!   sequences hold (idle ones are evicted); one that does not keeps its
//!   claim on the room, and those after it in that order are admitted only
//!   beside that claim too (first come, first served by room), so a long
//!   prompt starts as soon as the running ones leave it room instead of
//!   being passed by shorter ones forever.
//! - Every active generation of the lane advances in one decode call per
//!   step (continuous batching); a `batch_invariant` one runs alone, so its
//!   batch shape never depends on what else runs.
//! - Class 3 (background) advances only every `background_divisor`-th step.
//! - A generation whose grammar took longer to constrain its last token
//!   than the step's decode took sits out as many steps as that is longer
//!   (at most [`MAX_GRAMMAR_REST`]) while others run: every sequence waits
//!   for a grammar in the step it runs in, so one that costs 50 steps a
//!   token would otherwise slow every other stream 50 times; resting, it
//!   costs them at most about half their speed. Alone it is not rested.
//! - A session's tokens stay resident in its sequence after its turn, so the
//!   next turn prefills only what is new; a new generation whose prompt
//!   shares a prefix with another sequence (a fork and its parent) starts
//!   from a copy of that sequence's cells instead of a prefill.
//! - When the cells run out mid-generation (the running ones grew past the
//!   room their admissions left) and no idle sequence is left to evict,
//!   the youngest generation is preempted: taken off its sequence (left
//!   idle, its cells evictable like any other's) to wait, first in its
//!   order, until the cells its prompt, draws so far and remaining
//!   `max_tokens` need are free; it then goes on where it stopped (a draw
//!   depends on its position, so it draws what it would have). One whose
//!   draws are penalized (the worker keeps their counts per sequence) or
//!   that runs alone ends with `Finish::Error` instead.
//! - The KV budget is `n_ctx` cells; idle sequences are evicted to make
//!   room (and taken for a new generation) in this order: unprotected before
//!   pinned (session pins and `Admit::pin` prefix pins, within
//!   `--pin-budget-pct`); within each, cached prefixes of generations
//!   without a session ([`NO_SESSION`]) before sessions' sequences; then
//!   least recently used first. A pinned prefix is copied from, never taken.
//! - A waiting generation whose prompt shares [`WAIT_MIN_SHARED`] more
//!   tokens (or all but its last token) with a running generation's
//!   unfinished prefill than the KV holds waits for that prefill, then is
//!   seeded from it (so n identical requests prefill once). Only generations
//!   holding a sequence are waited on, so waiters never wait on each other,
//!   and one whose prefill ends any way (done, failed, cancelled) frees them.
//! - Steps are pipelined: while a step is in flight, [`SchedulerState::follow`]
//!   plans the next for the same generations, [`FOLLOW_STEPS`] tokens each,
//!   fed by the worker itself with what it draws (`WorkerRequest::DecodeNext`),
//!   so the worker never waits for the daemon between steps and the daemon
//!   hears from it once per few tokens. Anything that changes the batch (an
//!   admission, a KV operation, a prefill, a grammar) waits for the pipeline
//!   to drain and goes through [`SchedulerState::plan`]; nothing follows a
//!   long prefill ([`FOLLOW_MAX_PREFILL`]), so a generation admitted during
//!   one joins the very next step.
//!
//! Layout: this file holds the types and the state; `plan.rs` admission,
//! `plan` and `follow`; `reply.rs` what a step's reply does to the state;
//! `step.rs` the `Step`; [`pipeline`] the steps in flight and the order their
//! replies are taken in (what the scheduler actor runs); `tests.rs` drives
//! both against a fake worker that keeps the real worker's sequence table
//! (`engine::exec::seqs::SeqTable`).
//!
//! **src/scheduler sees tokens and sequence ids, never text or the log.**

pub mod pipeline;
mod plan;
mod reply;
pub mod spill;
mod step;
#[cfg(test)]
mod tests;

pub use step::Step;

use std::collections::BTreeMap;

use crate::wire::worker::{DrawExtras, Drawn, MediaSpan, WorkerRequest, MEDIA_TOKEN};
use crate::wire::{
    ExtrasError, Finish, Params, QosClass, SampleExtras, SessionId, Token, TokenLogprob,
};
use spill::SpillIndex;

/// `--pin-budget-pct` default.
pub const DEFAULT_PIN_BUDGET_PCT: u32 = 50;

/// The session id of generations without a session (the stateless routes):
/// their idle sequences are the prefix cache.
pub const NO_SESSION: SessionId = 0;

/// A waiting generation that would take at least this many more prompt
/// tokens from a running generation's prefill than the KV holds now waits
/// for that prefill instead of computing them too.
pub const WAIT_MIN_SHARED: usize = 1024;

/// The most steps a generation sits out for its grammar's cost: a grammar
/// may take `GRAMMAR_TOKEN_LIMIT` (500 ms) a token, a step a millisecond.
pub const MAX_GRAMMAR_REST: u32 = 1000;

/// Identifies one generation within a lane.
pub type GenId = u64;

/// Tokens a following step runs per generation on its own, in the worker,
/// before the daemon hears of them: the daemon wakes once per this many
/// tokens of a stream instead of once per token, and a cancel lands within
/// two following steps (the one running and the one queued).
pub const FOLLOW_STEPS: u32 = 4;

/// No step follows one that decodes more tokens than this (a prefill): it
/// runs long enough that planning the next step after its reply costs the
/// lane nothing worth counting, and a generation admitted meanwhile starts
/// right after it, not behind a queued step of the others' draws.
pub const FOLLOW_MAX_PREFILL: usize = 64;

/// Why the scheduler refuses a generation. The text is what the client sees.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SchedulerError {
    #[error("nothing to generate from: the session's input is empty")]
    EmptyInput,
    #[error(
        "the session's input ({tokens} tokens) does not fit the context ({n_ctx} cells, --ctx-size)"
    )]
    DoesNotFit { tokens: usize, n_ctx: u32 },
    #[error("QoS class {0} is out of range")]
    QosClass(u8),
    #[error(transparent)]
    Extras(#[from] ExtrasError),
    #[error("the prompt's images are malformed: {0}")]
    Media(String),
}

/// A prompt's images: in order, apart, inside it, never its last token;
/// every embedding position inside one.
fn check_media(prompt: &[Token], media: &[MediaSpan]) -> Result<(), SchedulerError> {
    let bad = |why: &str| Err(SchedulerError::Media(why.into()));
    let mut end = 0usize;
    for m in media {
        let at = m.at as usize;
        if m.len == 0 || at < end {
            return bad("an image is empty or overlaps the one before");
        }
        end = at + m.len as usize;
        if end >= prompt.len() {
            return bad("an image runs to the prompt's end");
        }
    }
    let inside = |j: usize| {
        media
            .iter()
            .any(|m| (m.at as usize..(m.at + m.len) as usize).contains(&j))
    };
    if (0..prompt.len()).any(|j| prompt[j] == MEDIA_TOKEN && !inside(j)) {
        return bad("an embedding position outside any image");
    }
    Ok(())
}

/// Why a step brought no tokens.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StepError {
    /// The worker's KV cache had no room for the step (it rolled the step
    /// back): the scheduler makes room, or ends a generation.
    /// `spilled`: the step's `Spilled` replies (its KV operations ran before
    /// the decode that found no room), which still stand.
    #[error("the worker's KV cache is full")]
    KvFull { spilled: Vec<(u64, u64)> },
    /// The lane or the worker failed it: its generations, and every one that
    /// has drawn tokens, fail with this text; the others run again.
    #[error("{0}")]
    Failed(String),
    /// The worker died before the step reached it: nothing of it ran. Only
    /// generations that have drawn tokens fail; the step's others run again.
    #[error("{0}")]
    NotDelivered(String),
    /// `KvRestore`s (or `KvUnpark`s) of the step found nothing to restore
    /// or no room: those sequences are empty, and their generations prefill
    /// instead. The worker ran the step's other requests: `decoded` when its
    /// decode went through (on the other sequences) although the step is
    /// taken as not run.
    /// `spilled`: the step's `Spilled` replies, which still stand;
    /// `unparked`: park artifacts the budget deleted, from its `Decoded`.
    #[error("sequences {seqs:?} were not restored")]
    NotRestored {
        seqs: Vec<u32>,
        decoded: bool,
        spilled: Vec<(u64, u64)>,
        unparked: Vec<u64>,
    },
}

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
    /// Protect the sequence this generation ends on (its prompt and reply)
    /// like a pin (an Anthropic `cache_control` breakpoint).
    pub pin: Option<PrefixPin>,
    /// Penalties, logit bias, log-probabilities (None: a plain generation).
    /// Checked at admission (ranges, and bias ids against the vocabulary).
    pub extras: Option<SampleExtras>,
    /// The images on `prompt` (offsets into it), in order. A generation
    /// with any neither takes a cached prefix nor leaves one: it prefills
    /// its whole prompt, and its sequence is cleared when it ends (never
    /// spilled or parked). Each image goes to the worker whole.
    pub media: Vec<MediaSpan>,
}

/// A pin a generation leaves on its sequence when it ends: the sequence is
/// protected from eviction for `ttl_ms`, and `len` tokens (the prefix up to
/// the breakpoint) count against the pin budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixPin {
    pub len: usize,
    pub ttl_ms: u64,
}

/// What the scheduler tells the generation's owner.
#[derive(Debug, Clone, PartialEq)]
pub enum GenEvent {
    /// It got a sequence; `warm_prefix` prompt tokens came from the KV, and
    /// `evicted` cached tokens were dropped to make way for it (cells that
    /// no longer matched its prompt, and idle sequences cleared for room).
    /// A restore from host memory or a park artifact that fails in the
    /// worker sends it again, with the warm prefix it really got (0).
    Started {
        gen: GenId,
        warm_prefix: u64,
        evicted: u64,
    },
    Token {
        gen: GenId,
        token: Token,
        /// Its log-probabilities, when the generation's extras asked for
        /// `logprobs` (None otherwise).
        logprob: Option<TokenLogprob>,
    },
    /// It ended; `finish` is a `wire::finish` code (never OPEN).
    Finished { gen: GenId, finish: Finish },
    /// The lane failed under it (a worker crash, a decode error), or, with
    /// `own`, the worker refused its own item (its grammar does not parse,
    /// dead-ends or costs too much; a draw it rejects): the request's
    /// fault, not the lane's.
    Failed {
        gen: GenId,
        message: String,
        own: bool,
    },
}

impl GenEvent {
    /// The generation it is about.
    pub fn gen(&self) -> GenId {
        match self {
            GenEvent::Started { gen, .. }
            | GenEvent::Token { gen, .. }
            | GenEvent::Finished { gen, .. }
            | GenEvent::Failed { gen, .. } => *gen,
        }
    }

    /// Whether it is the generation's last event.
    pub fn ends(&self) -> bool {
        matches!(self, GenEvent::Finished { .. } | GenEvent::Failed { .. })
    }
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
    /// A pin left by the generation that ended on it (`Admit::pin`):
    /// (deadline in unix ms, when it was pinned, tokens it counts).
    pin: Option<(u64, u64, usize)>,
    /// The index entry its cells were last restored from (forgotten if the
    /// restore fails).
    restored_from: Option<u64>,
    /// When its last generation ended (the scheduler's clock, unix ms):
    /// what `--idle-spill-ms` counts from.
    idle_since_ms: u64,
    /// Host memory would not take it when it was due to leave the cells:
    /// it stays until its next generation ends.
    stays: bool,
    /// Exported for `--idle-spill-ms` before the tier knew its size: its
    /// cells are cleared at the next plan if host memory kept it.
    idle_exported: bool,
    /// It holds an image: it gives no prefix to anyone, and is cleared when
    /// its generation ends.
    media: bool,
    /// Tokens to decode onto it while the lane is idle: the end of turn its
    /// generation drew and the lane's turn opening (`with_turn_opening`),
    /// which the session's next turn most likely starts with.
    warm: Vec<Token>,
    /// How many of `resident`'s last tokens were decoded that way.
    warmed: usize,
}

/// Stands for "no generation" beside a step's decode item that decodes a
/// sequence's `warm` tokens (generation ids start at 1).
pub(crate) const WARM: GenId = 0;

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
    /// Steps it sits out while others run: its grammar took longer to
    /// constrain its last token than the step's decode (see `rest_for`).
    rest: u32,
    /// Taken off its sequence when the KV cache filled (`kv_full`): it
    /// waits to be admitted again with room to finish.
    preempted: bool,
    /// `Stats::decode_calls` when it was preempted: it is admitted again
    /// only after a decode went through without it (so a cache fuller
    /// than the scheduler counts cannot preempt it in a loop while
    /// nothing advances).
    preempted_at: u64,
}

impl Gen {
    /// The extras its draws carry: the first draw is at the prompt's end.
    fn draw_extras(&self) -> Option<DrawExtras> {
        self.admit.extras.as_ref().map(|x| DrawExtras {
            extras: x.clone(),
            first_draw: self.admit.prompt.len() as u64,
        })
    }
}

/// Counters for metrics and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stats {
    /// Decode calls made (a following step makes one per token it draws).
    pub decode_calls: u64,
    /// Sequences advanced, summed over steps.
    pub seq_steps: u64,
    /// The most sequences one step advanced.
    pub max_seqs_per_step: u64,
    /// Tokens drawn.
    pub drawn: u64,
    /// Generations taken off their sequence when the KV cache filled, to
    /// go on once there is room (instead of ending them).
    pub preempted: u64,
    /// Steps a generation sat out because its grammar cost more than a
    /// step (summed over generations).
    pub grammar_rested_steps: u64,
    /// Prompt tokens taken from the KV instead of a prefill.
    pub warm_tokens: u64,
    /// Prompt tokens the worker decoded (prefill; drawn tokens fed back
    /// are not counted).
    pub prefilled_tokens: u64,
    /// Tokens the worker decoded (prompt and drawn), and the time its
    /// llama.cpp decode calls took, in microseconds.
    pub decoded_tokens: u64,
    pub decode_us: u64,
    /// Attention scores in the prefill tile pairs not wholly masked, as
    /// ggml computes them and as the trimmed kernel did (ggml-patch/).
    pub attention: crate::wire::worker::AttentionWork,
    /// KV cells in use: tokens resident across sequences, as the scheduler
    /// models them (filled in by `stats`, not counted).
    pub kv_cells_used: u64,
    /// Prompt tokens imported from the host-memory tier (part of
    /// `warm_tokens`).
    pub restored_tokens: u64,
    /// Sequences exported to the host-memory tier, and imported back.
    pub spills: u64,
    pub restores: u64,
    /// Bytes the host-memory tier holds, and its entries (filled in by
    /// `stats`).
    pub spilled_bytes: u64,
    pub spilled_entries: u64,
    /// Park artifacts the index knows (`--park`).
    pub parked_artifacts: u64,
    /// Park artifacts sealed (`--park`).
    pub parks: u64,
    /// Idle sequences moved to the host-memory tier (`--idle-spill-ms`).
    pub idle_spills: u64,
    /// Generations the worker refused on their own in a batched step (a
    /// grammar that does not parse or dead-ends): each failed alone.
    pub refused: u64,
    /// Tokens decoded ahead of a session's next turn while the lane was
    /// idle (its end of turn and the turn opening), and those of them the
    /// next turn's prompt did not start with (dropped).
    pub turn_warmed_tokens: u64,
    pub turn_warm_missed_tokens: u64,
}

/// The scheduler of one lane.
#[derive(Debug)]
pub struct SchedulerState {
    n_ctx: u32,
    n_batch: u32,
    seqs: Vec<Seq>,
    gens: BTreeMap<GenId, Gen>,
    next_gen: GenId,
    /// Steps planned so far (by `plan` and `follow`): the clock of LRU
    /// eviction, the background divisor and the batch-invariant turns.
    steps_planned: u64,
    background_divisor: u32,
    /// The time the last step's decode calls took (`note_decode`): what a
    /// grammar's cost is weighed against.
    last_decode_us: u64,
    /// Alternates batch-invariant generations with the shared batch.
    invariant_turn: bool,
    /// Batch-invariant steps planned: which invariant generation runs next
    /// (not `steps_planned`, whose parity on the invariant turns is fixed
    /// while a shared batch runs beside them).
    invariant_picks: u64,
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
    /// The vocabulary size, when known: `logit_bias` ids are checked
    /// against it at admission.
    n_vocab: Option<u32>,
    /// The host-memory tier's index (`--cache-ram-mb`; off by default).
    spill: SpillIndex,
    /// Keys the index forgot when the lane failed, for the worker to drop
    /// (a worker that died has none of them; one that failed a request
    /// still does).
    spill_orphans: Vec<u64>,
    /// `--park`: seal a session's sequence to disk when its generation ends.
    park: bool,
    /// `--idle-spill-ms`: an idle, unprotected sequence leaves the cells for
    /// the host-memory tier this long after its generation ended (0: never;
    /// only for room).
    idle_spill_ms: u64,
    /// What a session's next turn opens with after one that ended (a user
    /// message's head in the chat template): decoded ahead while the lane
    /// is idle. Empty: only the end of turn is.
    turn_opening: Vec<Token>,
    /// `--turn-warm-ms`: how long an ended turn waits for its next one
    /// before its opening is decoded ahead.
    turn_warm_ms: u64,
}

/// The most tokens decoded ahead of a session's next turn.
pub const MAX_TURN_OPENING: usize = 16;

/// `--turn-warm-ms` default: how long a session's ended turn waits before
/// its end and the turn opening are decoded ahead. A client that goes on at
/// once (an agent's tool result, a script's next message) gets them
/// computed in its own step instead of waiting behind a small one.
pub const TURN_WARM_DELAY_MS: u64 = 100;

impl SchedulerState {
    pub fn new(n_ctx: u32, n_seq: u32, n_batch: u32) -> SchedulerState {
        SchedulerState {
            n_ctx,
            n_batch: n_batch.max(1),
            seqs: vec![Seq::default(); n_seq as usize],
            gens: BTreeMap::new(),
            next_gen: 1,
            steps_planned: 0,
            background_divisor: 1,
            last_decode_us: 0,
            invariant_turn: false,
            invariant_picks: 0,
            dirty: false,
            pending_ops: Vec::new(),
            kv_tight: false,
            stats: Stats::default(),
            pins: BTreeMap::new(),
            pin_budget_pct: DEFAULT_PIN_BUDGET_PCT,
            clock_ms: 0,
            n_vocab: None,
            spill: SpillIndex::new(0),
            spill_orphans: Vec::new(),
            park: false,
            idle_spill_ms: 0,
            turn_opening: Vec::new(),
            turn_warm_ms: TURN_WARM_DELAY_MS,
        }
    }

    /// The tokens a session's next turn opens with after one that ended
    /// (at most [`MAX_TURN_OPENING`] of them are kept): while the lane is
    /// idle, a session whose turn ended gets its end-of-turn token and these
    /// decoded onto its sequence, so its next turn computes that much less
    /// when it comes. A next turn that opens otherwise drops what it does
    /// not share, as any prompt does.
    pub fn with_turn_opening(mut self, mut tokens: Vec<Token>) -> SchedulerState {
        tokens.truncate(MAX_TURN_OPENING);
        self.turn_opening = tokens;
        self
    }

    /// `--turn-warm-ms`: how long an ended turn waits for its next one
    /// before its end and the turn opening are decoded ahead.
    pub fn with_turn_warm_ms(mut self, ms: u64) -> SchedulerState {
        self.turn_warm_ms = ms;
        self
    }

    /// `--idle-spill-ms` (0: idle sequences stay until their cells are
    /// needed). Needs the host-memory tier (`with_spill`).
    pub fn with_idle_spill_ms(mut self, ms: u64) -> SchedulerState {
        self.idle_spill_ms = ms;
        self
    }

    /// [`with_park`](Self::with_park) when `parked` is Some.
    pub fn with_park_if(self, parked: Option<Vec<(SessionId, Vec<Token>)>>) -> SchedulerState {
        match parked {
            Some(p) => self.with_park(p),
            None => self,
        }
    }

    /// `--park`: when a generation of a session (not a stateless one) ends,
    /// the worker seals its sequence to the session's park artifact, and the
    /// index learns it (`parked` adds the artifacts found at start).
    pub fn with_park(mut self, parked: Vec<(SessionId, Vec<Token>)>) -> SchedulerState {
        self.park = true;
        for (session, tokens) in parked {
            self.spill.add_parked(session, &tokens);
        }
        self
    }

    /// The host-memory tier: sequences evicted from the KV cells are kept
    /// in the worker's host memory under this index (`--cache-ram-mb`).
    pub fn with_spill(mut self, index: SpillIndex) -> SchedulerState {
        self.spill = index;
        self
    }

    /// The model's vocabulary size: admission refuses `logit_bias` ids
    /// outside it (without it, only the worker checks them, and a bad id
    /// fails the step it is in).
    pub fn with_n_vocab(mut self, n_vocab: u32) -> SchedulerState {
        self.n_vocab = Some(n_vocab);
        self
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
        for s in &mut self.seqs {
            if s.pin.is_some_and(|(deadline, _, _)| deadline <= now) {
                s.pin = None;
            }
        }
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

    pub fn n_ctx(&self) -> u32 {
        self.n_ctx
    }

    /// Purged sessions: their park artifacts leave the index (the session
    /// actor deletes the files).
    pub fn forget_parked(&mut self, sessions: &[SessionId]) {
        for &s in sessions {
            self.spill.add_parked(s, &[]);
        }
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
    pub fn admit(&mut self, admit: Admit) -> Result<GenId, SchedulerError> {
        if admit.prompt.is_empty() {
            return Err(SchedulerError::EmptyInput);
        }
        if admit.prompt.len() as u64 + 1 > self.n_ctx as u64 {
            return Err(SchedulerError::DoesNotFit {
                tokens: admit.prompt.len(),
                n_ctx: self.n_ctx,
            });
        }
        if let Some(x) = &admit.extras {
            x.check(self.n_vocab.unwrap_or(u32::MAX))?;
        }
        check_media(&admit.prompt, &admit.media)?;
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
                rest: 0,
                preempted: false,
                preempted_at: 0,
            },
        );
        Ok(gen)
    }

    /// The generation is admitted and not finished.
    pub fn is_running(&self, gen: GenId) -> bool {
        self.gens.contains_key(&gen)
    }

    /// Asks a generation to stop; it finishes with `cancelled` at the end of
    /// the step in flight (or at once if it has not started).
    pub fn cancel(&mut self, gen: GenId) -> Vec<GenEvent> {
        let Some(g) = self.gens.get_mut(&gen) else {
            return vec![];
        };
        g.cancelled = true;
        // A resting generation is not in the next step: wake it, so it
        // finishes with the step after the one in flight like the others.
        g.rest = 0;
        if g.seq.is_none() {
            self.gens.remove(&gen);
            return vec![GenEvent::Finished {
                gen,
                finish: Finish::Cancelled,
            }];
        }
        vec![]
    }

    pub fn stats(&self) -> Stats {
        Stats {
            kv_cells_used: self.seqs.iter().map(|s| s.resident.len() as u64).sum(),
            spilled_bytes: self.spill.bytes(),
            spilled_entries: self.spill.len() as u64,
            parked_artifacts: self.spill.parked() as u64,
            ..self.stats
        }
    }

    /// What a sequence holds (for tests and metrics).
    pub fn resident(&self, seq: u32) -> &[Token] {
        &self.seqs[seq as usize].resident
    }
}
