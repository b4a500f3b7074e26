//! The model and its one llama.cpp context, executing [`WorkerRequest`]s in process.
//!
//! [`RawEngine`] is everything `superfluid worker` does except the frames: the worker is a loop of
//! `read frame -> RawEngine::handle -> write frame` around it (see [`super::worker`]), and the
//! benchmarks call it directly to measure what the pipe costs.
//!
//! # What keeps llama.cpp from aborting the process
//!
//! Every request is validated in Rust before llama.cpp sees any of it: sequence ids (`< n_seq`),
//! token ids (`< n_vocab`), positions (each item must start exactly where its sequence's KV ends,
//! as tracked here), sizes (a batch never exceeds the context's `n_batch`/`n_ubatch`; a request
//! never carries more than `n_ctx` tokens, nor takes a sequence past `n_ctx` positions), and a
//! grammar is parsed before anything is decoded. Bad input is an `Err` reply; nothing is touched.
//!
//! # Decode semantics
//!
//! Items are laid out in order, token by token, and cut into llama.cpp batches of at most
//! `n_batch` tokens across items (an item longer than the room left is split over consecutive
//! decode calls). Logits are requested only for the last token of an item that has a `sample`;
//! the token is drawn (with [`sample::draw`]) right after the decode call that contains it.
//!
//! A Decode is all or nothing: if llama.cpp fails (KV cache full, ...) or a grammar dead-ends after
//! some batches went in, every sequence the request touched is trimmed back to its length before
//! the request, its grammar state is dropped, and the reply is `Err`. The tracked lengths are then
//! re-read from the KV cache (`kv_cache_seq_pos_max`).
//!
//! # DecodeNext
//!
//! The engine remembers, per sequence, the token it last drew while the sequence's KV has not
//! changed since (a trim, copy, clear or another decode of it forgets it; any failed request
//! forgets them all). `DecodeNext` runs up to `steps` decode calls, each feeding every sequence
//! the token it drew in the call before (in the first, that remembered token) and drawing the
//! next; a sequence stops at a draw that ends the turn (EOG). The daemon queues it while the
//! request before is still running, so the worker never waits on the daemon between steps and
//! writes one reply per `steps` tokens. It is all or nothing like `Decode`: a failure in any
//! call trims every sequence it named back to its length before the request.
//!
//! # Grammars
//!
//! A sequence keeps one grammar sampler (`LlamaSampler::grammar(model, gbnf, "root")`) while the
//! same GBNF text and prefix (`Sample::grammar_prefix`, the tokens it has governed so far) are
//! asked for; each drawn token is accepted into it (end-of-generation tokens are not: llama.cpp
//! aborts on accepting EOG where the grammar is not complete, and there is nothing left to
//! accept). Otherwise it is rebuilt and fed the prefix, so its state is always a function of
//! (grammar, prefix): a forced call cut and continued on another sequence or after a worker
//! restart goes on where it stopped. A prefix the grammar rejects (the turn was not written under
//! it: the tool choice changed while the turn was open) makes the grammar start at the draw, and
//! the state then counts that prefix as governed, so the next draws keep it. The state is
//! dropped when the sequence is trimmed, cleared, copied into, or asked to sample without a
//! grammar. `DecodeNext` takes no grammar.

use std::path::Path;
use std::time::Instant;

use anyhow::Context as _;
use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::sampling::LlamaSampler;
use llama_cpp_2::token::data::LlamaTokenData;
use llama_cpp_2::token::data_array::LlamaTokenDataArray;
use llama_cpp_2::token::LlamaToken;
use llama_cpp_2::DecodeError;

use super::{backend, sample, EngineError};
use crate::wire::worker::{
    DecodeItem, Drawn, NextItem, Sample, WorkerConfig, WorkerRequest, WorkerResponse,
    MAX_NEXT_STEPS,
};

/// llama.cpp's `LLAMA_MAX_SEQ`: more sequences make context creation fail.
pub const MAX_SEQ: u32 = 256;

/// A grammar a draw asks for: its GBNF text and the tokens it already governed.
type GrammarAsk<'a> = (&'a str, &'a [u32]);

/// The grammar state of one sequence.
struct SeqGrammar {
    gbnf: String,
    sampler: LlamaSampler,
    /// The tokens accepted since it was built.
    accepted: Vec<u32>,
}

