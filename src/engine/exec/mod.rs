//! The model and its one llama.cpp context, executing [`WorkerRequest`]s in process.
//!
//! [`WorkerEngine`] is everything `superfluid worker` does except the frames: the worker is a loop
//! of `read frame -> WorkerEngine::handle -> write frame` around it (see [`super::worker`]), and
//! the decode benchmark runs it in process as its baseline, to measure what the pipe and the
//! daemon cost.
//!
//! - [`seqs`]: the sequence table (lengths, last draws) and the checks of every request;
//! - [`grammar`]: each sequence's grammar state;
//! - [`penalties`]: each sequence's generation's draws, for presence and frequency penalties;
//! - [`error`]: `RequestError`, why a request was refused or failed.
//!
//! # What keeps llama.cpp from aborting the process
//!
//! Every request is validated in Rust before llama.cpp sees any of it ([`seqs::SeqTable`]):
//! sequence ids (`< n_seq`), token ids (`< n_vocab`), positions (each item must start exactly
//! where its sequence's KV ends, as tracked here), sizes (a batch never exceeds the context's
//! `n_batch`/`n_ubatch`; a request never carries more than `n_ctx` tokens, nor takes a sequence
//! past `n_ctx` positions), and a grammar is parsed before anything is decoded. Bad input is an
//! `Err` reply; nothing is touched (a grammar that does not parse refuses its own item only).
//!
//! # Decode semantics
//!
//! Items are laid out in order, token by token, and cut into llama.cpp batches of at most
//! `n_batch` tokens across items (an item longer than the room left is split over consecutive
//! decode calls). Logits are requested only for the last token of an item that has a `sample`;
//! the token is drawn (with [`sample::draw`]) right after the decode call that contains it.
//! A sample with extras first has its row adjusted ([`sample::apply_extras`]: logit bias, and
//! penalties over the draws its generation made so far on the sequence), and reports the drawn
//! token's log-probabilities off that row ([`sample::logprobs`]) when asked.
//!
//! A Decode is all or nothing where llama.cpp fails (KV cache full, ...): every sequence the
//! request touched is trimmed back to its length before the request, its grammar state is
//! dropped, and the reply is `Err` (`KvFull` when the cache had no room). The tracked lengths are
//! then re-read from the KV cache (`kv_cache_seq_pos_max`). What belongs to one item fails that
//! item alone: a grammar that does not parse leaves it out of the decode, and a draw that fails
//! (a grammar that dead-ends or rejects the token) trims its sequence back; either way the reply
//! is `Decoded` with the item among `refused`, and every other item decoded and drew.
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

pub mod error;
mod grammar;
mod penalties;
pub mod seqs;
pub mod spill;
pub mod vision;

use std::path::{Path, PathBuf};
use std::time::Instant;

use llama_cpp_2::context::params::{KvCacheType, LlamaContextParams};
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::mtmd::MtmdInputChunks;
use llama_cpp_2::token::LlamaToken;
use llama_cpp_2::DecodeError;

use super::{backend, check_gguf, sample, EngineError};
use crate::wire::worker::{
    DecodeItem, Drawn, NextItem, Refused, Sample, WorkerConfig, WorkerRequest, WorkerResponse,
};
use error::RequestError;
use grammar::Grammars;
use penalties::Penalties;
use seqs::SeqTable;
use spill::SpillStore;

/// llama.cpp's `LLAMA_MAX_SEQ`: more sequences make context creation fail.
pub const MAX_SEQ: u32 = 256;

/// The most time a grammar may take to constrain one token (its allowed
/// tokens, then the drawn one accepted). A JSON schema's grammar takes
/// milliseconds; one whose alternatives multiply as the output grows (a
/// small schema of nested `$ref`s can double llama.cpp's parse stacks with
/// every `[`) takes twice as long with each token, and every other
/// sequence's step waits for it. Past this the generation is refused with
/// `GrammarTooCostly`, and only it. Measured in the worker thread's CPU time,
/// so a machine busy with other work does not trip it.
pub const GRAMMAR_TOKEN_LIMIT: std::time::Duration = std::time::Duration::from_millis(500);

/// CPU time this thread has used (None where the clock is not there).
fn thread_cpu_time() -> Option<std::time::Duration> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for clock_gettime to write.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    (rc == 0).then(|| {
        std::time::Duration::new(
            u64::try_from(ts.tv_sec).unwrap_or(0),
            u32::try_from(ts.tv_nsec).unwrap_or(0),
        )
    })
}

/// What a decode brought: the draws, the tokens decoded, and the time
/// llama.cpp's decode calls took.
#[derive(Debug, Default)]
struct Decoded {
    drawn: Vec<Drawn>,
    tokens: u32,
    decode_us: u64,
    /// Items that failed on their own (see `WorkerResponse::Decoded`).
    refused: Vec<Refused>,
}

/// A loaded model with one context (unified KV, `n_seq` sequences), executing worker requests.
///
/// Not `Sync`: llama.cpp's context belongs to one thread at a time. `Send`.
pub struct WorkerEngine {
    // Field order is drop order: everything that points into the model (grammar samplers hold
    // its vocabulary, the context its weights) is declared before `model`.
    grammars: Grammars,
    batch: LlamaBatch<'static>,
    /// `--mmproj`: the projector (it holds the model's vocabulary).
    vision: Option<vision::Vision>,
    /// Borrows `*model`; the `'static` is a lie kept inside this struct (see [`WorkerEngine::new`]).
    ctx: LlamaContext<'static>,
    model: Box<LlamaModel>,
    /// The configuration as llama.cpp applied it (`n_ctx` padded, `n_batch` capped).
    config: WorkerConfig,
    n_vocab: u32,
    /// The vocabulary's digest, for `Ready`.
    vocab_digest: [u8; 32],
    /// Per sequence: its length and its last draw.
    seqs: SeqTable,
    /// Per sequence: its generation's draws, for penalties.
    penalties: Penalties,
    /// The logits row adjusted by a draw's extras (bias, penalties); a draw
    /// without extras reads the context's row in place.
    row: Vec<f32>,
    /// The grammar's verdict on each token id, for the row being sampled.
    mask: Vec<bool>,
    /// The host-memory tier: sequences the scheduler spilled (`KvSpill`).
    spill: SpillStore,
    /// `--park`: sealing sessions' KV to disk (None: off).
    park: Option<super::park::Parker>,
    /// The KV cache's type, as park artifacts name it (`--kv-bits`).
    kv_type: u32,
    /// A sequence id past the scheduler's (`n_seq`), never decoded into:
    /// a segment seal copies the cells after what is sealed into it to
    /// export them alone, and a restore imports each segment into it before
    /// copying it on. None at llama.cpp's most sequences (256).
    scratch: Option<u32>,
    /// The tiled attention's counters at the last `Decoded` reply: each
    /// reply carries the work since.
    attention_seen: std::cell::Cell<crate::wire::worker::AttentionWork>,
}

