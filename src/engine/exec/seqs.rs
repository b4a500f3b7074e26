//! `SeqTable`: what the worker knows of each of its sequences without asking
//! llama.cpp (how many positions its KV holds, and the token last drawn for
//! it while its KV has not changed since), and the checks every request
//! passes against that before llama.cpp sees any of it.
//!
//! Plain data: the real worker ([`super::WorkerEngine`]) keeps one, and so
//! does the scheduler tests' fake worker, so the scheduler is tested against
//! the worker's own contract.

use super::error::RequestError;
use crate::wire::worker::{DecodeItem, Drawn, NextItem, MAX_NEXT_STEPS, MEDIA_TOKEN};

/// Per sequence: its length and its last draw; the limits requests are
/// checked against.
#[derive(Debug, Clone)]
pub struct SeqTable {
    n_ctx: u32,
    n_vocab: u32,
    /// Per sequence, the number of positions its KV holds (`0..len`).
    lens: Vec<u32>,
    /// Per sequence, the token last drawn for it, while its KV has not
    /// changed since: what a `DecodeNext` feeds. Every failed request
    /// clears them all.
    last: Vec<Option<Drawn>>,
}

impl SeqTable {
    /// `n_seq` empty sequences sharing `n_ctx` cells; token ids `0..n_vocab`.
    pub fn new(n_seq: u32, n_ctx: u32, n_vocab: u32) -> SeqTable {
        SeqTable {
            n_ctx,
            n_vocab,
            lens: vec![0; n_seq as usize],
            last: vec![None; n_seq as usize],
        }
    }

    /// The number of sequences.
    pub fn n_seq(&self) -> u32 {
        self.lens.len() as u32
    }

    /// The positions sequence `seq` holds (`0..len`), or None out of range.
    pub fn len(&self, seq: u32) -> Option<u32> {
        self.lens.get(seq as usize).copied()
    }

    /// Every sequence's length, in order.
    pub fn lens(&self) -> &[u32] {
        &self.lens
    }

    /// Whether `token` is a token id of the vocabulary.
    pub fn is_token(&self, token: u32) -> bool {
        token < self.n_vocab
    }

    /// The index of sequence `seq`, if it exists.
    pub fn check_seq(&self, seq: u32) -> Result<usize, RequestError> {
        if seq < self.n_seq() {
            Ok(seq as usize)
        } else {
            Err(RequestError::SeqOutOfRange {
                seq,
                n_seq: self.n_seq(),
            })
        }
    }

    /// Checks a `Decode` completely: sequences, token ids, positions (each
    /// item starts where its sequence ends), and sizes.
    pub fn validate_decode(&self, items: &[DecodeItem]) -> Result<(), RequestError> {
        let n_ctx = u64::from(self.n_ctx);
        let mut ends: Vec<u64> = self.lens.iter().map(|&l| u64::from(l)).collect();
        let mut total = 0u64;
        for (k, item) in items.iter().enumerate() {
            let s = self.check_seq(item.seq).map_err(RequestError::at(k))?;
            let at = RequestError::at(k);
            if item.tokens.is_empty() {
                return Err(at(RequestError::NoTokens));
            }
            check_media(item).map_err(RequestError::at(k))?;
            let embedding = |j: usize| {
                item.tokens[j] == MEDIA_TOKEN
                    && item
                        .media
                        .iter()
                        .any(|m| (m.at as usize..(m.at + m.len) as usize).contains(&j))
            };
            if let Some(j) =
                (0..item.tokens.len()).find(|&j| !embedding(j) && !self.is_token(item.tokens[j]))
            {
                return Err(at(RequestError::InvalidToken {
                    token: item.tokens[j],
                    n_vocab: self.n_vocab,
                }));
            }
            if let Some(x) = item.sample.as_ref().and_then(|s| s.extras.as_ref()) {
                x.extras
                    .check(self.n_vocab)
                    .map_err(|e| RequestError::at(k)(e.into()))?;
            }
            if u64::from(item.pos) != ends[s] {
                return Err(at(RequestError::Position {
                    seq: item.seq,
                    end: ends[s],
                    pos: item.pos,
                }));
            }
            let n = item.tokens.len() as u64;
            ends[s] += n;
            total += n;
            if ends[s] > n_ctx {
                return Err(at(RequestError::PastContext {
                    seq: item.seq,
                    end: ends[s],
                    n_ctx,
                }));
            }
        }
        if total > n_ctx {
            return Err(RequestError::TooManyTokens { total, n_ctx });
        }
        Ok(())
    }