/// A loaded model with one context (unified KV, `n_seq` sequences), executing worker requests.
///
/// Not `Sync`: llama.cpp's context belongs to one thread at a time. `Send`.
pub struct RawEngine {
    // Field order is drop order: everything that points into the model (grammar samplers hold
    // its vocabulary, the context its weights) is declared before `model`.
    grammars: Vec<Option<SeqGrammar>>,
    batch: LlamaBatch<'static>,
    /// Borrows `*model`; the `'static` is a lie kept inside this struct (see [`RawEngine::new`]).
    ctx: LlamaContext<'static>,
    model: Box<LlamaModel>,
    /// The configuration as llama.cpp applied it (`n_ctx` padded, `n_batch` capped).
    config: WorkerConfig,
    n_vocab: u32,
    /// Per sequence, the number of positions its KV holds (`0..len`).
    lens: Vec<u32>,
    /// The logits row being sampled (a copy, so the context is free again).
    row: Vec<f32>,
    /// The grammar's verdict on each token id, for the row being sampled.
    mask: Vec<bool>,
    /// Per sequence, the token last drawn for it, while its KV has not changed since: what a
    /// `DecodeNext` feeds. Every failed request clears them all.
    last: Vec<Option<Drawn>>,
}

impl std::fmt::Debug for RawEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawEngine")
            .field("config", &self.config)
            .field("n_vocab", &self.n_vocab)
            .field("lens", &self.lens)
            .finish_non_exhaustive()
    }
}

impl RawEngine {
    /// Load the model at `path` (all layers on the CPU) and create its context: `n_ctx` cells of
    /// unified KV shared by `n_seq` sequences, batches of `n_batch` tokens (`n_ubatch` the same),
    /// `threads` threads for decode and prefill.
    pub fn new(path: &Path, config: &WorkerConfig) -> anyhow::Result<RawEngine> {
        let WorkerConfig {
            n_ctx,
            n_seq,
            n_batch,
            threads,
        } = *config;
        anyhow::ensure!(
            (1..=i32::MAX as u32 / 2).contains(&n_ctx),
            "invalid context size {n_ctx}"
        );
        anyhow::ensure!(
            (1..=MAX_SEQ).contains(&n_seq),
            "invalid number of sequences {n_seq} (1..={MAX_SEQ})"
        );
        anyhow::ensure!(n_batch >= 1, "invalid batch size {n_batch}");
        anyhow::ensure!(
            (1..=1024).contains(&threads),
            "invalid thread count {threads}"
        );
        check_gguf(path)?;
        let backend = backend::backend()?;
        let params = LlamaModelParams::default().with_n_gpu_layers(0);
        let model = LlamaModel::load_from_file(backend, path, &params).map_err(|e| {
            EngineError::ModelLoad {
                path: path.to_path_buf(),
                reason: e.to_string(),
            }
        })?;
        let model = Box::new(model);
        let n_vocab = u32::try_from(model.vocab().n_tokens()).unwrap_or(0);
        anyhow::ensure!(n_vocab > 0, "the model has an empty vocabulary");

        let cparams = LlamaContextParams::default()
            .with_n_ctx(std::num::NonZeroU32::new(n_ctx))
            .with_n_seq_max(n_seq)
            .with_n_batch(n_batch)
            .with_n_ubatch(n_batch)
            .with_n_threads(threads as i32)
            .with_n_threads_batch(threads as i32)
            .with_kv_unified(true);
        // SAFETY: the model lives in a Box owned by the engine, so its address is stable, and it
        // is dropped after the context (field order). The context never leaves the engine.
        let model_ref: &'static LlamaModel =
            unsafe { &*std::ptr::from_ref::<LlamaModel>(model.as_ref()) };
        let ctx = model_ref.new_context(backend, cparams).with_context(|| {
            format!("cannot create a context (n_ctx {n_ctx}, n_seq {n_seq}, n_batch {n_batch})")
        })?;
        let step = ctx.n_batch().min(ctx.n_ubatch()).max(1);
        let effective = WorkerConfig {
            n_ctx: ctx.n_ctx(),
            n_seq,
            n_batch: step,
            threads,
        };
        log::info!(
            "engine ready: {} ({} tokens), n_ctx {} n_seq {} n_batch {} threads {}",
            path.display(),
            n_vocab,
            effective.n_ctx,
            n_seq,
            step,
            threads
        );
        Ok(RawEngine {
            grammars: (0..n_seq).map(|_| None).collect(),
            batch: LlamaBatch::new(step as usize, 1),
            ctx,
            model,
            config: effective,
            n_vocab,
            lens: vec![0; n_seq as usize],
            row: Vec::with_capacity(n_vocab as usize),
            mask: Vec::new(),
            last: vec![None; n_seq as usize],
        })
    }

