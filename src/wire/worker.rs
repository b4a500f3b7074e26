//! The worker pipe: what the lane (in the daemon) and `superfluid worker`
//! (the process that owns llama.cpp) say to each other, in the same
//! length-prefixed postcard frames as the socket.
//!
//! The worker is stateless apart from its KV cache and per-sequence grammar
//! state: the daemon's scheduler decides every batch. A worker crash loses
//! only the KV, which the daemon rebuilds from the session logs by prefill.
//!
//! Variant order is the format: append only.

use serde::{Deserialize, Serialize};

use super::{Params, SampleExtras, Token, TokenLogprob};

/// How the daemon starts a worker (passed as command-line flags, echoed in
/// `Ready`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerConfig {
    /// KV cells shared by all sequences (`--ctx-size`).
    pub n_ctx: u32,
    /// Sequences (`--parallel`), numbered 0..n_seq.
    pub n_seq: u32,
    /// Largest batch one decode call takes; prefill is chunked by it.
    pub n_batch: u32,
    /// CPU threads for decode and for prefill.
    pub threads: u32,
}

/// A draw from the logits of an item's last token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    pub params: Params,
    /// The stream position the drawn token will occupy. The draw depends only
    /// on `(params.seed, draw_pos)` and the logits, so a cut generation,
    /// continued, draws what the uncut one would have.
    pub draw_pos: u64,
    /// A GBNF grammar (root rule `root`) the token must satisfy, if any. The
    /// worker keeps the grammar's state per sequence while the same grammar
    /// and prefix are asked for, and accepts each drawn token into it.
    pub grammar: Option<String>,
    /// With a grammar: the tokens the grammar has already governed, before
    /// this draw (the turn so far). A grammar state built afresh (after a
    /// cut turn is continued on another sequence, a worker restart, a
    /// trim) accepts them first, so a continued forced call goes on from
    /// where it was cut. Empty without a grammar.
    pub grammar_prefix: Vec<Token>,
    /// Penalties, logit bias and log-probabilities, if the generation asks
    /// for any (None for a plain one: nothing extra is computed).
    pub extras: Option<DrawExtras>,
}

/// A generation's sampling extras as one draw carries them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DrawExtras {
    pub extras: SampleExtras,
    /// The stream position of the generation's first draw. Penalties count
    /// the tokens the worker drew for the sequence at `first_draw..draw_pos`
    /// (it keeps them per sequence, and forgets those at `draw_pos..` when a
    /// draw is asked again after a rollback); a draw at `first_draw` starts
    /// the count afresh.
    pub first_draw: u64,
}

/// Tokens of one sequence at consecutive positions from `pos`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecodeItem {
    pub seq: u32,
    pub pos: u32,
    pub tokens: Vec<Token>,
    /// Draw the next token from the logits of the last of `tokens`.
    pub sample: Option<Sample>,
    /// Images on `tokens`, each whole: their positions hold
    /// [`MEDIA_TOKEN`] where an embedding goes (and the projector's own
    /// wrapper tokens between). Empty for text.
    pub media: Vec<MediaSpan>,
}

/// Stands on a span for a position that holds an image embedding, not a
/// token: outside every vocabulary.
pub const MEDIA_TOKEN: Token = u32::MAX;

/// One image on a [`DecodeItem`]'s tokens: `tokens[at..at + len]` is the
/// layout the worker's projector gave the blob (`MediaLayout`), which the
/// worker evaluates as one unit (never split across items or requests).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MediaSpan {
    pub at: u32,
    pub len: u32,
    /// The blob's SHA-256 (lowercase hex) in the media store.
    pub blob: String,
}

/// One sequence's next steps in a [`WorkerRequest::DecodeNext`]: its first input is the token the
/// worker last drew for it, each further one the token drawn in the step before.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NextItem {
    pub seq: u32,
    /// Where the first input goes: the sequence's length now.
    pub pos: u32,
    /// Decode steps to run (at most [`MAX_NEXT_STEPS`]); fewer when a draw ends the turn.
    pub steps: u32,
    /// The first draw's parameters; each further draw's `draw_pos` is one more.
    pub sample: Sample,
}

/// The most steps one [`NextItem`] may ask for.
pub const MAX_NEXT_STEPS: u32 = 64;

/// Attention scores (query rows x KV cells) in the tile pairs llama.cpp's
/// tiled CPU flash attention did not skip as wholly masked: `full` as ggml
/// computes each pair, `computed` as superfluid's trimmed kernel did
/// (ggml-patch/; equal with `SUPERFLUID_FA_TRIM=0`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttentionWork {
    pub full: u64,
    pub computed: u64,
}

