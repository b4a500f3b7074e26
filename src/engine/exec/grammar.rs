//! The grammar state of each sequence.
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

use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::sampling::LlamaSampler;
use llama_cpp_2::token::data::LlamaTokenData;
use llama_cpp_2::token::data_array::LlamaTokenDataArray;
use llama_cpp_2::token::LlamaToken;

use super::error::RequestError;
use super::seqs::SeqTable;
use crate::wire::worker::{DecodeItem, Refused};

/// A grammar a draw asks for: its GBNF text and the tokens it already governed.
type GrammarAsk<'a> = (&'a str, &'a [u32]);

/// The grammar state of one sequence.
pub(super) struct SeqGrammar {
    gbnf: String,
    sampler: LlamaSampler,
    /// The tokens accepted since it was built.
    accepted: Vec<u32>,
}

impl SeqGrammar {
    /// Marks in `mask` the token ids the grammar allows after what it
    /// accepted, given the logits `row`; false when it allows none.
    pub(super) fn allowed(&mut self, row: &[f32], mask: &mut Vec<bool>) -> bool {
        let mut arr = LlamaTokenDataArray::new(
            row.iter()
                .enumerate()
                .map(|(id, &l)| LlamaTokenData::new(LlamaToken(id as i32), l, 0.0))
                .collect(),
            false,
        );
        self.sampler.apply(&mut arr);
        mask.clear();
        mask.resize(row.len(), false);
        let mut any = false;
        for d in &arr.data {
            if let Ok(id) = usize::try_from(d.id().0) {
                if id < mask.len() && d.logit() > f32::NEG_INFINITY {
                    mask[id] = true;
                    any = true;
                }
            }
        }
        any
    }

    /// Takes the drawn `token` into the state (an end-of-generation token
    /// only into the count of governed tokens).
    pub(super) fn accept(&mut self, token: u32, eog: bool) -> Result<(), RequestError> {
        if !eog {
            self.sampler
                .try_accept(LlamaToken(token as i32))
                .map_err(|e| RequestError::GrammarRejected {
                    token,
                    reason: e.to_string(),
                })?;
        }
        self.accepted.push(token);
        Ok(())
    }
}

/// Every sequence's grammar state.
pub(super) struct Grammars(Vec<Option<SeqGrammar>>);

impl Grammars {
    pub(super) fn new(n_seq: u32) -> Grammars {
        Grammars((0..n_seq).map(|_| None).collect())
    }

    /// Drops the state of sequence `seq` (its KV changed under it).
    pub(super) fn drop_state(&mut self, seq: usize) {
        self.0[seq] = None;
    }

    /// The state of sequence `seq`, if it has one.
    pub(super) fn get_mut(&mut self, seq: usize) -> Option<&mut SeqGrammar> {
        self.0.get_mut(seq).and_then(Option::as_mut)
    }

    /// Builds (or keeps) the grammar state every sampling item asks for. A
    /// grammar that does not parse (or a prefix with a token outside the
    /// vocabulary) refuses its own sequence, whose state is then dropped;
    /// the others are built.
    pub(super) fn prepare(
        &mut self,
        model: &LlamaModel,
        seqs: &SeqTable,
        items: &[DecodeItem],
    ) -> Vec<Refused> {
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
        let is_eog = |t: u32| seqs.is_token(t) && model.vocab().is_eog(LlamaToken(t as i32));
        let mut built: Vec<(usize, Option<SeqGrammar>)> = Vec::new();
        let mut refused = Vec::new();
        for (s, grammar) in wanted {
            let Some((g, prefix)) = grammar else {
                built.push((s, None));
                continue;
            };
            if self.0[s]
                .as_ref()
                .is_some_and(|cur| cur.gbnf == g && cur.accepted == prefix)
            {
                continue;
            }
            match build_state(model, s, g, prefix, is_eog, seqs) {
                Ok(state) => built.push((s, Some(state))),
                Err(e) => {
                    log::info!("sequence {s}: {e}");
                    refused.push(Refused {
                        seq: s as u32,
                        message: e.to_string(),
                    });
                    built.push((s, None));
                }
            }
        }
        for (s, g) in built {
            self.0[s] = g;
        }
        refused
    }
}

/// A grammar state for sequence `s`: `gbnf` parsed, `prefix` accepted (or,
/// when the grammar rejects it, counted as governed).
fn build_state(
    model: &LlamaModel,
    s: usize,
    gbnf: &str,
    prefix: &[u32],
    is_eog: impl Fn(u32) -> bool,
    seqs: &SeqTable,
) -> Result<SeqGrammar, RequestError> {
    // Its cost to llama.cpp first: a grammar past it would stall the step
    // for every sequence (session::gbnf_cost).
    crate::session::gbnf_cost::check(gbnf)
        .map_err(|reason| RequestError::GrammarParse { seq: s, reason })?;
    let build = || {
        LlamaSampler::grammar(model, gbnf, "root").map_err(|e| RequestError::GrammarParse {
            seq: s,
            reason: e.to_string(),
        })
    };
    let mut sampler = build()?;
    if let Some(&bad) = prefix.iter().find(|&&t| !seqs.is_token(t)) {
        return Err(RequestError::GrammarPrefixToken(bad));
    }
    let rejected = prefix
        .iter()
        .copied()
        .find(|&t| !is_eog(t) && sampler.try_accept(LlamaToken(t as i32)).is_err());
    if let Some(t) = rejected {
        // The turn so far was not written under this grammar (the tool
        // choice changed while the turn was open): it governs from here on.
        log::info!(
            "sequence {s}: the turn so far does not fit its grammar (token {t}); \
             the grammar starts at this draw"
        );
        sampler = build()?;
    }
    Ok(SeqGrammar {
        gbnf: gbnf.to_owned(),
        sampler,
        accepted: prefix.to_vec(),
    })
}