    /// The configuration as applied: `n_ctx` as llama.cpp padded it (a multiple of 256) and
    /// `n_batch` as capped (never above `n_ctx`). This is what `Ready` reports.
    pub fn config(&self) -> &WorkerConfig {
        &self.config
    }

    /// The vocabulary size: valid token ids are `0..n_vocab`.
    pub fn n_vocab(&self) -> u32 {
        self.n_vocab
    }

    /// The `Ready` message for this engine.
    pub fn ready(&self) -> WorkerResponse {
        WorkerResponse::Ready {
            config: self.config.clone(),
            n_vocab: self.n_vocab,
        }
    }

    /// The positions sequence `seq` holds (`0..len`), or None for a sequence out of range.
    pub fn seq_len(&self, seq: u32) -> Option<u32> {
        self.lens.get(seq as usize).copied()
    }

    /// Whether `token` ends generation. False for an invalid id.
    pub fn is_eog(&self, token: u32) -> bool {
        token < self.n_vocab && self.model.vocab().is_eog(LlamaToken(token as i32))
    }

    /// Execute one request and return its one reply. `Shutdown` answers `Done` (the caller
    /// stops). Never panics on bad input: it answers `Err`.
    pub fn handle(&mut self, request: &WorkerRequest) -> WorkerResponse {
        let result = match request {
            WorkerRequest::Decode { items } => self.decode(items),
            WorkerRequest::KvTrim { seq, from } => self.kv_trim(*seq, *from),
            WorkerRequest::KvCopy { src, dst, len } => self.kv_copy(*src, *dst, *len),
            WorkerRequest::KvClear { seq } => self.kv_clear(*seq),
            WorkerRequest::Shutdown => Ok(WorkerResponse::Done),
            WorkerRequest::DecodeNext { items } => self.decode_next(items),
        };
        result.unwrap_or_else(|message| {
            log::debug!("request failed: {message}");
            // A DecodeNext queued behind a failed request must not run on a stale draw.
            self.last.iter_mut().for_each(|l| *l = None);
            WorkerResponse::Err { message }
        })
    }

    /// `DecodeNext`: steps of the items' sequences, each fed the draw before.
    fn decode_next(&mut self, next: &[NextItem]) -> Result<WorkerResponse, String> {
        let mut seen = vec![false; self.lens.len()];
        for (k, n) in next.iter().enumerate() {
            let s = self
                .check_seq(n.seq)
                .map_err(|e| format!("item {k}: {e}"))?;
            if std::mem::replace(&mut seen[s], true) {
                return Err(format!("item {k}: sequence {} appears twice", n.seq));
            }
            if n.sample.grammar.is_some() {
                return Err(format!("item {k}: DecodeNext takes no grammar"));
            }
            if !(1..=MAX_NEXT_STEPS).contains(&n.steps) {
                return Err(format!(
                    "item {k}: {} steps asked, the range is 1..={MAX_NEXT_STEPS}",
                    n.steps
                ));
            }
            match self.last[s] {
                None => {
                    return Err(format!(
                        "item {k}: sequence {} has no drawn token to continue from",
                        n.seq
                    ))
                }
                Some(d) if !d.eog && n.pos != self.lens[s] => {
                    return Err(format!(
                        "item {k}: sequence {} holds positions 0..{}, not 0..{}",
                        n.seq, self.lens[s], n.pos
                    ))
                }
                Some(_) => {}
            }
        }
        let before = self.lens.clone();
        let (mut drawn, mut tokens, mut decode_us) = (Vec::new(), 0u32, 0u64);
        for j in 0..next.iter().map(|n| n.steps).max().unwrap_or(0) {
            let items: Vec<DecodeItem> = next
                .iter()
                .filter(|n| j < n.steps)
                .filter_map(|n| {
                    let d = self.last[n.seq as usize].filter(|d| !d.eog)?;
                    Some(DecodeItem {
                        seq: n.seq,
                        pos: self.lens[n.seq as usize],
                        tokens: vec![d.token],
                        sample: Some(Sample {
                            draw_pos: n.sample.draw_pos + u64::from(j),
                            ..n.sample.clone()
                        }),
                    })
                })
                .collect();
            if items.is_empty() {
                break;
            }
            match self.decode(&items) {
                Ok(WorkerResponse::Decoded {
                    drawn: d,
                    tokens: t,
                    decode_us: us,
                }) => {
                    drawn.extend(d);
                    tokens += t;
                    decode_us += us;
                }
                Ok(other) => return Err(format!("internal error: decode replied {other:?}")),
                Err(message) => {
                    // All or nothing: the steps before this one go too.
                    for n in next {
                        let s = n.seq as usize;
                        let _ = self
                            .ctx
                            .kv_cache_seq_rm(n.seq as i32, Some(before[s]), None);
                        self.grammars[s] = None;
                    }
                    self.resync_all();
                    return Err(message);
                }
            }
        }
        Ok(WorkerResponse::Decoded {
            drawn,
            tokens,
            decode_us,
        })
    }