impl AttentionWork {
    /// The work done since `earlier` (both counters only grow).
    pub fn since(self, earlier: AttentionWork) -> AttentionWork {
        AttentionWork {
            full: self.full.saturating_sub(earlier.full),
            computed: self.computed.saturating_sub(earlier.computed),
        }
    }

    pub fn add(&mut self, other: AttentionWork) {
        self.full += other.full;
        self.computed += other.computed;
    }
}

/// One drawn token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Drawn {
    pub seq: u32,
    pub token: Token,
    /// True when the token ends the turn (end of generation for the model).
    pub eog: bool,
    /// Its log-probability and the most likely alternatives, when the draw's
    /// extras asked for `logprobs`.
    pub logprob: Option<TokenLogprob>,
    /// Microseconds the draw's grammar took to constrain it (its allowed
    /// tokens, then the drawn one accepted); 0 without a grammar. The
    /// scheduler rests a generation whose grammar costs the others more
    /// than a step ([`crate::scheduler`]).
    #[serde(default)]
    pub grammar_us: u32,
}

/// One sequence of a `Decode` that failed on its own, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Refused {
    pub seq: u32,
    pub message: String,
}

/// Daemon → worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum WorkerRequest {
    /// Decode every item (one llama.cpp batch where they fit, chunked by
    /// n_batch where not) and draw a token for each item that asks. An item
    /// whose grammar fails (does not parse, dead-ends) is refused on its own
    /// (`Decoded::refused`); a llama.cpp failure fails the whole request.
    Decode { items: Vec<DecodeItem> },
    /// Forget positions `from..` of a sequence.
    KvTrim { seq: u32, from: u32 },
    /// Make `dst` hold positions `0..len` of `src` (shared cells), dropping
    /// whatever `dst` held.
    KvCopy { src: u32, dst: u32, len: u32 },
    /// Forget a whole sequence.
    KvClear { seq: u32 },
    /// Exit cleanly.
    Shutdown,
    /// Run decode steps with no round trip to the daemon between them: in step j (from 0),
    /// every item with `j < steps` whose previous draw did not end the turn (EOG) is fed that
    /// draw (in step 0, the token the worker last drew for the sequence) and draws the next.
    /// All sequences step together, one llama.cpp batch per step. The reply is one `Decoded`
    /// holding every draw, step by step. All or nothing, like `Decode`. Err, touching nothing,
    /// when a sequence has no draw to continue from (its last request failed, or its KV
    /// changed since). The daemon queues this while the step before is still running, so the
    /// worker never waits for it, and it hears from the worker once per `steps` tokens.
    DecodeNext { items: Vec<NextItem> },
    /// Export sequence `seq` (which must hold exactly positions `0..len`)
    /// into the worker's host-memory store under `key`, leaving the
    /// sequence as it is. Answered `Spilled` (with `bytes` 0 when nothing
    /// was stored: the store's cap, a length that does not match, or a
    /// failed export). The bytes stay in the worker; the daemon's index
    /// mirrors the key and the size.
    KvSpill { seq: u32, key: u64, len: u32 },
    /// Replace whatever `seq` holds with the state stored under `key`'s
    /// positions `0..len` (only those cells are imported when the worker
    /// reads the state's layout, `engine::seq_state::prefix`); the entry
    /// leaves the store unless `keep` (a prefix another conversation
    /// shares: its own stays in host memory). Answered `Done`, or
    /// `NotRestored` (the sequence then holds nothing): no such key, or
    /// llama.cpp found no room for the cells.
    KvRestore {
        seq: u32,
        key: u64,
        len: u32,
        keep: bool,
    },
    /// Forget the stored state under `key` (no such key is fine).
    KvDrop { key: u64 },
    /// `--park`: seal `seq` (holding exactly `tokens`) to the worker's park
    /// directory as `<session>.park`. The worker copies the state and
    /// answers `Done` at once; a thread of its own writes the file (temp
    /// file, fsync, rename, directory fsync) and keeps the directory within
    /// its budget. Soft: an artifact that cannot be sealed is logged and
    /// skipped.
    KvPark {
        seq: u32,
        session: u64,
        tokens: Vec<Token>,
    },
    /// Replace whatever `seq` holds with `<session>.park`, which must hold
    /// exactly `tokens` (every digest checked first), then keep only its
    /// positions `0..len`. `Done`, or `NotRestored` (missing, stale,
    /// truncated or corrupt artifact; the sequence is then empty).
    KvUnpark {
        seq: u32,
        session: u64,
        tokens: Vec<Token>,
        len: u32,
    },
    /// The positions the projector gives an image blob (read from the
    /// worker's media directory, its hash checked): answered `MediaLayout`.
    /// Touches no KV.
    MediaLayout { blob: String },
}

