//! `RequestError`: why the worker refused or failed a request. Its text is
//! the `Err { message }` the worker replies, and so what a generation's
//! client sees when it fails.

use crate::wire::worker::MAX_NEXT_STEPS;

/// Why a worker request was refused (checked before llama.cpp saw any of it)
/// or failed (llama.cpp or a grammar failed, and the request was rolled back).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    /// What was wrong with one item of a `Decode` or `DecodeNext`.
    #[error("item {item}: {error}")]
    Item {
        item: usize,
        error: Box<RequestError>,
    },
    #[error("sequence {seq} out of range: the worker has {n_seq} sequences")]
    SeqOutOfRange { seq: u32, n_seq: u32 },
    #[error("sequence {seq} appears twice")]
    SeqTwice { seq: u32 },
    #[error("DecodeNext takes no grammar")]
    NextGrammar,
    #[error("{steps} steps asked, the range is 1..={MAX_NEXT_STEPS}")]
    NextSteps { steps: u32 },
    #[error("sequence {seq} has no drawn token to continue from")]
    NoDraw { seq: u32 },
    #[error("sequence {seq} holds positions 0..{len}, not 0..{pos}")]
    NextPosition { seq: u32, len: u32, pos: u32 },
    #[error("no tokens")]
    NoTokens,
    #[error("invalid token id {token}: the vocabulary has {n_vocab} tokens")]
    InvalidToken { token: u32, n_vocab: u32 },
    #[error("sequence {seq} holds positions 0..{end}, so the next token is at {end}, not {pos}")]
    Position { seq: u32, end: u64, pos: u32 },
    #[error("sequence {seq} would reach {end} positions, more than n_ctx={n_ctx} cells")]
    PastContext { seq: u32, end: u64, n_ctx: u64 },
    #[error("the request carries {total} tokens, more than n_ctx={n_ctx} cells")]
    TooManyTokens { total: u64, n_ctx: u64 },
    #[error("cannot copy {len} positions of sequence {src}: it holds {holds}")]
    CopyTooLong { src: u32, len: u32, holds: u32 },
    #[error("cannot trim sequence {seq} from {from}: {reason}")]
    Trim { seq: u32, from: u32, reason: String },
    #[error("cannot clear sequence {seq}: {reason}")]
    Clear { seq: u32, reason: String },
    #[error("cannot copy sequence {src} to {dst}: {reason}")]
    Copy { src: u32, dst: u32, reason: String },
    #[error("grammar for sequence {seq} does not parse: {reason}")]
    GrammarParse { seq: usize, reason: String },
    #[error("grammar prefix: invalid token id {0}")]
    GrammarPrefixToken(u32),
    #[error("the grammar of sequence {seq} allows no token at position {pos}")]
    GrammarDeadEnd { seq: u32, pos: u64 },
    #[error("grammar rejected token {token}: {reason}")]
    GrammarRejected { token: u32, reason: String },
    #[error(
        "the grammar took {ms} ms to constrain the token at position {pos}, over the limit of \
         {limit} ms a token (a schema whose alternatives multiply as the output grows): the \
         generation is stopped so that it does not hold up the others"
    )]
    GrammarTooCostly { pos: u64, ms: u64, limit: u64 },
    #[error("sampling extras: {0}")]
    Extras(#[from] crate::wire::ExtrasError),
    #[error(
        "sequence {seq}: no penalty history for draws {first_draw}..{draw_pos} of its generation"
    )]
    PenaltyHistory {
        seq: u32,
        first_draw: u64,
        draw_pos: u64,
    },
    #[error("batch: {0}")]
    Batch(String),
    /// The KV cache had no room: replied as `WorkerResponse::KvFull`.
    #[error("KV cache full: n_ctx={n_ctx} cells cannot hold {tokens} more tokens")]
    KvFull { n_ctx: u32, tokens: u32 },
    #[error("llama.cpp rejected the batch of {0} tokens as invalid")]
    BatchRejected(i32),
    #[error("llama_decode failed: {0}")]
    Decode(String),
    /// An image could not be laid out or evaluated (a missing or corrupt
    /// blob, no projector, an image the projector refuses).
    #[error("{0}")]
    Media(String),
    #[error("internal error: {0}")]
    Internal(String),
}

impl RequestError {
    /// The same error, as found in item `item` of a request.
    pub fn at(item: usize) -> impl FnOnce(RequestError) -> RequestError {
        move |error| RequestError::Item {
            item,
            error: Box::new(error),
        }
    }
}