    fn check_seq(&self, seq: u32) -> Result<usize, String> {
        if seq < self.config.n_seq {
            Ok(seq as usize)
        } else {
            Err(format!(
                "sequence {seq} out of range: the worker has {} sequences",
                self.config.n_seq
            ))
        }
    }

    /// Re-read the length of `seq` from the KV cache.
    fn resync(&mut self, seq: usize) {
        let max = self.ctx.kv_cache_seq_pos_max(seq as i32);
        self.lens[seq] = u32::try_from(max.saturating_add(1)).unwrap_or(0);
    }

    fn resync_all(&mut self) {
        for seq in 0..self.lens.len() {
            self.resync(seq);
        }
    }

    fn kv_trim(&mut self, seq: u32, from: u32) -> Result<WorkerResponse, String> {
        let s = self.check_seq(seq)?;
        if from < self.lens[s] {
            let res = self.ctx.kv_cache_seq_rm(seq as i32, Some(from), None);
            self.grammars[s] = None;
            self.last[s] = None;
            self.resync(s);
            res.map_err(|e| format!("cannot trim sequence {seq} from {from}: {e}"))?;
        }
        Ok(WorkerResponse::Done)
    }

    fn kv_copy(&mut self, src: u32, dst: u32, len: u32) -> Result<WorkerResponse, String> {
        let s = self.check_seq(src)?;
        let d = self.check_seq(dst)?;
        if len > self.lens[s] {
            return Err(format!(
                "cannot copy {len} positions of sequence {src}: it holds {}",
                self.lens[s]
            ));
        }
        if s == d {
            return self.kv_trim(src, len);
        }
        let rm = self.ctx.kv_cache_seq_rm(dst as i32, None, None);
        self.grammars[d] = None;
        self.last[d] = None;
        let cp = if len > 0 && rm.is_ok() {
            self.ctx
                .kv_cache_seq_cp(src as i32, dst as i32, Some(0), Some(len))
        } else {
            Ok(())
        };
        self.resync(d);
        rm.map_err(|e| format!("cannot clear sequence {dst}: {e}"))?;
        cp.map_err(|e| format!("cannot copy sequence {src} to {dst}: {e}"))?;
        Ok(WorkerResponse::Done)
    }

    fn kv_clear(&mut self, seq: u32) -> Result<WorkerResponse, String> {
        let s = self.check_seq(seq)?;
        let res = self.ctx.kv_cache_seq_rm(seq as i32, None, None);
        self.grammars[s] = None;
        self.last[s] = None;
        self.resync(s);
        res.map_err(|e| format!("cannot clear sequence {seq}: {e}"))?;
        Ok(WorkerResponse::Done)
    }

    /// Check a Decode completely, without touching llama.cpp.
    fn validate(&self, items: &[DecodeItem]) -> Result<(), String> {
        let n_ctx = u64::from(self.config.n_ctx);
        let mut ends: Vec<u64> = self.lens.iter().map(|&l| u64::from(l)).collect();
        let mut total = 0u64;
        for (k, item) in items.iter().enumerate() {
            let s = self
                .check_seq(item.seq)
                .map_err(|e| format!("item {k}: {e}"))?;
            if item.tokens.is_empty() {
                return Err(format!("item {k}: no tokens"));
            }
            if let Some(&bad) = item.tokens.iter().find(|&&t| t >= self.n_vocab) {
                return Err(format!(
                    "item {k}: invalid token id {bad}: the vocabulary has {} tokens",
                    self.n_vocab
                ));
            }
            if u64::from(item.pos) != ends[s] {
                return Err(format!(
                    "item {k}: sequence {} holds positions 0..{}, so the next token is at {}, not {}",
                    item.seq, ends[s], ends[s], item.pos
                ));
            }
            let n = item.tokens.len() as u64;
            ends[s] += n;
            total += n;
            if ends[s] > n_ctx {
                return Err(format!(
                    "item {k}: sequence {} would reach {} positions, more than n_ctx={} cells",
                    item.seq, ends[s], n_ctx
                ));
            }
        }
        if total > n_ctx {
            return Err(format!(
                "the request carries {total} tokens, more than n_ctx={n_ctx} cells"
            ));
        }
        Ok(())
    }