/// Worker → daemon. Each request gets exactly one reply, in order; `Ready`
/// is sent once, unasked, when the model is loaded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum WorkerResponse {
    Ready {
        config: WorkerConfig,
        n_vocab: u32,
        /// SHA-256 of the vocabulary (every token's text in id order): a
        /// model file swapped under the daemon shows here.
        vocab_digest: [u8; 32],
    },
    Decoded {
        drawn: Vec<Drawn>,
        /// Tokens decoded, and time spent in llama.cpp's decode.
        tokens: u32,
        decode_us: u64,
        /// `Decode` items that failed on their own (a grammar that does not
        /// parse or dead-ends, a draw it rejects): each such sequence is back
        /// at its length before the request, with no draw; every other item
        /// of the request was decoded and drew as usual.
        refused: Vec<Refused>,
        /// Sessions whose park artifact the park budget deleted since the
        /// last `Decoded` (`--park-budget-mb`): the scheduler forgets them.
        #[serde(default)]
        unparked: Vec<u64>,
        /// The tiled attention's work since the last `Decoded`.
        #[serde(default)]
        attention: AttentionWork,
    },
    Done,
    Err {
        message: String,
    },
    /// The KV cache had no room for a `Decode` or `DecodeNext` (`tokens`
    /// more tokens in a context of `n_ctx` cells). Like `Err`, the request
    /// was rolled back and every last draw forgotten; the scheduler makes
    /// room and retries.
    KvFull {
        n_ctx: u32,
        tokens: u32,
    },
    /// The reply to `KvSpill`: the state's size in host memory (0: not
    /// stored).
    Spilled {
        key: u64,
        bytes: u64,
    },
    /// The reply to a `KvRestore` that could not restore: `seq` is empty.
    NotRestored {
        seq: u32,
    },
    /// The reply to `MediaLayout`: the image's positions, [`MEDIA_TOKEN`]
    /// for each embedding and the projector's wrapper tokens as they are.
    MediaLayout {
        tokens: Vec<Token>,
    },
}

/// What a reply may hold, kept by the lane for each request in flight (a
/// few numbers, not the request): the draws of a `Decode` or `DecodeNext`.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplyCheck {
    /// `Decode`: exactly one draw per sampling item (`seqs`), on its
    /// sequence, in order, except on refused ones; any item (`items`, a
    /// prefill chunk holding an image too) may be refused.
    Decode { seqs: Vec<u32>, items: Vec<u32> },
    /// `DecodeNext`: at most `steps` draws per item (none when the draw
    /// before it ended the turn: it was queued before that draw was known),
    /// each on one of the items' sequences.
    Next { seqs: Vec<(u32, u32)> },
    /// Anything else: the reply's kind is not checked here.
    Other,
}

impl ReplyCheck {
    pub fn of(request: &WorkerRequest) -> ReplyCheck {
        match request {
            WorkerRequest::Decode { items } => ReplyCheck::Decode {
                seqs: items
                    .iter()
                    .filter(|i| i.sample.is_some())
                    .map(|i| i.seq)
                    .collect(),
                items: items.iter().map(|i| i.seq).collect(),
            },
            WorkerRequest::DecodeNext { items } => ReplyCheck::Next {
                seqs: items.iter().map(|i| (i.seq, i.steps)).collect(),
            },
            _ => ReplyCheck::Other,
        }
    }