impl std::fmt::Debug for WorkerEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerEngine")
            .field("config", &self.config)
            .field("n_vocab", &self.n_vocab)
            .field("lens", &self.seqs.lens())
            .finish_non_exhaustive()
    }
}

impl WorkerEngine {
    /// Load the model at `path` (all layers on the CPU) and create its context: `n_ctx` cells of
    /// unified KV shared by `n_seq` sequences, batches of `n_batch` tokens (`n_ubatch` the same),
    /// `threads` threads for decode and prefill.
    pub fn new(path: &Path, config: &WorkerConfig) -> Result<WorkerEngine, EngineError> {
        WorkerEngine::with_kv_bits(path, config, 16)
    }

    /// [`new`](Self::new) with the KV cache's type: `kv_bits` 16 (f16) or 8
    /// (Q8_0: half the memory, values rounded to 8 bits; `--kv-bits`).
    pub fn with_kv_bits(
        path: &Path,
        config: &WorkerConfig,
        kv_bits: u8,
    ) -> Result<WorkerEngine, EngineError> {
        WorkerEngine::placed(
            path,
            config,
            kv_bits,
            false,
            &super::rpc::Placement::default(),
        )
    }

    /// [`with_kv_bits`](Self::with_kv_bits) with the model's layers placed on RPC servers
    /// (`--rpc`, `--tensor-split`; none: all on this machine's CPU), and the model file mapped
    /// (`mmap`) or read into memory (only on this machine's CPU: with RPC servers llama.cpp maps
    /// it).
    pub fn placed(
        path: &Path,
        config: &WorkerConfig,
        kv_bits: u8,
        mmap: bool,
        placement: &super::rpc::Placement,
    ) -> Result<WorkerEngine, EngineError> {
        placement.check().map_err(EngineError::Rpc)?;
        let WorkerConfig {
            n_ctx,
            n_seq,
            n_batch,
            threads,
        } = *config;
        let invalid = |what: String| Err(EngineError::InvalidConfig(what));
        if !(1..=i32::MAX as u32 / 2).contains(&n_ctx) {
            return invalid(format!("invalid context size {n_ctx}"));
        }
        if !(1..=MAX_SEQ).contains(&n_seq) {
            return invalid(format!(
                "invalid number of sequences {n_seq} (1..={MAX_SEQ})"
            ));
        }
        if n_batch < 1 {
            return invalid(format!("invalid batch size {n_batch}"));
        }
        if !(1..=1024).contains(&threads) {
            return invalid(format!("invalid thread count {threads}"));
        }
        let (kv_cache, kv_type) = match kv_bits {
            16 => (KvCacheType::F16, super::park::KV_TYPE_F16),
            8 => (KvCacheType::Q8_0, super::park::KV_TYPE_Q8_0),
            other => return invalid(format!("invalid --kv-bits {other} (16 or 8)")),
        };
        check_gguf(path)?;
        let backend = backend::backend()?;
        let model = if placement.servers.is_empty() {
            let params = LlamaModelParams::default()
                .with_n_gpu_layers(0)
                .with_use_mmap(mmap);
            LlamaModel::load_from_file(backend, path, &params).map_err(|e| {
                EngineError::ModelLoad {
                    path: path.to_path_buf(),
                    reason: e.to_string(),
                }
            })?
        } else {
            super::rpc::register(&placement.servers)?;
            let (layers, split) = placement.offload(super::rpc::n_layer(path)?);
            log::info!(
                "placing {layers} layers on {} RPC servers (weights {split:?})",
                placement.servers.len()
            );
            super::rpc::load(path, layers, &split)?
        };
        let model = Box::new(model);
        let vocab_digest = crate::engine::vocab::vocab_digest(&model);
        let n_vocab = u32::try_from(model.vocab().n_tokens()).unwrap_or(0);
        if n_vocab == 0 {
            return Err(EngineError::EmptyVocabulary);
        }

        let cparams = LlamaContextParams::default()
            .with_n_ctx(std::num::NonZeroU32::new(n_ctx))
            .with_n_seq_max(n_seq + u32::from(n_seq < MAX_SEQ))
            .with_n_batch(n_batch)
            .with_n_ubatch(n_batch)
            .with_n_threads(threads as i32)
            .with_n_threads_batch(threads as i32)
            .with_kv_unified(true)
            .with_type_k(kv_cache)
            .with_type_v(kv_cache);
        // SAFETY: the model lives in a Box owned by the engine, so its address is stable, and it
        // is dropped after the context (field order). The context never leaves the engine.
        let model_ref: &'static LlamaModel =
            unsafe { &*std::ptr::from_ref::<LlamaModel>(model.as_ref()) };
        let ctx = model_ref
            .new_context(backend, cparams)
            .map_err(|e| EngineError::Context {
                n_ctx,
                n_seq,
                n_batch,
                reason: e.to_string(),
            })?;
        let step = ctx.n_batch().min(ctx.n_ubatch()).max(1);
        let effective = WorkerConfig {
            n_ctx: ctx.n_ctx(),
            n_seq,
            n_batch: step,
            threads,
        };
        log::info!(
            "engine ready: {} ({} tokens), n_ctx {} n_seq {} n_batch {} threads {}, \
             tiled attention {}",
            path.display(),
            n_vocab,
            effective.n_ctx,
            n_seq,
            step,
            threads,
            if super::attention::trims() {
                "trimmed to the unmasked rows and cells"
            } else {
                "computed whole (SUPERFLUID_FA_TRIM=0)"
            }
        );
        Ok(WorkerEngine {
            grammars: Grammars::new(n_seq),
            batch: LlamaBatch::new(step as usize, 1),
            vision: None,
            ctx,
            model,
            seqs: SeqTable::new(n_seq, effective.n_ctx, n_vocab),
            penalties: Penalties::new(n_seq),
            config: effective,
            n_vocab,
            vocab_digest,
            row: Vec::with_capacity(n_vocab as usize),
            mask: Vec::new(),
            spill: SpillStore::new(0),
            park: None,
            kv_type,
            scratch: (n_seq < MAX_SEQ).then_some(n_seq),
            attention_seen: std::cell::Cell::new(super::attention::work()),
        })
    }