    /// Build (or keep) the grammar state every sampling item asks for; a grammar that does not
    /// parse fails the request before anything is decoded.
    fn prepare_grammars(&mut self, items: &[DecodeItem]) -> Result<(), String> {
        // Per sequence: the grammar (GBNF, prefix) its draw asks for, if any.
        let mut wanted: Vec<(usize, Option<GrammarAsk>)> = Vec::new();
        for item in items {
            if let Some(sample) = &item.sample {
                let s = item.seq as usize;
                wanted.retain(|w| w.0 != s);
                let grammar = sample
                    .grammar
                    .as_deref()
                    .map(|g| (g, sample.grammar_prefix.as_slice()));
                wanted.push((s, grammar));
            }
        }
        let mut built: Vec<(usize, Option<SeqGrammar>)> = Vec::new();
        for (s, grammar) in wanted {
            match grammar {
                None => built.push((s, None)),
                Some((g, prefix)) => {
                    if self.grammars[s]
                        .as_ref()
                        .is_some_and(|cur| cur.gbnf == g && cur.accepted == prefix)
                    {
                        continue;
                    }
                    let build = || {
                        LlamaSampler::grammar(&self.model, g, "root")
                            .map_err(|e| format!("grammar for sequence {s} does not parse: {e}"))
                    };
                    let mut sampler = build()?;
                    if let Some(&bad) = prefix.iter().find(|&&t| t >= self.n_vocab) {
                        return Err(format!("grammar prefix: invalid token id {bad}"));
                    }
                    let rejected = prefix.iter().copied().find(|&t| {
                        !self.is_eog(t) && sampler.try_accept(LlamaToken(t as i32)).is_err()
                    });
                    if let Some(t) = rejected {
                        // The turn so far was not written under this grammar (the tool
                        // choice changed while the turn was open): it governs from here on.
                        log::info!(
                            "sequence {s}: the turn so far does not fit its grammar (token {t}); \
                             the grammar starts at this draw"
                        );
                        sampler = build()?;
                    }
                    let accepted = prefix.to_vec();
                    built.push((
                        s,
                        Some(SeqGrammar {
                            gbnf: g.to_owned(),
                            sampler,
                            accepted,
                        }),
                    ));
                }
            }
        }
        for (s, g) in built {
            self.grammars[s] = g;
        }
        Ok(())
    }

    fn decode(&mut self, items: &[DecodeItem]) -> Result<WorkerResponse, String> {
        self.validate(items)?;
        self.prepare_grammars(items)?;
        let before = self.lens.clone();
        match self.decode_items(items) {
            Ok(reply) => {
                for item in items {
                    let s = item.seq as usize;
                    self.lens[s] = item.pos + item.tokens.len() as u32;
                    self.last[s] = None;
                }
                if let WorkerResponse::Decoded { drawn, .. } = &reply {
                    for d in drawn {
                        self.last[d.seq as usize] = Some(*d);
                    }
                }
                Ok(reply)
            }
            Err(message) => {
                // All or nothing: put every touched sequence back where it was.
                for item in items {
                    let s = item.seq as usize;
                    let _ = self.ctx.kv_cache_seq_rm(s as i32, Some(before[s]), None);
                    self.grammars[s] = None;
                }
                self.resync_all();
                Err(message)
            }
        }
    }

    fn decode_items(&mut self, items: &[DecodeItem]) -> Result<WorkerResponse, String> {
        let step = self.config.n_batch as usize;
        let mut drawn = Vec::new();
        let mut tokens = 0u32;
        let mut decode_us = 0u64;
        // (item index, batch index) of the logits the current batch will produce.
        let mut pending: Vec<(usize, i32)> = Vec::new();
        self.batch.clear();
        for (k, item) in items.iter().enumerate() {
            let last = item.tokens.len() - 1;
            for (j, &token) in item.tokens.iter().enumerate() {
                let logits = j == last && item.sample.is_some();
                let pos = (item.pos as usize + j) as i32;
                self.batch
                    .add(LlamaToken(token as i32), pos, &[item.seq as i32], logits)
                    .map_err(|e| format!("batch: {e}"))?;
                if logits {
                    pending.push((k, self.batch.n_tokens() - 1));
                }
                if self.batch.n_tokens() as usize == step {
                    self.run_batch(items, &mut pending, &mut drawn, &mut tokens, &mut decode_us)?;
                }
            }
        }
        if self.batch.n_tokens() > 0 {
            self.run_batch(items, &mut pending, &mut drawn, &mut tokens, &mut decode_us)?;
        }
        Ok(WorkerResponse::Decoded {
            drawn,
            tokens,
            decode_us,
        })
    }