    /// Why `reply` cannot be the worker's answer to the request, if it
    /// cannot: a token id outside the vocabulary of `n_vocab` tokens, or
    /// draws that do not match what was asked.
    pub fn verify(&self, reply: &WorkerResponse, n_vocab: u32) -> Result<(), String> {
        let WorkerResponse::Decoded { drawn, refused, .. } = reply else {
            return Ok(());
        };
        if let Some(d) = drawn.iter().find(|d| d.token >= n_vocab) {
            return Err(format!(
                "the worker drew token {} on sequence {}, outside the vocabulary of {n_vocab} tokens",
                d.token, d.seq
            ));
        }
        match self {
            ReplyCheck::Decode { seqs, items } => {
                // Every sampling item drew once, in order, unless refused.
                if let Some(r) = refused.iter().find(|r| !items.contains(&r.seq)) {
                    return Err(format!(
                        "the worker refused sequence {}, which was not in the request",
                        r.seq
                    ));
                }
                let got: Vec<u32> = drawn.iter().map(|d| d.seq).collect();
                let want: Vec<u32> = seqs
                    .iter()
                    .copied()
                    .filter(|s| !refused.iter().any(|r| r.seq == *s))
                    .collect();
                if got != want {
                    return Err(format!(
                        "the worker drew on sequences {got:?} where {want:?} were asked"
                    ));
                }
            }
            ReplyCheck::Next { seqs } => {
                if !refused.is_empty() {
                    return Err("the worker refused an item of a DecodeNext".into());
                }
                for &(seq, steps) in seqs {
                    let n = drawn.iter().filter(|d| d.seq == seq).count();
                    if n > steps as usize {
                        return Err(format!(
                            "the worker drew {n} tokens on sequence {seq} where at most {steps} \
                             were asked"
                        ));
                    }
                }
                if let Some(d) = drawn
                    .iter()
                    .find(|d| !seqs.iter().any(|&(s, _)| s == d.seq))
                {
                    return Err(format!(
                        "the worker drew on sequence {}, which was not asked",
                        d.seq
                    ));
                }
            }
            ReplyCheck::Other => {
                return Err("the worker answered Decoded to a request that decodes nothing".into())
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod check_tests {
    use super::*;

    fn drawn(seq: u32, token: Token) -> Drawn {
        Drawn {
            seq,
            token,
            eog: false,
            logprob: None,
            grammar_us: 0,
        }
    }

    fn decoded(d: Vec<Drawn>) -> WorkerResponse {
        WorkerResponse::Decoded {
            drawn: d,
            tokens: 1,
            decode_us: 1,
            refused: vec![],
            unparked: vec![],
            attention: AttentionWork::default(),
        }
    }

    #[test]
    fn a_refused_item_draws_nothing() {
        // Sequence 1 prefills (a chunk holding an image) without drawing.
        let c = ReplyCheck::Decode {
            seqs: vec![0, 2],
            items: vec![0, 1, 2],
        };
        let refused = |seq, d: Vec<Drawn>| WorkerResponse::Decoded {
            drawn: d,
            tokens: 1,
            decode_us: 1,
            refused: vec![Refused {
                seq,
                message: "no".into(),
            }],
            unparked: vec![],
            attention: AttentionWork::default(),
        };
        assert!(c.verify(&refused(2, vec![drawn(0, 5)]), 10).is_ok());
        assert!(c
            .verify(&refused(2, vec![drawn(0, 5), drawn(2, 1)]), 10)
            .is_err());
        // A prefill item refused on its own (its image): the draws stand.
        assert!(c
            .verify(&refused(1, vec![drawn(0, 5), drawn(2, 1)]), 10)
            .is_ok());
        assert!(c.verify(&refused(1, vec![drawn(0, 5)]), 10).is_err());
        // A sequence the request did not hold.
        assert!(c
            .verify(&refused(3, vec![drawn(0, 5), drawn(2, 1)]), 10)
            .is_err());
        let n = ReplyCheck::Next { seqs: vec![(1, 3)] };
        assert!(n.verify(&refused(1, vec![]), 10).is_err());
    }

    #[test]
    fn draws_are_checked_against_what_was_asked_and_the_vocabulary() {
        let c = ReplyCheck::Decode {
            seqs: vec![0, 2],
            items: vec![0, 2],
        };
        assert!(c
            .verify(&decoded(vec![drawn(0, 5), drawn(2, 9)]), 10)
            .is_ok());
        // An id outside the vocabulary, a missing draw, a draw not asked for.
        assert!(c
            .verify(&decoded(vec![drawn(0, 5), drawn(2, 10)]), 10)
            .is_err());
        assert!(c.verify(&decoded(vec![drawn(0, 5)]), 10).is_err());
        assert!(c
            .verify(&decoded(vec![drawn(0, 5), drawn(1, 1)]), 10)
            .is_err());
        // Errors and other replies are the caller's to read.
        assert!(c
            .verify(
                &WorkerResponse::KvFull {
                    n_ctx: 1,
                    tokens: 2
                },
                10
            )
            .is_ok());
        let n = ReplyCheck::Next { seqs: vec![(1, 3)] };
        assert!(n
            .verify(&decoded(vec![drawn(1, 1), drawn(1, 2)]), 10)
            .is_ok());
        assert!(n.verify(&decoded(vec![]), 10).is_ok(), "the turn had ended");
        assert!(n.verify(&decoded(vec![drawn(1, 1); 4]), 10).is_err());
        assert!(n
            .verify(&decoded(vec![drawn(1, 1), drawn(3, 1)]), 10)
            .is_err());
        assert!(ReplyCheck::Other.verify(&decoded(vec![]), 10).is_err());
        assert!(ReplyCheck::Other.verify(&WorkerResponse::Done, 10).is_ok());
    }
}