    /// Checks a `DecodeNext`: sequences (each once), no grammar, the step
    /// count, and a last draw to continue from at the item's position.
    pub fn validate_next(&self, next: &[NextItem]) -> Result<(), RequestError> {
        let mut seen = vec![false; self.lens.len()];
        for (k, n) in next.iter().enumerate() {
            let s = self.check_seq(n.seq).map_err(RequestError::at(k))?;
            let at = RequestError::at(k);
            if std::mem::replace(&mut seen[s], true) {
                return Err(at(RequestError::SeqTwice { seq: n.seq }));
            }
            if n.sample.grammar.is_some() {
                return Err(at(RequestError::NextGrammar));
            }
            if let Some(x) = &n.sample.extras {
                x.extras
                    .check(self.n_vocab)
                    .map_err(|e| RequestError::at(k)(e.into()))?;
            }
            if !(1..=MAX_NEXT_STEPS).contains(&n.steps) {
                return Err(at(RequestError::NextSteps { steps: n.steps }));
            }
            match &self.last[s] {
                None => return Err(at(RequestError::NoDraw { seq: n.seq })),
                Some(d) if !d.eog && n.pos != self.lens[s] => {
                    return Err(at(RequestError::NextPosition {
                        seq: n.seq,
                        len: self.lens[s],
                        pos: n.pos,
                    }))
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    /// Checks a `KvCopy` of `len` positions from `src` to `dst`; returns
    /// their indices.
    pub fn check_copy(&self, src: u32, dst: u32, len: u32) -> Result<(usize, usize), RequestError> {
        let s = self.check_seq(src)?;
        let d = self.check_seq(dst)?;
        if len > self.lens[s] {
            return Err(RequestError::CopyTooLong {
                src,
                len,
                holds: self.lens[s],
            });
        }
        Ok((s, d))
    }

    /// What a `DecodeNext` step feeds `seq`: its last draw, unless that
    /// ended the turn (the sequence is then skipped).
    pub fn next_input(&self, seq: u32) -> Option<Drawn> {
        self.last
            .get(seq as usize)
            .cloned()
            .flatten()
            .filter(|d| !d.eog)
    }

    /// Sequence `seq` holds `len` positions (as re-read from the KV, or
    /// after a trim, clear or copy).
    pub fn set_len(&mut self, seq: usize, len: u32) {
        self.lens[seq] = len;
    }

    /// The KV of `seq` changed other than by a decode: its last draw can no
    /// longer be followed.
    pub fn kv_changed(&mut self, seq: usize) {
        self.last[seq] = None;
    }

    /// A `Decode` of `items` went in whole and drew `drawn`.
    pub fn decoded(&mut self, items: &[DecodeItem], drawn: &[Drawn]) {
        for item in items {
            let s = item.seq as usize;
            self.lens[s] = item.pos + item.tokens.len() as u32;
            self.last[s] = None;
        }
        for d in drawn {
            // What a DecodeNext feeds: the token, not its log-probabilities.
            self.last[d.seq as usize] = Some(Drawn {
                logprob: None,
                ..*d
            });
        }
    }

    /// A request failed: a `DecodeNext` queued behind it must not run on a
    /// stale draw.
    pub fn forget_draws(&mut self) {
        self.last.iter_mut().for_each(|l| *l = None);
    }

    /// Sets the last draw of `seq` (tests).
    #[cfg(test)]
    pub fn set_last_draw(&mut self, seq: usize, draw: Option<Drawn>) {
        self.last[seq] = draw;
    }
}

/// An item's images: each inside its tokens, in order, not overlapping, and
/// never the last token when the item draws (the logits come from a token).
fn check_media(item: &DecodeItem) -> Result<(), RequestError> {
    let mut end = 0u64;
    for m in &item.media {
        let (at, len) = (u64::from(m.at), u64::from(m.len));
        let bad = |why: &str| Err(RequestError::Media(format!("image {}: {why}", m.blob)));
        if len == 0 {
            return bad("no positions");
        }
        if at < end {
            return bad("overlaps the image before it");
        }
        end = at + len;
        if end > item.tokens.len() as u64 {
            return bad("runs past the item's tokens");
        }
        if item.sample.is_some() && end == item.tokens.len() as u64 {
            return bad("ends the item, whose last token must be a token to draw from");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::worker::Sample;
    use crate::wire::Params;

    fn sample(draw_pos: u64) -> Sample {
        Sample {
            params: Params::greedy(0),
            draw_pos,
            grammar: None,
            grammar_prefix: vec![],
            extras: None,
        }
    }

    fn item(seq: u32, pos: u32, tokens: Vec<u32>) -> DecodeItem {
        DecodeItem {
            media: vec![],
            seq,
            pos,
            tokens,
            sample: Some(sample(u64::from(pos) + 1)),
        }
    }

    #[test]
    fn a_decode_is_checked_before_it_runs() {
        let t = SeqTable::new(2, 16, 100);
        assert!(t
            .validate_decode(&[item(0, 0, vec![1, 2]), item(1, 0, vec![3])])
            .is_ok());
        let msg = |items: &[DecodeItem]| t.validate_decode(items).unwrap_err().to_string();
        assert_eq!(
            msg(&[item(2, 0, vec![1])]),
            "item 0: sequence 2 out of range: the worker has 2 sequences"
        );
        assert_eq!(msg(&[item(0, 0, vec![])]), "item 0: no tokens");
        assert_eq!(
            msg(&[item(0, 0, vec![100])]),
            "item 0: invalid token id 100: the vocabulary has 100 tokens"
        );
        assert_eq!(
            msg(&[item(0, 0, vec![1]), item(0, 0, vec![1])]),
            "item 1: sequence 0 holds positions 0..1, so the next token is at 1, not 0"
        );
        assert_eq!(
            msg(&[item(0, 0, vec![1; 17])]),
            "item 0: sequence 0 would reach 17 positions, more than n_ctx=16 cells"
        );
        assert_eq!(
            msg(&[item(0, 0, vec![1; 9]), item(1, 0, vec![1; 9])]),
            "the request carries 18 tokens, more than n_ctx=16 cells"
        );
    }

    #[test]
    fn a_decode_next_follows_only_a_kept_draw() {
        let mut t = SeqTable::new(2, 16, 100);
        let next = |seq, pos, steps| NextItem {
            seq,
            pos,
            steps,
            sample: sample(u64::from(pos) + 1),
        };
        assert_eq!(
            t.validate_next(&[next(0, 0, 1)]),
            Err(RequestError::at(0)(RequestError::NoDraw { seq: 0 }))
        );
        let items = [item(0, 0, vec![1, 2])];
        let d = Drawn {
            seq: 0,
            token: 7,
            eog: false,
            logprob: None,
            grammar_us: 0,
        };
        t.decoded(&items, std::slice::from_ref(&d));
        assert_eq!((t.len(0), t.next_input(0)), (Some(2), Some(d.clone())));
        assert!(t.validate_next(&[next(0, 2, 4)]).is_ok());
        assert!(matches!(
            t.validate_next(&[next(0, 2, 4), next(0, 2, 4)]),
            Err(RequestError::Item { item: 1, .. })
        ));
        assert!(t.validate_next(&[next(0, 3, 4)]).is_err());
        assert!(t.validate_next(&[next(0, 2, MAX_NEXT_STEPS + 1)]).is_err());
        // A KV change, or any failure, forgets the draw.
        t.kv_changed(0);
        assert_eq!(t.next_input(0), None);
        t.decoded(&[item(0, 2, vec![3])], std::slice::from_ref(&d));
        t.forget_draws();
        assert!(t.validate_next(&[next(0, 3, 1)]).is_err());
        // A draw that ended the turn is skipped, wherever the item says.
        t.set_last_draw(0, Some(Drawn { eog: true, ..d }));
        assert!(t.validate_next(&[next(0, 99, 1)]).is_ok());
        assert_eq!(t.next_input(0), None);
    }
}