    /// Decode the batch built so far, draw the tokens it was built for, and clear it.
    fn run_batch(
        &mut self,
        items: &[DecodeItem],
        pending: &mut Vec<(usize, i32)>,
        drawn: &mut Vec<Drawn>,
        tokens: &mut u32,
        decode_us: &mut u64,
    ) -> Result<(), String> {
        let n = self.batch.n_tokens();
        let start = Instant::now();
        let res = self.ctx.decode(&mut self.batch);
        *decode_us += start.elapsed().as_micros() as u64;
        self.batch.clear();
        res.map_err(|e| match e {
            DecodeError::NoKvCacheSlot => format!(
                "{}: n_ctx={} cells cannot hold {n} more tokens",
                crate::wire::worker::KV_FULL,
                self.config.n_ctx
            ),
            DecodeError::NTokensZero => {
                format!("llama.cpp rejected the batch of {n} tokens as invalid")
            }
            other => format!("llama_decode failed: {other}"),
        })?;
        *tokens += n as u32;
        for (k, i) in pending.drain(..) {
            drawn.push(self.draw(&items[k], i)?);
        }
        Ok(())
    }

    /// Draw the token for `item` from the logits at batch index `i`.
    fn draw(&mut self, item: &DecodeItem, i: i32) -> Result<Drawn, String> {
        let Some(sample) = &item.sample else {
            return Err("internal error: no sample asked".into());
        };
        self.row.clear();
        self.row.extend_from_slice(self.ctx.get_logits_ith(i));
        let s = item.seq as usize;
        let token = match self.grammars[s].as_mut() {
            Some(g) if sample.grammar.is_some() => {
                let mut arr = LlamaTokenDataArray::new(
                    self.row
                        .iter()
                        .enumerate()
                        .map(|(id, &l)| LlamaTokenData::new(LlamaToken(id as i32), l, 0.0))
                        .collect(),
                    false,
                );
                g.sampler.apply(&mut arr);
                self.mask.clear();
                self.mask.resize(self.row.len(), false);
                let mut any = false;
                for d in &arr.data {
                    if let Ok(id) = usize::try_from(d.id().0) {
                        if id < self.mask.len() && d.logit() > f32::NEG_INFINITY {
                            self.mask[id] = true;
                            any = true;
                        }
                    }
                }
                if !any {
                    return Err(format!(
                        "the grammar of sequence {} allows no token at position {}",
                        item.seq, sample.draw_pos
                    ));
                }
                let mask = &self.mask;
                let allowed = |t: u32| mask.get(t as usize).copied().unwrap_or(false);
                let token =
                    sample::draw(&self.row, &sample.params, sample.draw_pos, Some(&allowed));
                if !self.model.vocab().is_eog(LlamaToken(token as i32)) {
                    g.sampler
                        .try_accept(LlamaToken(token as i32))
                        .map_err(|e| format!("grammar rejected token {token}: {e}"))?;
                }
                g.accepted.push(token);
                token
            }
            _ => sample::draw(&self.row, &sample.params, sample.draw_pos, None),
        };
        Ok(Drawn {
            seq: item.seq,
            token,
            eog: self.is_eog(token),
        })
    }
}