    /// `--mmproj`: load the vision projector at `mmproj`; images are read
    /// from the media store in `media_dir`.
    pub fn with_vision(
        mut self,
        mmproj: &Path,
        media_dir: &Path,
    ) -> Result<WorkerEngine, EngineError> {
        let model: &LlamaModel = &self.model;
        let vision = vision::Vision::load(mmproj, model, self.config.threads, media_dir)
            .map_err(EngineError::Projector)?;
        log::info!("vision projector ready: {}", mmproj.display());
        self.vision = Some(vision);
        Ok(self)
    }

    /// `--park`: seal sessions' KV into `dir` (`KvPark`) and restore it
    /// (`KvUnpark`), the directory kept within `budget_bytes` (0: unbounded);
    /// `lossy` (`--park-lossy`) stores the states as Q8_0.
    pub fn with_park(
        mut self,
        dir: PathBuf,
        model: &Path,
        budget_bytes: u64,
        lossy: bool,
    ) -> std::io::Result<WorkerEngine> {
        self.park = Some(super::park::Parker::new(
            dir,
            model,
            budget_bytes,
            lossy,
            self.kv_type,
        )?);
        Ok(self)
    }

    /// Let the host-memory store hold up to `cap_bytes` of spilled sequence
    /// state (`--cache-ram-mb`; 0, the default, stores nothing).
    pub fn with_spill_cap(mut self, cap_bytes: u64) -> WorkerEngine {
        self.spill = SpillStore::new(cap_bytes);
        self
    }