/// Check that `path` exists and starts with the GGUF magic bytes, before llama.cpp sees it.
///
/// The same check as the vocabulary load's (`vocab::check_gguf`, private there).
fn check_gguf(path: &Path) -> Result<(), EngineError> {
    use std::io::Read;
    let unreadable = |source| EngineError::ModelUnreadable {
        path: path.to_path_buf(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            EngineError::ModelNotFound(path.to_path_buf())
        } else {
            unreadable(e)
        }
    })?;
    if !meta.is_file() {
        return Err(unreadable(std::io::Error::other("not a regular file")));
    }
    let mut magic = [0u8; 4];
    let mut file = std::fs::File::open(path).map_err(unreadable)?;
    match file.read_exact(&mut magic) {
        Ok(()) if &magic == b"GGUF" => Ok(()),
        Ok(()) => Err(EngineError::NotGguf(path.to_path_buf())),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            Err(EngineError::NotGguf(path.to_path_buf()))
        }
        Err(e) => Err(unreadable(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::worker::Sample;
    use crate::wire::Params;

    fn model() -> std::path::PathBuf {
        crate::engine::vocab::tests::model()
    }

    fn greedy(draw_pos: u64) -> Option<Sample> {
        Some(Sample {
            params: Params {
                temperature: 0.0,
                top_p: 1.0,
                min_p: 0.0,
                top_k: 0,
                seed: 0,
            },
            draw_pos,
            grammar: None,
            grammar_prefix: vec![],
        })
    }

    #[test]
    fn not_a_model_is_an_error() {
        let config = WorkerConfig {
            n_ctx: 256,
            n_seq: 1,
            n_batch: 32,
            threads: 1,
        };
        let err = RawEngine::new(Path::new("/nonexistent.gguf"), &config).unwrap_err();
        assert!(err.to_string().contains("not found"), "{err}");
        let bad = WorkerConfig {
            n_seq: MAX_SEQ + 1,
            ..config
        };
        assert!(RawEngine::new(&model(), &bad).is_err());
    }

    /// DecodeNext feeds the last draw: it draws what a Decode of that token draws; it skips a
    /// sequence that drew EOG, and refuses one with no draw to continue from.
    #[test]
    fn decode_next_continues_from_the_last_draw() {
        let config = WorkerConfig {
            n_ctx: 512,
            n_seq: 2,
            n_batch: 64,
            threads: 2,
        };
        let mut e = RawEngine::new(&model(), &config).expect("engine");
        let prompt: Vec<u32> = (0..20).map(|i| 200 + i * 13).collect();
        let first = |e: &mut RawEngine, seq| match e.handle(&WorkerRequest::Decode {
            items: vec![DecodeItem {
                seq,
                pos: 0,
                tokens: prompt.clone(),
                sample: greedy(20),
            }],
        }) {
            WorkerResponse::Decoded { drawn, .. } => drawn[0],
            other => panic!("{other:?}"),
        };
        let a = first(&mut e, 0);
        let b = first(&mut e, 1);
        assert_eq!(a.token, b.token);
        // Seq 0 by hand, three steps; seq 1 by one DecodeNext of three steps.
        let mut by_hand = vec![];
        let mut input = a.token;
        for k in 0..3u32 {
            let r = e.handle(&WorkerRequest::Decode {
                items: vec![DecodeItem {
                    seq: 0,
                    pos: 20 + k,
                    tokens: vec![input],
                    sample: greedy(21 + u64::from(k)),
                }],
            });
            let WorkerResponse::Decoded { drawn, .. } = r else {
                panic!("{r:?}")
            };
            input = drawn[0].token;
            by_hand.push(input);
        }
        let r = e.handle(&WorkerRequest::DecodeNext {
            items: vec![NextItem {
                seq: 1,
                pos: 20,
                steps: 3,
                sample: greedy(21).unwrap(),
            }],
        });
        let WorkerResponse::Decoded {
            drawn, tokens: 3, ..
        } = r
        else {
            panic!("{r:?}")
        };
        assert_eq!(drawn.iter().map(|d| d.token).collect::<Vec<_>>(), by_hand);
        assert!(drawn.iter().all(|d| d.seq == 1));
        assert_eq!(e.seq_len(1), Some(23));
        // And it goes on from there, one step at a time too.
        let r = e.handle(&WorkerRequest::DecodeNext {
            items: vec![NextItem {
                seq: 1,
                pos: 23,
                steps: 1,
                sample: greedy(24).unwrap(),
            }],
        });
        assert!(
            matches!(r, WorkerResponse::Decoded { tokens: 1, .. }),
            "{r:?}"
        );
        assert_eq!(e.seq_len(1), Some(24));
        let r = e.handle(&WorkerRequest::DecodeNext {
            items: vec![NextItem {
                seq: 1,
                pos: 24,
                steps: MAX_NEXT_STEPS + 1,
                sample: greedy(25).unwrap(),
            }],
        });
        assert!(matches!(r, WorkerResponse::Err { .. }), "{r:?}");
        // The failed request forgot the last draw: nothing to continue from.
        let next = |pos| WorkerRequest::DecodeNext {
            items: vec![NextItem {
                seq: 1,
                pos,
                steps: 2,
                sample: greedy(u64::from(pos) + 1).unwrap(),
            }],
        };
        match e.handle(&next(24)) {
            WorkerResponse::Err { message } => {
                assert!(message.contains("no drawn token"), "{message}")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(e.seq_len(1), Some(24));
        // A last draw that ended the turn is skipped.
        e.last[1] = Some(Drawn {
            seq: 1,
            token: 2,
            eog: true,
        });
        assert!(matches!(
            e.handle(&next(24)),
            WorkerResponse::Decoded { tokens: 0, ref drawn, .. } if drawn.is_empty()
        ));
        // A wrong position is refused.
        e.last[1] = Some(Drawn {
            seq: 1,
            token: 300,
            eog: false,
        });
        assert!(matches!(e.handle(&next(99)), WorkerResponse::Err { .. }));
        assert_eq!(e.seq_len(1), Some(24));
    }

    /// A grammar's state is a function of (grammar, prefix): built afresh on another sequence
    /// with the tokens it already governed, it draws what the kept state draws; without them it
    /// starts over; a prefix it rejects is an Err.
    #[test]
    fn a_grammar_rebuilt_from_its_prefix_goes_on_where_it_was() {
        let config = WorkerConfig {
            n_ctx: 512,
            n_seq: 3,
            n_batch: 64,
            threads: 2,
        };
        let mut e = RawEngine::new(&model(), &config).expect("engine");
        let gbnf = r#"root ::= "The capital of France is Paris.""#;
        let prompt: Vec<u32> = (0..20).map(|i| 200 + i * 13).collect();
        let with = |draw_pos, prefix: &[u32]| {
            let mut s = greedy(draw_pos).unwrap();
            s.grammar = Some(gbnf.to_string());
            s.grammar_prefix = prefix.to_vec();
            Some(s)
        };
        let draw = |e: &mut RawEngine, seq, pos, tokens: Vec<u32>, sample| match e.handle(
            &WorkerRequest::Decode {
                items: vec![DecodeItem {
                    seq,
                    pos,
                    tokens,
                    sample,
                }],
            },
        ) {
            WorkerResponse::Decoded { drawn, .. } => Ok(drawn[0].token),
            WorkerResponse::Err { message } => Err(message),
            other => panic!("{other:?}"),
        };
        let t1 = draw(&mut e, 0, 0, prompt.clone(), with(20, &[])).unwrap();
        let t2 = draw(&mut e, 0, 20, vec![t1], with(21, &[t1])).unwrap();
        let mut longer = prompt.clone();
        longer.push(t1);
        assert_eq!(
            draw(&mut e, 1, 0, longer.clone(), with(21, &[t1])).unwrap(),
            t2
        );
        assert_ne!(draw(&mut e, 2, 0, longer, with(21, &[])).unwrap(), t2);
        // A prefix the grammar rejects (the turn was not written under it): the grammar
        // starts at the draw, and stays there for the next draw (no restart per step).
        e.handle(&WorkerRequest::KvClear { seq: 2 });
        let off = [t2, t2];
        assert_eq!(
            draw(&mut e, 2, 0, prompt.clone(), with(20, &off)).unwrap(),
            t1
        );
        let kept = [t2, t2, t1];
        assert_eq!(draw(&mut e, 2, 20, vec![t1], with(21, &kept)).unwrap(), t2);
        assert_eq!(e.seq_len(2), Some(21));
    }

    /// KV full in the middle of a multi-batch request: Err, and the request leaves no trace.
    #[test]
    fn kv_full_rolls_the_request_back() {
        let config = WorkerConfig {
            n_ctx: 256,
            n_seq: 2,
            n_batch: 32,
            threads: 2,
        };
        let mut e = RawEngine::new(&model(), &config).expect("engine");
        assert_eq!(e.config().n_ctx, 256);
        assert_eq!(e.config().n_batch, 32);
        let tokens = |n: usize| {
            (0..n)
                .map(|i| 100 + (i as u32 * 7) % 1000)
                .collect::<Vec<_>>()
        };
        let item = |seq, pos, n, sample| DecodeItem {
            seq,
            pos,
            tokens: tokens(n),
            sample,
        };
        let r = e.handle(&WorkerRequest::Decode {
            items: vec![item(0, 0, 200, None)],
        });
        assert!(
            matches!(r, WorkerResponse::Decoded { tokens: 200, .. }),
            "{r:?}"
        );
        // 200 + 100 > 256: the first 32-token batch of seq 1 fits, the second does not.
        let r = e.handle(&WorkerRequest::Decode {
            items: vec![item(1, 0, 100, greedy(100))],
        });
        match r {
            WorkerResponse::Err { message } => {
                assert!(message.contains("KV cache full"), "{message}")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(e.seq_len(0), Some(200));
        assert_eq!(e.seq_len(1), Some(0));
        // All 56 free cells are usable again.
        let r = e.handle(&WorkerRequest::Decode {
            items: vec![item(1, 0, 56, greedy(56))],
        });
        assert!(
            matches!(&r, WorkerResponse::Decoded { drawn, tokens: 56, .. } if drawn.len() == 1),
            "{r:?}"
        );
        assert_eq!(e.seq_len(1), Some(56));
    }
}