    /// Bytes and entries the host-memory store holds.
    pub fn spill_usage(&self) -> (u64, usize) {
        (self.spill.bytes(), self.spill.len())
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
            vocab_digest: self.vocab_digest,
        }
    }

    /// The positions sequence `seq` holds (`0..len`), or None for a sequence out of range.
    pub fn seq_len(&self, seq: u32) -> Option<u32> {
        self.seqs.len(seq)
    }

    /// Whether `token` ends generation. False for an invalid id.
    pub fn is_eog(&self, token: u32) -> bool {
        token < self.n_vocab && self.model.vocab().is_eog(LlamaToken(token as i32))
    }

    /// Execute one request and return its one reply. `Shutdown` answers `Done` (the caller
    /// stops). Never panics on bad input: it answers `Err` (or `KvFull`).
    /// A decode's reply, with the park artifacts the budget deleted since
    /// the last one.
    fn reply(&self, d: Decoded) -> WorkerResponse {
        WorkerResponse::Decoded {
            drawn: d.drawn,
            tokens: d.tokens,
            decode_us: d.decode_us,
            refused: d.refused,
            unparked: self
                .park
                .as_ref()
                .map(|p| p.take_deleted())
                .unwrap_or_default(),
            attention: {
                let now = super::attention::work();
                now.since(self.attention_seen.replace(now))
            },
        }
    }

    pub fn handle(&mut self, request: &WorkerRequest) -> WorkerResponse {
        if let WorkerRequest::MediaLayout { blob } = request {
            // Touches no KV: a refused image leaves every draw in place.
            return match self.vision.as_ref().map(|v| v.layout(blob)) {
                Some(Ok(tokens)) => WorkerResponse::MediaLayout { tokens },
                Some(Err(e)) => WorkerResponse::Err {
                    message: e.to_string(),
                },
                None => WorkerResponse::Err {
                    message: "this model has no vision projector (--mmproj)".into(),
                },
            };
        }
        let result = match request {
            WorkerRequest::Decode { items } => self.decode(items).map(|d| self.reply(d)),
            WorkerRequest::KvTrim { seq, from } => self.kv_trim(*seq, *from),
            WorkerRequest::KvCopy { src, dst, len } => self.kv_copy(*src, *dst, *len),
            WorkerRequest::KvClear { seq } => self.kv_clear(*seq),
            WorkerRequest::Shutdown => Ok(WorkerResponse::Done),
            WorkerRequest::DecodeNext { items } => self.decode_next(items).map(|d| self.reply(d)),
            WorkerRequest::KvSpill { seq, key, len } => self.kv_spill(*seq, *key, *len),
            WorkerRequest::KvRestore {
                seq,
                key,
                len,
                keep,
            } => self.kv_restore(*seq, *key, *len, *keep),
            WorkerRequest::KvDrop { key } => {
                self.spill.drop_key(*key);
                Ok(WorkerResponse::Done)
            }
            WorkerRequest::KvPark {
                seq,
                session,
                tokens,
            } => self.kv_park(*seq, *session, tokens),
            WorkerRequest::KvUnpark {
                seq,
                session,
                tokens,
                len,
            } => self.kv_unpark(*seq, *session, tokens, *len),
            WorkerRequest::MediaLayout { .. } => Err(RequestError::Internal("unreachable".into())),
        };
        result.unwrap_or_else(|error| {
            log::debug!("request failed: {error}");
            // A DecodeNext queued behind a failed request must not run on a stale draw.
            self.seqs.forget_draws();
            match error {
                RequestError::KvFull { n_ctx, tokens } => WorkerResponse::KvFull { n_ctx, tokens },
                other => WorkerResponse::Err {
                    message: other.to_string(),
                },
            }
        })
    }

    /// `DecodeNext`: steps of the items' sequences, each fed the draw before.
    fn decode_next(&mut self, next: &[NextItem]) -> Result<Decoded, RequestError> {
        self.seqs.validate_next(next)?;
        let before = self.seqs.lens().to_vec();
        let mut out = Decoded::default();
        for j in 0..next.iter().map(|n| n.steps).max().unwrap_or(0) {
            let items: Vec<DecodeItem> = next
                .iter()
                .filter(|n| j < n.steps)
                .filter_map(|n| {
                    let d = self.seqs.next_input(n.seq)?;
                    Some(DecodeItem {
                        media: vec![],
                        seq: n.seq,
                        pos: self.seqs.len(n.seq)?,
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
            // A DecodeNext stays all or nothing: an item refused on its own
            // (a failed draw) fails the request, as any failure does.
            let result = self.decode(&items).and_then(|d| match d.refused.first() {
                Some(r) => Err(RequestError::Internal(format!(
                    "sequence {}: {}",
                    r.seq, r.message
                ))),
                None => Ok(d),
            });
            match result {
                Ok(d) => {
                    out.drawn.extend(d.drawn);
                    out.tokens += d.tokens;
                    out.decode_us += d.decode_us;
                }
                Err(error) => {
                    // All or nothing: the steps before this one go too.
                    for n in next {
                        let s = n.seq as usize;
                        let _ = self
                            .ctx
                            .kv_cache_seq_rm(n.seq as i32, Some(before[s]), None);
                        self.grammars.drop_state(s);
                    }
                    self.resync_all();
                    return Err(error);
                }
            }
        }
        Ok(out)
    }

    /// Re-read the length of `seq` from the KV cache.
    fn resync(&mut self, seq: usize) {
        let max = self.ctx.kv_cache_seq_pos_max(seq as i32);
        self.seqs
            .set_len(seq, u32::try_from(max.saturating_add(1)).unwrap_or(0));
    }

    fn resync_all(&mut self) {
        for seq in 0..self.seqs.n_seq() as usize {
            self.resync(seq);
        }
    }

    /// The KV of `seq` changed other than by a decode: no grammar state, no
    /// draw to follow, and its length as llama.cpp has it.
    fn changed(&mut self, seq: usize) {
        self.grammars.drop_state(seq);
        self.seqs.kv_changed(seq);
        self.resync(seq);
    }

    fn kv_trim(&mut self, seq: u32, from: u32) -> Result<WorkerResponse, RequestError> {
        let s = self.seqs.check_seq(seq)?;
        if from < self.seqs.lens()[s] {
            let res = self.ctx.kv_cache_seq_rm(seq as i32, Some(from), None);
            self.changed(s);
            res.map_err(|e| RequestError::Trim {
                seq,
                from,
                reason: e.to_string(),
            })?;
        }
        Ok(WorkerResponse::Done)
    }

    fn kv_copy(&mut self, src: u32, dst: u32, len: u32) -> Result<WorkerResponse, RequestError> {
        let (s, d) = self.seqs.check_copy(src, dst, len)?;
        if s == d {
            return self.kv_trim(src, len);
        }
        let rm = self.ctx.kv_cache_seq_rm(dst as i32, None, None);
        let cp = if len > 0 && rm.is_ok() {
            self.ctx
                .kv_cache_seq_cp(src as i32, dst as i32, Some(0), Some(len))
        } else {
            Ok(())
        };
        self.changed(d);
        rm.map_err(|e| RequestError::Clear {
            seq: dst,
            reason: e.to_string(),
        })?;
        cp.map_err(|e| RequestError::Copy {
            src,
            dst,
            reason: e.to_string(),
        })?;
        Ok(WorkerResponse::Done)
    }

    /// `KvSpill`: export `seq` into the host store. Soft: anything that
    /// keeps it from being stored answers `Spilled` with 0 bytes, and the
    /// sequence is never touched.
    fn kv_spill(&mut self, seq: u32, key: u64, len: u32) -> Result<WorkerResponse, RequestError> {
        let s = self.seqs.check_seq(seq)?;
        let none = WorkerResponse::Spilled { key, bytes: 0 };
        if len == 0 || self.seqs.lens()[s] != len {
            log::debug!(
                "spill of sequence {seq}: it holds {} positions, not {len}",
                self.seqs.lens()[s]
            );
            return Ok(none);
        }
        let flags = llama_cpp_2::LlamaStateSeqFlags::empty();
        // The cap is checked against the state's size before it is copied.
        let size = self.ctx.state_seq_get_size_ext(seq as i32, flags) as u64;
        if !self.spill.fits(key, size) {
            log::debug!("spill of sequence {seq}: {size} bytes do not fit the host store");
            return Ok(none);
        }
        match self.export(seq) {
            Some(state) => {
                let bytes = self.spill.put(key, state, len);
                Ok(WorkerResponse::Spilled { key, bytes })
            }
            None => {
                log::warn!("spill of sequence {seq} failed: llama.cpp wrote another size");
                Ok(none)
            }
        }
    }

    /// `KvRestore`: `seq` becomes the stored state's first `len` positions
    /// (only those cells imported, when the layout is read); the entry
    /// stays in the store when `keep`.
    fn kv_restore(
        &mut self,
        seq: u32,
        key: u64,
        len: u32,
        keep: bool,
    ) -> Result<WorkerResponse, RequestError> {
        let s = self.seqs.check_seq(seq)?;
        let not = WorkerResponse::NotRestored { seq };
        let rm = self.ctx.kv_cache_seq_rm(seq as i32, None, None);
        self.changed(s);
        rm.map_err(|e| RequestError::Clear {
            seq,
            reason: e.to_string(),
        })?;
        let Some((state, stored)) = self.spill.take(key) else {
            log::warn!("restore into sequence {seq}: no stored state {key}");
            return Ok(not);
        };
        // Only the cells below `len`, when the layout is read; else all.
        let part = if len > 0 && len < stored {
            super::seq_state::prefix(&state, len)
        } else {
            None
        };
        let whole = part.is_none();
        let set = if len == 0 || len > stored {
            log::warn!(
                "restore into sequence {seq}: state {key} holds {stored} positions, not {len}"
            );
            false
        } else {
            let flags = llama_cpp_2::LlamaStateSeqFlags::empty();
            // SAFETY: the bytes are what llama.cpp's state_seq_get_data_ext wrote for this
            // context (the store holds only what `export` returned), or their first cells as
            // `seq_state::prefix` rewrote them: the same layout with fewer cells, every count
            // and size read back and checked.
            let ok = unsafe {
                self.ctx.state_seq_set_data_ext(
                    part.as_deref().unwrap_or(&state),
                    seq as i32,
                    flags,
                )
            };
            if !ok {
                log::warn!("restore into sequence {seq} failed (llama.cpp refused the state)");
            }
            ok
        };
        if keep {
            self.spill.put(key, state, stored);
        }
        if !set {
            let _ = self.ctx.kv_cache_seq_rm(seq as i32, None, None);
            self.changed(s);
            return Ok(not);
        }
        let trim = if whole && len < stored {
            self.ctx.kv_cache_seq_rm(seq as i32, Some(len), None)
        } else {
            Ok(())
        };
        self.changed(s);
        if trim.is_err() || self.seqs.lens()[s] != len {
            log::warn!(
                "restore into sequence {seq}: holds {} positions, not {len}",
                self.seqs.lens()[s]
            );
            let _ = self.ctx.kv_cache_seq_rm(seq as i32, None, None);
            self.changed(s);
            return Ok(not);
        }
        Ok(WorkerResponse::Done)
    }

    /// `KvPark`: copy `seq`'s state and hand it to the park writer. Soft.
    fn kv_park(
        &mut self,
        seq: u32,
        session: u64,
        tokens: &[u32],
    ) -> Result<WorkerResponse, RequestError> {
        let s = self.seqs.check_seq(seq)?;
        let Some(park) = &self.park else {
            return Ok(WorkerResponse::Done);
        };
        // The sequence may hold more than the turn: a step planned before
        // the generation ended (a cancel) fed a draw after the request was
        // queued. Its first `tokens.len()` positions are the turn's.
        let held = self.seqs.lens()[s] as usize;
        let longer = held > tokens.len();
        if tokens.is_empty()
            || held < tokens.len()
            || (longer && self.scratch.is_none())
            || !park.has_room()
        {
            log::debug!(
                "park of session {session} skipped (the sequence holds {held} of {} positions, \
                 or the writer is busy)",
                tokens.len()
            );
            park.not_sealed(session);
            return Ok(WorkerResponse::Done);
        }
        let from = match park.plan(session, tokens) {
            super::park::SealPlan::From(from) if self.scratch.is_some() => Some(from),
            _ => None,
        };
        let end = u32::try_from(tokens.len()).ok().filter(|_| longer);
        let state = match (from, end) {
            (None, None) => self.export(seq),
            (from, end) => self.export_range(seq, from.unwrap_or(0), end),
        };
        let Some(state) = state else {
            log::warn!("park of session {session}: llama.cpp did not export the sequence");
            if let Some(park) = &self.park {
                park.not_sealed(session);
            }
            return Ok(WorkerResponse::Done);
        };
        let Some(park) = &self.park else {
            return Ok(WorkerResponse::Done);
        };
        let sealed = match from {
            Some(from) => park.seal_from(session, tokens.to_vec(), from, state),
            None => park.seal(session, tokens.to_vec(), state),
        };
        if !sealed {
            park.not_sealed(session);
        }
        Ok(WorkerResponse::Done)
    }

    /// llama.cpp's per-sequence state of `seq`; None if it wrote less than
    /// it said.
    fn export(&mut self, seq: u32) -> Option<Vec<u8>> {
        let flags = llama_cpp_2::LlamaStateSeqFlags::empty();
        let size = self.ctx.state_seq_get_size_ext(seq as i32, flags);
        if size == 0 {
            // Not even the header: llama.cpp could not size it.
            return None;
        }
        let mut state = vec![0u8; size];
        // SAFETY: `state` holds the `size` bytes llama.cpp just reported for this sequence (at
        // least its header, checked above), and it writes exactly what it sized.
        let n = unsafe {
            self.ctx
                .state_seq_get_data_ext(state.as_mut_ptr(), seq as i32, flags)
        };
        (n == size).then_some(state)
    }

    /// The state of `seq`'s cells from position `from` up to `end` (None:
    /// its last) alone: copied into the scratch sequence (which shares the
    /// cells, no data moves), exported from there, and the scratch sequence
    /// cleared.
    fn export_range(&mut self, seq: u32, from: u32, end: Option<u32>) -> Option<Vec<u8>> {
        let scratch = self.scratch?;
        let _ = self.ctx.kv_cache_seq_rm(scratch as i32, None, None);
        let state = match self
            .ctx
            .kv_cache_seq_cp(seq as i32, scratch as i32, Some(from), end)
        {
            Ok(()) => self.export(scratch),
            Err(_) => None,
        };
        let _ = self.ctx.kv_cache_seq_rm(scratch as i32, None, None);
        state
    }

    /// Imports a segment's state into `seq` beside what it holds: into the
    /// scratch sequence first (llama.cpp clears the sequence it imports
    /// into), then copied on (shared cells) and the scratch cleared.
    fn import_beside(&mut self, seq: u32, state: &[u8]) -> bool {
        let Some(scratch) = self.scratch else {
            return false;
        };
        // SAFETY: the bytes are what llama.cpp's state_seq_get_data_ext wrote for this model
        // (identity digest) and KV type, verified by their sha256 before this call.
        let ok = unsafe {
            self.ctx.state_seq_set_data_ext(
                state,
                scratch as i32,
                llama_cpp_2::LlamaStateSeqFlags::empty(),
            )
        } && self
            .ctx
            .kv_cache_seq_cp(scratch as i32, seq as i32, None, None)
            .is_ok();
        let _ = self.ctx.kv_cache_seq_rm(scratch as i32, None, None);
        ok
    }

    /// `KvUnpark`: restore `<session>.park` into `seq`, keep `0..len`.
    fn kv_unpark(
        &mut self,
        seq: u32,
        session: u64,
        tokens: &[u32],
        len: u32,
    ) -> Result<WorkerResponse, RequestError> {
        let s = self.seqs.check_seq(seq)?;
        let not = WorkerResponse::NotRestored { seq };
        let rm = self.ctx.kv_cache_seq_rm(seq as i32, None, None);
        self.changed(s);
        rm.map_err(|e| RequestError::Clear {
            seq,
            reason: e.to_string(),
        })?;
        let Some(park) = &self.park else {
            return Ok(not);
        };
        let path = park.path(session);
        let got = super::park::read_chain(
            park.dir(),
            session,
            park.model(),
            park.cache(),
            len as usize,
        );
        let (chain, states) = match got {
            Ok(x) => x,
            Err(super::park::ParkError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {
                // Deleted by the park budget (least recently used first)
                // after the index learnt of it: not a fault.
                log::info!(
                    "park artifact {} is gone (the park budget); prefilling instead",
                    path.display()
                );
                return Ok(not);
            }
            Err(e) => {
                log::warn!(
                    "park artifact {} unusable ({e}); prefilling instead",
                    path.display()
                );
                return Ok(not);
            }
        };
        if let Some(why) = &chain.stopped {
            // A stale or damaged header was warned about once at start
            // (daemon::scan_parked, which deletes it); a state that fails
            // its digest is found here. The next seal writes the whole
            // artifact again (Parker::restored).
            log::warn!(
                "park segment {why}; restoring the {} tokens before it",
                chain.tokens.len()
            );
        }
        // Only positions 0..len are kept: the artifact must hold those
        // tokens (a later seal may have added more, a skipped one fewer).
        // Without a scratch sequence (at llama.cpp's most sequences) only
        // the base restores.
        let n = len as usize;
        let can = if self.scratch.is_some() {
            chain.tokens.len()
        } else {
            chain.base_len()
        };
        if n > tokens.len() || n > can || chain.tokens[..n] != tokens[..n] {
            log::warn!(
                "park artifact {} holds other tokens; prefilling instead",
                path.display()
            );
            return Ok(not);
        }
        let mut ok = true;
        for (i, (_, state)) in states.iter().enumerate() {
            ok = ok
                && if i == 0 {
                    // SAFETY: the bytes are what llama.cpp's state_seq_get_data_ext wrote for
                    // this model (identity digest) and KV type, verified by their sha256 before
                    // this call.
                    unsafe {
                        self.ctx.state_seq_set_data_ext(
                            state,
                            seq as i32,
                            llama_cpp_2::LlamaStateSeqFlags::empty(),
                        )
                    }
                } else {
                    self.import_beside(seq, state)
                };
        }
        let trim = if ok && n < chain.tokens.len() {
            self.ctx.kv_cache_seq_rm(seq as i32, Some(len), None)
        } else {
            Ok(())
        };
        self.changed(s);
        if !ok || trim.is_err() || self.seqs.lens()[s] != len {
            log::warn!(
                "park artifact {} did not restore; prefilling instead",
                path.display()
            );
            let _ = self.ctx.kv_cache_seq_rm(seq as i32, None, None);
            self.changed(s);
            return Ok(not);
        }
        if let Some(park) = &self.park {
            // The sequence holds the chain as it is on disk: the next seal
            // may add a segment to it.
            park.restored(session, &chain, n == chain.tokens.len());
        }
        // Used: the budget deletes it last.
        if let Ok(f) = std::fs::File::options().write(true).open(&path) {
            let _ = f.set_modified(std::time::SystemTime::now());
        }
        Ok(WorkerResponse::Done)
    }

    fn kv_clear(&mut self, seq: u32) -> Result<WorkerResponse, RequestError> {
        let s = self.seqs.check_seq(seq)?;
        let res = self.ctx.kv_cache_seq_rm(seq as i32, None, None);
        self.changed(s);
        res.map_err(|e| RequestError::Clear {
            seq,
            reason: e.to_string(),
        })?;
        Ok(WorkerResponse::Done)
    }

    fn decode(&mut self, items: &[DecodeItem]) -> Result<Decoded, RequestError> {
        self.seqs.validate_decode(items)?;
        // A grammar that does not parse fails its own item only: the item is
        // left out, its sequence untouched.
        let mut refused = self.grammars.prepare(&self.model, &self.seqs, items);
        let images = self.prepare_images(items, &mut refused);
        let kept: Vec<DecodeItem>;
        let items = if refused.is_empty() {
            items
        } else {
            kept = items
                .iter()
                .filter(|i| !refused.iter().any(|r| r.seq == i.seq))
                .cloned()
                .collect();
            &kept
        };
        let before = self.seqs.lens().to_vec();
        let result = if items.is_empty() {
            Ok(Decoded::default())
        } else {
            self.decode_items(items, images)
        };
        match result {
            Ok(mut out) => {
                // A draw that failed fails its own item: its sequence goes
                // back to where it was, the others keep what they decoded.
                let failed = |seq: u32| out.refused.iter().any(|r| r.seq == seq);
                let done: Vec<DecodeItem> =
                    items.iter().filter(|i| !failed(i.seq)).cloned().collect();
                self.seqs.decoded(&done, &out.drawn);
                for r in out.refused.iter().chain(&refused) {
                    let s = r.seq as usize;
                    let _ = self.ctx.kv_cache_seq_rm(s as i32, Some(before[s]), None);
                    self.changed(s);
                }
                out.refused.extend(refused);
                Ok(out)
            }
            Err(error) => {
                // All or nothing: put every touched sequence back where it was.
                for item in items {
                    let s = item.seq as usize;
                    let _ = self.ctx.kv_cache_seq_rm(s as i32, Some(before[s]), None);
                    self.grammars.drop_state(s);
                }
                self.resync_all();
                Err(error)
            }
        }
    }

    /// Reads and lays out the images of every item not refused yet, in
    /// order. An image that cannot be (a missing or corrupt blob, no
    /// projector, another layout than its span's) refuses its own item, so
    /// another session's item in the same request is not failed by it.
    fn prepare_images(
        &mut self,
        items: &[DecodeItem],
        refused: &mut Vec<Refused>,
    ) -> Vec<MtmdInputChunks> {
        let mut out = Vec::new();
        for item in items.iter().filter(|i| !i.media.is_empty()) {
            if refused.iter().any(|r| r.seq == item.seq) {
                continue;
            }
            let mut mine = Vec::new();
            for m in &item.media {
                let span = &item.tokens[m.at as usize..(m.at + m.len) as usize];
                let got = match &self.vision {
                    Some(v) => v.prepare(&m.blob, span),
                    None => Err(RequestError::Media(
                        "this model has no vision projector (--mmproj)".into(),
                    )),
                };
                match got {
                    Ok(chunks) => mine.push(chunks),
                    Err(e) => {
                        refused.push(Refused {
                            seq: item.seq,
                            message: e.to_string(),
                        });
                        mine.clear();
                        break;
                    }
                }
            }
            out.extend(mine);
        }
        out
    }

    fn decode_items(
        &mut self,
        items: &[DecodeItem],
        images: Vec<MtmdInputChunks>,
    ) -> Result<Decoded, RequestError> {
        let step = self.config.n_batch as usize;
        // The items' images, prepared in order ([`Self::prepare_images`]).
        let mut prepared = images.into_iter();
        let mut out = Decoded::default();
        // (item index, batch index) of the logits the current batch will produce.
        let mut pending: Vec<(usize, i32)> = Vec::new();
        self.batch.clear();
        for (k, item) in items.iter().enumerate() {
            let last = item.tokens.len() - 1;
            let mut images = item.media.iter().peekable();
            let mut skip_to = 0;
            for (j, &token) in item.tokens.iter().enumerate() {
                if j < skip_to {
                    continue;
                }
                if let Some(m) = images.next_if(|m| m.at as usize == j) {
                    // An image is evaluated whole, after what is batched before it.
                    if self.batch.n_tokens() > 0 {
                        self.run_batch(items, &mut pending, &mut out)?;
                    }
                    let (Some(vision), Some(chunks)) = (self.vision.as_mut(), prepared.next())
                    else {
                        return Err(RequestError::Internal("an image was not prepared".into()));
                    };
                    let started = Instant::now();
                    let pos = item.pos + j as u32;
                    vision.eval(&mut self.ctx, &chunks, item.seq, pos, m.len, step as u32)?;
                    out.decode_us += started.elapsed().as_micros() as u64;
                    out.tokens += m.len;
                    skip_to = j + m.len as usize;
                    continue;
                }
                let logits = j == last && item.sample.is_some();
                let pos = (item.pos as usize + j) as i32;
                self.batch
                    .add(LlamaToken(token as i32), pos, &[item.seq as i32], logits)
                    .map_err(|e| RequestError::Batch(e.to_string()))?;
                if logits {
                    pending.push((k, self.batch.n_tokens() - 1));
                }
                if self.batch.n_tokens() as usize == step {
                    self.run_batch(items, &mut pending, &mut out)?;
                }
            }
        }
        if self.batch.n_tokens() > 0 {
            self.run_batch(items, &mut pending, &mut out)?;
        }
        Ok(out)
    }

    /// Decode the batch built so far, draw the tokens it was built for, and clear it.
    fn run_batch(
        &mut self,
        items: &[DecodeItem],
        pending: &mut Vec<(usize, i32)>,
        out: &mut Decoded,
    ) -> Result<(), RequestError> {
        let n = self.batch.n_tokens();
        let start = Instant::now();
        crate::logging::stage("w_decode", &n);
        let res = self.ctx.decode(&mut self.batch);
        out.decode_us += start.elapsed().as_micros() as u64;
        crate::logging::stage("w_decoded", &n);
        self.batch.clear();
        res.map_err(|e| match e {
            DecodeError::NoKvCacheSlot => RequestError::KvFull {
                n_ctx: self.config.n_ctx,
                tokens: n as u32,
            },
            DecodeError::NTokensZero => RequestError::BatchRejected(n),
            other => RequestError::Decode(other.to_string()),
        })?;
        out.tokens += n as u32;
        for (k, i) in pending.drain(..) {
            let seq = items[k].seq;
            if out.refused.iter().any(|r| r.seq == seq) {
                continue;
            }
            match self.draw(&items[k], i) {
                Ok(d) => out.drawn.push(d),
                Err(e) => {
                    log::debug!("sequence {seq}: the draw failed: {e}");
                    out.refused.push(Refused {
                        seq,
                        message: e.to_string(),
                    });
                }
            }
        }
        Ok(())
    }

    /// Draw the token for `item` from the logits at batch index `i`: the row adjusted by the
    /// sampling extras (bias, penalties over this generation's draws so far), then the
    /// grammar's verdict and [`sample::draw`]; log-probabilities off the adjusted row if asked.
    fn draw(&mut self, item: &DecodeItem, i: i32) -> Result<Drawn, RequestError> {
        let Some(sample) = &item.sample else {
            return Err(RequestError::Internal("no sample asked".into()));
        };
        // The logits are read in place unless an extra adjusts them: a copy
        // of the row (the vocabulary's width) costs a plain greedy draw as
        // much as the draw itself.
        let row: &[f32] = match &sample.extras {
            None => self.ctx.get_logits_ith(i),
            Some(x) => {
                self.row.clear();
                self.row.extend_from_slice(self.ctx.get_logits_ith(i));
                // Only penalties need the history (bias and logprobs do not).
                if x.extras.penalizes() {
                    let counts = self
                        .penalties
                        .counts(item.seq, x.first_draw, sample.draw_pos)?;
                    sample::apply_extras(
                        &mut self.row,
                        &x.extras,
                        counts.iter().map(|(&t, &c)| (t, c)),
                    );
                } else {
                    sample::apply_extras(&mut self.row, &x.extras, std::iter::empty());
                }
                &self.row
            }
        };
        let mut grammar_us = 0u32;
        let token = match self.grammars.get_mut(item.seq as usize) {
            Some(g) if sample.grammar.is_some() => {
                let started = Instant::now();
                let cpu = thread_cpu_time();
                if !g.allowed(row, &mut self.mask) {
                    return Err(RequestError::GrammarDeadEnd {
                        seq: item.seq,
                        pos: sample.draw_pos,
                    });
                }
                let mask = &self.mask;
                let allowed = |t: u32| mask.get(t as usize).copied().unwrap_or(false);
                let token = sample::draw(row, &sample.params, sample.draw_pos, Some(&allowed));
                let eog = self.model.vocab().is_eog(LlamaToken(token as i32));
                g.accept(token, eog)?;
                let took = started.elapsed();
                // The limit is on this thread's CPU time, the grammar's own
                // work: a machine busy with other processes stretches the
                // wall clock, not it (a loaded CI machine saw 522 ms of
                // wall time for an ordinary forced call).
                let worked = thread_cpu_time().map_or(took, |now| {
                    cpu.map_or(took, |before| now.saturating_sub(before))
                });
                if worked > GRAMMAR_TOKEN_LIMIT {
                    return Err(RequestError::GrammarTooCostly {
                        pos: sample.draw_pos,
                        ms: worked.as_millis() as u64,
                        limit: GRAMMAR_TOKEN_LIMIT.as_millis() as u64,
                    });
                }
                grammar_us = took.as_micros().min(u32::MAX as u128) as u32;
                token
            }
            _ => sample::draw(row, &sample.params, sample.draw_pos, None),
        };
        let logprob = match &sample.extras {
            Some(x) => {
                if x.extras.penalizes() {
                    self.penalties.drew(item.seq, token);
                }
                x.extras.logprobs.map(|n| sample::logprobs(row, token, n))
            }
            None => None,
        };
        Ok(Drawn {
            seq: item.seq,
            token,
            eog: self.is_eog(token),
            logprob,
            grammar_us,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::worker::{Sample, MAX_NEXT_STEPS};
    use crate::wire::Params;

    fn model() -> std::path::PathBuf {
        crate::engine::vocab::tests::model()
    }

    fn greedy(draw_pos: u64) -> Option<Sample> {
        Some(Sample {
            params: Params::greedy(0),
            draw_pos,
            grammar: None,
            grammar_prefix: vec![],
            extras: None,
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
        let err = WorkerEngine::new(Path::new("/nonexistent.gguf"), &config).unwrap_err();
        assert!(err.to_string().contains("not found"), "{err}");
        let bad = WorkerConfig {
            n_seq: MAX_SEQ + 1,
            ..config
        };
        assert!(WorkerEngine::new(&model(), &bad).is_err());
    }

    /// A sequence spilled to host memory, cleared, and restored (into another sequence, trimmed)
    /// draws what the sequence drew before it left the cells; a missing key, a length that does
    /// not match, and a store too small are answered softly. Prints the spill and restore times.
    #[test]
    fn a_spilled_sequence_restores_and_draws_the_same() {
        let n: u32 = 1000;
        let config = WorkerConfig {
            n_ctx: 2048,
            n_seq: 2,
            n_batch: 256,
            threads: 2,
        };
        let mut e = WorkerEngine::new(&model(), &config)
            .expect("engine")
            .with_spill_cap(1 << 30);
        let prompt: Vec<u32> = (0..n).map(|i| 200 + (i * 37) % 5000).collect();
        let decode = |e: &mut WorkerEngine, seq, pos: u32, tokens: &[u32]| match e.handle(
            &WorkerRequest::Decode {
                items: vec![DecodeItem {
                    media: vec![],
                    seq,
                    pos,
                    tokens: tokens.to_vec(),
                    sample: greedy(u64::from(pos) + tokens.len() as u64),
                }],
            },
        ) {
            WorkerResponse::Decoded { drawn, .. } => drawn[0].token,
            other => panic!("{other:?}"),
        };
        let want = decode(&mut e, 0, 0, &prompt);
        let t = Instant::now();
        let r = e.handle(&WorkerRequest::KvSpill {
            seq: 0,
            key: 7,
            len: n,
        });
        let spill_ms = t.elapsed().as_secs_f64() * 1e3;
        let WorkerResponse::Spilled { key: 7, bytes } = r else {
            panic!("{r:?}")
        };
        assert!(bytes > 0);
        assert_eq!(e.spill_usage(), (bytes, 1));
        // The wrong length stores nothing.
        let r = e.handle(&WorkerRequest::KvSpill {
            seq: 0,
            key: 8,
            len: n - 1,
        });
        assert_eq!(r, WorkerResponse::Spilled { key: 8, bytes: 0 });
        // A prefix another conversation shares: only its cells are imported
        // (llama.cpp's layout is read), and the entry stays in host memory.
        // At a batch boundary, the rest is decoded in the same shapes as
        // before: the same draw.
        let m = 2 * config.n_batch;
        let whole = e.export(0).expect("exported");
        let part = crate::engine::seq_state::prefix(&whole, m).expect("the layout is read");
        assert!(
            part.len() < whole.len() * 11 / 20,
            "{} of {}",
            part.len(),
            whole.len()
        );
        let r = e.handle(&WorkerRequest::KvRestore {
            seq: 1,
            key: 7,
            len: m,
            keep: true,
        });
        assert_eq!(r, WorkerResponse::Done);
        assert_eq!(e.seq_len(1), Some(m));
        assert_eq!(e.spill_usage(), (bytes, 1));
        assert_eq!(decode(&mut e, 1, m, &prompt[m as usize..]), want);
        e.handle(&WorkerRequest::KvClear { seq: 1 });
        e.handle(&WorkerRequest::KvClear { seq: 0 });
        // Restored into the other sequence, all but the last prompt token.
        let t = Instant::now();
        let r = e.handle(&WorkerRequest::KvRestore {
            seq: 1,
            key: 7,
            len: n - 1,
            keep: false,
        });
        let restore_ms = t.elapsed().as_secs_f64() * 1e3;
        assert_eq!(r, WorkerResponse::Done);
        assert_eq!(e.seq_len(1), Some(n - 1));
        assert_eq!(e.spill_usage(), (0, 0));
        assert_eq!(decode(&mut e, 1, n - 1, &prompt[n as usize - 1..]), want);
        eprintln!(
            "spill of {n} tokens: {bytes} bytes ({} a token), {spill_ms:.1} ms; restore {restore_ms:.1} ms",
            bytes / u64::from(n)
        );
        // The entry left the store: a second restore finds nothing, and empties the sequence.
        let r = e.handle(&WorkerRequest::KvRestore {
            seq: 1,
            key: 7,
            len: 10,
            keep: false,
        });
        assert_eq!(r, WorkerResponse::NotRestored { seq: 1 });
        assert_eq!(e.seq_len(1), Some(0));
        // A store too small for the state stores nothing.
        let mut small = e.with_spill_cap(bytes / 2);
        decode(&mut small, 0, 0, &prompt);
        let r = small.handle(&WorkerRequest::KvSpill {
            seq: 0,
            key: 9,
            len: n,
        });
        assert_eq!(r, WorkerResponse::Spilled { key: 9, bytes: 0 });
        assert_eq!(
            small.handle(&WorkerRequest::KvDrop { key: 9 }),
            WorkerResponse::Done
        );
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
        let mut e = WorkerEngine::new(&model(), &config).expect("engine");
        let prompt: Vec<u32> = (0..20).map(|i| 200 + i * 13).collect();
        let first = |e: &mut WorkerEngine, seq| match e.handle(&WorkerRequest::Decode {
            items: vec![DecodeItem {
                media: vec![],
                seq,
                pos: 0,
                tokens: prompt.clone(),
                sample: greedy(20),
            }],
        }) {
            WorkerResponse::Decoded { mut drawn, .. } => drawn.remove(0),
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
                    media: vec![],
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
        e.seqs.set_last_draw(
            1,
            Some(Drawn {
                seq: 1,
                token: 2,
                eog: true,
                logprob: None,
                grammar_us: 0,
            }),
        );
        assert!(matches!(
            e.handle(&next(24)),
            WorkerResponse::Decoded { tokens: 0, ref drawn, .. } if drawn.is_empty()
        ));
        // A wrong position is refused.
        e.seqs.set_last_draw(
            1,
            Some(Drawn {
                seq: 1,
                token: 300,
                eog: false,
                logprob: None,
                grammar_us: 0,
            }),
        );
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
        let mut e = WorkerEngine::new(&model(), &config).expect("engine");
        let gbnf = r#"root ::= "The capital of France is Paris.""#;
        let prompt: Vec<u32> = (0..20).map(|i| 200 + i * 13).collect();
        let with = |draw_pos, prefix: &[u32]| {
            let mut s = greedy(draw_pos).unwrap();
            s.grammar = Some(gbnf.to_string());
            s.grammar_prefix = prefix.to_vec();
            Some(s)
        };
        let draw = |e: &mut WorkerEngine, seq, pos, tokens: Vec<u32>, sample| match e.handle(
            &WorkerRequest::Decode {
                items: vec![DecodeItem {
                    media: vec![],
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
        let mut e = WorkerEngine::new(&model(), &config).expect("engine");
        assert_eq!(e.config().n_ctx, 256);
        assert_eq!(e.config().n_batch, 32);
        let tokens = |n: usize| {
            (0..n)
                .map(|i| 100 + (i as u32 * 7) % 1000)
                .collect::<Vec<_>>()
        };
        let item = |seq, pos, n, sample| DecodeItem {
            media: vec![],
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
        assert!(
            matches!(r, WorkerResponse::KvFull { n_ctx: 256, .. }),
            "{r:?}"
        );
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
